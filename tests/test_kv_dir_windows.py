"""--kv-dir and the kept-prefix store on models with window layers (issue 28): an entry
records the layer kinds, the window and the positions its window layers' rings held (at
the end of the run and at the end of the prompt); a follow-up extending the saved tokens,
or the same prompt again, loads it (fewer tokens prefilled) with the cold run's greedy
output token for token; a prompt leaving the saved tokens before the rings' band prefills
cold, said once; old and damaged headers are refused in one line."""
from __future__ import annotations

import json
import zlib

import pytest
import torch

from helpers_spec import repetitive_prompt, tiny
from test_new_archs import tiny_gemma3
from test_windows import loaded_from, tiny_mistral
from triforce_offload.runtime import api
from triforce_offload.runtime.cache.kv import FullCache, copy_prefix
from triforce_offload.runtime.spec.engine import rollback_depth
from triforce_offload.runtime.cache.disk import MAGIC, KVDir, model_identity
from triforce_offload.runtime.cache.prefix import PrefixCache, numerics

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(autouse=True)
def ring_blocks_of_one(monkeypatch):
    """Window attention's rows in blocks of 1 position (cache.kv.BAND_BLOCK), so rings of
    window + depth slots move on within these short runs: what the spans and rules below
    are about (at the default 128 the rings hold these whole runs; tests/test_window_ring.py
    covers kept and saved rings there)."""
    from triforce_offload.runtime.cache import kv
    monkeypatch.setattr(kv, "BAND_BLOCK", 1)

NEW = 10  # tokens generated per run
MODES = {"autoregressive": {}, "triforce": {"budget": 16, "retrieval_chunk": 4},
         "triforce-offload": {"budget": 16, "retrieval_chunk": 4, "offload": "on", "transfer_chunk": 8}}


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def windowed(request, tmp_path_factory):
    """Gemma 3 (window 10, one global layer of 4) or Mistral (every layer a window of 12)."""
    hf = tiny_gemma3(seed=2) if request.param == "gemma3" else tiny_mistral(seed=3)
    L = loaded_from(hf, tmp_path_factory.mktemp(request.param))
    return L, repetitive_prompt(60, 97, seed=4)  # 5-6 windows


def opts(mode="autoregressive", n=NEW):
    extra = dict(MODES[mode])
    # every level runs (no bypass): which levels ran, and so how far the rings moved, must
    # not depend on timings
    return api.RunOptions.of(mode=extra.pop("mode", mode.split("-")[0]), max_new_tokens=n,
                             ignore_eos=True, bypass=False, **extra)


def gen(L, prompt, mode="autoregressive", store=None, n=NEW):
    """(tokens, Stats, tokens prefilled) of a run with `store` as the prefix store (None: cold)."""
    prefilled = []
    L.prefix = store
    try:
        toks, st = api.generate(L, prompt, opts(mode, n), progress=lambda e, T: prefilled.append(T))
    finally:
        L.prefix = None
    return toks, st, prefilled[-1]


def disk(path, L, notes, mem=0, save_later=False):
    """A prefix store over --kv-dir `path` (mem 0: disk only, as `run` has it; `serve`: mem > 0, saves later)."""
    return PrefixCache(mem, KVDir(path, 1 << 30, L, notes.append), save_later)


def header(f):
    return json.loads(f.read_bytes().split(b"\n", 2)[1])


@pytest.mark.parametrize("mode", list(MODES))
def test_a_follow_up_loads_the_saved_rings(windowed, tmp_path, mode):
    L, prompt = windowed
    notes = []
    first, st, _ = gen(L, prompt, mode, disk(tmp_path, L, notes))
    (f,) = tmp_path.glob("*.kv")
    head, w = header(f), L.cfg.sliding_window
    kinds = ["full_attention" if w is None else "sliding_attention" for w in L.cfg.windows]
    size = w + rollback_depth(opts(mode).generation)  # ring slots
    # the rings at the end of the prompt (its last `size` positions) and at the end of the
    # run, which overlap after 10 new tokens: one span
    (lo, N), = head["window_held"]
    # the tokens the cache holds: all but the last (never forwarded), or all of them after
    # a verification that accepted past the last one kept
    assert N == len(head["ids"]) and N - len(prompt) in (NEW - 1, NEW) and head["ids"] == (prompt + first)[:N]
    assert head["layers"] == kinds and head["window"] == w and lo == len(prompt) - size
    # global layers' blocks all N tokens, window layers' N - lo: the trailer starts right after
    kv = 2 * sum(N if k == "full_attention" else N - lo for k in kinds) * L.cfg.n_kv_heads * L.cfg.head_dim * 4
    crcs = json.loads(f.read_bytes().split(b"\n", 2)[2][kv:])["crc32"]
    assert len(crcs) == L.cfg.n_layers and all(len(c) == 2 for c in crcs)
    follow = prompt + first + [7, 8, 9]
    out, st, prefilled = gen(L, follow, mode, disk(tmp_path, L, notes))  # a new process would see this
    assert st.extra["reused_from"] == "disk" and st.extra["reused_tokens"] == N
    assert prefilled == len(follow) - N
    assert out == gen(L, follow, mode)[0] and notes == []
    # close to the saved length (a prompt differing in the last saved token) reuses the
    # rest where the ring still holds its band: always after autoregressive decoding (it
    # writes no position past the length); speculative drafts may have overwritten it
    near = prompt + first[:N - len(prompt) - 1] + [first[N - len(prompt) - 1] + 1, 6]
    out, st, prefilled = gen(L, near, mode, disk(tmp_path, L, notes))
    assert st.extra["reused_tokens"] == N - 1 and prefilled == len(near) - N + 1
    assert out == gen(L, near, mode)[0] and notes == []
    # the same prompt again: all of it but its last token
    out, st, prefilled = gen(L, prompt, mode, disk(tmp_path, L, notes))
    assert st.extra["reused_tokens"] == len(prompt) - 1 and prefilled == 1 and out == first


@pytest.mark.parametrize("mode", ["autoregressive", "triforce"])
def test_a_long_answer_keeps_the_prompts_rings_too(windowed, tmp_path, mode):
    """Generated tokens move the rings past the prompt: the entry holds two spans of the
    window layers, the prompt's end and the run's; the same prompt again and the follow-up
    load it, a prompt leaving in between prefills cold."""
    L, prompt = windowed
    notes, n = [], 40
    first = gen(L, prompt, mode, disk(tmp_path, L, notes), n=n)[0]
    (f,) = tmp_path.glob("*.kv")
    head, w = header(f), L.cfg.sliding_window
    size = w + rollback_depth(opts(mode).generation)
    (a, b), (lo, N) = head["window_held"]
    assert (a, b) == (len(prompt) - size, len(prompt)) and N - size <= lo <= N - w + 1 and b < lo
    for p, reused in [(prompt, len(prompt) - 1), (prompt + first[:20] + [first[20] + 1], 0),
                      (prompt + first + [1], N)]:
        out, st, prefilled = gen(L, p, mode, disk(tmp_path, L, notes), n=n)
        assert st.extra["reused_tokens"] == reused and prefilled == len(p) - reused
        assert out == gen(L, p, mode, n=n)[0]
    assert notes == [f"kv-dir: not using {f.name}: the prompt shares {len(prompt) + 20} of its {N} tokens, "
                     f"but its window layers hold positions {a}..{b - 1} and {lo}..{N - 1} only, "
                     f"not {len(prompt) + 21 - w}..{len(prompt) + 19}"]


@pytest.mark.parametrize("mode", ["autoregressive", "triforce"])
def test_a_prompt_leaving_before_the_band_prefills_cold(windowed, tmp_path, mode):
    L, prompt = windowed
    notes = []
    gen(L, prompt, mode, disk(tmp_path, L, notes))
    (f,) = tmp_path.glob("*.kv")
    early = prompt[:30] + [1, 2, 3, 4]  # shares 30 tokens: the rings hold only the latest 20-odd
    store = disk(tmp_path, L, notes)
    assert store.disk.match(early, numerics(L)) == (None, 0)  # says why, then the run asks again
    out, st, prefilled = gen(L, early, mode, store)
    assert st.extra["reused_tokens"] == 0 and prefilled == len(early)
    assert out == gen(L, early, mode)[0]
    (lo, N), = header(f)["window_held"]
    assert notes == [f"kv-dir: not using {f.name}: the prompt shares 30 of its {N} tokens, but its "
                     f"window layers hold positions {lo}..{N - 1} only, not {31 - L.cfg.sliding_window}..29"]


def test_a_short_entry_serves_any_shared_prefix(windowed, tmp_path):
    """An entry shorter than the window holds every position (window_held from 0): a prompt
    sharing only a few of its tokens reuses them."""
    L, prompt = windowed
    notes = []
    short = prompt[:5]
    first = gen(L, short, store=disk(tmp_path, L, notes), n=2)[0]
    (f,) = tmp_path.glob("*.kv")
    assert header(f)["window_held"] == [[0, 6]]
    other = prompt[:3] + [prompt[3] + 1, 12, 13]
    out, st, prefilled = gen(L, other, store=disk(tmp_path, L, notes))
    assert st.extra["reused_tokens"] == 3 and prefilled == 3 and out == gen(L, other)[0]
    assert notes == [] and first


def test_the_kept_store_takes_the_same_rule(windowed, tmp_path):
    """The server's path (a PrefixCache in memory, saving to --kv-dir after the reply): a
    follow-up reuses the kept cache, an early-leaving prompt prefills cold, and a new
    server loads the follow-up's entry from disk; outputs equal cold runs."""
    L, prompt = windowed
    notes = []
    store = disk(tmp_path, L, notes, mem=1 << 30, save_later=True)
    first = gen(L, prompt, "triforce", store, n=40)[0]  # the rings move past the prompt
    follow = prompt + first + [3, 4]
    answer, st, _ = gen(L, follow, "triforce", store)
    assert st.extra["reused_from"] == "memory" and st.extra["reused_tokens"] >= len(prompt) + 40 - 1
    assert answer == gen(L, follow, "triforce")[0]
    early = prompt[:25] + [9, 9]
    out, st, prefilled = gen(L, early, "triforce", store)
    assert st.extra["reused_tokens"] == 0 and prefilled == len(early) and out == gen(L, early, "triforce")[0]
    # the same prompt again: the kept rings moved on, the first request's saved entry has
    # the prompt's end
    out, st, prefilled = gen(L, prompt, "triforce", store, n=40)
    assert st.extra["reused_from"] == "disk" and st.extra["reused_tokens"] == len(prompt) - 1
    assert out == first
    store.save()  # the worker's save after the reply
    again = follow + answer + [1]  # extends the follow-up, whose saved entry serves it
    fresh = disk(tmp_path, L, notes, mem=1 << 30, save_later=True)
    out, st, _ = gen(L, again, "triforce", fresh)
    assert st.extra["reused_from"] == "disk" and st.extra["reused_tokens"] >= len(follow) + NEW - 1
    assert out == gen(L, again, "triforce")[0]
    assert not any(n.startswith("kv-dir: skipping") for n in notes), notes


def test_a_copied_prefix_holds_only_its_band(windowed):
    """A kept prefix copied into a new cache holds the band of its length, and the ring says
    so: a shorter prefix's band (never written) is not claimed."""
    L, prompt = windowed
    cfg, depth = L.cfg, 6
    src = FullCache(cfg, 128, ring_depth=depth)
    with torch.no_grad():
        L.model(torch.tensor([prompt]), 0, src)
    src.commit(len(prompt))
    dst = FullCache(cfg, 128, ring_depth=depth)
    copy_prefix(src, dst, len(prompt))
    assert dst.resumable(len(prompt)) and not dst.resumable(len(prompt) - 1)
    assert src.resumable(len(prompt) - 1)  # the source ring holds its depth too


def write_old_entry(path, L, ids):
    """An entry as written before layer kinds were recorded: magic, header {model, dtype,
    rope, shape, ids}, every layer's K and V of all tokens [N, B, Hkv, D], CRC trailer."""
    cache = FullCache(L.cfg, len(ids) + 8)  # every layer whole
    with torch.no_grad():
        L.model(torch.tensor([ids]), 0, cache)
    cache.commit(len(ids))
    me = {k: v for k, v in model_identity(L).items() if k in ("model", "dtype", "rope", "shape")}
    blocks, crcs = [], []
    for layer in range(L.cfg.n_layers):
        kv = [t.permute(2, 0, 1, 3).contiguous().numpy().tobytes() for t in cache.keys(layer)]
        blocks += kv
        crcs.append([zlib.crc32(b) for b in kv])
    f = path / "old.kv"
    f.write_bytes(MAGIC + json.dumps({**me, "ids": ids}).encode() + b"\n" + b"".join(blocks)
                  + json.dumps({"crc32": crcs}).encode() + b"\n")
    return f


def test_an_old_entry_loads_for_an_all_global_model(tmp_path):
    L, notes = tiny(vocab=64), []
    prompt = repetitive_prompt(120, 64)
    write_old_entry(tmp_path, L, prompt[:100])
    out, st, prefilled = gen(L, prompt, "triforce", disk(tmp_path, L, notes), n=8)
    assert st.extra["reused_from"] == "disk" and st.extra["reused_tokens"] == 100 and prefilled == 20
    assert out == gen(L, prompt, "triforce", n=8)[0] and notes == []


def test_an_old_entry_is_refused_for_a_windowed_model(windowed, tmp_path):
    L, prompt = windowed
    notes = []
    write_old_entry(tmp_path, L, prompt[:40])
    out, st, _ = gen(L, prompt, store=disk(tmp_path, L, notes))
    assert st.extra["reused_tokens"] == 0 and out == gen(L, prompt)[0]
    assert notes == ["kv-dir: not using old.kv: written without layer kinds (an older version), "
                     "and this model has window layers"]


@pytest.mark.parametrize("damage,said", [
    (lambda h: h.update(layers=h["layers"][:-1]), "skipping {}: unreadable or corrupt (the header's layers"),
    (lambda h: h.update(layers=["bogus"] * len(h["layers"])), "skipping {}: unreadable or corrupt (the header's layers"),
    (lambda h: h.update(window_held=[[h["window_held"][-1][1] + 1, h["window_held"][-1][1]]]),
     "skipping {}: unreadable or corrupt (the header's window_held"),
    (lambda h: h.update(window_held=[[0, 5], [3, h["window_held"][-1][1]]]),
     "skipping {}: unreadable or corrupt (the header's window_held"),
    (lambda h: h.update(window_held=h["window_held"][0]), "skipping {}: unreadable or corrupt (the header's window_held"),
    (lambda h: h.update(window_held="all"), "skipping {}: unreadable or corrupt (the header's window_held"),
    (lambda h: h.update(window=None), "skipping {}: unreadable or corrupt (the header's window None"),
    (lambda h: h.update(window=h["window"] + 1), "not using {}: window "),
    (lambda h: h.update(layers=["full_attention"] * len(h["layers"])), "not using {}: layers "),
    (lambda h: h.update(window_held=[[0, h["window_held"][-1][1]]]), "skipping {}: the file ends early"),
])
def test_a_damaged_header_is_refused_in_one_line(windowed, tmp_path, damage, said):
    L, prompt = windowed
    notes = []
    cold = gen(L, prompt, store=disk(tmp_path, L, notes))[0]
    (f,) = tmp_path.glob("*.kv")
    magic, line, rest = f.read_bytes().split(b"\n", 2)
    h = json.loads(line)
    damage(h)
    f.write_bytes(magic + b"\n" + json.dumps(h).encode() + b"\n" + rest)
    out, st, _ = gen(L, prompt, store=disk(tmp_path, L, notes))
    assert out == cold and st.extra["reused_tokens"] == 0
    assert len(notes) == 1 and notes[0].startswith("kv-dir: " + said.format(f.name)), notes
    assert "\n" not in notes[0]


def test_a_damaged_ring_block_is_skipped(windowed, tmp_path):
    L, prompt = windowed
    notes = []
    cold = gen(L, prompt, store=disk(tmp_path, L, notes))[0]
    (f,) = tmp_path.glob("*.kv")
    data = bytearray(f.read_bytes())
    data[len(MAGIC) + len(data.split(b"\n", 2)[1]) + 8] ^= 0xFF  # the first layer's K, a window layer
    f.write_bytes(bytes(data))
    out, st, _ = gen(L, prompt + cold, store=disk(tmp_path, L, notes))
    assert out == gen(L, prompt + cold)[0] and st.extra["reused_tokens"] == 0
    assert notes == [f"kv-dir: skipping {f.name}: layer 0 is damaged"]
