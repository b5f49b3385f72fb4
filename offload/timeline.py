"""Timeline instrumentation: busy spans per track (copy, compute, wait), Chrome trace export.

A span's ends are timing *events* of the device's `Clock`, resolved to host wall-clock
seconds (`time.perf_counter`) lazily, when a summary or a trace is taken:

- CPU (`HostEvent`): `record()` reads perf_counter; the copier thread and the compute
  thread are the two tracks.
- CUDA (`torch.cuda.Event(enable_timing=True)`): copies are timed by an event pair on the
  copy stream around each chunk copy, compute spans by events on the compute stream, so
  the spans are GPU times, not the host's issue times. Nothing synchronises while they are
  recorded; resolution synchronises only the events it reads (long landed by then) and
  measures each against a reference event whose host time is known: the clock's
  calibration event (recorded and synchronised once, when the clock is made) or, after
  the first forward, the start event of the previous resolved forward (`rebase`), so the
  float32 milliseconds of `elapsed_time` always span a short interval.

Both event kinds have the same interface (`record`, `query`, `synchronize`,
`elapsed_time`), so the CPU runs the same bookkeeping, resolution and summary code as CUDA.
Plain floats are accepted as span ends too (host times, already resolved).

A CUDA wait on a copy is a stream-side `wait_event`: the compute stream stalls from the
point the wait was issued (an event recorded there) until the copy's end event, so a wait
span is `[issued, max(issued, copy end)]` (`until=`): one event per wait, not two.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


class HostEvent:
    """The CPU's timing event, shaped like `torch.cuda.Event(enable_timing=True)`:
    `record()` reads `time.perf_counter()`; it is complete once recorded."""

    __slots__ = ("t",)

    def __init__(self):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def query(self) -> bool:
        return self.t is not None

    def synchronize(self):
        if self.t is None:
            raise RuntimeError("HostEvent.synchronize before record")

    def elapsed_time(self, end: "HostEvent") -> float:
        """Milliseconds from this event to `end` (torch.cuda.Event's unit)."""
        return (end.t - self.t) * 1e3


class Clock:
    """Makes recorded timing events for one device and resolves them to host seconds.

    `new_event()` makes an unrecorded event, `stream()` gives the stream to record on
    when none is named (CUDA: the current stream; CPU: None). The reference event is
    recorded and synchronised once here, and its host time read right after."""

    def __init__(self, new_event=HostEvent, stream=lambda: None):
        self.new_event, self.stream = new_event, stream
        self.ref = self.event()
        self.ref.synchronize()
        self.ref_s = time.perf_counter()

    def event(self, stream=None):
        ev = self.new_event()
        ev.record(self.stream() if stream is None else stream)
        return ev

    def seconds(self, ev) -> float:
        """Host perf_counter seconds of an event (floats pass through)."""
        if ev is None or isinstance(ev, (int, float)):
            return ev
        ev.synchronize()  # landed long ago when resolution runs; elapsed_time needs it
        return self.ref_s + self.ref.elapsed_time(ev) / 1e3

    def rebase(self, ev, seconds: float):
        """Measure later events from `ev` (resolved to `seconds`): a recent reference."""
        if ev is not None and not isinstance(ev, (int, float)):
            self.ref, self.ref_s = ev, seconds


def host_clock() -> Clock:
    return Clock()


def cuda_clock(device) -> Clock:
    import torch
    device = torch.device(device)
    return Clock(lambda: torch.cuda.Event(enable_timing=True),
                 lambda: torch.cuda.current_stream(device))


def device_clock(device) -> Clock:
    """The clock of a device: CUDA events on a GPU, perf_counter events on the CPU."""
    import torch
    return cuda_clock(device) if torch.device(device).type == "cuda" else host_clock()


@dataclass
class Forward:
    """One forward's unresolved record: its spans, start/end events and token count."""
    spans: list
    t0: object
    t1: object
    tokens: int
    tails: list = field(default_factory=list)  # last end event of each track: done => all done
    counts: dict | None = None  # copy_s, wait_s summed without spans (no --profile); None: from spans

    def done(self) -> bool:
        """Whether every event has landed (non-blocking: streams complete in order, so
        the last event of each stream tells)."""
        return all(ev is None or isinstance(ev, (int, float)) or ev.query()
                   for ev in (self.t1, *self.tails))


class Timeline:
    def __init__(self, log_order: bool = False, clock: Clock | None = None):
        self.spans = []  # (track, name, t0, t1, args, until): ends are events or floats
        self.order = [] if log_order else None  # ("signal"|"read", tag), in happens-before order
        self.lock = threading.Lock()
        self.clock = clock or host_clock()
        self.tails = {}  # track -> end event of its latest span

    def event(self, stream=None):
        """A timing event recorded now (on `stream`, default the current one)."""
        return self.clock.event(stream)

    def span(self, track: str, name: str, t0, t1, until=None, **args):
        """Record a span; t0/t1 are events or host seconds. `until`: the span ends at
        max(t0, until) (a stream-side wait on the event `until`); t1 is then None."""
        with self.lock:
            self.spans.append((track, name, t0, t1, args, until))
            self.tails[track] = until if t1 is None else t1

    def mark(self, kind: str, tag):
        if self.order is not None:
            with self.lock:
                self.order.append((kind, tag))

    def clear(self):
        with self.lock:
            self.spans = []
            self.tails = {}

    def take(self, t0, t1, tokens: int, counts: dict | None = None) -> Forward:
        """The spans since the last take/clear as one forward's record (and start afresh)."""
        with self.lock:
            spans, tails = self.spans, list(self.tails.values())
            self.spans, self.tails = [], {}
        return Forward(spans, t0, t1, tokens, tails, counts)

    def resolve(self, spans=None) -> list:
        """Spans as (track, name, t0, t1, args) in host seconds."""
        sec = self.clock.seconds
        out = []
        for tr, name, a, b, args, until in (self.spans if spans is None else spans):
            a = sec(a)
            b = max(a, sec(until)) if b is None else sec(b)
            out.append((tr, name, a, b, args))
        return out

    @staticmethod
    def busy_of(spans, track: str, t0: float, t1: float) -> float:
        """Seconds of `track` inside [t0, t1] (spans within one track do not overlap)."""
        return sum(max(0.0, min(b, t1) - max(a, t0)) for tr, _, a, b, _ in spans if tr == track)

    def busy(self, track: str, t0: float, t1: float) -> float:
        return self.busy_of(self.resolve(), track, t0, t1)

    @staticmethod
    def summarize(spans, t0: float, t1: float) -> dict:
        """copy / compute / wait seconds of one forward in [t0, t1] and the overlap fraction.

        compute = wall - time the compute thread (stream) waited for copies; overlap
        efficiency = (copy + compute - wall) / min(copy, compute): 1 when the shorter one
        is fully hidden."""
        copy, wait = Timeline.busy_of(spans, "copy", t0, t1), Timeline.busy_of(spans, "wait", t0, t1)
        return Timeline.figures(t1 - t0, copy, wait)

    @staticmethod
    def figures(wall: float, copy: float, wait: float) -> dict:
        """The summary from a forward's wall, copy-busy and wait seconds."""
        compute = wall - wait
        lo = min(copy, compute)
        eff = (copy + compute - wall) / lo if lo > 0 else 0.0
        return {"wall_s": wall, "copy_s": copy, "compute_s": compute, "wait_s": wait,
                "overlap": max(0.0, min(1.0, eff))}

    def summary(self, t0: float, t1: float) -> dict:
        return self.summarize(self.resolve(), self.clock.seconds(t0), self.clock.seconds(t1))

    def settle(self, fw: Forward) -> tuple[dict, list]:
        """Resolve a forward: (its summary with `tokens`, its resolved spans plus the
        forward span). Later forwards are measured from this one's start (`rebase`)."""
        t0, t1 = self.clock.seconds(fw.t0), self.clock.seconds(fw.t1)
        spans = self.resolve(fw.spans)
        if fw.counts is None:
            s = self.summarize(spans, t0, t1)
        else:  # no --profile: the copier's and scheduler's sums, no spans
            s = self.figures(t1 - t0, min(fw.counts["copy_s"], t1 - t0), fw.counts["wait_s"])
        s["tokens"] = fw.tokens
        self.clock.rebase(fw.t0, t0)
        spans.append(("forward", f"forward ({fw.tokens} tokens)", t0, t1, {"tokens": fw.tokens}))
        return s, spans

    def chrome_trace(self, t0: float | None = None, t1: float | None = None, spans=None) -> dict:
        """Chrome trace JSON (chrome://tracing, Perfetto): one thread per track.

        With a `forward` span among them (a settled forward), copies that started before
        the forward did go on the `prefetch` thread: the next verification's first chunks,
        streamed while the draft levels ran."""
        spans = self.resolve() if spans is None else spans
        spans = [s for s in spans if (t0 is None or s[3] >= t0) and (t1 is None or s[2] <= t1)]
        base = min((s[2] for s in spans), default=0.0)
        start = min((s[2] for s in spans if s[0] == "forward"), default=None)
        tids = {"forward": 1, "compute": 1, "wait": 1, "copy": 2, "write-back": 2, "prefetch": 3}
        ev = []
        for tr, name, a, b, args in spans:
            if tr == "copy" and start is not None and a < start:
                tr, args = "prefetch", {**args, "prefetch": True}
            ev.append({"name": name, "cat": tr, "ph": "X", "pid": 0, "tid": tids.get(tr, 4),
                       "ts": (a - base) * 1e6, "dur": (b - a) * 1e6, "args": args})
        ev += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": n}}
               for n, t in (("compute", 1), ("copy", 2), ("prefetch", 3))]
        return {"traceEvents": ev, "displayTimeUnit": "ms"}


class Span:
    """`with Span(timeline, track, name):` records one span between two clock events
    (no-op when timeline is None). `until`: an event the span waits for stream-side; the
    span then ends at max(its start, that event) and records no end event."""

    def __init__(self, tl: Timeline | None, track: str, name: str, until=None, **args):
        self.tl, self.track, self.name, self.until, self.args = tl, track, name, until, args

    def __enter__(self):
        if self.tl is not None:
            self.t0 = self.tl.event()
        return self

    def __exit__(self, *exc):
        if self.tl is not None:
            t1 = None if self.until is not None else self.tl.event()
            self.tl.span(self.track, self.name, self.t0, t1, until=self.until, **self.args)
