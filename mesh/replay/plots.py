"""Replay figures with matplotlib: TTFT CDFs per policy (LLM-Mesh Figure 12, bottom row) and
nodes in use over time (Figure 13's timeline)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after matplotlib.use, which must come first
import numpy as np  # noqa: E402 - likewise

from mesh.replay.driver import PolicyRun  # noqa: E402 - likewise
from mesh.wire.served_request import Outcome  # noqa: E402 - likewise


def ttft_cdf(runs: dict[str, PolicyRun], path: str | Path, title: str = "") -> Path:
    """CDF of TTFT over all requests: rejected and failed ones never get a first token in
    time, so a curve flattens at the fraction completed (as in the paper)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, run in runs.items():
        n = len(run.requests)
        ttft = np.sort([r.ttft_s for r in run.requests if r.outcome is Outcome.COMPLETED])
        if n == 0:
            continue
        y = np.arange(1, len(ttft) + 1) / n
        ax.step(np.concatenate([[0.0], ttft]), np.concatenate([[0.0], y]), where="post", label=name)
    ax.axvline(2.0, color="grey", linestyle=":", linewidth=1, label="TTFT SLO (short prompts)")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.0)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def node_usage(runs: dict[str, PolicyRun], path: str | Path, title: str = "") -> Path:
    """CPU and GPU nodes in use over time, one line per policy."""
    fig, axes = plt.subplots(2, 1, figsize=(7, 4.4), sharex=True)
    for name, run in runs.items():
        t = [u[0] for u in run.usage] + [run.duration_s]
        for ax, col in zip(axes, (1, 2)):
            v = [u[col] for u in run.usage] + [run.usage[-1][col]]
            ax.step(t, v, where="post", label=name, linewidth=1)
    for ax, kind in zip(axes, ("CPU", "GPU")):
        ax.set_ylabel(f"{kind} nodes in use")
        ax.grid(alpha=0.3)
        ax.set_xlim(0, max(r.duration_s for r in runs.values()))
    axes[1].set_xlabel("time (s)")
    axes[0].legend(fontsize=8, loc="upper right", ncol=min(3, len(runs)))
    if title:
        axes[0].set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
