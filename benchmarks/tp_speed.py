"""Tensor parallelism on this machine: `--tp 1` against `--tp 2`, decode ms/token, one run.

Usage:
    python benchmarks/tp_speed.py                        # 2K-token prompt, 32 new tokens, fp32
    python benchmarks/tp_speed.py --context 4096 --new-tokens 64 --dtype bf16

The model is a random-initialised SmolLM2-135M look-alike whose head counts split over 2
ranks (30 layers, width 512, 8 query / 2 KV heads of 64, MLP 1536, 49152-token vocab,
tied embeddings): the real SmolLM2 has 9 heads, which 2 ranks cannot split. Runs, each in
fresh spawned processes, on the same prompt, greedy, EOS ignored:

- tp1 x 1 thread: one process, one core (the per-rank budget of tp2);
- tp2 x 1 thread: two ranks over gloo, one core each;
- tp1 x 2 threads: one process using both cores (what you would run without TP).

Also times the all-reduces alone: 2 per layer of a [1, 1, width] tensor over gloo, i.e.
the communication one decode step of tp2 pays. ms/token counts decode only; a warm-up
generate precedes every timed one. Results append to results/tp_speed.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from triforce_offload.runtime import api
from triforce_offload.runtime.model import distributed, tp
from triforce_offload.runtime.model.config import ModelConfig
from triforce_offload.runtime.model.loader import parse_dtype
from triforce_offload.runtime.model.transformer import Transformer
from triforce_offload.runtime.sampling import SamplingParams

CFG = dict(vocab_size=49152, hidden_size=512, intermediate_size=1536, n_layers=30, n_heads=8,
           n_kv_heads=2, head_dim=64, max_position_embeddings=16384, tie_word_embeddings=True)


class _NoTokenizer:
    eos_token_id = None


def build(dtype: str) -> api.Loaded:
    """The same random model on every rank, sharded when in a process group."""
    torch.manual_seed(0)
    cfg = ModelConfig(**CFG)
    m = Transformer(cfg)
    m.tie_weights()
    m = m.to(parse_dtype(dtype)).eval().requires_grad_(False)
    return tp.shard(api.Loaded(m, cfg, _NoTokenizer(), torch.device("cpu"), parse_dtype(dtype)))


def decode_ms(dtype: str, context: int, new: int) -> dict:
    """Rank body: warm-up generate, timed generate; ms/token and the tokens."""
    L = build(dtype)
    prompt = torch.randint(3, CFG["vocab_size"], (context,), generator=torch.Generator().manual_seed(1))
    opts = api.RunOptions.of(max_new_tokens=new, sampling=SamplingParams(), ignore_eos=True)
    api.generate(L, prompt.tolist()[:64], api.RunOptions.of(max_new_tokens=4, ignore_eos=True))
    toks, st = api.generate(L, prompt.tolist(), opts)
    return {"ms_per_token": st.decode_ms_per_token, "prefill_s": st.prefill_s, "tokens": toks,
            "threads": torch.get_num_threads()}


def all_reduce_ms(dtype: str, steps: int = 20) -> float:
    """Rank body: the 2 x n_layers all-reduces of one decode step, alone (ms per step)."""
    import torch.distributed as dist
    x = torch.randn(1, 1, CFG["hidden_size"]).to(parse_dtype(dtype))
    n = 2 * CFG["n_layers"]
    for _ in range(n):  # warm-up
        dist.all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(steps * n):
        dist.all_reduce(x)
    return 1000 * (time.perf_counter() - t0) / steps


def run(args) -> list[dict]:
    rows = []
    for name, world, threads in (("tp1 x 1 thread", 1, 1), ("tp2 x 1 thread", 2, 1),
                                 ("tp1 x 2 threads", 1, 2)):
        r = distributed.launch(decode_ms, world, (args.dtype, args.context, args.new_tokens),
                               threads=threads, timeout=1800)[0]
        rows.append({"run": name, "tp": world, "threads_per_rank": threads, **r})
    ar = distributed.launch(all_reduce_ms, 2, (args.dtype,), threads=1, timeout=600)[0]
    rows.append({"run": "tp2 all-reduces only", "tp": 2, "threads_per_rank": 1, "ms_per_token": ar})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="fp32", help="fp32 (the CPU default) or bf16")
    ap.add_argument("--out", default="results/tp_speed.jsonl")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    rows = run(args)
    load = (load0, os.getloadavg()[0])  # other processes on the machine skew every figure
    same = rows[0]["tokens"] == rows[1]["tokens"] == rows[2]["tokens"]
    base = rows[0]["ms_per_token"]
    print(f"context {args.context}, {args.new_tokens} new tokens, {args.dtype}; "
          f"greedy tokens identical across runs: {same}; "
          f"load average {load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'run':<22} {'ms/token':>9} {'vs tp1x1':>9}")
    for r in rows:
        print(f"{r['run']:<22} {r['ms_per_token']:>9.1f} {base / r['ms_per_token']:>8.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for r in rows:
            r = {k: v for k, v in r.items() if k != "tokens"}
            f.write(json.dumps({**vars(args), **r, "identical": same,
                                "loadavg": load, "time": time.time()}) + "\n")


if __name__ == "__main__":
    main()
