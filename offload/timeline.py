"""Timeline instrumentation: busy spans per track (copy, compute, wait), Chrome trace export.

Spans are host wall-clock times (perf_counter). On the CPU the copier thread and the
compute thread are the two tracks; on CUDA the spans are host-side and only exact when
the copier is asked to time its copies (profile runs).
"""
from __future__ import annotations

import threading
import time


class Timeline:
    def __init__(self, log_order: bool = False):
        self.spans = []  # (track, name, t0, t1, args)
        self.order = [] if log_order else None  # ("signal"|"read", tag), in happens-before order
        self.lock = threading.Lock()

    def span(self, track: str, name: str, t0: float, t1: float, **args):
        with self.lock:
            self.spans.append((track, name, t0, t1, args))

    def mark(self, kind: str, tag):
        if self.order is not None:
            with self.lock:
                self.order.append((kind, tag))

    def clear(self):
        with self.lock:
            self.spans.clear()

    def busy(self, track: str, t0: float, t1: float) -> float:
        """Seconds of `track` inside [t0, t1] (spans within one track do not overlap)."""
        return sum(max(0.0, min(b, t1) - max(a, t0)) for tr, _, a, b, _ in self.spans if tr == track)

    def summary(self, t0: float, t1: float) -> dict:
        """copy / compute / wait seconds of one forward in [t0, t1] and the overlap fraction.

        compute = wall - time the compute thread waited for copies; overlap efficiency =
        (copy + compute - wall) / min(copy, compute): 1 when the shorter one is fully hidden.
        """
        wall = t1 - t0
        copy, wait = self.busy("copy", t0, t1), self.busy("wait", t0, t1)
        compute = wall - wait
        lo = min(copy, compute)
        eff = (copy + compute - wall) / lo if lo > 0 else 0.0
        return {"wall_s": wall, "copy_s": copy, "compute_s": compute, "wait_s": wait,
                "overlap": max(0.0, min(1.0, eff))}

    def chrome_trace(self, t0: float | None = None, t1: float | None = None) -> dict:
        """Chrome trace JSON (chrome://tracing, Perfetto): one thread per track."""
        spans = [s for s in self.spans if (t0 is None or s[3] >= t0) and (t1 is None or s[2] <= t1)]
        base = min((s[2] for s in spans), default=0.0)
        tids = {"compute": 1, "wait": 1, "copy": 2, "write-back": 2}
        ev = [{"name": name, "cat": tr, "ph": "X", "pid": 0, "tid": tids.get(tr, 3),
               "ts": (a - base) * 1e6, "dur": (b - a) * 1e6, "args": args}
              for tr, name, a, b, args in spans]
        ev += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": n}}
               for n, t in (("compute", 1), ("copy", 2))]
        return {"traceEvents": ev, "displayTimeUnit": "ms"}


class Span:
    """`with Span(timeline, track, name):` records one span (no-op when timeline is None)."""

    def __init__(self, tl: Timeline | None, track: str, name: str, **args):
        self.tl, self.track, self.name, self.args = tl, track, name, args

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.tl is not None:
            self.tl.span(self.track, self.name, self.t0, time.perf_counter(), **self.args)
