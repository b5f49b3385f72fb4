"""Up to --max-batch generations at once: a bounded FIFO queue, the worker thread that owns
the model and drives the batch's rounds, and each request's way back to the event loop.

A request is a `Job`. Each running job is a member of one `runtime.batch.Batch`: its thread
runs `api.generate` with an `on_token` that decodes the text, holds back what may begin a
stop string, and hands each new piece to the job's asyncio queue; it returns True (end
generation) on a stop string, a cancel (the client hung up, the server stops) or the time
limit, so generation ends within one verification. A cancel during the prefill ends it at
the next prefill chunk (the progress callback). The worker thread admits queued jobs, oldest
first, while fewer than --max-batch run and the job's KV caches fit beside the running ones'
(`batch.memory.Budget`, --kv-memory: the oldest waits for memory, and the others behind it;
one that could never fit was refused with a 400 before it queued). A job joins at the next
round; in a round the running jobs' forwards share one forward per model, and the prompts
arriving together prefill at most --prefill-budget tokens (the others' decodes do not wait
for them). Each answer equals its answer alone (docs/batching.md).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..offload.errors import OffloadError
from ..runtime import api
from ..runtime.batch.memory import Budget
from ..runtime.batch.runner import Batch
from ..runtime.errors import TriforceError
from .metrics import Metrics

log = logging.getLogger("triforce_offload.server")


class Cancelled(Exception):
    """The job was cancelled (499: the client hung up; 503: the server stops) or ran out
    of time before its first token (504)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Result:
    text: str  # the whole completion (up to a stop string)
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length
    figures: dict  # the stats line's figures (the response's `triforce` field)


@dataclass
class Job:
    ids: list[int]  # prompt token ids
    opts: api.RunOptions  # per-request sampling and max tokens on the server's options
    stops: list[str]  # stop strings
    loop: asyncio.AbstractEventLoop  # where `events` is read
    deadline: float  # time.monotonic() after which generation stops
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("delta", str) ... ("done", Result)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)
    kv: tuple = (0, 0)  # (device, host) bytes its caches take (Worker.price)

    def emit(self, kind: str, value=None):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    def cancel(self):
        self.cancelled.set()


class TextStream:
    """Text of a growing token list. New text is released unless it may be the start of
    a stop string or ends in an incomplete UTF-8 character; a stop string ends the text."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.ids, self.text, self.sent, self.stopped = [], "", 0, False

    def decode(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def add(self, t: int) -> str:
        self.ids.append(t)
        text = self.decode()
        if text.endswith("\ufffd"):
            return ""
        self.text = text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = text[:min(hits)], True
            return self._release(len(self.text))
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._release(len(text) - hold)

    def finish(self) -> str:
        if not self.stopped:
            self.text = self.decode()
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out


class Worker:
    def __init__(self, loaded: api.Loaded, max_queue: int, metrics: Metrics, max_batch: int = 1,
                 prefill_budget: int | None = None, kv_memory: int | None = None, host_reserve: int = 0,
                 max_stall: float | None = None):
        """`prefill_budget`: prompt tokens per round over all requests (None: no cap);
        `max_stall`: a round with prefill beside decodes within this times theirs alone
        (`runner.Batcher.chunk_tokens`; None: chunks of --prefill-chunk);
        `kv_memory`: bytes the running requests' caches may take (None: what is free now, less
        `host_reserve` host bytes: the kept prefixes')."""
        self.loaded, self.metrics, self.max_batch = loaded, metrics, max_batch
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.running: list[Job] = []  # jobs generating now (their member threads run)
        self.lock = threading.Lock()  # `running` and the budget are changed by member threads
        self.batch = Batch(loaded, prefill_budget=prefill_budget, max_stall=max_stall)
        self.budget = Budget(loaded, kv_memory, host_reserve)
        self.head: Job | None = None  # the oldest queued job, waiting for memory
        self.closing = False
        # the generating threads alone use loaded.tokenizer (decoding): requests encode with a copy
        self.thread = threading.Thread(target=self._loop, name="generation", daemon=True)
        self.thread.start()

    def running_count(self) -> int:
        return len(self.running)

    def price(self, job: Job) -> str | None:
        """Price the job's caches (job.kv); why it could never run, or None."""
        job.kv = self.budget.price(job.ids, job.opts)
        return self.budget.refusal(job.kv)

    def submit(self, job: Job):
        """Queue the job; queue.Full when --max-queue jobs wait already."""
        if self.closing:
            raise queue.Full
        self.queue.put_nowait(job)

    def depth(self) -> int:
        """Requests waiting: queued, and the oldest waiting for memory."""
        return self.queue.qsize() + (self.head is not None)

    def shutdown(self):
        """Cancel the running job and every queued one; the thread ends."""
        self.closing = True
        with self.lock:
            for job in list(self.running):
                job.cancel()
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit("error", (503, "the server is shutting down"))
        self.queue.put(None)

    def join(self, timeout: float):
        """Wait (at most `timeout` s) for the thread to end after `shutdown`: a --kv-dir
        save in progress lands before the process exits (a daemon thread killed inside
        torch at interpreter exit aborts the process)."""
        self.thread.join(timeout)

    def _loop(self):
        """Admit queued jobs while fewer than max_batch run (waiting for one when none
        runs), run a round, again; ends after `shutdown` once the running jobs ended."""
        ending = False
        while not ending or self.running:  # a job leaves `running` once its KV is saved
            while not ending and len(self.running) < self.max_batch:
                job, self.head = self.head, None
                if job is None:
                    try:
                        job = self.queue.get(block=not self.running)
                    except queue.Empty:
                        break
                if job is None:
                    ending = True
                elif job.cancelled.is_set():  # it hung up while queued
                    continue
                elif self.closing:
                    job.emit("error", (503, "the server is shutting down"))
                else:
                    with self.lock:
                        fits = self.budget.fits(job.kv) or not self.running
                        if fits:
                            self.budget.take(job.kv)
                    if not fits:  # waits until running jobs give their memory back
                        self.head = job
                        break
                    self._start(job)
            try:
                self.batch.step(0.05)
            except Exception:  # a round's failure reached its sequences; the server keeps serving
                log.exception("a batch round failed")

    def _start(self, job: Job):
        with self.lock:
            self.running.append(job)
        try:
            self.batch.spawn(lambda: self._serve(job), "generation-request", after=lambda: self._done(job))
        except Exception as e:  # no thread for it: it is answered, the others run on
            log.exception("could not start a generation")
            job.emit("error", (500, f"generation failed to start: {type(e).__name__}: {e}"))
            self._done(job, save=False)

    def _serve(self, job: Job):
        """One job in its member thread: generate and answer."""
        try:
            self._run(job)
        except Cancelled as e:
            self.metrics.inc("timeouts_total" if e.status == 504 else "cancelled_total")
            job.emit("error", (e.status, str(e)))
        except (TriforceError, OffloadError) as e:
            job.emit("error", (400, str(e)))
        except Exception as e:  # the server keeps serving
            log.exception("generation failed")
            job.emit("error", (500, f"generation failed: {type(e).__name__}: {e}"))

    def _done(self, job: Job, save: bool = True):
        """After the answer, out of the batch's rounds: save the KV (--kv-dir), then the job
        leaves `running` (shutdown waits for it)."""
        try:
            if save:
                self._save()
        finally:
            with self.lock:
                self.running = [j for j in self.running if j is not job]
                self.budget.give(job.kv)

    def _save(self):
        """--kv-dir: write the finished request's KV once its response is out."""
        try:
            if self.loaded.prefix is not None:
                self.loaded.prefix.save()
        except Exception:  # a full disk must not stop the server
            log.exception("saving the KV to --kv-dir failed")

    def _run(self, job: Job):
        text = TextStream(self.loaded.tokenizer, job.stops)
        state = {"first": None, "timed_out": False, "last": None}

        def on_token(t: int) -> bool:
            now = time.monotonic()
            if state["first"] is None:
                state["first"] = now
                self.metrics.histogram("time_to_first_token_seconds", now - job.arrived)
            else:
                self.metrics.histogram("inter_token_seconds", now - state["last"])
            state["last"] = now
            self.metrics.token(now)
            piece = text.add(t)
            if piece:
                job.emit("delta", piece)
            state["timed_out"] = time.monotonic() > job.deadline
            return text.stopped or job.cancelled.is_set() or state["timed_out"]

        def progress(done: int = 0, total: int = 0):
            if job.cancelled.is_set():
                raise self._cancelled()
            if time.monotonic() > job.deadline:
                raise Cancelled(504, "the request ran past its time limit (--request-timeout) "
                                "before its first token")

        progress()
        toks, st = api.generate(self.loaded, job.ids, job.opts, on_token, progress)
        if job.cancelled.is_set():
            raise self._cancelled()
        rest = text.finish()
        if rest:
            job.emit("delta", rest)
        stopped = text.stopped or (toks and toks[-1] in self.loaded.eos and not job.opts.ignore_eos)
        figures = stats_figures(st.as_dict(), state["first"] - job.arrived, state["timed_out"])
        if state["timed_out"]:
            self.metrics.inc("timeouts_total")
        self.metrics.record(st.as_dict(), figures)
        job.emit("done", Result(text.text, len(job.ids), len(toks), "stop" if stopped else "length",
                                figures))


    def _cancelled(self) -> Cancelled:
        if self.closing:
            return Cancelled(503, "the server is shutting down")
        return Cancelled(499, "cancelled: the client closed the connection")


def stats_figures(d: dict, ttft: float, timed_out: bool) -> dict:
    """The stats line's figures for a response's `triforce` field."""
    keep = ("mode", "prompt_tokens", "new_tokens", "reused_tokens", "reused_from", "prefill_s",
            "decode_ms_per_token", "tokens_per_s", "acceptance", "acceptance_per_token",
            "mean_accepted", "rebuilds", "notes", "overlap")
    # the same keys in every response: a figure this run has not (no reuse, no drafting
    # level, resident KV) is null, or 0 reused tokens
    out = {k: d.get(k, 0 if k == "reused_tokens" else None) for k in keep}
    out.update(time_to_first_token_s=round(ttft, 4), timed_out=timed_out)
    for k in ("prefill_s", "decode_ms_per_token", "tokens_per_s"):
        out[k] = round(out[k], 4)
    return out
