"""KV reuse across runs (runtime/cache/prefix.py): a prompt sharing a prefix with a kept
cache prefills only the rest, and greedy output equals a cold start in every mode,
resident and offloaded; kept caches stay within their byte budget."""
import pytest
import torch

from helpers_spec import repetitive_prompt, tiny
from triforce_offload.runtime import api
from triforce_offload.runtime.cache.prefix import PrefixCache

MODES = ["autoregressive", "triforce", "retrieval", "draft"]


def opts(mode, n=16, **extra):
    return api.RunOptions.of(mode=mode, max_new_tokens=n, ignore_eos=True, **extra)


def cold(L, prompt, o):
    store, L.prefix = L.prefix, None
    try:
        return api.generate(L, prompt, o)[0]
    finally:
        L.prefix = store


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("offload", ["off", "on"])
def test_reuse_equals_cold_start_tiny(mode, offload):
    L = tiny(vocab=64, layers=2)
    L.prefix = PrefixCache(1 << 30)
    o = opts(mode, budget=64, offload=offload, transfer_chunk=32)
    doc, qa, qb = repetitive_prompt(300, 64), [1, 2, 3, 4, 5], [9, 8, 7]
    a, st = api.generate(L, doc + qa, o)
    assert st.extra["reused_tokens"] == 0
    b, st = api.generate(L, doc + qb, o)  # another question on the same document
    assert st.extra["reused_tokens"] == 300 and b == cold(L, doc + qb, o)
    follow = doc + qb + b + qa  # a follow-up: the answer's KV (from decoding) is reused too
    c, st = api.generate(L, follow, o)
    assert st.extra["reused_tokens"] >= len(doc + qb + b) - 1  # all but maybe the last token
    assert c == cold(L, follow, o)


def test_entries_within_budget_lru_and_contained_dropped():
    L = tiny(vocab=64, layers=2)
    o = opts("autoregressive", 4)
    L.prefix = probe = PrefixCache(1 << 30)
    api.generate(L, list(range(40)), o)
    one = probe.nbytes()
    L.prefix = store = PrefixCache(2 * one + one // 2)  # room for two such caches
    for start in (0, 1, 2):
        api.generate(L, [start] + list(range(3, 40)), o)
    assert len(store.entries) == 2 and store.nbytes() <= store.max_bytes
    assert [int(e.ids[0]) for e in store.entries] == [1, 2]  # the least recently used went first
    api.generate(L, [2] + list(range(3, 60)), o)  # extends entry 2: that one is superseded
    assert [int(e.ids[0]) for e in store.entries] == [1, 2] and len(store.entries[1].ids) > 60
    L.prefix = PrefixCache(0)  # no room: nothing kept, nothing reused
    api.generate(L, list(range(40)), o)
    assert L.prefix.entries == []


def test_small_kept_cache_is_copied_into_a_bigger_one():
    L = tiny(vocab=64, layers=2)
    L.prefix = store = PrefixCache(1 << 30)
    prompt = repetitive_prompt(200, 64)
    api.generate(L, prompt, opts("autoregressive", 4))
    small = store.entries[0].cache
    out, st = api.generate(L, prompt + [5, 6], opts("autoregressive", 900))  # needs a bigger cache
    assert st.extra["reused_tokens"] == 200 and store.entries[0].cache is not small
    assert store.entries[0].cache.capacity > small.capacity
    assert out == cold(L, prompt + [5, 6], opts("autoregressive", 900))


def test_a_short_shared_prefix_copies_and_keeps_the_entry():
    L = tiny(vocab=64, layers=2)
    L.prefix = store = PrefixCache(1 << 30)
    a, b = repetitive_prompt(100, 64, seed=1), repetitive_prompt(100, 64, seed=2)
    api.generate(L, a, opts("triforce", 4, budget=32))
    out, st = api.generate(L, a[:10] + b, opts("triforce", 4, budget=32))
    assert st.extra["reused_tokens"] == 10 and len(store.entries) == 2  # the long entry stays
    assert out == cold(L, a[:10] + b, opts("triforce", 4, budget=32))


@pytest.mark.parametrize("mode", ["autoregressive", "triforce"])
def test_on_token_true_stops_and_cancel_keeps_the_prompt(mode):
    L = tiny(vocab=64, layers=2)
    L.prefix = store = PrefixCache(1 << 30)
    prompt = repetitive_prompt(120, 64)
    seen = []
    out, _ = api.generate(L, prompt, opts(mode, 50, budget=32), on_token=lambda t: len(seen.append(t) or seen) == 3)
    assert len(out) == 3 and seen == out
    assert len(store.entries[0].ids) >= len(prompt)

    def cancel(done, total):
        raise KeyboardInterrupt  # the server's cancel during a prefill
    one_by_one = api.RunOptions.of(mode=mode, max_new_tokens=8, prefill_chunk=1, budget=32)
    store.clear()
    with pytest.raises(KeyboardInterrupt):
        api.generate(L, prompt + [1, 2], one_by_one, progress=cancel)
    api.generate(L, prompt, opts(mode, 8, budget=32))  # kept: the prompt and its answer
    with pytest.raises(KeyboardInterrupt):  # cancelled after one more token's prefill
        api.generate(L, prompt + [1, 2], one_by_one, progress=cancel)
    assert max(len(e.ids) for e in store.entries) >= len(prompt)
    out, st = api.generate(L, prompt + [1, 2], opts(mode, 8, budget=32))
    assert out == cold(L, prompt + [1, 2], opts(mode, 8, budget=32))


# the real model: a ~700-token document, each mode resident and offloaded

@pytest.fixture(scope="module")
def smol():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: OpenMP teams spin each other out
    L = api.load(None, "float32", "cpu")
    yield L
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("offload", ["off", "on"])
def test_reuse_equals_cold_start_smollm2(smol, mode, offload):
    from triforce_offload.runtime.data import encode_chat, essay_tokens
    tok = smol.tokenizer
    doc = tok.decode(essay_tokens(tok, 700))
    ask = lambda *turns: encode_chat(tok, [{"role": r, "content": c} for r, c in turns])
    o = opts(mode, 12, budget=256, offload=offload)
    smol.prefix = PrefixCache(1 << 30)
    first = api.generate(smol, ask(("user", doc + "\n\nWho wrote this?")), o)[0]
    second = ask(("user", doc + "\n\nWhat is the main point?"))
    out, st = api.generate(smol, second, o)
    assert st.extra["reused_tokens"] > 650
    assert out == cold(smol, second, o)
    follow = ask(("user", doc + "\n\nWhat is the main point?"), ("assistant", tok.decode(out)),
                 ("user", "Say it shorter."))
    out, st = api.generate(smol, follow, o)
    assert st.extra["reused_tokens"] > len(second)
    assert out == cold(smol, follow, o)
    smol.prefix = None
