"""`bench --batch`: many sequences at once, each its own prompt; aggregate decode throughput
against llama.cpp's batched decoding (`llama-batched-bench`), in one run.

For a batch of B sequences of P prompt tokens and N new tokens each, both sides are timed
the way `llama-batched-bench` reports itself: the prompts' prefill (T_PP: until the last
sequence has its first token) apart from the decode (T_TG: from then until the last
token), and S_TG = the tokens produced in T_TG over T_TG. Our side runs
`runtime.batch.generate_batch` (each sequence its own window of the essays, end of
sequence ignored) and timestamps every token; llama.cpp runs `llama-batched-bench -npp P
-ntg N -npl B` on the same GGUF and threads (its tokens are random: a plain decode's
speed does not depend on them; speculative modes' does, and they are labelled so).

Our batched greedy output is checked against each sequence's solo run where `check` asks
(the identity the batched engine guarantees).

Repeats (`repeats`): every mode at every batch size runs once per repeat, the modes of one
repeat back to back, so each repeat's ratios (a mode over batched autoregressive at the same
batch size, a batch size over batch 1) see the same machine; the summary reports medians of
those paired ratios, as the single-stream bench does. One prefill per prompt (`reuse`, on the
CPU): our runs take each prompt's KV from a PrefixCache that the first run to prefill it
filled (each run prefills the prompt's last token again, as the server does), so a 4 x 16K
batch prefills once, not once per mode and repeat; such a run's T_PP is the time to take the
kept KV (`kept_prefill`), and decoding starts from the same KV either way. llama.cpp runs once
per batch size, its own prefill included.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time

from ..runtime import api
from ..runtime.batch.runner import Batch
from ..runtime.data import SUMMARY_ASK, encode_prompt, essay_tokens, with_bos
from ..runtime.errors import TriforceError
from .runner import kept_store, paired


def batch_prompts(tokenizer, n: int, tokens: int, shared: int = 0, kind: str = "continue") -> list[list[int]]:
    """n prompts of `tokens` tokens, each its own stretch of the essays (no two alike);
    `shared` > 0: the first `shared` tokens one document for all (several questions over
    one text), each prompt's own stretch after it. `kind` "summary": each prompt its own
    stretch followed by the summary request, through the chat template (at most `tokens`)."""
    own = tokens - shared
    text = essay_tokens(tokenizer, shared + n * own + 64)
    if kind == "summary" and not shared:
        body = [tokenizer.decode(text[i * own: (i + 1) * own - 64]) for i in range(n)]
        return [encode_prompt(tokenizer, f"{b}\n\n{SUMMARY_ASK}", True)[-tokens:] for b in body]
    doc = with_bos(tokenizer, text[n * own: n * own + shared])[:shared] if shared else []
    return [(doc + text[i * own: (i + 1) * own] if shared
             else with_bos(tokenizer, text[i * own: (i + 1) * own]))[:tokens] for i in range(n)]


def run_ours(loaded, prompts: list[list[int]], opts, share: bool = False) -> dict:
    """One batch of `prompts` under `opts`: its T_PP, T_TG, S_TG and per-sequence tokens.
    `share`: prefixes that prompts start with are prefilled and held once
    (`api.share_prefixes`, inside T_PP); else each sequence holds its own."""
    stamps = [[] for _ in prompts]
    b = Batch(loaded)
    t0 = time.perf_counter()
    with api.holding(loaded, api.shared_prefixes(loaded, prompts, opts) if share else [], opts) as segs:
        members = [b.add(p, opts, lambda t, s=s: s.append(time.perf_counter()) and False)
                   for p, s in zip(prompts, stamps)]
        b.drain()
    toks = [m.result()[0] for m in members]
    first = max(s[0] for s in stamps)  # every sequence has its first token: prefill is over
    last = max(s[-1] for s in stamps)
    tg = sum(1 for s in stamps for t in s if t > first)
    st = members[0].stats.extra
    return {"t_pp": first - t0, "t_tg": last - first, "tg_tokens": tg,
            "speed_tg": tg / (last - first) if last > first else 0.0,
            "tokens": toks, "seqs_per_forward": st.get("batch_seqs_per_forward", 0.0),
            "rows_per_forward": st.get("batch_rows_per_forward", 0.0),
            "acceptance": {k: v for k, v in members[0].stats.extra.items() if k.startswith("acceptance")},
            # every prompt's KV but its last token's taken from a kept cache (a PrefixCache)
            "kept_prefill": all(m.stats.extra.get("reused_tokens", 0) >= len(p) - 1 for m, p in zip(members, prompts)),
            "shared_tokens": sum(seg.length for seg in segs)}


def llama_batched_bench(path: str | None = None) -> str | None:
    """The llama-batched-bench binary: `path`, else $LLAMA_CPP_BIN/llama-batched-bench, else
    one on PATH; None where there is none."""
    for cand in (path, os.path.join(os.environ.get("LLAMA_CPP_BIN", ""), "llama-batched-bench"),
                 shutil.which("llama-batched-bench")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def run_llama_cpp(binary: str, gguf: str, batch: list[int], prompt: int, new: int, threads: int) -> dict:
    """`llama-batched-bench` over every batch size: {B: its JSONL row} (t_pp, t_tg, speed_tg).
    Its KV is split evenly between sequences (no unified KV), so -c gives each room."""
    ctx = max(batch) * (-(-(prompt + new + 64) // 256) * 256)
    cmd = [binary, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt),
           "-ntg", str(new), "-npl", ",".join(map(str, batch)), "-t", str(threads),
           "--output-format", "jsonl"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    rows = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            rows[row["pl"]] = row
    if r.returncode or not rows:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise TriforceError(f"llama-batched-bench failed ({r.returncode}): {' / '.join(tail)}")
    return rows


OURS = ("autoregressive", "triforce", "retrieval", "draft")  # the modes a batch runs


def run_batch_bench(loaded, sizes: list[int], context: int, new: int, modes: list[str], spec: dict,
                    threads: int, gguf: str | None, binary: str | None, check: bool = True,
                    progress=None, on_row=None, shared: int = 0, kind: str = "continue",
                    repeats: int = 1, reuse: bool = True) -> list[dict]:
    """Per repeat and batch size, each of our `modes` then llama.cpp (when in `modes` and
    found; the first repeat only), back to back: rows with t_pp, t_tg, speed_tg (aggregate
    decode tokens/s), the repeat and, for ours, whether every sequence equals its solo run
    (`check`, greedy; the first repeat). Ratios: `summarize_batch`. `shared` > 0: every
    prompt starts with one document of that many tokens, and each mode runs twice, its
    batch holding the document per sequence ("<mode> own") and once for all ("<mode>
    shared"); its runs prefill every time (the prefill is what sharing saves). `reuse`: one
    prefill per prompt (the module's docstring)."""
    prompt = context - new
    ours = [m for m in modes if m in OURS]
    peer = "llama.cpp" in modes
    exe = llama_batched_bench(binary) if peer else None
    prompts = batch_prompts(loaded.tokenizer, max(sizes), prompt, shared, kind)
    ways = [(" own", False), (" shared", True)] if shared else [("", False)]
    rows, steps = [], len(sizes) * (repeats * len(ours) * len(ways) + peer)
    store = kept_store(loaded, context, max(sizes)) if reuse and not shared and ours else None
    prev = loaded.prefix
    loaded.prefix = store if store is not None else prev

    def emit(row):
        rows.append(row)
        if on_row:
            on_row(row)
    if peer and exe is None:
        emit({"mode": "llama.cpp", "skipped": "no llama-batched-bench (give --llama-batched-bench PATH or "
              "set LLAMA_CPP_BIN; docs/benchmarks.md says how to build it)"})
    try:
        for rep in range(repeats):
            for b in sizes:
                for m in ours:
                    solo = None
                    for label, share in ways:
                        if progress:
                            progress(len(rows), steps, f"{m}{label} x{b}" + (f" (repeat {rep + 1})" if rep else ""))
                        opts = api.RunOptions.of(mode=m, max_new_tokens=new, ignore_eos=True, **spec)
                        r = run_ours(loaded, prompts[:b], opts, share)
                        if check and rep == 0 and solo is None:
                            solo = [api.generate(loaded, p, opts)[0] for p in prompts[:b]]
                        emit({"mode": m + label, "batch": b, "prompt_tokens": prompt, "new_tokens": new,
                              **{k: v for k, v in r.items() if k != "tokens"}, "repeat": rep,
                              "same_as_solo": r["tokens"] == solo if solo is not None else None})
            for b in sizes if exe and rep == 0 else ():
                if progress:
                    progress(len(rows), steps, f"llama.cpp x{b}")
                r = run_llama_cpp(exe, gguf, [b], prompt, new, threads)[b]
                emit({"mode": "llama.cpp", "batch": b, "prompt_tokens": prompt, "new_tokens": new,
                      "t_pp": r["t_pp"], "t_tg": r["t_tg"], "tg_tokens": b * new, "speed_tg": r["speed_tg"],
                      "flash_attn": r.get("flash_attn"), "repeat": 0})
    finally:
        loaded.prefix = prev
        if store is not None:
            store.clear()
    return rows


def summarize_batch(rows: list[dict]) -> list[dict]:
    """One row per (mode, batch size): the medians over repeats of t_pp, t_tg and speed_tg,
    with `vs_batch1` (S_TG over the same mode's at batch 1), `vs_autoregressive` (over
    batched autoregressive's at the same batch size, with the same document handling) and,
    for a shared document, `vs_own` (S_TG) and `vs_own_total` (the whole batch's time) over
    the same mode holding it per sequence: each the median over repeats of that repeat's
    ratio (the ratio of medians where the repeats do not pair up); `vs_llama_cpp` over
    llama.cpp's at the same batch size."""
    groups: dict[tuple, list[dict]] = {}
    out = []
    for r in rows:
        if "batch" not in r:
            out.append(r)
        else:
            groups.setdefault((r["mode"], r["batch"]), []).append(r)
    speed = lambda r: r["speed_tg"]
    total = lambda r: 1.0 / (r["t_pp"] + r["t_tg"]) if r["t_pp"] + r["t_tg"] > 0 else 0.0
    for (mode, b), g in groups.items():
        s = _median_row(g)
        s["per_seq_ms"] = 1000 * b / s["speed_tg"] if s["speed_tg"] else None
        label = next((x for x in (" own", " shared") if mode.endswith(x)), "")
        for key, other, f in (("vs_batch1", (mode, 1), speed),
                              ("vs_autoregressive", ("autoregressive" + label, b), speed),
                              ("vs_llama_cpp", ("llama.cpp", b), speed),
                              ("vs_own", (mode.removesuffix(" shared") + " own", b), speed),
                              ("vs_own_total", (mode.removesuffix(" shared") + " own", b), total)):
            if other == (mode, b) or other not in groups or (mode == "llama.cpp" and key != "vs_batch1"):
                continue
            if key.startswith("vs_own") and not mode.endswith(" shared"):
                continue
            ratio = paired(g, groups[other], f)
            if ratio is not None:
                s[key] = ratio
        out.append(s)
    return out


def _median_row(g: list[dict]) -> dict:
    """The first repeat's row with the medians over repeats of its timings (and `repeats`)."""
    s = dict(g[0], repeats=len(g))
    for k in ("t_pp", "t_tg", "speed_tg", "seqs_per_forward", "rows_per_forward"):
        if k in s:
            s[k] = statistics.median(x[k] for x in g)
    # most repeats took kept KV: the median T_PP is one of theirs (a prefill's is far longer)
    s["kept_prefill"] = 2 * sum(bool(x.get("kept_prefill")) for x in g) > len(g)
    return s
