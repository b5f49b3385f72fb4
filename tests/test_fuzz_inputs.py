"""Fuzzed inputs (issue 39, item 3), bounded and seeded: damaged copies of a valid tiny GGUF
(truncated, bytes flipped in the header, metadata and tensor table, counts, lengths,
offsets and shapes set out of range). Each load ends in the model or in one line of
TriforceError, in a bounded time: never another exception (a traceback for the user) or a
hang. What loads must also generate (a damaged value that still parses must not crash a
forward)."""
from __future__ import annotations

import random
import signal
import struct
from contextlib import contextmanager

import pytest

from test_bad_inputs import write_tiny_gguf
from triforce_offload.runtime import api
from triforce_offload.runtime.errors import TriforceError
from triforce_offload.runtime.options import ModelOptions, RunOptions

SEED = 39
CASES = 48  # per kind of damage


@contextmanager
def time_limit(seconds: int):
    def expired(*_):
        raise TimeoutError(f"no answer in {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> tuple[bytes, int]:
    """The file's bytes and where its tensor data starts (the fuzzed region is before it)."""
    import gguf
    path = tmp_path_factory.mktemp("fuzz") / "valid.gguf"
    write_tiny_gguf(path)
    return path.read_bytes(), gguf.GGUFReader(str(path)).data_offset


def damaged(data: bytes, head: int, kind: str, rng: random.Random) -> bytes:
    b = bytearray(data)
    if kind == "truncated":
        return bytes(b[:rng.randrange(0, len(b))])
    if kind == "flipped":  # 1-4 bytes of the header, metadata or tensor table
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(0, head)
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)
    # out of range: an aligned 4- or 8-byte field of the head set to an extreme value
    width = rng.choice((4, 8))
    i = rng.randrange(0, head - width)
    big = rng.choice((2 ** (8 * width) - 1, 2 ** (8 * width - 1), 2 ** (8 * width - 2) + 7, 0))
    b[i:i + width] = struct.pack("<Q" if width == 8 else "<I", big)
    return bytes(b)


@pytest.mark.parametrize("kind", ["truncated", "flipped", "out-of-range"])
def test_a_damaged_gguf_loads_or_is_refused_in_one_line(valid, kind, tmp_path, monkeypatch):
    monkeypatch.setenv("TRIFORCE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    data, head = valid
    rng = random.Random(f"{SEED}-{kind}")
    outcomes = {"refused": 0, "loaded": 0}
    for n in range(CASES):
        path = tmp_path / f"{kind}-{n}.gguf"
        path.write_bytes(damaged(data, head, kind, rng))
        try:
            with time_limit(60):
                loaded = api.load(ModelOptions(model=str(path), dtype="float32"))
                toks, _ = api.generate(loaded, [65, 66, 67], RunOptions.of(mode="autoregressive", max_new_tokens=2))
            outcomes["loaded"] += 1
            assert len(toks) <= 2
        except TriforceError as e:
            outcomes["refused"] += 1
            assert str(e).strip() and "\n" not in str(e).strip(), (n, str(e))
        except Exception as e:  # noqa: BLE001 - what the user would see as a traceback
            raise AssertionError(f"case {n} ({kind}): {type(e).__name__}: {e}") from e
    print(kind, outcomes)
    if kind == "truncated":
        assert outcomes["refused"] > 0


# --kv-dir entries: a valid entry (of an all-global model and of a windowed one: Gemma 3's
# window layers store the spans their rings held) damaged as the GGUFs are, and its JSON
# header and trailer given wrong values that still parse. Each run must end in the cold
# run's tokens (a damaged entry is skipped, with one line) or in the same tokens from what
# the entry still holds correctly: never an exception, never another answer.
KV_CASES = 40  # per kind of damage and model
NASTY = (None, True, -1, 0, 1, 2 ** 31, 2 ** 63, -2 ** 63, 2 ** 80, 1.5, float("nan"), "", "x",
         [], [0], [[0, 1]], [[-5, 3]], [[3, 2]], [[0, 10 ** 12]], {}, {"a": 1}, ["sliding_attention"])


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def saved_entry(request, tmp_path_factory):
    """(model, prompt, cold tokens, the entry's bytes, where its KV starts and ends)."""
    from helpers_spec import repetitive_prompt, tiny
    from test_new_archs import tiny_gemma3
    from test_windows import loaded_from
    from triforce_offload.runtime.cache.disk import KVDir
    from triforce_offload.runtime.cache.prefix import PrefixCache
    d = tmp_path_factory.mktemp(f"kv-{request.param}")
    if request.param == "llama":
        L, prompt = tiny(vocab=64), repetitive_prompt(80, 64)
    else:
        L, prompt = loaded_from(tiny_gemma3(seed=2), d / "hf"), repetitive_prompt(60, 97, seed=4)
    L.prefix = PrefixCache(0, KVDir(d / "kv", 1 << 30, L, print))
    cold, st = api.generate(L, prompt, kv_opts())
    L.prefix = PrefixCache(0, KVDir(d / "kv", 1 << 30, L, print))
    warm, st = api.generate(L, prompt, kv_opts())
    assert warm == cold and st.extra["reused_tokens"] == len(prompt) - 1  # the entry serves
    L.prefix = None
    f = next((d / "kv").glob("*.kv"))
    data = f.read_bytes()
    magic_end = data.index(b"\n") + 1
    start = data.index(b"\n", magic_end) + 1
    end = data.rindex(b'{"crc32"')  # the trailer line follows the last block
    return L, prompt, cold, data, start, end


def kv_opts():
    return RunOptions.of(mode="triforce", max_new_tokens=8, ignore_eos=True, budget=16,
                         retrieval_chunk=4, bypass=False)


def damaged_entry(data: bytes, start: int, end: int, kind: str, rng: random.Random) -> bytes:
    if kind in ("truncated", "flipped"):
        return damaged(data, len(data), kind, rng)
    import json
    magic_end = data.index(b"\n") + 1
    head, trailer = json.loads(data[magic_end:start]), json.loads(data[end:])
    doc = head if kind == "header-value" else trailer
    target, key = doc, rng.choice(sorted(doc))
    while isinstance(target[key], (list, dict)) and target[key] and rng.random() < 0.6:
        target = target[key]  # somewhere inside: one token id, one span end, one CRC
        key = rng.choice(sorted(target)) if isinstance(target, dict) else rng.randrange(len(target))
    target[key] = rng.choice(NASTY) if rng.random() < 0.7 else (
        target[key] + rng.choice((-1, 1)) if type(target[key]) is int else rng.choice(NASTY))
    line = lambda d: json.dumps(d).encode() + b"\n"  # noqa: E731
    return data[:magic_end] + line(head) + data[start:end] + line(trailer)


@pytest.mark.parametrize("kind", ["truncated", "flipped", "header-value", "trailer-value"])
def test_a_damaged_kv_entry_is_skipped_or_serves_the_same_answer(saved_entry, kind, tmp_path):
    from triforce_offload.runtime.cache.disk import KVDir
    from triforce_offload.runtime.cache.prefix import PrefixCache
    L, prompt, cold, data, start, end = saved_entry
    rng = random.Random(f"{SEED}-kv-{kind}-{L.cfg.arch}")
    outcomes = {"skipped": 0, "reused": 0}
    for n in range(KV_CASES):
        d = tmp_path / f"{kind}-{n}"
        d.mkdir()
        (d / "entry.kv").write_bytes(damaged_entry(data, start, end, kind, rng))
        notes = []
        try:
            with time_limit(60):
                L.prefix = PrefixCache(0, KVDir(d, 1 << 30, L, notes.append))
                toks, st = api.generate(L, prompt, kv_opts())
        except Exception as e:  # noqa: BLE001 - what the user would see as a traceback
            raise AssertionError(f"case {n} ({kind}): {type(e).__name__}: {e}") from e
        finally:
            L.prefix = None
        assert toks == cold, (n, kind, notes)  # never another answer from a damaged entry
        assert all("\n" not in m for m in notes), notes
        outcomes["reused" if st.extra["reused_tokens"] else "skipped"] += 1
    print(L.cfg.arch, kind, outcomes)
    assert outcomes["skipped"] > 0
