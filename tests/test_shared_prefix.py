"""Shared prefixes (runtime/cache/shared.py): sequences whose prompts start with the same
tokens hold that prefix's KV once, a batch's round reads it once for all of them, and every
answer equals its solo answer token for token."""
from __future__ import annotations

import pytest
import torch

from triforce_offload.kernels import native
from triforce_offload.runtime import api
from triforce_offload.runtime.api import RunOptions, generate
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.cache.shared import Segment, Shared, alignment, common_prefixes
from triforce_offload.runtime.sampling import SamplingParams

from helpers_spec import repetitive_prompt, tiny
from test_batch import quantized, sampled, windowed

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not native.enabled(), reason="needs the native attention kernel")]

B = native.BLOCK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,softcap", [(64, None), (128, None), (64, 20.0)])
@pytest.mark.parametrize("T", [1, 6, 40])
def test_attention_after_a_shared_prefix_is_the_bits_of_one_buffer(dtype, D, softcap, T):
    g = torch.Generator().manual_seed(T + D)
    H, G, L, P = 3, 3, 3 * B - 37, 2 * B
    K, V = (torch.randn(1, H, L, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(1, H * G, T, D, generator=g)
    ref, lse = native.attend(q, K, V, L - T, 0, softcap=softcap)
    own = K[:, :, P:].clone(), V[:, :, P:].clone()
    prefix = K[:, :, :P].clone(), V[:, :, :P].clone()
    out, l2 = native.attend(q, *own, L - T, P, softcap=softcap, pre_kv=prefix)
    assert torch.equal(out, ref) and torch.equal(l2, lse)
    # its rows among another sequence's, in one pass over the prefix
    other = torch.randn(H, 5, D, generator=g)
    parts = native.attend_parts(torch.cat([other, q.reshape(H, G * T, D)], 1), *prefix, softcap=softcap)
    assert parts.shape == (H, P // B, 5 + G * T, D + 2)
    out, l3 = native.attend(q, *own, L - T, P, softcap=softcap, pre=parts[:, :, 5:])
    assert torch.equal(out, ref) and torch.equal(l3, lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,softcap", [(64, None), (64, 20.0), (128, None)])
@pytest.mark.parametrize("prefix", [0, 2 * B])
def test_many_sequences_in_one_call_are_the_bits_of_their_own_calls(dtype, D, softcap, prefix):
    """native.attend_seqs: sequences of mixed rows (a decode, a verification, more rows than
    the few-rows path) and key counts (under a block, several), each over its own buffer
    of spare capacity, in one call, after a shared prefix or not: each row the bits of its
    sequence's own native.attend, written at its rows' places among the forward's rows."""
    g = torch.Generator().manual_seed(D + prefix)
    H, G, cap = 2, 3, 3 * B
    shape = [(1, 7), (6, 300), (1, 1), (11, 600), (3, 2 * B)]  # (tokens, own keys)
    pre_kv = tuple(torch.randn(1, H, prefix, D, generator=g).to(dtype) for _ in range(2)) if prefix else None
    bufs = [tuple(torch.randn(1, H, cap, D, generator=g).to(dtype) for _ in range(2)) for _ in shape]
    N = sum(t for t, _ in shape)
    q = torch.randn(1, H * G, N, D, generator=g)
    rows, refs, a = [], [], 0
    for (T, S), (K, V) in zip(shape, bufs):
        start = prefix + S - T
        ref = native.attend(q[:, :, a: a + T], K[:, :, :S], V[:, :, :S], start, prefix, softcap=softcap,
                            pre_kv=pre_kv)[0]
        refs.append(ref)
        rows.append((a, T, start, prefix, S, K.stride(1), K.stride(2)))
        a += T
    plan = native.Seqs(rows, G, N)
    qf = plan.fold(q)
    pre = native.attend_parts(qf, *pre_kv, softcap=softcap) if prefix else None
    out = torch.full(q.shape, float("nan"))
    native.attend_seqs(plan, qf, bufs, out, dtype == torch.bfloat16, pre, softcap=softcap)
    a = 0
    for (T, _), ref in zip(shape, refs):
        assert torch.equal(out[:, :, a: a + T], ref)
        a += T
    with pytest.raises(ValueError, match="query rows"):
        native.attend_seqs(plan, qf[:, 1:], bufs, out, dtype == torch.bfloat16, pre, softcap=softcap)


def seqs_per_call(monkeypatch, names=("attend_seqs", "rope_attend_seqs")) -> list[int]:
    """The sequence count of every native call of `names` a ragged forward makes from now on
    (attend_seqs: after the model's RoPE and the caches' writes; rope_attend_seqs: the
    whole layer's step in one call; the program's call of every layer, model/program.py,
    counts as each layer's rope_attend_seqs with every sequence)."""
    from triforce_offload.runtime.batch import rows
    from triforce_offload.runtime.model.program import Program
    calls = []
    run_rows = Program.run_rows

    def whole(self, x, cos, sin, cache):
        done = run_rows(self, x, cos, sin, cache)
        if done:
            calls.extend([len(cache.sets)] * self.L)
        return done
    monkeypatch.setattr(Program, "run_rows", whole)

    def spy(real):
        def call(*a, **kw):
            plan = a[0] if isinstance(a[0], native.Seqs) else a[3]
            calls.append(plan.n)
            return real(*a, **kw)
        return call
    for name in names:
        monkeypatch.setattr(rows.native, name, spy(getattr(native, name)))
    return calls


def batch_calls(monkeypatch, widths: dict[int, int]) -> tuple[list[int], list, list]:
    """A ragged forward of sequences with `widths` {prompt length: rows} on a model whose
    head size takes the bf16 path, with the sequence counts of its native.attend_seqs
    calls recorded: (counts, the forward's logits, each sequence's solo logits)."""
    from triforce_offload.runtime.batch.rows import Rows, forward
    L = quantized(tiny(scale=3.0, seed=1, dim=128))  # head size 32: the bf16 path
    calls = seqs_per_call(monkeypatch)
    sets, solo = [], []
    for i, (n, T) in enumerate(widths.items()):
        ids = torch.tensor([repetitive_prompt(n + T, L.cfg.vocab_size, seed=i)])
        c, alone = (FullCache(L.cfg, 1024, dtype=L.kv_dtype) for _ in range(2))
        with torch.inference_mode():
            for cache in (c, alone):
                L.model(ids[:, :n], 0, cache)
                cache.commit(n)
            solo.append(L.model(ids[:, n: n + T], n, alone))
        sets.append(Rows(ids[:, n: n + T], n, c))
    return calls, forward(L.model, sets), solo


def test_a_batchs_sequences_attend_in_one_call_per_layer(monkeypatch):
    """Plain sequences (no shared prefix) of a ragged forward attend in one native call per
    layer, and each sequence's logits are its solo forward's."""
    calls, got, solo = batch_calls(monkeypatch, {300: 1, 41: 2, 700: 3})  # a decode, verifications
    assert calls and set(calls) == {3} and len(calls) == 2  # tiny(): 2 layers
    for a, b in zip(got, solo):
        assert torch.equal(a, b)


def test_retrieval_caches_attend_in_the_same_call_as_full_caches(monkeypatch):
    """The retrieval level's caches (selected chunks, then appended tokens) join the full
    caches' one native call per layer in a ragged forward (a triforce batch's rounds mix
    both levels' rows), and each sequence's logits are the bits of its solo forward over a
    cache built the same way."""
    from triforce_offload.runtime.batch.rows import Rows, forward
    from triforce_offload.runtime.cache.retrieval import Recorder, RetrievalCache
    L = quantized(tiny(scale=3.0, seed=1, dim=128))  # head size 32: the bf16 path
    calls = seqs_per_call(monkeypatch)

    def retrieval(ids, n):  # a prompt's retrieval cache (budget 64 of n tokens), as the engine builds it
        full = Recorder(FullCache(L.cfg, 1024, dtype=L.kv_dtype))
        with torch.inference_mode():
            L.model(ids[:, :n], 0, full)
        full.commit(n)
        ret = RetrievalCache(L.cfg, 64, 8, 16, dtype=L.kv_dtype)
        ret.build(full, full.q, n)
        return ret
    sets, solo = [], []
    for i, (n, T) in enumerate({300: 1, 517: 5, 90: 3}.items()):
        ids = torch.tensor([repetitive_prompt(n + T, L.cfg.vocab_size, seed=i)])
        if i == 2:  # a full cache beside them (a verification)
            c, alone = (FullCache(L.cfg, 1024, dtype=L.kv_dtype) for _ in range(2))
            with torch.inference_mode():
                for cache in (c, alone):
                    L.model(ids[:, :n], 0, cache)
                    cache.commit(n)
        else:
            c, alone = retrieval(ids, n), retrieval(ids, n)
            assert c.n_retrieved < n  # chunks were selected: the slots are not the positions
        with torch.inference_mode():
            solo.append(L.model(ids[:, n: n + T], n, alone))
        sets.append(Rows(ids[:, n: n + T], n, c))
    got = forward(L.model, sets)
    assert calls and set(calls) == {3} and len(calls) == 2  # tiny(): 2 layers, every sequence in each
    for a, b in zip(got, solo):
        assert torch.equal(a, b)


def test_a_prefix_off_the_key_blocks_is_refused():
    k = torch.randn(1, 2, B + 16, 64)
    with pytest.raises(ValueError, match="multiple"):
        native.attend_parts(torch.randn(2, 3, 64), k, k)
    with pytest.raises(ValueError, match="multiple"):
        native.attend(torch.randn(1, 2, 1, 64), k, k, B + 20, B + 16, pre_kv=(k, k))


def test_a_sharing_cache_reads_as_one_that_holds_everything():
    L = tiny(scale=3.0, seed=1, dim=64)
    cfg, P, n = L.cfg, 2 * B, 2 * B + 50
    whole, base, mine = FullCache(cfg, 1024), FullCache(cfg, P), FullCache(cfg, 1024)
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(1, cfg.n_kv_heads, n, cfg.head_dim, generator=g),
           torch.randn(1, cfg.n_kv_heads, n, cfg.head_dim, generator=g)) for _ in range(cfg.n_layers)]
    for layer, (k, v) in enumerate(kv):
        whole.put(layer, 0, k, v)
        base.put(layer, 0, k[:, :, :P], v[:, :, :P])
    whole.commit(n)
    base.commit(P)
    assert mine.share(base) and mine.length == P
    assert mine.nbytes() < whole.nbytes() - base.nbytes() + 1  # the prefix's bytes are the segment's
    for layer, (k, v) in enumerate(kv):
        mine.put(layer, P, k[:, :, P:], v[:, :, P:])
    mine.commit(n)
    for layer in range(cfg.n_layers):
        for a, b in zip(mine.keys(layer), whole.keys(layer)):
            assert torch.equal(a, b)
        for lo, hi in ((0, 10), (P - 5, P + 5), (P + 3, n)):
            for a, b in zip(mine.recent(layer, lo, hi), whole.recent(layer, lo, hi)):
                assert torch.equal(a, b)
    # attention of a new token: the sharing path equals the whole buffer's
    q = torch.randn(1, cfg.n_heads, 1, cfg.head_dim, generator=g)
    k1 = torch.randn(1, cfg.n_kv_heads, 1, cfg.head_dim, generator=g)
    assert torch.equal(mine.attend(0, q, k1, k1, n), whole.attend(0, q, k1, k1, n))
    # an output settled by a forward that failed is gone at the next forward's start
    mine.settle(0, torch.zeros_like(q))
    mine.begin_forward(n, 1)
    assert torch.equal(mine.attend(0, q, k1, k1, n), whole.attend(0, q, k1, k1, n))
    mine.end_forward()
    own_k, own_v = mine.k[0][:, :, :n + 1 - P], mine.v[0][:, :, :n + 1 - P]
    with pytest.raises(ValueError, match="per-block results of shape"):  # another set of rows' results
        native.attend(q, own_k, own_v, n, P, pre=torch.zeros(cfg.n_kv_heads, P // B, 1, cfg.head_dim + 2))
    # a rollback below the prefix holds it again, unchanged, and the segment stays untouched
    before = base.keys(0)[0].clone()
    mine.rollback(P - 10)
    assert mine.base is None and mine.length == P - 10
    assert torch.equal(mine.keys(0)[0], whole.keys(0, P - 10)[0])
    mine.put(0, P - 10, torch.zeros_like(k1), torch.zeros_like(k1))
    assert torch.equal(base.keys(0)[0], before)


def test_caches_that_cannot_share_hold_their_own():
    L = tiny(dim=64)
    base = FullCache(L.cfg, B)
    base.commit(B)
    assert not FullCache(L.cfg, 64).share(base)  # no room after the prefix
    assert not FullCache(L.cfg, 1024, dtype=torch.bfloat16).share(base)  # another dtype
    assert not FullCache(L.cfg, 1024, static=True).share(base)  # fixed-shape steps


def test_common_prefixes_group_prompts_by_their_shared_start():
    doc, other = list(range(1000)), [7] * 600
    ps = [doc + [1, 2], other + [3], doc + [5] * 40, other + [4], [9] * 300, doc[:B + 3]]
    got = common_prefixes(ps, B)
    # doc: three prompts, the shortest ending at B + 3 (its last token is its own); other: two
    assert sorted(len(p) for p in got) == [B, 2 * B] and tuple(doc[:B]) in got and tuple(other[:2 * B]) in got
    assert common_prefixes([doc + [1], doc + [2]], B) == [tuple(doc[:3 * B])]
    assert common_prefixes([doc[:300] + [1], doc[:300] + [2]], 2 * B) == []  # shorter than the alignment
    assert common_prefixes([doc], B) == []
    assert alignment(True, 512) == B and alignment(False, 512) == 512 and alignment(False, 100) == 6400


def test_the_longest_segment_of_the_runs_numerics_serves_a_prompt():
    sh, doc = Shared(), tuple(range(600))
    short, long_ = Segment(doc[:B], None), Segment(doc[:2 * B], None)
    other = Segment(doc[:2 * B], None, act="int8")
    for s in (short, long_, other):
        sh.add(s)
    assert sh.match(list(doc)) is long_ and sh.match(list(doc), "int8") is other
    assert sh.match(list(doc[:2 * B])) is short  # the prompt's last token is the run's
    assert sh.match([1] + list(doc)) is None


MODELS = {
    "fp32": lambda: tiny(scale=3.0, seed=1, dim=64),
    "int4:int8": lambda: quantized(tiny(scale=3.0, seed=1, dim=64)),
    "window": lambda: quantized(windowed()),
}

MODES = [
    ("autoregressive", {}),
    ("retrieval", {"budget": 32}),
    ("triforce", {"budget": 32}),
    ("triforce", {"budget": 16, "retrieval_chunk": 4, "draft": "self", "draft_window": 8}),
    ("draft", {}),
]


def document_prompts(vocab: int, doc_tokens: int = 700) -> list[list[int]]:
    """Four questions of mixed lengths after one document."""
    doc = repetitive_prompt(doc_tokens, vocab, seed=9)
    return [doc + repetitive_prompt(n, vocab, seed=i) for i, n in enumerate([10, 33, 5, 61])]


def count_passes(monkeypatch) -> list[int]:
    """The row counts of the prefix passes that served several sequences at once."""
    from triforce_offload.runtime.batch import rows
    seen, real = [], native.attend_parts

    def spy(qf, *a, **kw):
        seen.append(qf.shape[1])
        return real(qf, *a, **kw)
    monkeypatch.setattr(rows.native, "attend_parts", spy)
    return seen


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("mode,extra", MODES)
def test_sequences_sharing_a_document_equal_their_solo_runs(model, mode, extra, monkeypatch):
    L = MODELS[model]()
    ps = document_prompts(L.cfg.vocab_size)
    opts = RunOptions.of(mode=mode, max_new_tokens=20, **extra)
    solo = [generate(L, p, opts)[0] for p in ps]
    passes = count_passes(monkeypatch)
    got = api.generate_batch(L, ps, opts)
    assert [t for t, _ in got] == solo
    assert L.shared.leases == len(ps) and not L.shared.segments  # every sequence shared; the segment let go
    st = got[0][1].extra
    assert st["reused_from"] == "shared" and st["reused_tokens"] == 2 * B
    assert passes and max(passes) > 2 * L.cfg.n_heads // L.cfg.n_kv_heads  # rows of several sequences at once


def test_sampled_sequences_sharing_a_document_follow_their_seeds():
    L = MODELS["int4:int8"]()
    ps = document_prompts(L.cfg.vocab_size)
    opts = sampled(["triforce", "autoregressive", "triforce", "triforce"], [1, 2, 3, 1], 20)
    solo = [generate(L, p, o)[0] for p, o in zip(ps, opts)]
    # options differ between the prompts: no segment, each holds its own prefix
    assert [t for t, _ in api.generate_batch(L, ps, opts)] == solo
    assert L.shared is None
    same = RunOptions.of(mode="triforce", max_new_tokens=20, budget=32,
                         sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=5))
    assert ([t for t, _ in api.generate_batch(L, ps, same)] == [generate(L, p, same)[0] for p in ps])
    assert L.shared.leases == len(ps)


def test_no_sharing_where_caches_cannot():
    L = MODELS["int4:int8"]()
    ps = document_prompts(L.cfg.vocab_size)
    opts = RunOptions.of(mode="autoregressive", max_new_tokens=8, offload="on", transfer_chunk=24)
    assert api.shared_prefixes(L, ps, opts) == []
    assert ([t for t, _ in api.generate_batch(L, ps, opts)] == [generate(L, p, opts)[0] for p in ps])
    off = RunOptions.of(mode="autoregressive", max_new_tokens=8)
    assert ([t for t, _ in api.generate_batch(L, ps, off, share=False)]
            == [generate(L, p, off)[0] for p in ps]) and L.shared is None


def test_a_batch_that_fits_only_when_sharing_is_priced_so():
    """The memory check counts a shared prefix once: a budget between the two prices runs
    the batch with its document shared and refuses it held per sequence, before allocating."""
    from triforce_offload.runtime.batch.memory import check_batch
    from triforce_offload.runtime.errors import TriforceError
    L = MODELS["int4:int8"]()
    ps = document_prompts(L.cfg.vocab_size)
    opts = RunOptions.of(mode="autoregressive", max_new_tokens=8)
    pre = api.shared_prefixes(L, ps, opts)
    apart = check_batch(L, ps, [opts] * len(ps))
    together = check_batch(L, ps, [opts] * len(ps), prefixes=pre)
    assert together < apart - 2 * B * L.cfg.kv_bytes_per_token(2)  # three of four prefixes' bytes saved
    budget = (apart + together) // 2
    with pytest.raises(TriforceError, match="a batch of 4 sequences needs"):
        api.generate_batch(L, ps, opts, memory=budget, share=False)
    got = api.generate_batch(L, ps, opts, memory=budget)
    assert [t for t, _ in got] == [generate(L, p, opts)[0] for p in ps]


@pytest.mark.parametrize("model", ["int4:int8", "window"])
def test_a_kept_conversation_seeds_a_prefix_later_questions_share(model):
    """`serve`'s way (Shared.seed_bytes): the second question over a document makes a
    segment of the kept first conversation's document (copied once; the kept entry stays);
    questions after it, alone or together, share it; every answer equals its cold run;
    seeded segments no run uses go past the byte budget. A window model's kept rings no
    longer hold the band at a block boundary inside the document: no segment, the kept
    entry serves as before."""
    from triforce_offload.runtime.batch.runner import Batch
    from triforce_offload.runtime.cache.prefix import PrefixCache
    L = MODELS[model]()
    ps = document_prompts(L.cfg.vocab_size)
    opts = RunOptions.of(mode="triforce", max_new_tokens=12, budget=32)
    cold = [generate(L, p, opts)[0] for p in ps]
    L.prefix, L.shared = PrefixCache(1 << 30), Shared(seed_bytes=1 << 30)
    try:
        first, st0 = generate(L, ps[0], opts)
        assert first == cold[0] and st0.extra.get("reused_from") is None and not L.shared.segments
        second, st1 = generate(L, ps[1], opts)
        if model == "window":
            assert second == cold[1] and st1.extra["reused_from"] == "memory" and not L.shared.segments
            return
        assert second == cold[1] and st1.extra["reused_from"] == "shared" and st1.extra["reused_tokens"] == 2 * B
        (seg,) = L.shared.segments
        # the first conversation stays kept; a sharing run's cache is not (the segment holds the prefix)
        assert seg.seeded and seg.users == 0 and len(L.prefix.entries) == 1
        b = Batch(L)
        ms = [b.add(p, opts) for p in ps[2:]]
        b.drain()
        assert [m.result()[0] for m in ms] == cold[2:] and L.shared.segments == [seg] and L.shared.leases == 3
        L.shared.seed_bytes = 1  # over budget: unused seeded segments go when a run ends
        assert generate(L, ps[3], opts)[0] == cold[3] and L.shared.segments == []
    finally:
        L.prefix, L.shared = None, None


def test_a_batchs_call_is_cut_to_the_scratch_limit(monkeypatch):
    """Ragged splits a layer's sequences into calls whose per-block results stay under
    native.SCRATCH_BYTES (as native.attend slices its rows), each sequence still the bits
    of its solo forward."""
    monkeypatch.setattr(native, "SCRATCH_BYTES", 12 << 10)  # about two of these sequences a call
    calls, got, solo = batch_calls(monkeypatch, {900: 3, 700: 3, 500: 3, 300: 3})
    assert max(calls) < 4 and sum(calls) == 4 * 2
    for a, b in zip(got, solo):
        assert torch.equal(a, b)
