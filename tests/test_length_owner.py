"""A cache's length has one owner: it moves only through `commit` and `rollback` (the
engine and `generate` call them), and a level's `held` only in the level's own forward,
commit and rollback.

Every cache class and ModelLevel get a watched attribute that records which function
wrote it; a triforce run over every cache kind must show no other writer.
"""
import sys

import pytest

from helpers_spec import repetitive_prompt, run, tiny
from triforce_offload.runtime.cache import kv as cache_mod
from triforce_offload.runtime.spec import drafters
from triforce_offload.runtime.cache import offloaded, retrieval, streaming

ALLOWED = {  # attribute -> functions that may write it
    "length": {"__init__", "commit", "rollback", "build", "load_from"},  # build/load_from: a fresh fill
    "held": {"__init__", "forward", "commit", "rollback", "prefill"},
}


def _watch(monkeypatch, cls, name, bad):
    key = f"_watched_{name}"

    def get(self):
        return self.__dict__.get(key, 0)

    def put(self, value):
        writer = sys._getframe(1).f_code.co_name
        if writer not in ALLOWED[name]:
            bad.append(f"{cls.__name__}.{name} written by {writer}")
        self.__dict__[key] = value

    monkeypatch.setattr(cls, name, property(get, put), raising=False)


@pytest.mark.parametrize("extra", [
    {"budget": 64, "rebuild": "every:7"},
    {"budget": 48, "draft": "self", "draft_window": 16, "gamma2": "auto"},
    {"budget": 64, "offload": "on", "transfer_chunk": 64},
])
def test_only_commit_moves_lengths(monkeypatch, extra):
    bad = []
    for cls in (cache_mod.KVCache, cache_mod.FullCache, retrieval.RetrievalCache,
                streaming.StreamingCache, offloaded.OffloadedCache):
        _watch(monkeypatch, cls, "length", bad)
    _watch(monkeypatch, drafters.ModelLevel, "held", bad)
    L = tiny(scale=3.0, seed=1)
    prompt = repetitive_prompt(200, L.cfg.vocab_size, seed=3)
    ref, _ = run(L, prompt, "autoregressive", 24)
    out, st = run(L, prompt, "triforce", 24, **extra)
    assert out == ref
    assert not bad, sorted(set(bad))


def test_the_watch_sees_a_stray_writer(monkeypatch):
    bad = []
    _watch(monkeypatch, retrieval.RetrievalCache, "length", bad)
    L = tiny()
    c = retrieval.RetrievalCache(L.cfg, 16, 8, 8)

    def stray():
        c.length = 5
    stray()
    assert bad == ["RetrievalCache.length written by stray"]
