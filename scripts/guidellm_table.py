"""Tables and a plot from guidellm's JSON reports (docs/benchmarking.md).

    python scripts/guidellm_table.py LABEL=report.json[.gz] [LABEL=report.json ...] [--plot out.png]

One row per benchmark of each report (a concurrency sweep has one per stream count): requests
served and errored (every request counts: errored ones are in the total), TTFT p50 and p99,
inter-token latency p50, output tokens per second (output tokens of the served requests over
the benchmark's wall time) and the wall time. The plot draws output tokens/s and TTFT p99
against concurrency, one line per label.
"""
from __future__ import annotations

import argparse
import gzip
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Row:
    label: str
    streams: int
    served: int
    errored: int
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_ms: float
    output_tok_s: float
    wall_s: float


def rows(label: str, path: Path) -> list[Row]:
    out = []
    text = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()  # reports kept gzipped
    for b in json.loads(text)["benchmarks"]:
        m = b["metrics"]
        totals = m["request_totals"]
        ttft = m["time_to_first_token_ms"]["successful"]["percentiles"]
        itl = m["inter_token_latency_ms"]["successful"]["percentiles"]
        tokens = m["output_token_count"]["successful"]["total_sum"]
        streams = b["config"]["strategy"].get("streams") or 0
        wall = b["duration"]
        out.append(Row(label, int(streams), totals["successful"], totals["errored"] + totals["incomplete"],
                       ttft["p50"] / 1e3, ttft["p99"] / 1e3, itl["p50"], tokens / wall, wall))
    return out


def table(all_rows: list[Row]) -> str:
    lines = ["| server | streams | served | errored | TTFT p50 / p99 | ITL p50 | output tok/s | wall |",
             "|---|---|---|---|---|---|---|---|"]
    labels = list(dict.fromkeys(r.label for r in all_rows))
    for r in sorted(all_rows, key=lambda r: (labels.index(r.label), r.streams)):
        lines.append(f"| {r.label} | {r.streams} | {r.served} | {r.errored} | {r.ttft_p50_s:.2f} s / {r.ttft_p99_s:.2f} s "
                     f"| {r.itl_p50_ms:.0f} ms | {r.output_tok_s:.1f} | {r.wall_s:.0f} s |")
    return "\n".join(lines)


def plot(all_rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(r.label for r in all_rows):
        mine = sorted((r for r in all_rows if r.label == label), key=lambda r: r.streams)
        xs = [r.streams for r in mine]
        ax1.plot(xs, [r.output_tok_s for r in mine], marker="o", label=label)
        ax2.plot(xs, [r.ttft_p99_s for r in mine], marker="o", label=label)
    ax1.set(xlabel="concurrent streams", ylabel="output tokens/s (served requests)", title="throughput")
    ax2.set(xlabel="concurrent streams", ylabel="TTFT p99 (s)", title="time to first token", yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("guidellm, prompt 128 / output 64 tokens (one 2-core machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", metavar="LABEL=report.json")
    p.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    args = p.parse_args()
    all_rows = []
    for spec in args.reports:
        label, _, path = spec.partition("=")
        all_rows.extend(rows(label, Path(path)))
    print(table(all_rows))
    if args.plot:
        plot(all_rows, args.plot)


if __name__ == "__main__":
    main()
