"""Offload pipeline: verify and decode latency against the link floor, and overlap against serial.

Usage:
    python benchmarks/offload_pipeline.py [--contexts 8192,16384,32768] [--tokens 6]
        [--chunk 1024] [--dtype float32] [--repeats 3] [--out benchmarks/results/offload_pipeline.jsonl]
    python benchmarks/offload_pipeline.py --device cuda --contexts 32768          # SmolLM2, bf16
    python benchmarks/offload_pipeline.py --device cuda --geometry llama2-7b --contexts 16384,131072 --no-compare
    python benchmarks/offload_pipeline.py --device cuda --geometry llama2-7b --contexts 131072 --no-compare --prefill

The model is the bundled SmolLM2-135M stretched to 32K with `--rope-scaling linear:4` (or
`--model PATH`, or a random-weight `--geometry` as in gpu_decode.py: speed does not depend
on weight values), all layers offloaded (`--on-chip 0`). The KV is random (a verification's
cost does not depend on the values; a 32K prefill takes minutes on a CPU); the forward runs
the real weights over it. On a GPU the KV sits in pinned host memory and streams over PCIe
on the copy stream; on this CPU the "link" is the copier thread doing real memcpy from the
host store into staging slots (one core) while the model computes in the main thread
(torch.set_num_threads(1): the other core). Every time is read after a device
synchronisation (on CUDA the per-forward copy/overlap figures come from CUDA events).

Per context:
  KV GB          bytes of the offloaded KV over the context (what one forward streams)
  link GB/s      one host->device copy of `--link-mib` MiB measured in this run: pinned
                 memory on the copy stream timed by a CUDA event pair (GPU), the copier's
                 memcpy (CPU)
  floor ms       KV bytes / link GB/s: the physical floor of an offloaded forward
  verify ms      a verification of `--tokens` tokens through the pipeline (chunks land while
                 attention runs; a ring of `depth` transfer chunks streams ahead), from an
                 idle link, best of `--repeats` after a warm-up; x floor = verify / floor
  decode ms      the same for one token (autoregressive + offload); x floor = decode / floor
  overlap        the verification's overlap efficiency from its timeline (copy and compute
                 spans of this forward)
  host us/chunk  host microseconds per streamed chunk spent in the pipeline itself
                 (scheduler, copier, timeline): a pass over every layer's prefix with no
                 attention, wall time minus the time blocked waiting for copies, / chunks
With --compare (default), also the serial reference, measured in interleaved rounds so load
drift hits them alike (it holds a second host store and the KV resident on the device: use
--no-compare where that does not fit):
  serialized: each layer is copied whole into staging, then computed (nothing streams ahead)
  copy:       copying every layer's KV into whole-layer staging, alone (no compute)
  compute:    the same forward with the KV resident (FullCache), no copies
  efficiency = (copy + compute - overlapped) / min(copy, compute); speedup = serialized / overlapped
With --prefill, also an offloaded prefill of each context through `api.generate` (random
ids, layer-major, `--prefill-chunk` tokens per forward): seconds, tokens/s and the bytes
streamed host->device (nothing is re-streamed: only the prefetch that follows the
prefill, of the next forward's first `depth` transfer chunks).
Rows append to `--out` (JSONL); the table goes to stdout.
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from triforce_offload.bench.offload_timing import compare, host_per_chunk, make_cache, verify_once
from triforce_offload.offload.costmodel import default_transfer_chunk
from triforce_offload.offload.tune import link_gbps
from triforce_offload.runtime import api


def kv_bytes(loaded, context: int) -> int:
    return context * loaded.cfg.kv_bytes_per_token(torch.empty(0, dtype=loaded.dtype).element_size())


def latencies(loaded, context: int, tokens: int, transfer_chunk: int, repeats: int) -> dict:
    """Best-of-`repeats` verification (`tokens`) and decode (1 token) forwards over one
    offloaded cache, interleaved, after a warm-up of each."""
    cache = make_cache(loaded, context, tokens, transfer_chunk)
    best = {}
    for r in range(repeats + 1):
        for name, t in (("verify", tokens), ("decode", 1)):
            s = verify_once(loaded.model, cache, t, loaded.device)
            if r and (name not in best or s["latency_s"] < best[name]["latency_s"]):
                best[name] = s
    if cache.spans is not None:  # CUDA: the timed cache records spans; measure one without
        cache.close()
        cache = make_cache(loaded, context, tokens, transfer_chunk, profile=False)
    best["host"] = host_per_chunk(cache, repeats)
    cache.close()
    return best


def row(loaded, context: int, args, link: float) -> dict:
    gb = kv_bytes(loaded, context) / 1e9
    floor = gb / link
    lat = latencies(loaded, context, args.tokens, args.chunk, args.repeats)
    v, d = lat["verify"], lat["decode"]
    r = {"context": context, "tokens": args.tokens, "chunk": args.chunk, "dtype": args.dtype,
         "device": str(loaded.device), "model": args.label, "kv_gb": gb, "link_gbps": link,
         "floor_ms": 1000 * floor, "verify_ms": 1000 * v["latency_s"],
         "verify_x_floor": v["latency_s"] / floor, "decode_ms": 1000 * d["latency_s"],
         "decode_x_floor": d["latency_s"] / floor, "verify_overlap": v["overlap"],
         "verify_copy_ms": 1000 * v["copy_s"], "verify_wait_ms": 1000 * v["wait_s"],
         "decode_overlap": d["overlap"], "host_us_per_chunk": 1e6 * lat["host"]["host_s_per_chunk"],
         "chunks_per_pass": lat["host"]["chunks"]}
    if args.compare:
        gc.collect()
        t = compare(loaded, context, args.tokens, args.chunk, args.repeats)
        copy, compute, ser, wall = t["copy"], t["compute"], t["serialized"], t["overlapped"]
        r.update({"serialized_ms": 1000 * ser, "overlapped_ms": 1000 * wall,
                  "copy_ms": 1000 * copy, "compute_ms": 1000 * compute,
                  "efficiency": (copy + compute - wall) / min(copy, compute),
                  "speedup": ser / wall, "stream_gbps": gb / copy})
    return r


def prefill_row(loaded, context: int, args) -> dict:
    """An offloaded prefill of `context - 1` random tokens through `api.generate` (layer-major:
    every prompt chunk through a layer while its KV stays on the device, nothing
    re-streamed), and the first token: seconds, tokens/s, bytes streamed host->device."""
    gc.collect()
    g = torch.Generator().manual_seed(context)
    prompt = torch.randint(0, loaded.cfg.vocab_size, (context - 1,), generator=g).tolist()
    opts = api.RunOptions.of(mode="autoregressive", max_new_tokens=1, ignore_eos=True,
                          prefill_chunk=args.prefill_chunk,
                          **{"offload": "on", "transfer_chunk": args.chunk})
    _, st = api.generate(loaded, prompt, opts)
    return {"prefill_tokens": len(prompt), "prefill_chunk": args.prefill_chunk,
            "prefill_s": st.prefill_s, "prefill_tok_per_s": len(prompt) / st.prefill_s,
            "prefill_streamed_gb": st.extra["streamed_gb"] * 2 ** 30 / 1e9}


HEAD = (f"{'context':>8} {'KV GB':>6} {'link GB/s':>9} {'floor ms':>8} {'verify ms':>9} "
        f"{'x floor':>7} {'decode ms':>9} {'x floor':>7} {'overlap':>7} {'host us/chunk':>13}")
HEAD_CMP = f" {'serial ms':>9} {'copy ms':>8} {'compute ms':>10} {'speedup':>7} {'efficiency':>10}"


def line(r: dict) -> str:
    s = (f"{r['context']:>8} {r['kv_gb']:>6.3f} {r['link_gbps']:>9.2f} {r['floor_ms']:>8.2f} "
         f"{r['verify_ms']:>9.1f} {r['verify_x_floor']:>7.2f} {r['decode_ms']:>9.1f} "
         f"{r['decode_x_floor']:>7.2f} {r['verify_overlap']:>7.2f} {r['host_us_per_chunk']:>13.1f}")
    if "serialized_ms" in r:
        s += (f" {r['serialized_ms']:>9.1f} {r['copy_ms']:>8.1f} {r['compute_ms']:>10.1f} "
              f"{r['speedup']:>7.2f} {r['efficiency']:>10.2f}")
    return s


def load(args, device: torch.device):
    if args.geometry:
        from triforce_offload.bench.geometries import geometry_config, random_model
        from triforce_offload.runtime.model.loader import parse_dtype
        dtype = parse_dtype(args.dtype)
        cfg = geometry_config(args.geometry, args.layers, max(args.contexts) + args.tokens)
        model = random_model(cfg, dtype, device, 0)
        label = args.geometry + (f" ({args.layers} layers)" if args.layers else "")
        return api.Loaded(model, cfg, SimpleNamespace(eos_token_id=None), device, dtype), label
    rope = args.rope_scaling or (None if args.model else "linear:4")
    loaded = api.load(args.model, args.dtype, str(device), rope_scaling=rope)
    return loaded, (args.model or "smollm2-135m") + (f" (rope {rope})" if rope else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,16384,32768")
    ap.add_argument("--tokens", type=int, default=6, help="tokens per verification (gamma2)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="transfer chunk (tokens) [default: 1024 on the CPU, >= 4 MiB per copy on CUDA]")
    ap.add_argument("--device", default="cpu", help="cpu|cuda|auto")
    ap.add_argument("--dtype", default=None, help="[default: float32 on the CPU, bfloat16 on CUDA]")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="HF directory or .gguf [default: bundled SmolLM2]")
    src.add_argument("--geometry", default=None, help="random weights: llama2-7b|llama3-8b|smollm2")
    ap.add_argument("--layers", type=int, default=0, help="override the geometry's layer count")
    ap.add_argument("--rope-scaling", default=None, help="[default: linear:4 for the bundled model]")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--link-mib", type=int, default=256, help="size of the link measurement copy")
    ap.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                    help="also the serialized / copy-alone / compute-alone reference")
    ap.add_argument("--prefill", action="store_true",
                    help="also time an offloaded prefill of each context (prefill_s, tokens/s, bytes streamed)")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prompt tokens per prefill forward [default: 4096 on CUDA, 512 on the CPU]")
    ap.add_argument("--threads", type=int, default=1, help="torch compute threads (CPU)")
    ap.add_argument("--out", default="benchmarks/results/offload_pipeline.jsonl")
    args = ap.parse_args(argv)
    args.contexts = [int(x) for x in args.contexts.split(",") if x.strip()]
    device = api.resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    loaded, args.label = load(args, device)
    if args.chunk is None:
        elem = torch.empty(0, dtype=loaded.dtype).element_size()
        layer = 2 * loaded.cfg.n_kv_heads * loaded.cfg.head_dim * elem
        args.chunk = default_transfer_chunk(layer) if device.type == "cuda" else 1024
    args.prefill_chunk = args.prefill_chunk or (4096 if device.type == "cuda" else 512)
    link = link_gbps(device, args.link_mib)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"# {args.label}, {args.dtype} on {device}, transfer chunk {args.chunk} tokens, "
          f"{args.tokens} tokens per verification; link {link:.2f} GB/s ({args.link_mib} MiB copy)")
    print(HEAD + (HEAD_CMP if args.compare else ""))
    for n in args.contexts:
        r = row(loaded, n, args, link)
        if args.prefill:
            r.update(prefill_row(loaded, n, args))
            print(f"# prefill of {r['prefill_tokens']} tokens: {r['prefill_s']:.1f} s "
                  f"({r['prefill_tok_per_s']:.0f} tok/s), {r['prefill_streamed_gb']:.3f} GB streamed "
                  f"host->device (the prefetch of the next forward's first chunks)", flush=True)
        r["time"] = time.time()
        with out.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(line(r), flush=True)


if __name__ == "__main__":
    main()
