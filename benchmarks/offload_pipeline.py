"""Offload pipeline: verify latency with copy/compute overlap vs the same work serialized.

Usage:
    python benchmarks/offload_pipeline.py [--contexts 8192,16384,32768] [--tokens 6]
        [--chunk 1024] [--dtype float32] [--repeats 3] [--out benchmarks/results/offload_pipeline.jsonl]

SmolLM2-135M stretched to 32K with `--rope-scaling linear:4`, all 30 layers offloaded
(`--on-chip 0`). On this CPU the "link" is the copier thread doing real memcpy from the
host store into staging slots (one core) while the model computes in the main thread
(torch.set_num_threads(1): the other core). The KV is random (a verification's cost does
not depend on the values; a 32K prefill takes minutes here); the forward runs the real
weights over it. Each row: best of `repeats` interleaved rounds after a warm-up round,
each forward measured from an idle link (prefetch issued right before it, as if
drafting took no time).

  serialized: each layer is copied whole into staging, then computed (nothing streams ahead)
  overlapped: the pipeline (chunks land while attention runs; a ring of two transfer
              chunks, so the next chunk, of this layer or the next, streams meanwhile)
  copy:       copying every layer's KV into whole-layer staging, alone (no compute)
  compute:    the same forward with the KV resident (FullCache), no copies
  efficiency = (copy + compute - wall_overlapped) / min(copy, compute)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from triforce_offload.runtime.api import load
from triforce_offload.runtime.offload_bench import compare


def row(loaded, context: int, args) -> dict:
    t = compare(loaded, context, args.tokens, args.chunk, args.repeats)
    copy, compute, ser, wall = t["copy"], t["compute"], t["serialized"], t["overlapped"]
    eff = (copy + compute - wall) / min(copy, compute)
    gb = context * loaded.cfg.kv_bytes_per_token(torch.empty(0, dtype=loaded.dtype).element_size()) / 1e9
    return {"context": context, "tokens": args.tokens, "chunk": args.chunk, "dtype": args.dtype,
            "kv_gb": gb, "serialized_ms": 1000 * ser, "overlapped_ms": 1000 * wall,
            "copy_ms": 1000 * copy, "compute_ms": 1000 * compute, "efficiency": eff,
            "speedup": ser / wall, "link_gbps": gb / copy}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,16384,32768")
    ap.add_argument("--tokens", type=int, default=6, help="tokens per verification (gamma2)")
    ap.add_argument("--chunk", type=int, default=1024, help="transfer chunk (tokens)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch compute threads")
    ap.add_argument("--out", default="benchmarks/results/offload_pipeline.jsonl")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load(None, args.dtype, "cpu", rope_scaling="linear:4")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{'context':>8} {'KV GB':>6} {'serial ms':>10} {'overlap ms':>10} {'copy ms':>8} "
          f"{'compute ms':>10} {'speedup':>7} {'efficiency':>10}")
    for n in (int(x) for x in args.contexts.split(",")):
        r = row(loaded, n, args)
        r["time"] = time.time()
        with out.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"{n:>8} {r['kv_gb']:>6.2f} {r['serialized_ms']:>10.1f} {r['overlapped_ms']:>10.1f} "
              f"{r['copy_ms']:>8.1f} {r['compute_ms']:>10.1f} {r['speedup']:>7.2f} "
              f"{r['efficiency']:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
