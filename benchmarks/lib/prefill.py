"""What the speculative benchmark scripts share: one essay prompt per context, prefilled once.

speedup.py, retrieval_sweep.py and retrieval_expected.py decode from the same prefilled
full cache (a `Recorder` that keeps the verifier's queries), optionally saved to and
loaded from `--prefill-cache`; plus their thread/output setup and the retrieval scripts'
common options. `a` is the script's argparse namespace.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ..runtime.api import load
from ..runtime.cache.kv import FullCache
from ..runtime.data import builtin_prompt
from ..runtime.generate import prefill
from ..runtime.cache.retrieval import Recorder


def prefilled(ctx: int, a):
    """Load (stretching RoPE past 8K), build the prompt, prefill once: (L, prompt, full, logits,
    qs, prefill seconds). With `a.prefill_cache` set, the prefilled KV, queries and logits are
    saved to that file (about 0.7 GB at 32K in bf16) and loaded from it on the next run."""
    scale = -(-ctx // 8192)
    L = load(None, a.dtype, "cpu", f"linear:{scale}" if scale > 1 else None)
    path = Path(a.prefill_cache.replace("{context}", str(ctx))) if a.prefill_cache else None
    if path is not None and path.exists():
        return (L, *load_prefill(L, path, a), 0.0)
    want = ctx - a.new_tokens - 64
    kind = getattr(a, "prompt", "summary")
    prompt = builtin_prompt(L.tokenizer, kind, want)
    prompt = builtin_prompt(L.tokenizer, kind, want - (len(prompt) - want))  # chat template overhead
    full = Recorder(FullCache(L.cfg, len(prompt) + a.new_tokens + 64, dtype=L.dtype))
    t0 = time.perf_counter()
    logits = prefill(L.model, full, torch.tensor([prompt]))
    print(f"ctx {ctx}: prompt {len(prompt)} tokens, prefill {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)
    if path is not None:
        n = len(prompt)
        torch.save({"prompt": prompt, "logits": logits, "qs": dict(full.q), "new_tokens": a.new_tokens,
                    "dtype": a.dtype, "k": [k[:, :, :n].clone() for k in full.inner.k],
                    "v": [v[:, :, :n].clone() for v in full.inner.v]}, path)
    return L, prompt, full, logits, dict(full.q), time.perf_counter() - t0


def load_prefill(L, path: Path, a):
    """(prompt, full, logits, qs) from a file `prefilled` saved."""
    s = torch.load(path)
    if (s["new_tokens"], s["dtype"]) != (a.new_tokens, a.dtype):
        sys.exit(f"{path} was prefilled for --new-tokens {s['new_tokens']} --dtype {s['dtype']}, "
                 f"not {a.new_tokens} / {a.dtype}")
    prompt, n = s["prompt"], len(s["prompt"])
    full = Recorder(FullCache(L.cfg, n + a.new_tokens + 64, dtype=L.dtype))
    for layer in range(L.cfg.n_layers):
        full.inner.k[layer][:, :, :n].copy_(s["k"][layer])
        full.inner.v[layer][:, :, :n].copy_(s["v"][layer])
    full.commit(n)
    print(f"prompt {n} tokens, prefill loaded from {path}", file=sys.stderr, flush=True)
    return prompt, full, s["logits"], s["qs"]


def start(a) -> Path:
    """Thread count and output folder for a benchmark run; the JSONL path."""
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def retrieval_parser(description: str, rebuilds: list[str], seeds: list[int], out: str) -> argparse.ArgumentParser:
    """The options retrieval_sweep.py and retrieval_expected.py share."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--budgets", type=int, nargs="+", default=[4096, 6144, 8192])
    ap.add_argument("--chunks", type=int, nargs="+", default=[8, 16], help="retrieval chunks (tokens)")
    ap.add_argument("--rebuilds", nargs="+", default=rebuilds)
    ap.add_argument("--seeds", type=int, nargs="+", default=seeds,
                    help="sampling seeds; at T>0 one 128-token sample per seed is noisy, average several")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--prefill-cache", default=None, help="save/load the prefilled state here")
    ap.add_argument("--out", default=out)
    return ap
