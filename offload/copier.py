"""Chunk copier: host->device fetches and device->host write-backs, in submission order.

One interface, two backends:
- CUDA: copies go on a dedicated copy stream with one event per copy; compute waits on
  the event with `stream.wait_event` (no host synchronisation), and the copy stream waits
  on a compute event before overwriting a staging slot or reading fresh KV.
- CPU: a worker thread runs the copies (real memcpy into staging buffers, the analogue of
  the PCIe transfer) and sets one `threading.Event` per copy. torch releases the GIL
  inside copy_, so the copies overlap with compute in the main thread.

Per copy the host does little: no timeline unless `--profile` (then every copy is a
span, below), and a `SimpleQueue` hand-off to the worker on the CPU. Without a timeline
the CPU worker still sums its copy seconds (`busy`), two clock reads per copy, for the
per-forward overlap summary.

With a timeline, every copy is a span between two timing events of the timeline's clock:
on CUDA a `torch.cuda.Event(enable_timing=True)` pair recorded on the copy stream around
the copy (the end event is also the copy's completion signal), resolved later, never
synchronised here; on the CPU the worker records perf_counter events around the memcpy.

Copies run strictly in the order submitted (stream order / FIFO queue): a write-back of
layer l submitted before a fetch of layer l always lands first.
"""
from __future__ import annotations

import queue
import threading
import time

import numpy as np
import torch

from .timeline import Timeline


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's bytes (bf16 has no numpy dtype: view as int16)."""
    return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()


class Signal:
    """Completion of one submitted copy (or a compute-side marker on CUDA)."""

    def __init__(self, event=None, cuda: bool = False):
        self.cuda = cuda
        self.event = event if event is not None else threading.Event()
        self.error = None

    @property
    def end(self):
        """The copy's end as a timing event a wait span can end at (CUDA; None on the CPU,
        where a wait blocks the host and is timed there)."""
        return self.event if self.cuda else None

    def wait(self):
        """Make the current compute wait for the copy: stream-side on CUDA, blocking on CPU."""
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.event)
        else:
            self.event.wait()
            if self.error is not None:
                raise self.error

    def synchronize(self):
        """Block the host until the copy landed (host-side reads such as `keys()`)."""
        self.event.synchronize() if self.cuda else self.wait()


class ChunkCopier:
    def __init__(self, device, timeline: Timeline | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.timeline = timeline
        self.bytes = 0  # total bytes moved host->device
        self.busy = 0.0  # seconds the CPU worker spent copying (the cheap overlap summary)
        self.q = None
        self.thread = None
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)

    def marker(self) -> Signal | None:
        """A compute-side point the next copies must wait for (CUDA); None on the CPU,
        where compute runs synchronously in the submitting thread."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return Signal(ev, cuda=True)

    def fetch(self, dst: tuple, src: tuple, tag, after: Signal | None = None) -> Signal:
        """Copy host tensors `src` into device staging `dst` (pairwise same shape,
        contiguous): one chunk's K and V (one interleaved block), signalled together."""
        self.bytes += sum(s.nbytes for s in src)
        return self._submit(dst, src, tag, after, "copy")

    def write_back(self, dst: tuple, src: tuple, tag) -> Signal:
        """Copy fresh device KV `src` into host `dst` once the compute that made it is done."""
        return self._submit(dst, src, tag, self.marker(), "write-back")

    def _submit(self, dst, src, tag, after, track) -> Signal:
        if self.cuda:
            return self._cuda_copy(dst, src, tag, after, track)
        sig = Signal()
        self._queue().put((dst, src, tag, sig, track))
        return sig

    def _cuda_copy(self, dst, src, tag, after, track) -> Signal:
        tl = self.timeline
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after.event)
            t0 = tl.event(self.stream) if tl is not None else None  # once the wait is over
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)
                if s.device.type == "cuda":
                    s.record_stream(self.stream)  # keep the fresh KV alive until copied
            if tl is not None:
                ev = tl.event(self.stream)  # timed: the span's end and the completion signal
            else:
                ev = torch.cuda.Event()
                ev.record(self.stream)
        if tl is not None:
            tl.span(track, f"{track} {tag}", t0, ev, tag=str(tag))
        return Signal(ev, cuda=True)

    def _queue(self) -> queue.SimpleQueue:
        if self.thread is None:
            self.q = queue.SimpleQueue()  # a C queue: a fraction of Queue's locking per chunk
            self.thread = threading.Thread(target=self._worker, name="kv-copier", daemon=True)
            self.thread.start()
        return self.q

    @torch.inference_mode()  # thread-local: the buffers may be inference tensors
    def _worker(self):
        while True:
            job = self.q.get()
            if job is None:
                return
            dst, src, tag, sig, track = job
            if dst is None:  # flush marker
                sig.event.set()
                continue
            tl = self.timeline
            t0 = tl.event() if tl is not None else time.perf_counter()
            try:
                self.copy(dst, src)
            except Exception as e:  # surfaced to the waiter, never lost in the thread
                sig.error = e
            if tl is not None:
                tl.span(track, f"{track} {tag}", t0, tl.event(), tag=str(tag))
                tl.mark("signal", tag)
            elif track == "copy":
                self.busy += time.perf_counter() - t0
            sig.event.set()

    def copy(self, dst: tuple, src: tuple):
        """The memcpy itself (tests slow it down to provoke races). numpy copies on this one
        thread with the GIL released; torch's copy_ would start an OpenMP team that fights
        the compute threads for the cores (and setting torch threads here is global)."""
        for d, s in zip(dst, src):
            if d.dtype == s.dtype and d.device.type == s.device.type == "cpu":
                np.copyto(_raw(d), _raw(s))
            else:
                d.copy_(s)

    def flush(self):
        """Block until every submitted copy has landed."""
        if self.cuda:
            self.stream.synchronize()
        elif self.thread is not None:
            sig = Signal()
            self.q.put((None, None, "flush", sig, "flush"))
            sig.event.wait()

    def close(self):
        """Let in-flight copies land (on CUDA the staging ring they write may be freed and
        reused next: a prefetch is always in flight after the last commit); stop the thread."""
        if self.cuda:
            self.stream.synchronize()
        if self.thread is not None:
            self.q.put(None)
            self.thread.join()
            self.thread = None
