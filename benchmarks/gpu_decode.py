"""Decode speed against the hardware floor: eager, graphed and compiled autoregressive, triforce, transformers.

Usage:
    python benchmarks/gpu_decode.py --geometry llama2-7b              # 4K/16K/32K (+128K where it fits), bf16
    python benchmarks/gpu_decode.py --geometry smollm2 --contexts 32768
    python benchmarks/gpu_decode.py --model PATH --prompt-text essays --contexts 32768
    python benchmarks/gpu_decode.py --device cpu --geometry smollm2 --layers 2 --contexts 256 --new-tokens 4

The model is a checkpoint (`--model PATH`: an HF directory or a .gguf; `bundled` is the
bundled SmolLM2) or a random-weight model built in device memory with a known geometry
(`--geometry llama2-7b|llama3-8b|smollm2`, `--layers N` to shrink it): decode speed does
not depend on weight values, acceptance does. Geometries are stretched (RoPE) to cover
128K positions. A context counts prompt + new tokens; the prompt is random token ids, or
the bundled essays (`--prompt-text essays`, real models only: the n-gram drafter rarely
matches random ids, so triforce's acceptance means something only on text).

Per context, in this one process and on the same prompt, each run prefills once and then
decodes `--new-tokens` tokens (end-of-sequence ignored), the full KV cache resident on the
device (`offload off`):
  autoregressive eager    `graphs=False`
  autoregressive graphed  `graphs=True` (on the CPU the same code path; `graphs` in the row
                          says whether CUDA graphs actually replayed)
  autoregressive compiled `graphs=True, compile=True` (`--compile`: torch.compile under the
                          captured step; its compile seconds are in `warm_up_s`, untimed)
  triforce                n-gram drafter -> target + retrieval cache (`--budget`) -> target
                          + full cache, graphed; acceptance from the engine
  transformers            `generate` on the same weights (a real `--model` only)
ms/token = decode seconds / (new tokens - 1), with no graph capture and no kernel compile
inside: each autoregressive row first decodes the same tokens untimed over the same cache
and step (captures, Triton compiles for exactly those shapes), rolls back and times the
decode (`timed_captures` 0); triforce runs once untimed at the same settings (its retrieval
level built, every kernel specialization compiled), and its levels, rebuilt per run,
capture again: those seconds are measured (`capture_s`) and left out of ms/token.
`steady ms/token` leaves out the first forward (or speculative round).

The floor: a token must read every weight it uses (the embedding table only when it is tied
to the LM head) and the KV of the whole context. `copy GB/s` is measured in the same run (a
device-to-device `copy_` of a 1 GiB buffer on CUDA, timed with CUDA events; a 256 MiB tensor
copy on the CPU; read + write counted), floor ms = bytes / copy bandwidth, and `x floor` =
measured / floor: how far from the hardware a mode is. Triforce rows use the same bytes (an
autoregressive token's), so a ratio under 1 means beating the autoregressive floor. A
context whose weights + KV exceed 90% of the free device memory is skipped, with the reason.
Before timing, one decode step (32-token context) runs under runtime/opcount.py's counter:
the work ops per layer on the eager and the fixed-shape (graph) path go into every row
(`ops_per_layer`) and above the table.
Rows append to results/gpu_decode.jsonl; the table goes to stdout, progress to stderr.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from triforce_offload.bench.bandwidth import copy_bandwidth
from triforce_offload.bench.geometries import GEOMETRIES, geometry_config, p_bytes, random_model
from triforce_offload.runtime import opcount
from triforce_offload.runtime.model import quantized

MODES = ("eager", "graphed", "compiled", "triforce", "hf")
LABEL = {"eager": "autoregressive eager", "graphed": "autoregressive graphed",
         "compiled": "autoregressive compiled",
         "triforce": "triforce", "hf": "transformers generate"}
SLACK = 64  # cache capacity past prompt + new tokens (generate.capacity)


def contexts_arg(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def args_(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF directory, .gguf file, or 'bundled' (the bundled SmolLM2)")
    src.add_argument("--geometry", choices=sorted(GEOMETRIES), help="random weights, this geometry")
    ap.add_argument("--layers", type=int, default=0, help="override the geometry's layer count (tests)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda[:N]")
    ap.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--contexts", type=contexts_arg, nargs="+",
                    default=[[4096, 16384, 32768, 131072]],
                    help="prompt + new tokens, comma- or space-separated (131072 skipped where "
                         "it does not fit)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=[m for m in MODES if m != "compiled"], choices=MODES,
                    help="default: all but compiled (gpu_session.py c runs that)")
    ap.add_argument("--prompt-text", choices=("random", "essays"), default="random")
    ap.add_argument("--rope-scaling", default=None,
                    help="for --model: e.g. linear:4 (default: linear stretch when a context "
                         "exceeds the model's)")
    ap.add_argument("--budget", type=int, default=4096, help="triforce retrieval budget")
    ap.add_argument("--gamma2", default="6", help="triforce tokens per verification")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per mode; the median is kept")
    ap.add_argument("--copy-mib", type=int, default=0,
                    help="copy-bandwidth buffer (default 1024 on CUDA, 256 on the CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--batch", type=contexts_arg, nargs="+", default=None,
                    help="batch sizes (e.g. 1,4,8,16): each context decoded by B sequences at once "
                         "(runtime/batch), aggregate tokens/s against the floor (the weights read "
                         "once a step, every sequence's KV), instead of the single-stream rows")
    ap.add_argument("--out", default="results/gpu_decode.jsonl")
    a = ap.parse_args(argv)
    a.batch = [b for group in a.batch for b in group] if a.batch else None
    if a.batch and (min(a.batch) < 1 or set(a.modes) - {"graphed", "triforce"}):
        ap.error("--batch takes sizes >= 1 and the modes graphed and triforce")
    a.contexts = [c for group in a.contexts for c in group]
    if a.new_tokens < 3:
        ap.error("--new-tokens must be at least 3")
    bad = [c for c in a.contexts if c <= a.new_tokens]
    if bad:
        ap.error(f"--contexts {bad}: a context counts prompt + new tokens, so it must exceed "
                 f"--new-tokens {a.new_tokens}")
    if a.prompt_text == "essays" and a.geometry:
        ap.error("--prompt-text essays needs a real --model (a geometry has no tokenizer)")
    return a


def log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- the model

def load(a, device: torch.device, dtype_name: str):
    """(api.Loaded, label). A geometry is built in memory; a checkpoint goes through api.load."""
    from triforce_offload.runtime import api
    from triforce_offload.runtime.model.loader import parse_dtype, read_config, resolve
    dtype = parse_dtype(dtype_name)
    if a.geometry:
        cfg = geometry_config(a.geometry, a.layers, max(a.contexts))
        need = sum(p_bytes(cfg, dtype))
        free = device_free(device)
        if free is not None and need > 0.9 * free:
            sys.exit(f"{a.geometry}: weights of {need / 2**30:.1f} GiB exceed 90% of the free "
                     f"{free / 2**30:.1f} GiB on {device}")
        model = random_model(cfg, dtype, device, a.seed)
        tok = SimpleNamespace(eos_token_id=None)
        label = a.geometry + (f" ({a.layers} layers)" if a.layers else "") + ", random weights"
        return api.Loaded(model, cfg, tok, device, dtype), label
    path = None if a.model == "bundled" else a.model
    rope = a.rope_scaling
    if rope is None:
        limit = read_config(resolve(path)).max_position_embeddings
        if max(a.contexts) > limit:
            rope = f"linear:{math.ceil(max(a.contexts) / limit)}"
            log(f"contexts beyond the model's {limit}: --rope-scaling {rope}")
    L = api.load(path, dtype_name, str(device), rope)
    return L, a.model + (f" (rope {rope})" if rope else "")


# --------------------------------------------------------------------------- the hardware

def device_free(device: torch.device) -> int | None:
    """Free bytes where the model and its KV live: CUDA memory (with what torch's caching
    allocator holds but does not use), or available host memory on the CPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil
        return psutil.virtual_memory().available
    except ImportError:
        return None




def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# --------------------------------------------------------------------------- the runs

def make_prompt(L, a, n: int, which: int = 0) -> list[int]:
    """`n` prompt token ids: random ids (seeded; `which` another seed), or the essays with a
    summary request."""
    if a.prompt_text == "random":
        g = torch.Generator().manual_seed(a.seed + n + 7919 * which)
        return torch.randint(0, L.cfg.vocab_size, (n,), generator=g).tolist()
    from triforce_offload.runtime.data import long_prompt
    prompt = long_prompt(L.tokenizer, n)
    prompt = long_prompt(L.tokenizer, n - (len(prompt) - n))  # chat template overhead
    return prompt[-n:] if len(prompt) > n else prompt


def options(mode: str, a, n: int):
    from triforce_offload.runtime import api
    if mode == "triforce":
        return api.RunOptions.of(mode="triforce", max_new_tokens=n, ignore_eos=True, graphs=True,
                              **{"budget": a.budget, "gamma2": a.gamma2, "offload": "off"})
    return api.RunOptions.of(mode="autoregressive", max_new_tokens=n, ignore_eos=True,
                             graphs=mode != "eager", compile=mode == "compiled", **{"offload": "off"})


def steady_ms(marks: list[float]) -> float | None:
    """ms/token after the first forward (or speculative round) and the tokens it emitted
    together: graph captures and first-call costs left out."""
    j = 1
    while j + 1 < len(marks) and marks[j + 1] - marks[j] < 1e-4:  # same burst
        j += 1
    n = len(marks) - 1 - j
    return 1000 * (marks[-1] - marks[j]) / n if n > 0 else None


def run_ours(L, mode: str, prompt: list[int], a, n: int) -> dict:
    """One timed run of `mode`: autoregressive through `run_ar`; triforce after an untimed
    run at the same settings (every kernel specialization it launches compiled, its
    retrieval level built), its graph captures timed apart and left out of ms/token."""
    if mode in ("eager", "graphed", "compiled"):
        return run_ar(L, mode, prompt, a, n)
    generate(L, mode, prompt, a, n)  # warm-up: same prompt, same settings
    return generate(L, mode, prompt, a, n)


def generate(L, mode: str, prompt: list[int], a, n: int) -> dict:
    from triforce_offload.runtime import api
    marks = []
    sync(L.device)
    toks, st = api.generate(L, prompt, options(mode, a, n),
                            on_token=lambda t: marks.append(time.perf_counter()))
    sync(L.device)
    capture_s = st.extra.get("capture_s", 0.0)  # levels are rebuilt per run: recaptured
    first = 1000 * (marks[1] - marks[0]) if len(marks) > 1 else None
    row = {"ms_per_token": 1000 * (st.decode_s - capture_s) / max(len(toks) - 1, 1),
           "steady_ms_per_token": steady_ms(marks), "first_step_ms": first,
           "prefill_s": round(st.prefill_s, 3), "capture_s": capture_s,
           "timed_captures": st.extra.get("graph_captures", 0),
           "new_tokens": len(toks), "graphs": st.extra.get("graphs")}
    for k in ("acceptance", "mean_accepted", "host_reads", "notes"):
        if st.extra.get(k) not in (None, [], {}):
            row[k] = st.extra[k]
    return row


def run_ar(L, mode: str, prompt: list[int], a, n: int) -> dict:
    """Autoregressive decode with no capture or compile in the timed region: prefill, one
    untimed decode of the same length over the same cache and `Step` (graphs captured,
    kernels compiled for exactly these shapes), roll back to the prompt, time the decode."""
    from triforce_offload.runtime.generate import capacity, decode, prefill
    from triforce_offload.runtime.graphs import Step
    from triforce_offload.runtime.cache.offloaded import make_full_cache
    opts = options(mode, a, n)
    cap, max_new = capacity(L, len(prompt), opts)
    cache = make_full_cache(L, cap, opts)
    t0 = time.perf_counter()
    logits = prefill(L.model, cache, torch.tensor([prompt], device=L.device), prefill_chunk=opts.prefill_chunk)
    sync(L.device)
    g = opts.generation
    step, t1 = Step(L.model, cache, g.graphs, g.compile), time.perf_counter()
    decode(L.model, cache, logits, len(prompt), opts.sampling, max_new, set(), step=step)
    sync(L.device)
    warm_s, captures = time.perf_counter() - t1, len(step.graphs)
    cache.rollback(len(prompt))
    row = timed_decode(L, cache, step, logits, len(prompt), opts.sampling, max_new)
    cache.close()
    return {**row, "prefill_s": round(t1 - t0, 3), "warm_up_s": round(warm_s, 3),
            "capture_s": round(step.capture_s, 3), "timed_captures": len(step.graphs) - captures,
            "graphs": step.figures()["graphs"], "compiled": step.compiled,
            **({"notes": step.notes} if step.notes else {})}


def timed_decode(L, cache, step, logits, start: int, sp, max_new: int) -> dict:
    from triforce_offload.runtime.generate import decode
    marks = []
    sync(L.device)
    t0 = time.perf_counter()
    toks = decode(L.model, cache, logits, start, sp, max_new, set(),
                  on_token=lambda t: marks.append(time.perf_counter()), step=step)
    sync(L.device)
    decode_s = time.perf_counter() - t0
    first = 1000 * (marks[1] - marks[0]) if len(marks) > 1 else None
    return {"ms_per_token": 1000 * decode_s / max(len(toks) - 1, 1), "tokens": toks,
            "steady_ms_per_token": steady_ms(marks), "first_step_ms": first, "new_tokens": len(toks)}


def run_hf(hf, prompt: list[int], a, n: int, device: torch.device) -> dict:
    from triforce_offload.bench import peers
    sync(device)
    r = peers.hf_generate(hf, prompt, n, 0.0, a.seed, device=device)
    sync(device)
    return {"ms_per_token": r.ms_per_token, "new_tokens": len(r.tokens)}


def median_run(fn, repeats: int) -> dict:
    rows = [fn() for _ in range(repeats)]
    ms = statistics.median(r["ms_per_token"] for r in rows)
    row = min(rows, key=lambda r: abs(r["ms_per_token"] - ms))
    return {**row, "ms_per_token": ms} if repeats > 1 else row


def fit(L, ctx: int, a, device: torch.device, weights: int, batch: int = 1) -> str | None:
    """Why `ctx` (for `batch` sequences) does not fit (weights + KV over 90% of the free
    device memory), or None."""
    free = device_free(device)
    if free is None:
        return None
    elem = torch.empty(0, dtype=L.dtype).element_size()
    kv = L.cfg.kv_bytes_per_token(elem) * (ctx + SLACK)
    if "triforce" in a.modes:
        kv += L.cfg.kv_bytes_per_token(elem) * a.budget  # the retrieval cache
    kv *= batch
    avail = free + weights  # the weights are resident already
    if weights + kv <= 0.9 * avail:
        return None
    return (f"weights {weights / 2**30:.1f} GiB + KV {kv / 2**30:.1f} GiB = "
            f"{(weights + kv) / 2**30:.1f} GiB > 90% of {avail / 2**30:.1f} GiB free on {device}")


def figures(row: dict, bytes_tok: int, copy_bps: float) -> dict:
    """GB/s achieved, the floor and the measured/floor ratio for a timed row."""
    s = row["ms_per_token"] / 1000
    floor = bytes_tok / copy_bps
    return {"gb_per_s": bytes_tok / s / 1e9, "floor_ms": 1000 * floor,
            "floor_ratio": s / floor}


def main(argv=None):
    a = args_(argv)
    from triforce_offload.runtime import api
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    device = api.resolve_device(a.device)
    dtype_name = a.dtype or ("bf16" if device.type == "cuda" else "fp32")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    mib = a.copy_mib or (1024 if device.type == "cuda" else 256)
    copy_bps = copy_bandwidth(device, mib)  # before the model: the buffers leave room after
    log(f"copy bandwidth on {device_name(device)}: {copy_bps / 1e9:.1f} GB/s "
        f"({mib} MiB copy_, read + write)")
    L, label = load(a, device, dtype_name)
    weights = quantized.token_weight_bytes(L.model)
    resident = quantized.weight_bytes(L.model)
    elem = torch.empty(0, dtype=L.dtype).element_size()
    base = {"bench": "gpu_decode", "time": time.time(), "commit": commit(), "model": label,
            "device": device_name(device), "dtype": str(L.dtype).replace("torch.", ""),
            "torch": torch.__version__, "copy_gb_per_s": copy_bps / 1e9,
            "weights_bytes": weights, "budget": a.budget, "gamma2": a.gamma2,
            "prompt_text": a.prompt_text}
    log(f"{label}: {resident / 2**30:.2f} GiB of weights ({weights / 2**30:.2f} GiB read per "
        f"token), KV {L.cfg.kv_bytes_per_token(elem) / 2**10:.1f} KiB per token, {dtype_name}")
    ops = opcount.decode_step_ops(L.model, L.cfg)
    base["ops_per_layer"] = ops
    log(ops_line(ops))

    rows, prompts = [], {}

    def emit(row):
        row = {**base, **row}
        rows.append(row)
        log(json.dumps({k: v for k, v in row.items() if k not in base}))
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")

    if a.batch:
        batch_rows(L, a, device, emit, weights, resident, copy_bps, elem)
        print(batch_table(rows, copy_bps))
        return
    for ctx in a.contexts:
        why = fit(L, ctx, a, device, resident)
        if why:
            log(f"context {ctx} skipped: {why}")
            emit({"context": ctx, "mode": "all", "skipped": why})
            continue
        prompt = prompts[ctx] = make_prompt(L, a, ctx - a.new_tokens)
        kv = L.cfg.kv_bytes_per_token(elem) * ctx
        first = None  # (label, tokens) of the first autoregressive row: the others must match
        for mode in a.modes:
            if mode == "hf":
                continue
            r = median_run(lambda: run_ours(L, mode, prompt, a, a.new_tokens), a.repeats)
            toks = r.pop("tokens", None)
            if toks is not None and first is None:
                first = (LABEL[mode], toks)
            elif toks is not None:  # bf16: a fused kernel may round differently (docs/gpu.md)
                r["same_tokens_as"] = {first[0]: toks == first[1]}
            emit({"context": ctx, "prompt_tokens": len(prompt), "mode": LABEL[mode], **r,
                  "kv_bytes": kv, "bytes_per_token": weights + kv,
                  **figures(r, weights + kv, copy_bps)})
    if "hf" in a.modes:
        hf_rows(L, a, device, prompts, emit, weights, copy_bps, elem)
    print(table(rows, copy_bps))


def batch_rows(L, a, device, emit, weights, resident, copy_bps, elem):
    """Per context and batch size B: B sequences, each its own prompt, through
    `runtime.batch` (bench --batch's timing: T_PP until every sequence has its first token,
    S_TG the tokens after it over the time they took), each mode after an untimed run of the
    same batch (Triton kernels compiled, graphs of lone rounds captured). The floor: a step
    reads the weights once and each sequence's KV. `same_as_batch1`: the first sequence's
    tokens equal its run at batch 1 (the batched engine's identity, on this GPU)."""
    from triforce_offload.bench.batch import run_ours as run_batch
    for ctx in a.contexts:
        kv = L.cfg.kv_bytes_per_token(elem) * ctx
        solo = {}
        for B in a.batch:
            why = fit(L, ctx, a, device, resident, B)
            if why:
                log(f"context {ctx} batch {B} skipped: {why}")
                emit({"context": ctx, "batch": B, "mode": "all", "skipped": why})
                continue
            prompts = [make_prompt(L, a, ctx - a.new_tokens, b) for b in range(B)]
            for mode in a.modes:
                opts = options(mode, a, a.new_tokens)
                run_batch(L, prompts, opts)  # warm-up
                sync(device)
                r = run_batch(L, prompts, opts)
                sync(device)
                toks = r.pop("tokens")
                solo.setdefault(mode, toks[0])
                step_bytes = weights + B * kv
                floor_s = step_bytes / copy_bps  # a step: B tokens
                emit({"context": ctx, "batch": B, "mode": LABEL[mode], **r,
                      "ms_per_step": 1000 * B / r["speed_tg"] if r["speed_tg"] else None,
                      "bytes_per_step": step_bytes, "floor_tok_per_s": B / floor_s,
                      "floor_ratio": (B / floor_s) / r["speed_tg"] if r["speed_tg"] else None,
                      "same_as_batch1": toks[0] == solo[mode]})


def batch_table(rows: list[dict], copy_bps: float) -> str:
    head = rows[0] if rows else {}
    one = {(r["context"], r["mode"]): r["speed_tg"] for r in rows if r.get("batch") == 1 and "speed_tg" in r}
    lines = [f"{head.get('model', '')} on {head.get('device', '')}, {head.get('dtype', '')}; copy bandwidth "
             f"{copy_bps / 1e9:.1f} GB/s; floor = B / (weights once + B x KV per step / copy bandwidth)", "",
             "| context | batch | mode | S_TG tok/s | ms/step | floor tok/s | x floor | vs batch 1 "
             "| seqs/forward | acceptance | same as batch 1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['context']} | {r['batch']} | {r['mode']} | skipped: {r['skipped']} | | | | | | | |")
            continue
        b1 = one.get((r["context"], r["mode"]))
        acc = ", ".join(f"{k} {v:.2f}" for k, v in r.get("acceptance", {}).get("acceptance", {}).items())
        vs = f"{r['speed_tg'] / b1:.2f}x" if b1 else ""
        lines.append(f"| {r['context']} | {r['batch']} | {r['mode']} | {r['speed_tg']:.1f} "
                     f"| {r['ms_per_step'] or 0:.2f} | {r['floor_tok_per_s']:.1f} | {r['floor_ratio'] or 0:.2f}x "
                     f"| {vs} | {r['seqs_per_forward']} | {acc} | {'yes' if r['same_as_batch1'] else 'NO'} |")
    return "\n".join(lines)


def hf_rows(L, a, device, prompts, emit, weights, copy_bps, elem):
    """transformers `generate` on the same checkpoint, after our model leaves the device."""
    if a.geometry:
        for ctx in a.contexts:
            emit({"context": ctx, "mode": LABEL["hf"],
                  "skipped": "random-weight geometry: no checkpoint for transformers to load"})
        return
    from triforce_offload.bench import peers
    from triforce_offload.runtime.model.loader import resolve
    resident = quantized.weight_bytes(L.model)
    L.model = None  # one copy of the weights on the device at a time
    hf = peers.load_hf(resolve(None if a.model == "bundled" else a.model), L.dtype).to(device)
    n = max(16, min(256, min(a.contexts) - a.new_tokens))
    run_hf(hf, prompts.get(min(a.contexts), list(range(n)))[:n], a, 4, device)  # warm-up
    for ctx in a.contexts:
        if ctx not in prompts:
            emit({"context": ctx, "mode": LABEL["hf"], "skipped": "did not fit (see above)"})
            continue
        why = fit(L, ctx, a, device, resident)
        if why:
            emit({"context": ctx, "mode": LABEL["hf"], "skipped": why})
            continue
        kv = L.cfg.kv_bytes_per_token(elem) * ctx
        r = median_run(lambda: run_hf(hf, prompts[ctx], a, a.new_tokens, device), a.repeats)
        emit({"context": ctx, "prompt_tokens": len(prompts[ctx]), "mode": LABEL["hf"], **r,
              "kv_bytes": kv, "bytes_per_token": weights + kv,
              **figures(r, weights + kv, copy_bps),
              "note": "transformers with the checkpoint's own RoPE (speed does not depend on it)"})


def ops_line(ops: dict) -> str:
    """Work ops per layer of one decode step (runtime/opcount.py): as dispatched, and as the
    kernels this device runs (composite ops it has no kernel for expanded)."""
    return (f"work ops per layer per decode step: eager {ops['eager']} ({ops['eager_kernels']} "
            f"kernels here), fixed-shape {ops['fixed']} ({ops['fixed_kernels']} kernels here); "
            f"{ops['outside']} per forward outside the layers; host syncs in a fixed-shape "
            f"step: {ops['fixed_syncs']}")


def table(rows: list[dict], copy_bps: float) -> str:
    graphed = {r["context"]: r["ms_per_token"] for r in rows
               if r.get("mode") == LABEL["graphed"] and "ms_per_token" in r}
    head = rows[0] if rows else {}
    lines = [f"{head.get('model', '')} on {head.get('device', '')}, {head.get('dtype', '')}; "
             f"copy bandwidth {copy_bps / 1e9:.1f} GB/s (read + write); weights read per token "
             f"{head.get('weights_bytes', 0) / 1e9:.3f} GB + the context's KV; "
             "floor = bytes per token / copy bandwidth",
             ops_line(head["ops_per_layer"]) if "ops_per_layer" in head else "", "",
             "| context | mode | ms/token | steady ms/token | GB/token | GB/s | floor ms | x floor "
             "| vs AR graphed | graphs | acceptance | mean accepted |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['context']} | {r['mode']} | skipped: {r['skipped']} "
                         "| | | | | | | | | |")
            continue
        g = graphed.get(r["context"])
        acc = ", ".join(f"{k} {v:.2f}" for k, v in r.get("acceptance", {}).items())
        ma = f"{r['mean_accepted']:.2f}" if "mean_accepted" in r else ""
        steady = f"{r['steady_ms_per_token']:.2f}" if r.get("steady_ms_per_token") else ""
        vs = f"{g / r['ms_per_token']:.2f}x" if g else ""
        lines.append(
            f"| {r['context']} | {r['mode']} | {r['ms_per_token']:.2f} | {steady} "
            f"| {r['bytes_per_token'] / 1e9:.3f} | {r['gb_per_s']:.1f} | {r['floor_ms']:.2f} "
            f"| {r['floor_ratio']:.2f}x | {vs} "
            f"| {'' if r.get('graphs') is None else ('yes' if r['graphs'] else 'no')} "
            f"| {acc} | {ma} |")
    lines.append("")
    for mode in ("triforce", LABEL["compiled"]):  # what decides --compile's default
        lines += [f"{mode} vs graphed autoregressive at {r['context']}: "
                  f"{graphed[r['context']] / r['ms_per_token']:.2f}x" for r in rows
                  if r.get("mode") == mode and "ms_per_token" in r and r["context"] in graphed]
    lines += host_read_lines(rows)
    return "\n".join(lines)


def host_read_lines(rows: list[dict]) -> list[str]:
    """Blocking device-to-host reads per top verification, by level (runtime/hostread.py)."""
    return [f"host reads per verification at {r['context']} ({r['mode']}): "
            + ", ".join(f"{k} {v:g}" for k, v in r["host_reads"].items())
            for r in rows if r.get("host_reads")]


if __name__ == "__main__":
    main()
