"""Before/after: autoregressive decode ms/token of another commit and this checkout, in one process.

Usage:
    python benchmarks/ab_decode.py --base 67d8af4                        # 4K and 16K, bundled SmolLM2
    python benchmarks/ab_decode.py --base main --contexts 2048 --tokens 33 --threads 1
    python benchmarks/ab_decode.py --base main --fp32                     # dense float32 weights and KV

On a shared machine, timings taken minutes apart differ by more than a model change does.
So both versions run in this one process: `--base` (a git revision, exported with `git
archive` into a temp folder) and this checkout are imported under their own package names
(a folder of symlinks each), each loads the bundled model as `run` does (the API's
defaults: the GGUF's own precision, int8 activations and a bfloat16 KV where the CPU takes
them; `--fp32`: dense float32 weights and KV; RoPE stretched linearly when a context
exceeds its 8K). Per context one prefill (this checkout; `--prefill-chunk` tokens
per forward) fills both caches (its KV copied into the base's), then each version takes
`--tokens` greedy one-token steps, one step of each in turn (order swapped every step), so
both see the same load. ms/token is the median of a version's steps, the first left out;
`paired` is the median of the per-step ratios base/this. Rows append to
results/ab_decode.jsonl; a table goes to stdout, progress to stderr.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PARTS = {"runtime": "runtime", "kernels": "kernels", "offload": "offload", "bench": "benchmarks/lib"}


def log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def export(rev: str, tmp: Path) -> Path:
    """The tree of `rev` in tmp/src (git archive: no worktree left behind)."""
    out = tmp / "src"
    out.mkdir()
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=tar, check=True)
    return out


def package(src: Path, name: str, tmp: Path):
    """Import the package folders of `src` as `name` (relative imports keep them apart)."""
    d = tmp / name
    d.mkdir()
    root = src / "package"  # the import root's own modules (errors, settings), where a revision has them
    for f in (root.glob("*.py") if root.is_dir() else []):
        os.symlink(f, d / f.name)
    if not (d / "__init__.py").exists():
        (d / "__init__.py").write_text("")
    for sub, rel in PARTS.items():
        os.symlink(src / rel, d / sub)
    # register the folder as package `name` (its subpackages resolve through its __path__)
    spec = importlib.util.spec_from_file_location(name, d / "__init__.py", submodule_search_locations=[str(d)])
    sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])
    return _either(name, "runtime.model.loader", "runtime.loader"), _either(name, "runtime.cache.kv", "runtime.cache")


def _either(name: str, new: str, old: str):
    """A module by its place in the layout of runtime/model, cache, spec (new) or before it."""
    try:
        return importlib.import_module(f"{name}.{new}")
    except ModuleNotFoundError:
        return importlib.import_module(f"{name}.{old}")


def prefill(v, ids, cache, chunk: int):
    n = ids.shape[1]
    for s in range(0, n, chunk):
        logits = v["model"](ids[:, s:s + chunk], s, cache)
    cache.commit(n)
    return int(logits[0, -1].argmax())


def copy_kv(src, dst, n: int):
    for layer in range(len(src.k)):
        dst.k[layer][:, :, :n].copy_(src.k[layer][:, :, :n])
        dst.v[layer][:, :, :n].copy_(src.v[layer][:, :, :n])
    dst.commit(n)


def interleaved(V, caches, first: int, n: int, tokens: int):
    """`tokens` greedy steps of each version, alternating: per-version step seconds, tokens."""
    state = {t: (first, n) for t in V}
    secs, toks = {t: [] for t in V}, {t: [first] for t in V}
    for i in range(tokens):
        for t in (("base", "this") if i % 2 == 0 else ("this", "base")):
            cur, pos = state[t]
            t0 = time.perf_counter()
            logits = V[t]["model"](torch.tensor([[cur]]), pos, caches[t])[0, -1]
            cur = int(logits.argmax())
            secs[t].append(time.perf_counter() - t0)
            caches[t].commit(pos + 1)
            toks[t].append(cur)
            state[t] = (cur, pos + 1)
    return {t: s[1:] for t, s in secs.items()}, toks  # the first step warms up


def run_context(V, tok_ids, ctx: int, a) -> dict:
    n = len(tok_ids)
    caches = {t: V[t]["cache"].FullCache(V[t]["cfg"], n + a.tokens + 8, dtype=V[t]["kv"]) for t in V}
    t0 = time.perf_counter()
    first = prefill(V["this"], torch.tensor([tok_ids]), caches["this"], a.prefill_chunk)
    copy_kv(caches["this"], caches["base"], n)
    log(f"context {ctx}: prefill {time.perf_counter() - t0:.1f} s")
    secs, toks = interleaved(V, caches, first, n, a.tokens)
    ms = {t: 1000 * statistics.median(s) for t, s in secs.items()}
    paired = statistics.median(b / t for b, t in zip(secs["base"], secs["this"]))
    return {"context": ctx, "base_ms_per_token": ms["base"], "this_ms_per_token": ms["this"],
            "speedup": ms["base"] / ms["this"], "paired_speedup": paired,
            "steps": len(secs["this"]), "same_tokens": toks["base"] == toks["this"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--tokens", type=int, default=41, help="steps per version (the first is not timed)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--fp32", action="store_true",
                    help="dense float32 weights and KV (default: the runtime's defaults, as `run` loads)")
    ap.add_argument("--out", default="results/ab_decode.jsonl")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    base_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", a.base],
                              capture_output=True, text=True, check=True).stdout.strip()
    this_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
    limit = 8192  # the bundled model's context
    rope = f"linear:{-(-max(a.contexts) // limit)}" if max(a.contexts) > limit else None
    V = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for tag, src in (("base", export(a.base, tmp)), ("this", ROOT)):
            loader, cache = package(src, f"ab_{tag}", tmp)
            if a.fp32:
                model, cfg, tokenizer = loader.load_model(None, torch.float32, "cpu", rope, weights="fp32")
                kv = torch.float32
            else:  # what `run` loads: the API's defaults (weights, activations, KV dtype)
                L = importlib.import_module(f"ab_{tag}.runtime.api").load(None, device="cpu", rope_scaling=rope)
                model, cfg, tokenizer, kv = L.model, L.cfg, L.tokenizer, L.kv_dtype
            V[tag] = {"model": model, "cfg": cfg, "cache": cache, "tokenizer": tokenizer, "kv": kv}
        data = importlib.import_module("ab_this.runtime.data")
        log(f"base {base_rev} against this checkout ({this_rev}), {torch.get_num_threads()} threads")
        rows = []
        for ctx in a.contexts:
            ids = data.essay_tokens(V["this"]["tokenizer"], ctx)
            row = {"bench": "ab_decode", "time": time.time(), "base": base_rev, "this": this_rev,
                   "threads": torch.get_num_threads(), "rope": rope, "fp32": a.fp32}
            with torch.inference_mode():
                row.update(run_context(V, ids, ctx, a))
            rows.append(row)
            log(json.dumps(row))
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    what = "fp32" if a.fp32 else "at the runtime's defaults"
    print(f"bundled SmolLM2 {what}, {rows[0]['threads']} threads; base {base_rev}, this {this_rev}\n")
    print("| context | base ms/token | this ms/token | base/this | paired base/this | same tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['base_ms_per_token']:.2f} | {r['this_ms_per_token']:.2f} "
              f"| {r['speedup']:.3f}x | {r['paired_speedup']:.3f}x | {r['same_tokens']} |")


if __name__ == "__main__":
    main()
