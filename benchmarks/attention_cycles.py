"""Cycles per query row and key of the native attention kernel's bf16 path, by phase.

Usage:
    python benchmarks/attention_cycles.py                       # a 7-token verification, SmolLM2 shapes
    python benchmarks/attention_cycles.py --rows 3 --keys 32768 # a decode (3 query heads per KV head)

Compiles benchmarks/attention_cycles.c, which includes kernels/cpu_attention.c (the kernel's
static functions are callable there), with the kernel's own flags, and prints: the clock
(a chain of dependent adds), vdpbf16ps a cycle, one block of 256 keys in the caches and from
memory (called through a pointer as the kernel calls it), each phase of a block alone, and
the whole call over --keys keys of 3 KV heads with --threads threads, K and V of --layers
layers cycled so that they come from memory. The floor beside the block: its dot products
alone (D/16 vdpbf16ps per row and key: D/32 for the scores, D/32 for the weighted values)
at the measured rate; the clock estimate moves by 10% between runs on a VM. Needs a C compiler and a CPU with AVX512_BF16.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from triforce_offload.kernels import native

HERE = Path(__file__).resolve().parent


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=21, help="query rows per KV head (tokens x query heads per KV head)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--keys", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    cc = native.compiler()
    if cc is None:
        sys.exit("attention_cycles: no C compiler (cc, gcc or clang) on PATH")
    flags = [f for f in native.flags() if f not in ("-shared", "-fPIC")]
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "attention_cycles"
        r = subprocess.run([cc, *flags, f'-DATTENTION_SOURCE="{native.SOURCE}"', str(HERE / "attention_cycles.c"),
                            "-o", str(exe), "-lm"], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"attention_cycles: the build failed: {r.stderr.strip().splitlines()[-1] if r.stderr else r.returncode}")
        run = subprocess.run([str(exe), str(a.rows), str(a.head_dim), str(a.keys), str(a.layers)], capture_output=True,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
    if run.returncode:
        sys.exit(f"attention_cycles: {run.stderr.strip() or run.returncode}")
    v = {k: float(x) for k, x in (line.split() for line in run.stdout.splitlines() if line and line[0] != "#")}
    dp = v["dp_per_cycle"]
    floor = a.head_dim / 16 / dp if dp else float("nan")  # D/32 for the scores, D/32 for the values
    print(f"rows {a.rows}, head {a.head_dim}, clock {v['clock_ghz']:.2f} GHz, vdpbf16ps {dp:.2f} a cycle "
          f"(cycles per row and key; floor: the dot products alone {floor:.2f})")
    print("| phase | cycles per row and key |\n|---|---|")
    for k in ("block_hot", "block_memory", "scores", "transposes", "softmax", "pv", "pv_one_row_at_a_time"):
        if k in v:
            print(f"| {k.replace('_', ' ')} | {v[k]:.2f} |")
    print(f"| whole call, {a.keys} keys x 3 KV heads, {a.threads} threads ({v['call_ms']:.3f} ms) | {v['call']:.2f} |")


if __name__ == "__main__":
    main()
