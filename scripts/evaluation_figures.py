"""Summary figures and tables of the evaluation (docs/evaluation.md) from `mesh replay` JSON.

    python scripts/evaluation_figures.py docs/eval docs/figures

Writes docs/figures/fig12_grid.png, fig13_ablation.png, fig14_mix.png (those whose JSON
exist) and docs/eval/tables.md (markdown tables of every run).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

MODELS = ("llama-3.2-3b", "llama-2-7b", "llama-2-13b")
SIZES = (32, 64, 128)
LABEL = {"llama-3.2-3b": "3B", "llama-2-7b": "7B", "llama-2-13b": "13B"}
COLS = ("cpu_nodes_avg", "gpu_nodes_avg", "slo_compliant", "slo_rate", "slo_rate_strict",
        "decode_tok_s_per_cpu_node", "decode_tok_s_per_gpu_node", "ttft_p99_s", "rejected", "failed", "wall_s")
HEAD = "| policy | CPU nodes | GPU nodes | SLO-compliant | SLO % | strict % | tok/s/CPU node | tok/s/GPU node | TTFT p99 s | rejected | failed | wall s |"


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def row(name: str, m: dict) -> str:
    return (f"| {name} | {m['cpu_nodes_avg']:.2f} | {m['gpu_nodes_avg']:.2f} | {m['slo_compliant']} | "
            f"{m['slo_rate']:.1%} | {m['slo_rate_strict']:.1%} | {m['decode_tok_s_per_cpu_node']:.0f} | "
            f"{m['decode_tok_s_per_gpu_node']:.0f} | {m['ttft_p99_s']:.2f} | {m['rejected']} | {m['failed']} | "
            f"{m['wall_s']:.1f} |")


def table(title: str, data: dict) -> list[str]:
    any_m = next(iter(data.values()))
    lines = [f"### {title}", "", f"{any_m['replay']['requests']} requests ({any_m['replay']['mean_rps']:.2f} rps).", "",
             HEAD, "|" + "---|" * 12]
    lines += [row(name, m) for name, m in data.items()]
    if "mesh" in data:
        ratios = [f"mesh / {k}: {data['mesh']['slo_compliant'] / v['slo_compliant']:.2f}x SLO-compliant"
                  for k, v in data.items() if k != "mesh" and v["slo_compliant"]]
        if ratios:
            lines += ["", "; ".join(ratios) + "."]
    return lines + [""]


def fig12(eval_dir: Path, fig_dir: Path, out: list[str]) -> None:
    runs = {(m, n): load(eval_dir / f"fig12_{m}_{n}.json") for m in MODELS for n in SIZES}
    if not any(runs.values()):
        return
    out += ["## Figure 12 grid", ""]
    for (m, n), data in runs.items():
        if data:
            out += table(f"{n} x {LABEL[m]}", data)
    policies = ("mesh", "sllm", "sllm+cpu")
    metrics = (("cpu_nodes_avg", "CPU nodes (avg)"), ("gpu_nodes_avg", "GPU nodes (avg)"),
               ("slo_compliant", "SLO-compliant requests"), ("decode_tok_s_per_gpu_node", "decode tok/s per GPU node"))
    fig, axes = plt.subplots(len(metrics), len(MODELS), figsize=(11, 9), sharex=True)
    x = np.arange(len(SIZES))
    w = 0.26
    for j, m in enumerate(MODELS):
        for i, (key, label) in enumerate(metrics):
            ax = axes[i][j]
            for k, p in enumerate(policies):
                vals = [runs[(m, n)][p][key] if runs[(m, n)] and p in runs[(m, n)] else np.nan for n in SIZES]
                ax.bar(x + (k - 1) * w, vals, w, label=p)
            if j == 0:
                ax.set_ylabel(label, fontsize=8)
            if i == 0:
                ax.set_title(LABEL[m], fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            ax.tick_params(labelsize=8)
        axes[-1][j].set_xticks(x, [str(n) for n in SIZES])
        axes[-1][j].set_xlabel("functions (models)", fontsize=8)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(fig_dir / "fig12_grid.png", dpi=110)
    plt.close(fig)


def fig13(eval_dir: Path, fig_dir: Path, out: list[str]) -> None:
    data = load(eval_dir / "fig13_llama-2-7b_64.json")
    if not data:
        return
    out += ["## Figure 13 ablations (64 x 7B)", ""] + table("64 x 7B, ablations", data)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.4), gridspec_kw={"width_ratios": [1, 2]})
    names = list(data)
    a.bar(names, [data[n]["gpu_nodes_avg"] for n in names], color="tab:orange", label="GPU nodes")
    a.set_ylabel("GPU nodes (avg)")
    a2 = a.twinx()
    a2.plot(names, [100 * data[n]["slo_rate"] for n in names], "ko-", label="SLO %")
    a2.set_ylabel("SLO compliance %")
    a2.set_ylim(0, 105)
    a.tick_params(axis="x", labelrotation=20, labelsize=8)
    for n in names:
        u = data[n]["usage_per_second"]
        b.step(u["t"][:300], u["gpu"][:300], where="post", label=n, linewidth=1)
    b.set_xlabel("time (s), first 300 s")
    b.set_ylabel("GPU nodes in use")
    b.legend(fontsize=7)
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(fig_dir / "fig13_ablation.png", dpi=110)
    plt.close(fig)


def fig14(eval_dir: Path, fig_dir: Path, out: list[str]) -> None:
    runs = {mix: load(eval_dir / f"fig14_mix{mix}_64.json") for mix in ("4-1-1", "1-1-4")}
    if not any(runs.values()):
        return
    out += ["## Figure 14 mixes (64 functions, 3B:7B:13B)", ""]
    for mix, data in runs.items():
        if data:
            out += table(f"mix {mix.replace('-', ':')}", data)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    policies = [p for p in ("mesh", "sllm+cpu", "sllm") if all(d and p in d for d in runs.values())]
    x = np.arange(len(runs))
    for k, p in enumerate(policies):
        ax.bar(x + (k - (len(policies) - 1) / 2) * 0.25, [runs[m][p]["gpu_nodes_avg"] for m in runs], 0.25, label=p)
    ax.set_xticks(x, [m.replace("-", ":") for m in runs])
    ax.set_ylabel("GPU nodes (avg)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(fig_dir / "fig14_mix.png", dpi=110)
    plt.close(fig)


def sensitivity(eval_dir: Path, out: list[str]) -> None:
    for path, title in (("sensitivity_queue-slo_llama-2-7b_128.json", "128 x 7B, queue rule 'slo' for every policy"),
                        ("sensitivity_load2x_llama-2-7b_128.json", "128 x 7B, twice the load (0.2 rps per function)")):
        data = load(eval_dir / path)
        if data:
            out += table(title, data)
    for seed in (1, 2):
        data = load(eval_dir / f"seed{seed}_llama-2-7b_128.json")
        if data:
            out += table(f"128 x 7B, seed {seed}", data)


def main(argv: list[str]) -> int:
    eval_dir, fig_dir = Path(argv[1]), Path(argv[2])
    fig_dir.mkdir(parents=True, exist_ok=True)
    out: list[str] = ["# Evaluation tables (generated by scripts/evaluation_figures.py)", ""]
    fig12(eval_dir, fig_dir, out)
    fig13(eval_dir, fig_dir, out)
    fig14(eval_dir, fig_dir, out)
    sens: list[str] = []
    sensitivity(eval_dir, sens)
    if sens:
        out += ["## Sensitivity", ""] + sens
    (eval_dir / "tables.md").write_text("\n".join(out) + "\n")
    print(f"wrote {eval_dir / 'tables.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
