"""Autoregressive decode speed: ours against transformers `generate` on the bundled SmolLM2.

Usage:
    python benchmarks/decode_speed.py                       # 1K/4K/8K, fp32 and bf16
    python benchmarks/decode_speed.py --contexts 1024 --dtypes bf16 --new-tokens 16 --threads 1

For every (context, dtype) it runs, in this one process and on the same prompt: our
`autoregressive` mode, transformers with its default (dynamic) cache, and transformers
with `cache_implementation="static"`. ms/token counts decode only (first new token to
last). Peak memory of our runtime is measured in a fresh subprocess per dtype at the
largest context: peak RSS above the process's RSS once libraries and tokenizer are loaded,
against the bytes of weights + KV cache. Results append to results/decode_speed.jsonl.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch


def our_ms(L, prompt, n):
    from triforce_offload.runtime import api
    from triforce_offload.runtime.sampling import SamplingParams
    opts = api.RunOptions.of(mode="autoregressive", max_new_tokens=n, sampling=SamplingParams())
    opts.ignore_eos = True
    toks, st = api.generate(L, prompt, opts)
    return st.decode_s * 1000 / max(len(toks) - 1, 1), toks


class Clock:
    """A transformers streamer that timestamps each new token."""

    def __init__(self):
        self.t = []

    def put(self, value):
        self.t.append(time.perf_counter())

    def end(self):
        pass


def hf_ms(hf, prompt, n, static):
    clock = Clock()
    kw = {"cache_implementation": "static"} if static else {}
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, streamer=clock, **kw)
    t = clock.t[1:]  # the first put is the prompt
    return 1000 * (t[-1] - t[0]) / (len(t) - 1), out[0, len(prompt):].tolist()


def rss_probe(dtype: str, ctx: int, n: int) -> dict:
    """Run in a fresh process: peak RSS of our runtime vs weights + KV."""
    import psutil
    from triforce_offload.runtime import api
    from triforce_offload.runtime.data import essay_tokens
    from triforce_offload.runtime.generate import host_peak_bytes
    L = api.load(None, dtype, "cpu")
    prompt = essay_tokens(L.tokenizer, ctx - n)
    weights = sum(p.numel() * p.element_size() for p in L.model.parameters())
    base = psutil.Process().memory_info().rss - weights  # libraries + tokenizer
    our_ms(L, prompt, n)
    kv = L.cfg.kv_bytes_per_token(L.model.lm_head.weight.element_size()) * (ctx + 64)
    peak = host_peak_bytes()
    return {"dtype": dtype, "context": ctx, "weights_gb": weights / 2**30, "kv_gb": kv / 2**30,
            "runtime_peak_gb": (peak - base) / 2**30,
            "overhead": (peak - base) / (weights + kv) - 1}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default="results/decode_speed.jsonl")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--rss-probe", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.rss_probe:
        print(json.dumps(rss_probe(a.rss_probe[0], int(a.rss_probe[1]), int(a.rss_probe[2]))))
        return
    rows = speed_rows(a) + [memory_row(dt, max(a.contexts), a.new_tokens) for dt in a.dtypes]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "a") as f:
        for r in rows:
            f.write(json.dumps({"bench": "decode_speed", "time": time.time(), **r}) + "\n")
    print_table(rows)


def speed_rows(a) -> list[dict]:
    from transformers import AutoModelForCausalLM
    from triforce_offload.runtime import api
    from triforce_offload.runtime.data import essay_tokens
    from triforce_offload.runtime.model.loader import parse_dtype, resolve
    rows = []
    for dt in a.dtypes:
        L = api.load(None, dt, "cpu")
        hf = AutoModelForCausalLM.from_pretrained(resolve(None), dtype=parse_dtype(dt)).eval()
        for ctx in a.contexts:
            prompt = essay_tokens(L.tokenizer, ctx - a.new_tokens)
            ours, toks = our_ms(L, prompt, a.new_tokens)
            dyn, _ = hf_ms(hf, prompt, a.new_tokens, static=False)
            sta, ref = hf_ms(hf, prompt, a.new_tokens, static=True)
            rows.append({"dtype": dt, "context": ctx, "ours_ms": ours, "hf_dynamic_ms": dyn,
                         "hf_static_ms": sta, "vs_static": sta / ours, "vs_dynamic": dyn / ours,
                         "same_tokens_as_hf": toks == ref})
            print(json.dumps(rows[-1]), file=sys.stderr)
        del hf
    return rows


def memory_row(dt: str, ctx: int, n: int) -> dict:
    cmd = [sys.executable, __file__, "--rss-probe", dt, str(ctx), str(n),
           "--threads", str(torch.get_num_threads())]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def print_table(rows):
    print("| dtype | context | ours ms/tok | HF dynamic ms/tok | HF static ms/tok | vs static | vs dynamic | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "ours_ms" in r:
            print(f"| {r['dtype']} | {r['context']} | {r['ours_ms']:.1f} | {r['hf_dynamic_ms']:.1f} | "
                  f"{r['hf_static_ms']:.1f} | {r['vs_static']:.2f}x | {r['vs_dynamic']:.2f}x | "
                  f"{r['same_tokens_as_hf']} |")
    print("\n| dtype | context | weights GB | KV GB | runtime peak GB | over weights+KV |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "overhead" in r:
            print(f"| {r['dtype']} | {r['context']} | {r['weights_gb']:.3f} | {r['kv_gb']:.3f} | "
                  f"{r['runtime_peak_gb']:.3f} | {100 * r['overhead']:+.1f}% |")


if __name__ == "__main__":
    main()
