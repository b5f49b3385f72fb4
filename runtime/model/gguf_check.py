"""A quick GGUF sanity check: walk the header, metadata and tensor table (no weights read)
and check that the file holds every tensor's bytes. A truncated or corrupt file is then named
in one line before transformers dequantizes it and before anything is written to the cache.
Layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 counted in 32 bits; transformers reads 2 and 3
ALIGNMENT_KEY = "general.alignment"
STRING, ARRAY = 8, 9  # metadata value types of variable size
FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
         10: "<Q", 11: "<q", 12: "<d"}  # the other value types


class _Cursor:
    """Reads little-endian fields from a buffer; running past its end is a ValueError."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def need(self, n: int):
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"truncated: the metadata runs past the end of the file "
                             f"({len(self.buf):,} bytes)")

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        self.need(n)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self) -> str:
        n = self.take("<Q")
        self.need(n)
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", "replace")

    def value(self, kind: int):
        """Read one metadata value; arrays are skipped (returned as None)."""
        if kind == STRING:
            return self.string()
        if kind in FIXED:
            return self.take(FIXED[kind])
        if kind != ARRAY:
            raise ValueError(f"corrupt metadata: unknown value type {kind} at byte {self.pos}")
        item, count = self.take("<I"), self.take("<Q")
        if item in FIXED:
            self.need(count * struct.calcsize(FIXED[item]))
            self.pos += count * struct.calcsize(FIXED[item])
            return None
        self.need(count * 8)  # every string or array takes at least 8 bytes
        for _ in range(count):
            self.value(item)
        return None


def gguf_data_size(path: Path) -> int:
    """Bytes the file must have to hold all its tensors; ValueError says what is wrong."""
    with open(path, "rb") as f:
        if f.seek(0, 2) < 24:
            raise ValueError("too short for a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _extent(_Cursor(buf))


def _extent(c: _Cursor) -> int:
    if bytes(c.buf[:4]) != MAGIC:
        raise ValueError("it does not start with the GGUF magic bytes")
    c.pos = 4
    version = c.take("<I")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    align = 32
    for _ in range(n_kv):
        key, value = c.string(), c.value(c.take("<I"))
        if key == ALIGNMENT_KEY and isinstance(value, int) and value > 0:
            align = value
    end = 0
    for _ in range(n_tensors):
        end = max(end, _tensor_end(c))
    start = -(-c.pos // align) * align  # tensor data begins at the next aligned byte
    return start + end


def _tensor_end(c: _Cursor) -> int:
    """Read one tensor-table entry; return where its bytes end within the data section."""
    name, dims = c.string(), c.take("<I")
    shape = [c.take("<Q") for _ in range(dims)]
    kind, offset = c.take("<I"), c.take("<Q")
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except ValueError:
        raise ValueError(f"corrupt tensor table: tensor {name!r} has unknown type {kind}") from None
    n = 1
    for d in shape:
        n *= d
    return offset + n // block * size


def check(path: Path) -> None:
    """Raise ValueError (one line, for the user) unless `path` looks like a complete GGUF."""
    need = gguf_data_size(path)
    have = path.stat().st_size
    if have < need:
        raise ValueError(f"truncated: its tensors need {need:,} bytes, the file has {have:,}")
