"""Speculative modes for `api.MODES`: triforce, retrieval (ablation) and draft (classic).

| mode | levels |
|---|---|
| triforce | drafter -(gamma1)-> target+retrieval -(gamma2)-> target+full |
| retrieval | target+retrieval -(gamma2)-> target+full |
| draft | drafter -(gamma1)-> target+full |
"""
from __future__ import annotations

import time

import torch

from .drafters import ModelLevel, NgramDrafter, check_vocab
from .engine import KAPPA, AutoGamma, Bypass, Engine, Rebuild, rollback_depth
from ..errors import TriforceError
from ..generate import Stats, capacity, peak_memory_gb, prefill, stop_ids
from ..graphs import combined, graphable, keeps, kept, room_for
from ..hostread import to_device, to_host
from ..cache.offloaded import finish_stats, make_full_cache
from ..cache.prefix import lease
from ..model import quantized
from ..cache.retrieval import Recorder, RetrievalCache
from ..sampling import draws, next_token
from ..cache.streaming import StreamingCache
from ..options import GenerationOptions
from ..protocols import RetrievalKV
from ..model.tp import agree


def make_drafter(o: GenerationOptions, loaded, prompt, full):
    """The bottom level: n-gram lookup, the target over a streaming cache, or a draft model."""
    if o.draft == "ngram":
        dr = NgramDrafter(loaded.cfg.vocab_size, o.ngram, loaded.device, size=o.bypass)
        dr.learn(prompt)  # index the prompt while building, not in the first draft, and judge its tail
        return dr
    mk = lambda cfg: StreamingCache(cfg, o.draft_sink, o.draft_window, max(64, o.gamma1 + 16),
                                    dtype=loaded.kv_dtype, device=loaded.device, ring_depth=rollback_depth(o))
    if o.draft == "self":
        cache = mk(loaded.cfg)
        cache.load_from(full, len(prompt))  # the target's own KV of sink + window
        return ModelLevel(loaded.model, cache, "self", held=len(prompt))
    from ..model.loader import load_model
    model, cfg, tok = load_model(o.draft, loaded.dtype, loaded.device)
    check_vocab(loaded.tokenizer, tok)
    lv = ModelLevel(model, mk(cfg), "draft")
    lv.prefill(prompt, prefill_chunk=lv.cache.pending)  # at most what the streaming cache takes uncommitted
    return lv


def check_draft(o: GenerationOptions, loaded):
    """Compare a draft model's tokenizer with the target's before its weights load (a GGUF
    draft's first conversion prints progress bars: a mismatch stays one line)."""
    if o.draft not in ("ngram", "self"):
        from ..model.loader import peek_tokenizer
        check_vocab(loaded.tokenizer, peek_tokenizer(o.draft))


def retrieval_slots(kind, loaded, n: int, opts) -> int:
    """Slots of the retrieval cache a run of `kind` over a prompt of n tokens builds (0:
    none): the budget, the incomplete last chunk and room for every new token; rounded up
    to a size class (graphs.ROOM) where it is kept across runs (graphs.Kept)."""
    r = opts.retrieval
    budget, chunk = r.budget_for(n), r.retrieval_chunk
    if kind not in ("triforce", "retrieval") or (kind == "triforce" and RetrievalCache.fits(n, budget, chunk)):
        return 0
    extra = capacity(loaded, n, opts)[0] - n + 64  # every new token and the look-ahead
    slots = RetrievalCache.slots_for(budget, chunk, extra)
    return room_for(slots) if graphable(loaded.device) else slots


def retrieval_cache(loaded, budget: int, chunk: int, slots: int, depth: int | None = None):
    """The model's kept retrieval cache of `slots` slots (and window rings of `depth`),
    reset (graphs.Kept), or a new one."""
    k = kept(loaded.model) if keeps(loaded.device) else None
    ret = k.retrieval_cache(slots, depth) if k else None
    if ret is not None:
        ret.reset(budget, chunk)
        return ret
    ret = RetrievalCache(loaded.cfg, budget, chunk, 0, dtype=loaded.kv_dtype, device=loaded.device, slots=slots,
                         ring_depth=depth)
    return k.keep_retrieval(ret) if k else ret


def build_levels(kind, opts, loaded, prompt, full, notes: list):
    """[drafter?, target+retrieval?, target+full] and their gammas for `kind`. The target's
    levels get the model's kept Steps (graphs.Kept: captured once)."""
    g, r, n = opts.generation, opts.retrieval, len(prompt)
    steps = kept(loaded.model).step
    top = ModelLevel(loaded.model, full, "full", g.graphs, held=n, compile=g.compile, steps=steps)
    levels, gammas = [top], []
    if kind in ("triforce", "retrieval"):
        budget, chunk = r.budget_for(n), r.retrieval_chunk
        if budget % chunk:
            notes.append(f"budget {budget} rounded down to {budget // chunk * chunk} "
                         f"(a multiple of --retrieval-chunk {chunk})")
        if kind == "triforce" and RetrievalCache.fits(n, budget, chunk):
            # the middle level would run the full model over a copy of the full cache: pure cost
            notes.append(f"prompt of {n} tokens fits the budget {budget}: no retrieval level, "
                         f"the drafter drafts for the full cache directly (lower --budget to keep it)")
        else:
            ret = retrieval_cache(loaded, budget, chunk, retrieval_slots(kind, loaded, n, opts),
                                  rollback_depth(g))
            ret.build(full, full.q, n)
            if ret.holds_all:
                notes.append(f"prompt of {n} tokens fits the budget: the retrieval cache holds all of it")
            mid = ModelLevel(loaded.model, ret, "retrieval", g.graphs, held=n, compile=g.compile, steps=steps)
            levels.insert(0, mid)
            gammas.insert(0, g.gamma2_start)
            notes.append(f"retrieval level: budget {budget} tokens of {n} "
                         f"({'auto' if r.budget is None else '--budget'})")
    if kind in ("triforce", "draft"):
        levels.insert(0, make_drafter(g, loaded, prompt, full))
        gammas.insert(0, g.gamma1)
    return levels, gammas


def run_speculative(kind: str, loaded, prompt, opts, on_token=None, progress=None):
    """Prefill the full cache (recording the last prompt token's queries), then speculate.
    A kept cache of loaded.prefix may hold a prefix of the prompt: only the rest (at least
    its last token, for the queries) is prefilled."""
    check_draft(opts.generation, loaded)  # a draft model
    # with another tokenizer fail before the long prefill
    cap, max_new = capacity(loaded, len(prompt), opts)
    # in memory, or offloaded with --offload; with loaded.prefix maybe holding a prefix already
    slots = retrieval_slots(kind, loaded, len(prompt), opts)  # counted in the memory checks
    with lease(loaded, prompt, cap, lambda c: make_full_cache(loaded, c, opts, slots)) as kv:
        full = kept(loaded.model).recorder_for(kv.cache, Recorder)  # the kept one over a kept cache
        t0 = time.perf_counter()
        ids = to_device([prompt[kv.start:]], loaded.device)
        logits = prefill(loaded.model, full, ids, kv.start, opts.prefill_chunk, progress)
        toks, st = speculate(kind, loaded, prompt, opts.but(max_new_tokens=max_new), full,
                             logits, on_token)
        st.prefill_s = time.perf_counter() - t0 - st.decode_s
        finish_stats(full.inner, st, opts)
        kv.ids = prompt + toks
    kv.report(st)
    return toks, st


def speculate(kind: str, loaded, prompt, opts, full, logits, on_token=None):
    """Decode after a prefill: `full` a Recorder over the prefilled full cache, logits [1, V].

    Stats.prefill_s covers building the retrieval cache and the drafter here; benchmarks
    reuse one prefill for several modes (roll `full` back and restore its queries).
    """
    o = opts.generation
    t0 = time.perf_counter()
    notes = []
    levels, gammas = build_levels(kind, opts, loaded, prompt, full, notes)
    sp = opts.sampling
    gen = draws(sp)
    auto = AutoGamma(o.gamma2_start) if o.gamma2 == "auto" and kind != "draft" else None  # adapts gamma2
    eng = Engine(levels, gammas, sp, gen, auto, Rebuild.parse(opts.retrieval.rebuild), agree=agree,
                 kappa=KAPPA.get(loaded.device.type, KAPPA["cpu"]),
                 bypass=bypass_for(levels, gammas, loaded.device.type == "cuda" and o.graphs) if o.bypass else None,
                 read_ratio=read_ratio(levels, loaded))
    t1 = time.perf_counter()
    seq = list(prompt) + [to_host(next_token(logits[0], sp, gen, len(prompt)))]  # counted as 'other'
    with torch.inference_mode():
        toks = eng.run(seq, opts.max_new_tokens, stop_ids(loaded, opts), on_token)
    t2 = time.perf_counter()
    st = Stats(len(prompt), len(toks), t1 - t0, t2 - t1, peak_memory_gb(loaded.device))
    steps = combined([lv.step for lv in levels if lv.step is not None])
    steps["notes"] = notes + steps.get("notes", [])  # the levels' build notes first
    st.extra.update(eng.figures(), build_s=round(t1 - t0, 3), **steps)
    return toks, st


# exploring (probes beyond the running configuration's pace, scorings) may cost at most this
# share of the decode time so far before another probe or scoring starts: within 64 tokens a
# run pays for about one scoring and one probe, over hundreds the probe cycles run as before
EXPLORE = 0.03


def read_ratio(levels, loaded):
    """ratio(i): bytes a one-token forward of level i reads over the top level's: the
    weights (`quantized.token_weight_bytes`) plus the KV it attends (a retrieval level: its
    selected tokens and those since; a model drafter: its streaming cache's sink and window;
    the top: all it holds). None for other levels. The weights are counted at the first
    call of the first run that prices a level (a walk over every module, ~4 ms on the
    bundled model) and kept in `loaded.token_bytes` (a draft model's on its level)."""
    per_token = loaded.cfg.kv_bytes_per_token(loaded.kv_dtype.itemsize)
    top = levels[-1]

    def weights(lv) -> int:
        if lv.model is top.model:
            if loaded.token_bytes is None:  # the loaded model's, counted once (a walk over every module)
                loaded.token_bytes = quantized.token_weight_bytes(loaded.model)
            return loaded.token_bytes
        if lv.token_bytes is None:  # a draft model's, counted once
            lv.token_bytes = quantized.token_weight_bytes(lv.model)
        return lv.token_bytes

    def ratio(i: int) -> float | None:
        lv = levels[i]
        if isinstance(lv.cache, StreamingCache):  # a model drafter: weights and sink + window
            c = lv.cache
            kv = 2 * c.n_layers * c.n_kv_heads * c.head_dim * loaded.kv_dtype.itemsize
            attended = min(c.sink + c.window, top.held)
            return (weights(lv) + kv * attended) / (weights(top) + per_token * top.held)
        if not isinstance(lv.cache, RetrievalKV) or lv.model is not top.model:
            return None
        w = weights(top)
        attended = lv.cache.n_retrieved + max(top.held - lv.cache.base, 0)
        return (w + per_token * attended) / (w + per_token * top.held)
    return ratio


def bypass_for(levels, gammas, captures: bool = False) -> Bypass | None:
    """The levels that may be skipped: retrieval levels (they stay in sync while skipped)
    and a model drafter (its streaming cache catches up when it runs again:
    `ModelLevel.resume`; a draft model with window layers always runs: its rings would miss
    their bands). The n-gram drafter sizes its own drafts (none where they would not
    pay: a lookup's price). Decoding starts plain (every optional level skipped): the
    first probe cycle comes after γ+1 tokens of the bottom level, enough text to score the
    retrieval level (Engine.score), so it runs only where its measured acceptance and costs
    predict that it pays (Engine.predict) or a probe shows it; a model drafter is first
    probed only where its best case, priced by the bytes it reads, promises `engine.EAGER`
    (Engine.unready). `captures`: CUDA graphs, whose first replay of a new width captures
    (not counted)."""
    top = levels[-1]
    optional = [i for i, lv in enumerate(levels[:-1]) if isinstance(lv.cache, RetrievalKV)
                or (isinstance(lv.cache, StreamingCache) and (lv.model is top.model or lv.cache.ring is None))]
    if not optional:
        return None
    return Bypass(optional, warm=gammas[0] + 1, first_per_config=captures, start_plain=True,
                  explore=EXPLORE)


def runner(kind: str):
    def run(loaded, prompt, opts, on_token=None, progress=None):
        return run_speculative(kind, loaded, prompt, opts, on_token, progress)
    run.__name__ = f"run_{kind}"
    return run


SPEC_MODES = {k: runner(k) for k in ("triforce", "retrieval", "draft")}
