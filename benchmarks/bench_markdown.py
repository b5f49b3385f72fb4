"""Markdown table (and fresh plots) from the last `triforce-offload bench` run in a JSONL.

Usage:
    python benchmarks/bench_markdown.py                         # results/bench.jsonl
    python benchmarks/bench_markdown.py results/temperature/bench.jsonl --plots

Rows of one invocation share its start `time`; the latest invocation is summarized the
way `bench` prints it (median over repeats, speedup over autoregressive, lossless).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from triforce_offload.bench.runner import summarize


def last_run(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    t = max(r["time"] for r in rows)
    return [r for r in rows if r["time"] == t]


def markdown(summary: list[dict]) -> str:
    lines = ["| mode | context | T | ms/token | tok/s | speedup | acceptance | mean accepted | "
             "peak GB | lossless |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        if "skipped" in s:
            continue
        acc = ", ".join(f"{k} {v:.2f}" for k, v in s.get("acceptance", {}).items()) or "-"
        same = {None: "-", True: "yes", False: "NO"}[s["lossless"]]
        if s.get("peer") and s["lossless"] is not None:  # a reference, not a lossless claim
            same = "same" if s["lossless"] else "differs"
        mean = f"{s['mean_accepted']:.2f}" if "mean_accepted" in s else "-"
        speed = f"{s['speedup']:.2f}x" if s["speedup"] else "-"
        lines.append(f"| {s['mode']} | {s['context']} | {s['temperature']:g} | "
                     f"{s['ms_per_token']:.1f} | {s['tokens_per_s']:.1f} | {speed} | {acc} | "
                     f"{mean} | {s['peak_gb']:.2f} | {same} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="?", default="results/bench.jsonl")
    ap.add_argument("--plots", action="store_true", help="rewrite the PNGs next to the JSONL")
    a = ap.parse_args()
    path = Path(a.jsonl)
    summary = summarize(last_run(path))
    print(markdown(summary))
    if a.plots:
        from triforce_offload.bench.plots import plot_acceptance, plot_speed
        plot_speed(summary, path.parent / "bench_speed.png")
        plot_acceptance(summary, path.parent / "bench_acceptance.png")


if __name__ == "__main__":
    main()
