"""Window layers in rings (issue 28 step 5): a cache built with a `ring_depth` keeps a
sliding layer's KV in a ring of window + depth slots on the device (cache.WindowRing) and
only the global layers whole; an offloaded cache streams the global layers only. Against
transformers on every cache kind, with rollbacks; a ring too shallow for the engine fails
instead of reading stale keys; streamed bytes are the global layers' share."""
from __future__ import annotations

import pytest
import torch

from test_windows import WINDOW, hf_greedy, loaded_from, ours, tiny_mistral, tiny_qwen2
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.model.config import BAND_BLOCK
from triforce_offload.runtime.errors import TriforceError
from triforce_offload.runtime.generate import autoregressive
from triforce_offload.runtime.cache.offloaded import OffloadedCache
from triforce_offload.runtime.cache.retrieval import RetrievalCache
from triforce_offload.runtime.sampling import SamplingParams
from triforce_offload.runtime.cache.streaming import StreamingCache

DEPTH = 6


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def script(model, cache, ids):
    """Prefill chunks (one longer than the ring), decode steps, verifications each after a
    rejected pending forward rolled back (positions written past the length, then forgotten)."""
    outs, pos = [], 0
    for n in (9, 25, 1, 1, 5, 1, 3, 1, 5):
        static = cache.static and 0 < pos and n <= DEPTH
        if pos:  # a draft that is rolled back: its junk must leave no trace
            junk = torch.randint(0, 97, (1, 3), generator=torch.Generator().manual_seed(pos))
            if static:
                cache.check_end(pos + 3)
            model(junk, torch.tensor([pos]) if static else pos, cache)
            cache.rollback(pos)
        if static:
            cache.check_end(pos + n)  # on the host, as graphs.Step does
        outs.append(model(ids[:, pos:pos + n], torch.tensor([pos]) if static else pos, cache))
        pos += n
        cache.commit(pos)
    return torch.cat(outs, 1)


@pytest.mark.parametrize("make", ["mistral", "qwen2"])
@pytest.mark.parametrize("kind", ["full", "static", "offloaded", "offloaded-on-chip"])
def test_rings_equal_transformers(make, kind, tmp_path):
    hf = tiny_mistral() if make == "mistral" else tiny_qwen2()
    model, cfg = ours(hf, tmp_path)
    ids = torch.randint(0, 97, (1, 51), generator=torch.Generator().manual_seed(5))
    cache = {"full": lambda: FullCache(cfg, 64, ring_depth=DEPTH),
             "static": lambda: FullCache(cfg, 64, static=True, ring_depth=DEPTH),
             "offloaded": lambda: OffloadedCache(cfg, 64, transfer_chunk=5, ring_depth=DEPTH),
             "offloaded-on-chip": lambda: OffloadedCache(cfg, 64, transfer_chunk=5, on_chip=1,
                                                         ring_depth=DEPTH)}[kind]()
    assert cache.ring is not None and cache.ring.size == WINDOW + DEPTH + BAND_BLOCK - 1
    with torch.no_grad():
        ref = hf(ids).logits
        got = script(model, cache, ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    whole = FullCache(cfg, 64).nbytes() if kind != "offloaded" else None
    if kind == "full":  # window layers hold window + depth slots instead of the capacity
        n_win = sum(w is not None for w in cfg.windows)
        per_slot = whole // (64 * cfg.n_layers)
        assert cache.nbytes() == per_slot * ((cfg.n_layers - n_win) * 64 + n_win * (WINDOW + DEPTH + BAND_BLOCK - 1))


def test_retrieval_and_streaming_rings_are_exact(tmp_path):
    """The draft levels' caches keep a window layer's ring, built from the full cache's
    ring and absorbing from it: exact at any budget (here one smaller than the window)."""
    hf = tiny_mistral()
    model, cfg = ours(hf, tmp_path)
    ids = torch.randint(0, 97, (1, 44), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
        full = FullCache(cfg, 64, ring_depth=DEPTH)
        model(ids[:, :30], 0, full)
        full.commit(30)
        ret = RetrievalCache(cfg, 4, 4, 40, ring_depth=DEPTH)
        ret.build(full, {}, 30)  # every layer windowed: no scores needed
        s = StreamingCache(cfg, sink=2, window=4, pending=16, ring_depth=DEPTH)
        s.load_from(full, 30)
        outs = {"retrieval": [], "streaming": []}
        for name, c in (("retrieval", ret), ("streaming", s)):
            for i in range(30, 44):
                outs[name].append(model(ids[:, i:i + 1], i, c))
                c.commit(i + 1)
        for name in outs:
            torch.testing.assert_close(torch.cat(outs[name], 1), ref[:, 30:44], rtol=1e-4, atol=1e-4)
        # a rebuild writes the ring afresh; verified tokens are absorbed through the full ring
        ret.ring.reach(30 + ret.ring.size + 14)  # writes that went further than the ring holds
        with pytest.raises(TriforceError, match="no longer holds"):
            ret.rollback(30)  # deeper than the ring
        ret.build(full, {}, 30)
        model(ids[:, 30:34], 30, full)
        full.commit(34)
        ret.absorb(full, 30, 34)
        ret.commit(34)
        out = model(ids[:, 34:35], 34, ret)
        torch.testing.assert_close(out, ref[:, 34:35], rtol=1e-4, atol=1e-4)


def test_a_ring_refuses_to_roll_back_past_its_depth(tmp_path):
    hf = tiny_mistral()
    model, cfg = ours(hf, tmp_path)
    cache = FullCache(cfg, 400, ring_depth=2)  # a ring of window 12 + depth 2 + 127 slots
    ids = torch.randint(0, 97, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids[:, :200], 0, cache)
        cache.commit(200)  # the ring holds 58..199; a forward at n reads from band_lo(n)
        assert cache.resumable(200) and cache.resumable(128) and not cache.resumable(127)
        model(ids[:, 200:262], 200, cache)  # 62 pending tokens: past what the ring keeps of 117..199
    with pytest.raises(TriforceError, match="no longer holds positions 117..199"):
        cache.rollback(200)
    with pytest.raises(TriforceError, match="recent"):
        cache.keys(0)  # a window layer has no whole KV to read


@pytest.fixture(scope="module")
def qwen2_run(tmp_path_factory):
    from helpers_spec import repetitive_prompt
    hf = tiny_qwen2(seed=3)
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)
    L = loaded_from(hf, tmp_path_factory.mktemp("qwen2"))
    prompt = repetitive_prompt(70, 97, seed=4)
    return hf, L, prompt, hf_greedy(hf, prompt, 24)


@pytest.mark.parametrize("mode,extra", [
    ("autoregressive", {}),
    ("draft", {"draft": "self", "draft_sink": 4, "draft_window": 16}),
    ("triforce", {"budget": 16, "retrieval_chunk": 4, "gamma2": "auto"}),
    ("triforce", {"budget": 8, "retrieval_chunk": 4, "offload": "on", "transfer_chunk": 8}),
    ("retrieval", {"budget": 8, "retrieval_chunk": 4, "offload": "on", "on_chip": 1}),
])
def test_modes_over_rings_equal_transformers(qwen2_run, mode, extra):
    """The factories build rings as deep as the engine may roll back (rollback_depth): a
    shallower one would refuse (above), so every mode running through is the bound held."""
    from helpers_spec import run
    hf, L, prompt, ref = qwen2_run
    out, st = run(L, prompt, mode, 24, **extra)
    assert out == ref


def test_too_shallow_rings_fail_loudly(qwen2_run, monkeypatch):
    """With rings shallower than the engine's rollbacks the run stops with the ring's error
    rather than attending to overwritten keys. The bypass is off: every level runs, so the
    rollbacks happen whatever the run's timings say about the retrieval level."""
    from helpers_spec import run
    from triforce_offload.runtime.cache import offloaded
    from triforce_offload.runtime.spec import modes as spec_modes
    monkeypatch.setattr(offloaded, "rollback_depth", lambda g: 1)
    monkeypatch.setattr(spec_modes, "rollback_depth", lambda g: 1)
    from triforce_offload.runtime.cache import kv
    # rows in blocks of 1 position: no block's slack in the ring (window + depth + BAND_BLOCK - 1
    # slots), so the shallow depth is all there is, as at a block's last position
    monkeypatch.setattr(kv, "BAND_BLOCK", 1)
    hf, L, prompt, ref = qwen2_run
    with pytest.raises(TriforceError, match="window ring"):
        run(L, prompt, "triforce", 24, budget=16, retrieval_chunk=4, bypass=False)


def test_offload_streams_global_layers_only(tmp_path):
    """Bytes streamed per decode step: the global layers' share of an all-global stream
    (tiny Qwen2: 1 global layer of 3), and the same tokens as resident decoding."""
    hf = tiny_qwen2()
    model, cfg = ours(hf, tmp_path)
    prompt = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    sp = SamplingParams()

    def run(cache):
        toks, _ = autoregressive(model, cache, prompt, sp, 16, set(), prefill_chunk=16)
        return toks, cache.stats().get("streamed_gb", 0) * 2 ** 30

    want, _ = run(FullCache(cfg, 64))
    # overlap=False: no prefetch for a forward that never comes (it streams whole layers)
    ringed, b_ring = run(OffloadedCache(cfg, 64, transfer_chunk=8, overlap=False, ring_depth=DEPTH))
    whole, b_all = run(OffloadedCache(cfg, 64, transfer_chunk=8, overlap=False))
    n_global = sum(w is None for w in cfg.windows)
    assert ringed == whole == want
    assert b_all > 0 and b_ring * cfg.n_layers == b_all * n_global


@pytest.mark.parametrize("block", [1, 128])
def test_kept_prefix_and_kv_dir_with_rings(qwen2_run, tmp_path, monkeypatch, block):
    """A kept cache whose rings still hold the shared prefix's band is reused (a follow-up
    prompt extending the last run), one whose rings moved on is not (a cold start, same
    tokens); --kv-dir saves the rings' positions (tests/test_kv_dir_windows.py). Rows in
    blocks of 1 position: rings of window + depth + 1 slots, which move on within this
    run; of 128 (the default): the rings still hold the cold start's band here."""
    from helpers_spec import run
    from triforce_offload.runtime.cache import kv
    from triforce_offload.runtime.cache.prefix import PrefixCache
    from triforce_offload.runtime.cache.disk import KVDir
    monkeypatch.setattr(kv, "BAND_BLOCK", block)
    hf, L, prompt, ref = qwen2_run
    notes = []
    L.prefix = PrefixCache(1 << 30, KVDir(tmp_path, 1 << 30, L, notes.append))
    try:
        out, st = run(L, prompt, "autoregressive", 24)
        assert out == ref and notes == [] and len(list(tmp_path.glob("*.kv"))) == 1
        follow = prompt + out + [5, 6, 7]
        out2, st2 = run(L, follow, "autoregressive", 8)
        assert st2.extra.get("reused_tokens", 0) >= len(prompt)
        cold = prompt[:30] + [1, 2, 3]  # shares 30 tokens: the rings hold only the latest
        out3, st3 = run(L, cold, "autoregressive", 8)
        L.prefix = None
        assert out3 == run(L, cold, "autoregressive", 8)[0]
        assert st3.extra.get("reused_tokens", 0) == (30 if block == 128 else 0)
        assert out2 == run(L, follow, "autoregressive", 8)[0]
    finally:
        L.prefix = None
