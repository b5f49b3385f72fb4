"""Every blocking device-to-host read of the decode loop, counted per level.

A read (`int(t)`, `.item()`, `.tolist()`, `bool(t)`, `.cpu()` of a device tensor) makes
the host wait until the device has run everything queued before it. The decode loop
reads only through `to_host`, which counts each read under the level that made it
(`READS.at(name)`; the engine names the verifying level, a drafter itself). One
verification of the top level needs one read: its accepted count and next token come
back together (`acceptance.accept`). tests/test_hostread.py checks this with the helper
and, independently, with a dispatch mode that watches for raw reads; it also greps the
decode-loop modules for reads that bypass `to_host`.

The other way, host values reach the device through `to_device`: `torch.tensor(list,
device=cuda)` copies from pageable memory, which blocks the host until the copy ran.
"""
from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager

import torch


class HostReads(threading.local):
    """Blocking reads so far, per level name (`count`), and the level reading now; per
    thread (the sequences of a batch each run in their own: runtime/batch)."""

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


def to_device(values, device, dtype=torch.long) -> torch.Tensor:
    """Host values (token ids: a list, or nested lists) as a tensor on `device`, without a
    blocking copy. On the CPU it is just built; elsewhere it is built in page-locked memory
    and copied with non_blocking=True, queued on the current stream like any kernel. A fresh
    page-locked tensor per call: torch's caching host allocator records the copy's stream
    and hands the block out again only after the copy ran, so no later call can overwrite
    it while in flight."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return staged(values, dtype).to(device, non_blocking=True)


def staged(values, dtype) -> torch.Tensor:
    """`values` in page-locked host memory (the source of an asynchronous copy)."""
    return torch.tensor(values, dtype=dtype, pin_memory=True)
