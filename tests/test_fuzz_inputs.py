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
