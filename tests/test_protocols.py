"""Caches, host stores and engine levels follow the protocols of runtime/protocols.py;
the model brackets every forward with the cache's hooks; commit and rollback only move
the length (no I/O); the layer-major prefill runs the model's own layer step."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from helpers_spec import repetitive_prompt, run, tiny
from triforce_offload.offload.store import HostKVStore, StoreSpec
from triforce_offload.runtime import protocols as P
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.spec.drafters import ModelLevel, NgramDrafter
from triforce_offload.runtime.spec.engine import Engine
from triforce_offload.runtime.generate import prefill
from triforce_offload.runtime.model.transformer import Transformer
from triforce_offload.runtime.cache.offloaded import OffloadedCache
from triforce_offload.runtime.cache.retrieval import Recorder, RetrievalCache
from triforce_offload.runtime.sampling import SamplingParams
from triforce_offload.runtime.cache.streaming import StreamingCache

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"


@pytest.fixture(scope="module")
def L():
    return tiny(layers=3)


def kinds(cfg) -> dict:
    """One cache of every kind, with the protocol it follows."""
    return {
        "full": (FullCache(cfg, 64), P.FullKV),
        "streaming": (StreamingCache(cfg, 2, 8, 8), P.StreamingKV),
        "retrieval": (RetrievalCache(cfg, 16, 4, 16), P.RetrievalKV),
        "offloaded": (OffloadedCache(cfg, 64, transfer_chunk=8, on_chip=1), P.OffloadedKV),
        "recorder": (Recorder(FullCache(cfg, 64)), P.RecordingKV),
    }


def test_every_kind_follows_its_protocol_and_no_other(L):
    caches = kinds(L.cfg)
    for name, (c, proto) in caches.items():
        assert isinstance(c, P.Cache) and isinstance(c, proto), name
    assert not isinstance(caches["retrieval"][0], P.FullKV)
    assert not isinstance(caches["full"][0], P.RetrievalKV)
    assert not isinstance(caches["full"][0], P.RecordingKV)
    assert not isinstance(caches["recorder"][0], P.OffloadedKV)  # what it wraps is
    # a ragged forward's one attention call per layer: the in-memory full and retrieval caches
    assert {n for n, (c, _) in caches.items() if isinstance(c, P.DirectKV)} == {"full", "retrieval"}
    assert isinstance(Recorder(caches["offloaded"][0]).inner, P.OffloadedKV)
    spec = StoreSpec([1, 2], L.cfg.n_kv_heads, L.cfg.head_dim, 16)
    assert isinstance(HostKVStore(spec, pin=False), P.HostStore)
    drafter, level = NgramDrafter(L.cfg.vocab_size), ModelLevel(L.model, FullCache(L.cfg, 64), "full")
    assert isinstance(drafter, P.Level) and not isinstance(drafter, P.VerifyingLevel)
    assert isinstance(level, P.VerifyingLevel)
    caches["offloaded"][0].close()


def test_no_hasattr_dispatch_in_the_runtime():
    """Capabilities are protocols or base-class members, never probed by name."""
    for f in ("cache/kv", "cache/streaming", "cache/retrieval", "cache/offloaded", "spec/engine", "generate",
              "spec/drafters", "graphs", "spec/modes", "model/transformer"):
        src = (RUNTIME / f"{f}.py").read_text()
        assert not re.search(r"\bhasattr\(|getattr\(|def __getattr__", src), f


def test_recorder_forwards_only_the_protocol(L):
    rec = Recorder(FullCache(L.cfg, 64))
    with pytest.raises(AttributeError):
        rec.k  # noqa: B018 - the wrapped cache's tensors are `rec.inner.k`
    assert rec.static is False and rec.capacity == 64 and rec.layer_major is False


@pytest.mark.parametrize("kind", ["full", "streaming", "retrieval", "offloaded", "recorder"])
def test_commit_moves_forward_and_rollback_back_only(L, kind):
    c, _ = kinds(L.cfg)[kind]
    ids = torch.randint(0, L.cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        L.model(ids, 0, c)
    c.commit(6)
    c.commit(6)  # the same length: pending tokens above it leave no trace
    with pytest.raises(ValueError, match=r"commit\(5\) below the committed length 6"):
        c.commit(5)
    with pytest.raises(ValueError, match=r"rollback\(7\) outside"):
        c.rollback(7)
    c.rollback(4)
    assert c.length == 4
    c.close()


def test_commit_and_rollback_do_no_io(L, monkeypatch):
    """An offloaded cache's commit neither writes back nor prefetches: transfers start
    only in forwards and in the prefetch() the engine and generate call."""
    c = OffloadedCache(L.cfg, 64, transfer_chunk=4, on_chip=1)
    ids = torch.randint(0, L.cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        L.model(ids[:, :12], 0, c)
        c.commit(12)
        L.model(ids[:, 12:16], 12, c)
    c.copier.flush()
    calls = []
    for name in ("fetch", "write_back"):
        monkeypatch.setattr(c.copier, name, lambda *a, name=name, **k: calls.append(name))
    c.commit(14)
    c.rollback(13)
    assert calls == [] and c.sched.current is None
    c.prefetch()
    assert calls and set(calls) == {"fetch"} and c.sched.current.end == 13
    monkeypatch.undo()
    c.close()


class Spy(FullCache):
    """A full cache that logs the calls a forward makes on it."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.log = []

    def begin_forward(self, start, n_tokens):
        self.log.append(("begin", start, n_tokens))

    def attend(self, layer, q, k, v, start):
        self.log.append(("attend", layer))
        return super().attend(layer, q, k, v, start)

    def rope_attend(self, layer, qkv, cos, sin, start, heads):
        done = super().rope_attend(layer, qkv, cos, sin, start, heads)
        if done is not None:  # the layer's attend, in one native call
            self.log.append(("attend", layer))
        return done

    def one_call_layers(self, start, n_tokens):
        return None  # every layer's call goes through the methods logged here

    def end_forward(self):
        self.log.append(("end",))


def test_a_forward_tells_its_cache_where_it_begins_and_ends(L):
    c = Spy(L.cfg, 64)
    with torch.inference_mode():
        L.model(torch.zeros(1, 5, dtype=torch.long), 0, c)
        c.commit(5)
        L.model(torch.zeros(1, 2, dtype=torch.long), 5, c)
    one = lambda s, t: [("begin", s, t), *[("attend", i) for i in range(3)], ("end",)]  # noqa: E731
    assert c.log == one(0, 5) + one(5, 2)


def test_static_caches_keep_graph_safe_hooks(L):
    """A graph replay runs no Python: the hooks of the caches that are graphed issue device
    ops only (the slots and length every layer of a fixed-shape forward shares, captured
    with the forward), read nothing on the host, and leave nothing behind for a later
    forward, whose start tensor Step refills in place (a Recorder passes the hooks on to
    the cache it wraps)."""
    from triforce_offload.runtime.opcount import OpCount
    D, Hkv = L.cfg.head_dim, L.cfg.n_kv_heads
    q, k, v = torch.randn(1, L.cfg.n_heads, 1, D), torch.randn(1, Hkv, 1, D), torch.randn(1, Hkv, 1, D)
    for c in (FullCache(L.cfg, 64, static=True), RetrievalCache(L.cfg, 32, 8, 40)):
        start = torch.tensor([3])
        with torch.inference_mode(), OpCount() as ops:
            c.begin_forward(start, 1)
            c.end_forward()
        assert ops.ops and not ops.syncs
        start.fill_(10)  # the next step, same tensor
        with torch.inference_mode():
            c.attend(0, q, k, v, start)
        assert torch.equal(c.k[0][:, :, 10], k[:, :, 0]) and not c.k[0][:, :, 3].any()
    rec = Recorder(Spy(L.cfg, 64))
    rec.begin_forward(torch.tensor([3]), 1)
    rec.end_forward()
    assert [e[0] for e in rec.inner.log] == ["begin", "end"]


def test_layer_major_prefill_runs_the_models_layer_step(L, monkeypatch):
    """One forward for the offloaded cache's timing (not one per chunk), every chunk
    through Transformer.layer_step, and the logits of the chunked prefill."""
    steps = []
    real = Transformer.layer_step
    monkeypatch.setattr(Transformer, "layer_step",
                        lambda self, i, *a: steps.append(i) or real(self, i, *a))
    ids = torch.randint(0, L.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    off = OffloadedCache(L.cfg, 64, transfer_chunk=8, on_chip=1)
    got = prefill(L.model, off, ids, prefill_chunk=16)
    assert steps == [0] * 3 + [1] * 3 + [2] * 3 and off.length == 40
    assert [f["tokens"] for f in off.forwards] == [40]
    monkeypatch.undo()
    want = prefill(L.model, FullCache(L.cfg, 64), ids, prefill_chunk=16)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    off.close()


def test_a_level_rollback_commits_below_and_forgets_above(L):
    lv = ModelLevel(L.model, FullCache(L.cfg, 64), "full")
    seq = list(range(10))
    lv.forward(seq, 1)
    lv.rollback(7)  # pending 0..9, accepted below 7: committed
    assert (lv.held, lv.cache.length) == (7, 7)
    lv.rollback(5)  # committed 5..6 rejected
    assert (lv.held, lv.cache.length) == (5, 5)


def test_only_the_first_level_may_be_a_drafter(L):
    levels = [ModelLevel(L.model, FullCache(L.cfg, 64), "a"), NgramDrafter(L.cfg.vocab_size)]
    with pytest.raises(TypeError, match="'ngram' cannot verify"):
        Engine(levels, [2], SamplingParams(), torch.Generator())


def test_the_engine_prefetches_right_after_each_verification_commit(monkeypatch):
    """With --offload the top level's commits are each followed by a prefetch, before
    the levels below absorb, roll back or draft: the link streams while they run."""
    calls = []
    for name in ("commit", "prefetch"):
        real = getattr(OffloadedCache, name)
        monkeypatch.setattr(OffloadedCache, name,
                            lambda self, *a, name=name, real=real: calls.append(name) or real(self, *a))
    monkeypatch.setattr(RetrievalCache, "absorb", _logged(RetrievalCache.absorb, calls, "absorb"))
    Lm = tiny(scale=3.0, seed=1)
    prompt = repetitive_prompt(200, Lm.cfg.vocab_size, seed=3)
    out, st = run(Lm, prompt, "triforce", 16, budget=64, offload="on", transfer_chunk=64)
    commits = [i for i, c in enumerate(calls) if c == "commit"]
    assert len(commits) > 2 and "absorb" in calls
    assert all(calls[i + 1] == "prefetch" for i in commits)


def _logged(fn, calls, name):
    def wrapped(*a, **k):
        calls.append(name)
        return fn(*a, **k)
    return wrapped
