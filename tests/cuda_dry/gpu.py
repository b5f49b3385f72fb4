"""The fake GPU: streams and events as vector clocks, memory accesses checked against them.

Each stream has a vector clock (stream id -> the latest op of that stream known to have
run before this stream's next op); so does the host. An op issued on stream s ticks s's
own entry and takes in what the host knows (work issued after the host saw a stream
finish runs after it). `record` snapshots a stream's clock in an event, `wait_event` and
`wait_stream` merge one into another, a host synchronisation (a blocking read, an event
or stream `synchronize`, `torch.cuda.synchronize`) merges into the host's clock.

Memory is the CPU memory of the real tensors behind the fake CUDA ones, in byte ranges:
a `Block` per allocation keeps its accesses (stream, tick, read or write, range). Two
accesses from different streams, at least one a write, to overlapping bytes must be
ordered: the earlier one's tick must be in the later one's stream clock (or the host's,
for host memory the host touches). Otherwise:
- `race`: a read of bytes whose write on another stream was not waited for;
- `reuse`: a write over bytes a reader (or writer) on another stream may still be using,
  or a block freed on the host while another stream may still use it (no
  `record_stream` for that stream and no wait: the caching allocator may hand it to the
  next allocation on its stream).
Host memory a stream copied from or into (the pinned KV store, staged token ids) gets a
`Block` as well and is kept alive for the run, so its addresses are never reused.

Pinned memory: ranges registered with the fake `cudaHostRegister`, and tensors created
with `pin_memory=True` (kept alive for the run: torch's caching host allocator never hands
a block out again while a copy may still read it).
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass

import torch

CUDA = torch.device("cuda", 0)


@dataclass(frozen=True)
class Violation:
    kind: str  # device | race | reuse | pageable | capture | read | generator
    message: str

    def __str__(self):
        return f"[{self.kind}] {self.message}"


class CaptureError(RuntimeError):
    """What CUDA raises for an operation not permitted while a stream is capturing."""


class Stream:
    """torch.cuda.Stream, faked: a name and a vector clock."""

    def __init__(self, gpu: "Gpu", name: str):
        self.gpu, self.name, self.id = gpu, name, len(gpu.streams)
        self.vc = {self.id: 0}
        gpu.streams.append(self)

    device = property(lambda self: CUDA)
    cuda_stream = property(lambda self: self.id + 1)

    def wait_event(self, event):
        if event.vc is not None:  # waiting for an event never recorded: no ordering (CUDA)
            _join(self.vc, event.vc)

    def wait_stream(self, stream):
        _join(self.vc, stream.vc)

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self):
        self.gpu.host_sync(self.vc, f"{self.name}.synchronize()")

    def query(self) -> bool:
        self.gpu.capture_check("a stream query", sync=True)
        return self.gpu.known(self.vc)

    def __enter__(self):
        self._prev = self.gpu.current
        self.gpu.current = self

    def __exit__(self, *exc):
        self.gpu.current = self._prev

    def __repr__(self):
        return f"<stream {self.name}>"


class Event:
    """torch.cuda.Event: a snapshot of a stream's clock, with the host time it was recorded."""

    gpu: "Gpu" = None  # the active fake device (DryRun sets it)

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.timing, self.vc, self.t = enable_timing, None, None

    def record(self, stream=None):
        stream = stream or self.gpu.current
        self.vc, self.t = dict(stream.vc), time.perf_counter()

    def wait(self, stream=None):
        (stream or self.gpu.current).wait_event(self)

    def query(self) -> bool:
        self.gpu.capture_check("an event query", sync=True)
        return self.vc is None or self.gpu.known(self.vc)

    def synchronize(self):
        if self.vc is not None:
            self.gpu.host_sync(self.vc, "Event.synchronize()")

    def elapsed_time(self, end: "Event") -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.vc is None or end.vc is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.gpu.known(self.vc) and self.gpu.known(end.vc)):
            raise RuntimeError("CUDA error: device not ready (elapsed_time of an event not completed)")
        return (end.t - self.t) * 1e3


def _join(into: dict, other: dict):
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


class Block:
    """One allocation (a CUDA one, or host memory streams touched): its accesses."""

    __slots__ = ("name", "records", "last_use", "recorded", "__weakref__")

    def __init__(self, name: str):
        self.name = name
        self.records = []  # [lo, hi, stream id, tick, kind 'r'/'w', what]
        self.last_use = {}  # stream id -> tick of its latest access
        self.recorded = set()  # streams named by record_stream


class Gpu:
    """The fake device's state and the checks on it."""

    @property
    def current(self) -> "Stream":
        """The calling thread's current stream (a thread that set none: the default one)."""
        return getattr(self._tls, "current", self.default)

    @current.setter
    def current(self, stream: "Stream"):
        self._tls.current = stream

    def __init__(self, free: int = 20 << 30, total: int = 24 << 30):
        self.streams: list[Stream] = []
        self.default = Stream(self, "compute")
        self._tls = threading.local()  # the current stream is per host thread, as CUDA's is
        self.current = self.default
        self.host = {}  # the host's vector clock
        self.mem_free, self.mem_total = free, total
        self.violations: list[Violation] = []
        self._seen = set()
        self.syncs = []  # (what, phase): every host synchronisation
        self.active = True
        self.capture = None  # the CUDAGraph being captured
        self.capture_stream = None  # torch.cuda.graph's side stream (made on first use)
        self.pinned_ranges = {}  # cudaHostRegister'ed: base address -> end
        self.pinned = set()  # storages allocated pinned (kept alive in `keep`)
        self.keep = []  # host tensors kept alive for the run
        self.hostblocks = {}  # host storage address -> Block
        self.allocated = 0  # bytes allocated on the device so far (max_memory_allocated)
        self.decoding = False  # between the first generated token and the end of a run
        self.counting = 0  # inside hostread.READS.read (a counted blocking read)
        self.copies_in_read = 0  # blocking reads made inside the current counted read
        self.reads = {"counted": 0, "uncounted": 0}
        self.launches = Counter()  # faked kernel launches by name (flash-attn, Triton)

    # ---- findings

    def violate(self, kind: str, message: str):
        if (kind, message) not in self._seen:
            self._seen.add((kind, message))
            self.violations.append(Violation(kind, message))

    def capture_check(self, what: str, sync: bool = False, kind: str = "capture"):
        """`what` is not permitted while capturing: a violation, and the error CUDA raises."""
        if self.capture is not None:
            msg = f"{what} inside a CUDA graph capture"
            self.violate(kind, msg + (" (a host synchronisation)" if sync else ""))
            raise CaptureError(f"operation not permitted when stream is capturing: {msg}")

    # ---- clocks

    def issue(self, stream: Stream) -> int:
        """Tick `stream` for one op issued now; returns the op's tick."""
        _join(stream.vc, self.host)
        stream.vc[stream.id] += 1
        return stream.vc[stream.id]

    def known(self, vc: dict) -> bool:
        """Whether the host already knows everything in `vc` ran."""
        return all(self.host.get(k, 0) >= v for k, v in vc.items())

    def host_sync(self, vc: dict, what: str):
        """The host blocks until everything in `vc` ran."""
        self.capture_check(what, sync=True)
        self.syncs.append((what, "decode" if self.decoding else "setup"))
        _join(self.host, vc)

    def synchronize(self, what: str = "torch.cuda.synchronize()"):
        vc = {}
        for s in self.streams:
            _join(vc, s.vc)
        self.host_sync(vc, what)

    # ---- memory

    def host_block(self, t: torch.Tensor) -> Block:
        """The Block of host tensor `t`'s storage (made, and the storage kept alive, on first use)."""
        key = t.untyped_storage().data_ptr()
        b = self.hostblocks.get(key)
        if b is None:
            b = self.hostblocks[key] = Block(f"host memory {tuple(t.shape)}")
            self.keep.append(t)
        return b

    def access(self, block: Block, lo: int, hi: int, kind: str, stream: Stream | None, tick: int,
               what: str):
        """Check an access of bytes [lo, hi) of `block` by `stream` (None: the host) and
        record it (stream accesses only: the host's are ordered before later stream work)."""
        if hi <= lo:
            return
        me = None if stream is None else stream.id
        clock = self.host if stream is None else stream.vc
        who = "the host" if stream is None else f"stream {stream.name}"
        for r in block.records:
            if r[2] == me or r[1] <= lo or hi <= r[0] or (kind == "r" and r[4] == "r"):
                continue
            if clock.get(r[2], 0) < r[3]:
                other = self.streams[r[2]].name
                if kind == "r":
                    self.violate("race", f"{what} on {who} reads {block.name} written by {r[5]} on stream "
                                         f"{other} without waiting for it (no event wait / wait_stream)")
                else:
                    verb = "read" if r[4] == "r" else "written"
                    self.violate("reuse", f"{what} on {who} overwrites {block.name} while stream {other} may "
                                          f"still use it ({verb} by {r[5]}): reused without waiting for its "
                                          "reader")
        if stream is None:
            return
        block.records = [r for r in block.records
                         if not (r[2] == me and lo <= r[0] and r[1] <= hi and (kind == "w" or r[4] == "r"))]
        block.records.append([lo, hi, me, tick, kind, what])
        block.last_use[me] = tick

    def freed(self, name: str, alloc: Stream, last_use: dict, recorded: set):
        """A device block was freed on the host: every other stream that used it must be
        ordered before its allocation stream's next work, or named by record_stream."""
        if not self.active:
            return
        clock = dict(alloc.vc)
        _join(clock, self.host)
        for sid, tick in last_use.items():
            if sid != alloc.id and sid not in recorded and clock.get(sid, 0) < tick:
                self.violate("reuse", f"{name}, allocated on stream {alloc.name}, was freed while stream "
                                      f"{self.streams[sid].name} may still use it (no record_stream, no wait): "
                                      f"the caching allocator may hand it to the next allocation")

    def new_block(self, name: str) -> Block:
        """A fresh device allocation on the current stream (in a capture: the graph's pool,
        whose lifetime the graph governs)."""
        b = Block(name)
        if self.capture is None:
            weakref.finalize(b, self.freed, name, self.current, b.last_use, b.recorded)
        return b

    # ---- pinned host memory

    def pin_range(self, ptr: int, nbytes: int):
        self.capture_check("cudaHostRegister (an allocation)")
        self.pinned_ranges[ptr] = ptr + nbytes

    def unpin_range(self, ptr: int):
        self.pinned_ranges.pop(ptr, None)

    def pinned_alloc(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (host) as page-locked memory: registered and kept for the run."""
        self.capture_check("a page-locked host allocation")
        self.pinned.add(t.untyped_storage().data_ptr())
        self.keep.append(t)
        return t

    def is_pinned(self, t: torch.Tensor) -> bool:
        if t.untyped_storage().data_ptr() in self.pinned:
            return True
        p = t.data_ptr()
        return any(lo <= p < hi for lo, hi in self.pinned_ranges.items())

    # ---- blocking reads (device to host)

    def blocking_read(self, what: str):
        """A blocking device-to-host copy was issued (the stream sync itself: `host_sync`)."""
        if not self.decoding:
            return
        if self.counting == 0:
            self.reads["uncounted"] += 1
            self.violate("read", f"{what}: a blocking device-to-host read in the decode loop that "
                                 "hostread.to_host does not count")
            return
        self.reads["counted"] += 1
        self.copies_in_read += 1
        if self.copies_in_read > 1:
            self.violate("read", f"{what}: a second blocking device-to-host copy inside one counted read")

