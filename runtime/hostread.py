"""Every blocking device-to-host read of the decode loop, counted per level.

A read (`int(t)`, `.item()`, `.tolist()`, `bool(t)`, `.cpu()` of a device tensor) makes
the host wait until the device has run everything queued before it. The decode loop
reads only through `to_host`, which counts each read under the level that made it
(`READS.at(name)`; the engine names the verifying level, a drafter itself). One
verification of the top level needs one read: its accepted count and next token come
back together (`acceptance.accept`). tests/test_hostread.py checks this with the helper
and, independently, with a dispatch mode that watches for raw reads; it also greps the
decode-loop modules for reads that bypass `to_host`.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch


class HostReads:
    """Blocking reads so far, per level name (`count`), and the level reading now."""

    def __init__(self):
        self.count = Counter()  # level name -> reads
        self.level = "other"  # the level whose reads are counted now

    @contextmanager
    def at(self, level: str):
        """Count the reads made inside the block under `level`."""
        outer, self.level = self.level, level
        try:
            yield
        finally:
            self.level = outer

    def read(self, t: torch.Tensor):
        """One blocking read of `t` as Python values (a 0-dim tensor: a number)."""
        self.count[self.level] += 1
        return t.tolist()  # one copy to the host (on CUDA: waits for the stream)


READS = HostReads()  # the process's counter (tensor-parallel ranks are processes)


def to_host(t: torch.Tensor):
    """`t` as Python values (int/float or nested lists), counted as one blocking read."""
    return READS.read(t)
