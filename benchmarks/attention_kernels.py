"""One layer's attention on the CPU: torch SDPA, torch split-K, and the native kernel, side by side.

Usage:
    python benchmarks/attention_kernels.py                      # SmolLM2 shapes, 8K and 32K keys
    python benchmarks/attention_kernels.py --keys 4096 --tokens 1 4 8 --kv-heads 8 --q-heads 32 --head-dim 128

Each cell runs the same call over `--layers` distinct K/V tensors (so the cache does not
sit in L3, as in a real forward) and reports ms per layer; all three kernels run in this
one process on the same tensors (the native kernel is timed even where attention would not
dispatch to it, see kernels/native.py). Rows append to results/attention_kernels.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from triforce_offload.kernels import attention as A
from triforce_offload.kernels import native


def time_per_layer(fn, ks, vs, repeats: int) -> float:
    fn(ks[0], vs[0])
    t0 = time.perf_counter()
    for _ in range(repeats):
        for k, v in zip(ks, vs):
            fn(k, v)
    return 1000 * (time.perf_counter() - t0) / (repeats * len(ks))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 7], help="query tokens per call")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8, help="distinct K/V tensors cycled through")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", default="results/attention_kernels.jsonl")
    a = ap.parse_args()
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    print(f"native kernel: {'available' if native.available() else 'unavailable: ' + native.reason()}; "
          f"dispatch: {native.status()}; {torch.get_num_threads()} threads")
    os.environ["TRIFORCE_OFFLOAD_NATIVE"] = "1"  # time the kernel even where dispatch would skip it
    rows = []
    supports = native.supports
    for S in a.keys:
        for name in a.dtypes:
            dt = dtypes[name]
            shape = (1, a.kv_heads, S, a.head_dim)
            ks = [torch.randn(shape).to(dt) for _ in range(a.layers)]
            vs = [torch.randn(shape).to(dt) for _ in range(a.layers)]
            for T in a.tokens:
                q = torch.randn(1, a.q_heads, T, a.head_dim).to(dt)
                qf = A._fold(q, a.kv_heads)
                mask = A.causal_mask(S - T, T, 0, S, a.q_heads // a.kv_heads, q.device)
                r = {"keys": S, "dtype": name, "tokens": T}
                with torch.inference_mode():
                    r["sdpa_ms"] = time_per_layer(
                        lambda k, v: F.scaled_dot_product_attention(qf, k, v, attn_mask=mask), ks, vs, a.repeats)
                    native.supports = lambda q, k: False
                    try:
                        r["split_k_ms"] = time_per_layer(lambda k, v: A.attention(q, k, v, S - T), ks, vs, a.repeats)
                    finally:
                        native.supports = supports
                    r["native_ms"] = (time_per_layer(lambda k, v: native.attend(q, k, v, S - T), ks, vs, a.repeats)
                                      if native.supports(q, ks[0]) else None)
                rows.append(r)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "a") as f:
        for r in rows:
            f.write(json.dumps({"bench": "attention_kernels", "time": time.time(), **r}) + "\n")
    fmt = lambda x: "—" if x is None else f"{x:.3f}"
    print("| keys | dtype | query tokens | torch SDPA | torch, split-K | native | native vs SDPA |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['sdpa_ms'] / r['native_ms']:.2f}x" if r["native_ms"] else "—"
        print(f"| {r['keys']} | {r['dtype']} | {r['tokens']} | {fmt(r['sdpa_ms'])} | {fmt(r['split_k_ms'])} "
              f"| {fmt(r['native_ms'])} | {ratio} |")


if __name__ == "__main__":
    main()
