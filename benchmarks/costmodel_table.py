"""The cost model against the TriForce paper's offloading table (predicted, not measured).

Usage:
    python benchmarks/costmodel_table.py        # markdown table for the README

Rows and settings are `offload.costmodel.PAPER_ROWS` (arXiv 2404.11912, Table 3); the
hardware constants come from datasheets, see offload/costmodel.py.
"""
from triforce_offload.offload import costmodel as cm


def main():
    print("| setup | mode | predicted ms/token | paper ms/token | predicted / paper |")
    print("|---|---|---|---|---|")
    for setup, mode, pred, paper in cm.paper_table():
        print(f"| {setup} | {mode} | {pred:.0f} | {paper:.0f} | {pred / paper:.2f} |")
    pred = {(s, m): p for s, m, p, _ in cm.paper_table()}
    paper = {(s, m): p for s, m, _, p in cm.paper_table()}
    print()
    for s in dict.fromkeys(s for s, _ in pred):
        base = "autoregressive" if (s, "autoregressive") in pred else "deepspeed"
        speed = lambda d: d[(s, base)] / d[(s, "triforce")]
        print(f"- {s}: TriForce over {base}: predicted {speed(pred):.1f}x, paper {speed(paper):.1f}x")


if __name__ == "__main__":
    main()
