"""What quantized weights cost in quality: perplexity and agreement with fp32, per precision.

Usage:
    python benchmarks/quality.py                              # the bundled model: fp32, auto, auto:int8, int8, int4
    python benchmarks/quality.py --models bundled,path/to/model.gguf --tokens 4096 --out q.jsonl

For each model and each `--weights` precision W or W:A (the model loaded as `run --weights W
--activations A` would; A is fp32 unless given, so W alone measures the weights alone):
- perplexity on the bundled essays (`--tokens` tokens from `--offset`, scored in
  independent windows of `--window` tokens, the first token of a window not scored);
- top-1 agreement with fp32: the share of those positions where the precision's argmax
  equals fp32's (teacher-forced: both see the essay text, so one divergence does not
  decide the rest);
- greedy generations: `--generations` prompts (essay windows at spread offsets), `--new`
  greedy tokens each; `same` is the mean number of leading tokens equal to fp32's output
  and `identical` how many of the outputs are identical to fp32's.

fp32 of a GGUF is its blocks dequantized exactly, so a GGUF's own class (`auto`: Q4_1
loads as int4) computes the same weights as fp32 and differs only in summation order; int8
of a 4-bit GGUF requantizes. `:int8` quantizes each row of activations per 32 inputs into the
quantized linears (what `--activations auto` does on an AVX-512 VNNI CPU), and the KV is then
bfloat16 (`--kv-dtype auto`). One JSON line per
(model, precision) to `--out`.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from triforce_offload.runtime import api, data
from triforce_offload.runtime.model import quantized
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.options import ModelOptions, RunOptions


@torch.inference_mode()
def window_logits(L, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] (float32) of one window scored from an empty cache."""
    cache = FullCache(L.cfg, len(ids), dtype=L.kv_dtype, device=L.device)
    x = torch.tensor([ids], device=L.device)
    return L.model(x, 0, cache)[0].float()


def score(L, toks: list[int], window: int):
    """(negative log-likelihoods, argmax predictions) of every scored position."""
    nll, top = [], []
    for s in range(0, len(toks) - 1, window):
        w = toks[s: s + window]
        if len(w) < 2:
            break
        lg = window_logits(L, w)[:-1]
        tgt = torch.tensor(w[1:], device=lg.device)
        nll.append(torch.nn.functional.cross_entropy(lg, tgt, reduction="none").cpu())
        top.append(lg.argmax(-1).cpu())
    return torch.cat(nll), torch.cat(top)


def generations(L, toks: list[int], n: int, length: int, new: int) -> list[list[int]]:
    step = max((len(toks) - length) // max(n, 1), 1)
    outs = []
    for i in range(n):
        prompt = toks[i * step: i * step + length]
        out, _ = api.generate(L, prompt, RunOptions.of(mode="autoregressive", max_new_tokens=new))
        outs.append(out)
    return outs


def lead(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bundled", help="comma list: 'bundled', HF folders, .gguf files")
    ap.add_argument("--weights", default="fp32,auto,auto:int8,int8,int4",
                    help="precisions W or W:A (activations); fp32 first is the reference")
    ap.add_argument("--tokens", type=int, default=4096, help="essay tokens scored")
    ap.add_argument("--offset", type=int, default=0, help="first essay token")
    ap.add_argument("--window", type=int, default=512, help="tokens per scored window")
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", help="append JSON lines here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    kinds = a.weights.split(",")
    if kinds[0] != "fp32":
        kinds.insert(0, "fp32")  # the reference
    print("| model | weights | MB | perplexity | top-1 agreement with fp32 | greedy: same leading tokens | identical outputs |")
    print("|---|---|---|---|---|---|---|")
    for model in a.models.split(","):
        path = None if model == "bundled" else model
        ref = None
        for kind in kinds:
            t0 = time.perf_counter()
            w, _, act = kind.partition(":")
            L = api.load(ModelOptions(path, weights=w, activations=act or "fp32"))
            toks = data.essay_tokens(L.tokenizer, a.offset + a.tokens)[a.offset:]
            nll, top = score(L, toks, a.window)
            gens = generations(L, toks, a.generations, a.prompt_len, a.new)
            if ref is None:
                ref = (top, gens)
            agree = (top == ref[0]).float().mean().item()
            same = sum(lead(g, r) for g, r in zip(gens, ref[1])) / len(gens)
            ident = sum(g == r for g, r in zip(gens, ref[1]))
            row = {"bench": "quality", "model": model, "weights": kind, "loaded": L.weights,
                   "activations": L.activations or str(L.dtype).removeprefix("torch."),
                   "kv_dtype": str(L.kv_dtype).removeprefix("torch."),
                   "mb": round(quantized.weight_bytes(L.model) / 1e6, 1),
                   "perplexity": round(math.exp(nll.mean().item()), 4), "scored": len(nll),
                   "top1_agreement": round(agree, 4), "greedy_same_tokens": same,
                   "greedy_identical": ident, "generations": len(gens), "new_tokens": a.new,
                   "seconds": round(time.perf_counter() - t0, 1)}
            print(f"| {model} | {kind} ({L.weights}) | {row['mb']:.0f} | {row['perplexity']:.3f} | "
                  f"{agree:.4f} | {same:.1f} of {a.new} | {ident} of {len(gens)} |", flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            del L


if __name__ == "__main__":
    main()
