"""Needle in a haystack: autoregressive vs triforce on essay haystacks, greedy.

Usage:
    python benchmarks/niah.py                                  # 2K/4K/8K x depths 0..100%
    python benchmarks/niah.py --lengths 2048 --depths 0 50 100 --new-tokens 24
    python benchmarks/niah.py --model path/to/hf-dir --budget 512

A needle sentence goes at a depth of 0-100% (snapped to the next sentence start) into
the Paul Graham essays cut to the haystack length; the chat prompt ends with the
question. For each cell: does the greedy answer of autoregressive and of triforce
contain the needle's key phrase, and are the two answers the same tokens (they must be:
TriForce is lossless). Appends results/niah.jsonl and writes heat maps
results/niah_found.png (autoregressive found the needle) and results/niah_identical.png.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

NEEDLE = ("The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park "
          "on a sunny day.")
QUESTION = "What is the best thing to do in San Francisco? Answer from the text above."
KEY = "dolores park"  # the answer counts as found when it contains this (case-insensitive)
OVERHEAD = 96  # tokens of needle + question + chat template, taken off the essay text


def haystack(tokenizer, n_tokens: int, depth: float) -> str:
    """`n_tokens` of essays with the needle at `depth` percent, at a sentence start."""
    from triforce_offload.runtime.data import essay_tokens
    text = tokenizer.decode(essay_tokens(tokenizer, n_tokens))
    at = int(len(text) * depth / 100)
    if 0 < at < len(text):
        dot = text.find(". ", at)
        at = len(text) if dot < 0 else dot + 2
    return f"{text[:at]} {NEEDLE} {text[at:]}".strip()


def cell(loaded, length: int, depth: float, o) -> dict:
    """Both modes on one haystack; found / identical flags and the answers."""
    from triforce_offload.runtime import api
    from triforce_offload.runtime.data import encode_prompt
    body = haystack(loaded.tokenizer, length - OVERHEAD, depth)
    ids = encode_prompt(loaded.tokenizer, f"{body}\n\n{QUESTION}", chat=True)
    out = {"length": length, "depth": depth, "prompt_tokens": len(ids)}
    for mode in ("autoregressive", "triforce"):
        opts = api.RunOptions.of(mode=mode, max_new_tokens=o.new_tokens,
                              **{"offload": "off", "budget": o.budget})
        toks, st = api.generate(loaded, ids, opts)
        text = loaded.tokenizer.decode(toks, skip_special_tokens=True)
        out[mode] = {"tokens": toks, "text": text, "found": KEY in text.lower(),
                     "ms_per_token": st.decode_ms_per_token}
    ar, tf = out["autoregressive"], out["triforce"]
    out.update(found=ar["found"], found_triforce=tf["found"], identical=ar["tokens"] == tf["tokens"])
    return out


def run_grid(loaded, o, progress=None) -> list[dict]:
    cells = [(n, d) for n in o.lengths for d in o.depths]
    grid = []
    for i, (n, d) in enumerate(cells):
        if progress:
            progress(i, len(cells), f"{n} tokens, depth {d:g}%")
        grid.append(cell(loaded, n, d, o))
    return grid


def save(grid: list[dict], o) -> list[Path]:
    from triforce_offload.bench.plots import plot_niah
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "niah.jsonl", "a") as f:
        for c in grid:
            f.write(json.dumps({"bench": "niah", "time": time.time(), "model": o.model or "bundled",
                                "budget": o.budget, **c}) + "\n")
    return [plot_niah(grid, out / "niah_found.png", "found"),
            plot_niah(grid, out / "niah_identical.png", "identical")]


def table(grid: list[dict]) -> str:
    lines = ["| haystack | depth | autoregressive found | triforce found | identical |",
             "|---|---|---|---|---|"]
    yes = {True: "yes", False: "no"}
    for c in grid:
        lines.append(f"| {c['length']} | {c['depth']:g}% | {yes[c['found']]} | "
                     f"{yes[c['found_triforce']]} | {yes[c['identical']]} |")
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF dir or .gguf [default: bundled SmolLM2]")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000])
    ap.add_argument("--depths", type=float, nargs="+", default=[0, 25, 50, 75, 100])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--budget", type=int, default=1024, help="triforce retrieval budget")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", default="results")
    return ap.parse_args(argv)


def main(argv=None):
    import sys
    from triforce_offload.runtime import api
    o = parse(argv)
    loaded = api.load(o.model, o.dtype, "cpu")
    grid = run_grid(loaded, o, lambda i, n, what: print(f"[{i + 1}/{n}] {what}", file=sys.stderr))
    pngs = save(grid, o)
    print(table(grid))
    print(f"\nwrote {', '.join(map(str, pngs))}", file=sys.stderr)
    return grid


if __name__ == "__main__":
    main()
