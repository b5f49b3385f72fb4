"""A batch of sequences: each runs the solo code path in a member thread; their model
forwards meet at a rendezvous and run together.

Each sequence is a `Member`: `api.generate` for its prompt and options (any mode: its own
caches, drafter, retrieval level, acceptance, γ, bypass, sampling generator, stop
callback), run in its own thread. A model forward of that thread (`graphs.Step`, where
every decode, verification and draft step goes) is handed to the `Batcher` and waits. The
thread that drives the batch (`Batch.drain`, `Batch.step`) waits until every running
member has handed in a forward or finished, then runs them: forwards of one model whose
rows are row-exact (`rows.exact`) as one ragged forward (`rows.forward`), the others
(fixed-shape steps, a model without row-exact kernels) one after another as they would
run alone. So at most one thread computes at a time, the weights are read once per round
for every sequence at that model, and a sequence's tokens do not depend on the others.

Sequences join at any time (`Batch.add`, also from an `on_token` callback) and leave when
they finish: the next round simply has more or fewer forwards. Prefill runs in the member
thread: its chunks (`--prefill-chunk` tokens each) are forwards like the others, so a
prompt prefills a chunk per round beside the running sequences' decodes, in the same
forward where the model allows (`rows.exact`). A `prefill_budget` caps the prompt tokens
all sequences prefill in one round (vLLM's max_num_batched_tokens): the chunks past it wait
for the next round, those of the sequence that joined first first, and the decodes of the running sequences do not wait for
the prompts that arrive together.
"""
from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..errors import TriforceError
from . import member
from ..model.distributed import world_size
from .memory import check_batch
from .rows import Graphs, Rows, chunk_invariant, exact, forward


_driving = threading.local()  # the thread count a driving thread has set (Batcher._drive)
PREFILL_MIN = 16  # Batcher.chunk_tokens: the fewest tokens a prompt prefills in a round
ROW_SHARE = 16  # Batcher._charge: rows that weigh as much as a forward's weight read (an estimate)


@dataclass
class Ask:
    """One member's model forward, waiting for its round."""
    step: object  # the graphs.Step it came through (model, cache)
    ids: torch.Tensor  # [1, T]
    start: int
    last_only: bool
    order: int = 0  # the member's place in joining order (prefill: the oldest first)
    out: torch.Tensor | None = None  # logits, as step(ids, start, last_only) returns them
    error: BaseException | None = None
    done: bool = False
    # seconds the batch charges this forward (`Batcher._run`): the member's clock advances by
    # them instead of the wait (member.clock); None: not charged
    charge: float | None = None

    @property
    def prefill(self) -> bool:
        """A prefill chunk (graphs.Direct) or a layer-major prefill (graphs.Call)."""
        return getattr(self.step, "prefill", False)

    @property
    def tokens(self) -> int:
        return 0 if self.ids is None else self.ids.shape[1]

    def mergeable(self) -> bool:
        """Whether it can share a ragged forward: a step whose forward a ragged one computes
        alike (`graphs.Step.shareable`) on a row-exact model (the native kernels on the CPU,
        the row-exact Triton linear on CUDA)."""
        return (self.ids is not None and self.step.shareable(self.ids.shape[1], self.last_only)
                and exact(self.step.model, self.ids.shape[1]))


class Batcher:
    """The rendezvous: members `ask` for forwards and wait; the driving thread runs a round
    once every running member is waiting (`round`). Counts rounds, rows and forwards."""

    def __init__(self, threads: int | None = None, prefill_budget: int | None = None,
                 max_stall: float | None = None):
        self.threads = threads or torch.get_num_threads()  # what the driving thread computes with
        self.prefill_budget = prefill_budget  # prompt tokens per round (None: every chunk asked)
        # a round with prefill beside decodes takes at most this times a round of the decodes
        # alone (None: chunks of --prefill-chunk): see `chunk_tokens`
        self.max_stall = max_stall
        self.decode_s: float | None = None  # EMA: a round of decodes alone
        self.token_s: float | None = None  # EMA: a prefill token's share of a round
        self.decoding = 0  # decode, verification and draft forwards in the last round
        self._cv = threading.Condition()
        self._running = 0  # members whose thread has not finished
        self._asks: list[Ask] = []
        self.joined = 0  # members that joined, ever (each member's `order`)
        self.rounds = 0  # rounds run
        self.forwards = Counter()  # "ragged" (shared forwards), "alone" (forwards run by themselves)
        self.rows = 0  # rows computed in ragged forwards
        self.merged = 0  # sequence forwards that ran inside ragged forwards
        self.forward_s = 0.0
        self.seqs = 0  # sequence forwards run, over all rounds (per round: the batch's size)
        self.prefill_tokens = 0  # prompt tokens prefilled, over all rounds
        self.last_prefill = 0  # ... in the last round
        self.deferred = 0  # prefill chunks that waited a round for the budget
        self.graphs = Graphs()  # CUDA graphs of ragged forwards of graphed steps

    def join(self) -> int:
        """A member joins; its order (0, 1, ...: prefill chunks of earlier ones go first)."""
        with self._cv:
            self._running += 1
            self.joined += 1
            return self.joined - 1

    def leave(self):
        with self._cv:
            self._running -= 1
            self._cv.notify_all()

    @property
    def running(self) -> int:
        return self._running

    def ask(self, step, ids, start: int, last_only: bool):
        """A member's forward: wait for its round; its logits (or its error, raised here)."""
        a = Ask(step, ids, start, last_only, member.order())
        t0 = time.perf_counter()
        with self._cv:
            self._asks.append(a)
            self._cv.notify_all()
            while not a.done:
                self._cv.wait()
        if a.charge is not None:
            member.charge(time.perf_counter() - t0, a.charge)
        if a.error is not None:
            raise a.error
        return a.out

    def round(self, timeout: float | None = None) -> bool:
        """Wait until every running member has asked (or none runs), run their forwards;
        False once no member runs and nothing is asked."""
        with self._cv:
            ok = self._cv.wait_for(lambda: len(self._asks) >= self._running, timeout)
            if not ok:
                return True  # a member is still busy (prefill): come back
            asks, self._asks = self._within_budget(self._asks)
        if not asks:
            return self._running > 0
        self._drive()
        t0 = time.perf_counter()
        try:
            self._run(asks)
        except BaseException as e:  # noqa: BLE001 - the asks still waiting get it (below)
            failed = e
        else:
            failed = None
        finally:
            took = time.perf_counter() - t0
            self.forward_s += took
            self.rounds += 1
            self.seqs += len(asks)
            self.last_prefill = sum(a.tokens for a in asks if a.prefill)
            self.prefill_tokens += self.last_prefill
            self.decoding = sum(not a.prefill for a in asks)
            self._timed(took)
            with self._cv:
                for a in asks:
                    if a.out is None and a.error is None:  # never left waiting without an answer
                        a.error = failed or RuntimeError("the batch's round gave this forward no result")
                    a.done = True
                self._cv.notify_all()
        if isinstance(failed, (KeyboardInterrupt, SystemExit)):
            raise failed
        return True

    def _timed(self, took: float, keep: float = 0.7):
        """The round's time into the EMAs `chunk_tokens` sizes chunks by: a round of
        decodes alone, and a prefill token's share (the rest of a round with both)."""
        if self.last_prefill == 0:
            if self.decoding:
                self.decode_s = took if self.decode_s is None else keep * self.decode_s + (1 - keep) * took
            return
        if self.decoding and self.decode_s is None:
            return  # the decodes' share is not known yet
        share = max(took - (self.decode_s if self.decoding else 0.0), 0.0) / self.last_prefill
        self.token_s = share if self.token_s is None else keep * self.token_s + (1 - keep) * share

    def chunk_tokens(self, model, cache, chunk: int) -> int:
        """Tokens of a prompt's next prefill forward, `chunk` (--prefill-chunk) at most: while
        other sequences decode and `max_stall` is set, as many as keep the round within
        max_stall times a round of their decodes alone (at least PREFILL_MIN: a prompt always
        moves), measured; else `chunk`. Only on a model whose prefill gives the same KV and
        logits at any chunk boundaries (`chunk_invariant`): elsewhere a prompt's chunks must be
        those of its solo run."""
        if (self.max_stall is None or not self.decoding or self.decode_s is None or self.token_s is None
                or not chunk_invariant(model, cache)):
            return chunk
        fit = int((self.max_stall - 1) * self.decode_s / max(self.token_s, 1e-9))
        return max(PREFILL_MIN, min(chunk, fit))

    def _within_budget(self, asks: list[Ask]) -> tuple[list[Ask], list[Ask]]:
        """(this round's asks, those that wait): every decode, verification and draft step,
        and prefill chunks, those of the member that joined first first (first come, first
        served: the oldest prompt finishes its prefill before the next one starts, which
        brings the mean time to first token down from every prompt's end to each one's
        turn), while their tokens fit the budget (the first one always: a prompt never
        starves)."""
        if self.prefill_budget is None:
            return asks, []
        run, wait, used = [], [], 0
        for a in sorted(asks, key=lambda a: a.order if a.prefill else -1):  # stable: decodes as asked
            if not a.prefill:
                run.append(a)
            elif used == 0 or used + a.tokens <= self.prefill_budget:
                run.append(a)
                # a layer-major prefill (no ids: the whole prompt) takes the round's budget
                used += a.tokens if a.ids is not None else self.prefill_budget
            else:
                wait.append(a)
        self.deferred += len(wait)
        return run, wait

    def _drive(self):
        """The driving thread computes with the thread count the batch was made with (a
        member's torch.set_num_threads(1) also becomes torch's default for threads that
        start their first parallel work afterwards)."""
        if getattr(_driving, "threads", None) != self.threads:
            torch.set_num_threads(self.threads)
            _driving.threads = self.threads

    @torch.inference_mode()
    def _run(self, asks: list[Ask]):
        groups: dict[int, list[Ask]] = {}
        for a in asks:
            if a.mergeable():
                groups.setdefault(id(a.step.model), []).append(a)
            else:
                self._alone(a)
        for g in groups.values():
            g.sort(key=lambda a: a.order)  # joining order, not arrival's: a round's class is the same each time
            if len(g) == 1:
                self._alone(g[0])
                continue
            try:
                for a in g:  # refused before the forward: one sequence's error is its own
                    a.step.cache.check_end(a.start + a.ids.shape[1])
            except Exception:  # noqa: BLE001 - each runs alone: the failing one gets its error
                for a in g:
                    self._alone(a)
                continue
            sets = [Rows(a.ids, a.start, a.step.cache, a.last_only, a.step.static) for a in g]
            t0 = time.perf_counter()
            try:
                outs = None
                if all(getattr(a.step, "graphed", False) for a in g):  # CUDA: one graph per class of round
                    outs = self.graphs.run(g[0].step.model, g)
                if outs is None:
                    outs = forward(g[0].step.model, sets)
            except Exception as e:  # noqa: BLE001 - every sequence of the forward gets it
                for a in g:
                    a.error = e
                continue
            self._charge(g, sets, time.perf_counter() - t0)
            for a, o in zip(g, outs):
                a.out = o
            self.forwards["ragged"] += 1
            self.rows += sum(a.ids.shape[1] for a in g)
            self.merged += len(g)

    def _alone(self, a: Ask):
        self.forwards["alone"] += 1
        t0 = time.perf_counter()
        try:
            a.out = a.step.alone(a.ids, a.start, a.last_only)
        except BaseException as e:  # noqa: BLE001 - the member raises it in its own thread
            a.error = e
        a.charge = time.perf_counter() - t0

    @staticmethod
    def _charge(asks: list[Ask], sets: list[Rows], took: float):
        """What each sequence of a ragged forward that took `took` seconds is charged: its
        own attention (`Rows.attention_s`, timed), plus a share of the rest (the weights,
        read once for every row; norms; RoPE), each sequence weighing 1 + rows / ROW_SHARE
        (a decode's or a verification's rows add little to reading the weights; a prefill
        chunk of hundreds of rows adds a lot). So a sequence's run prices its levels by what
        they cost the batch (a retrieval-level draft step costs its share of the weights and
        its small attention, not the round the other sequences' verifications fill), and
        the charges add up to the forward's time."""
        own = sum(s.attention_s for s in sets)
        weights = [1.0 + s.n / ROW_SHARE for s in sets]
        rest = max(took - own, 0.0) / sum(weights)
        for a, s, w in zip(asks, sets, weights):
            a.charge = rest * w + s.attention_s

    def figures(self) -> dict:
        """For Stats.extra: how the batch ran (shared across its members)."""
        f = self.forwards["ragged"]
        return {"batch_rounds": self.rounds, "batch_forwards_shared": f,
                "batch_forwards_alone": self.forwards["alone"],
                "batch_seqs_per_round": round(self.seqs / self.rounds, 2) if self.rounds else 0.0,
                "batch_seqs_per_forward": round(self.merged / f, 2) if f else 0.0,
                "batch_rows_per_forward": round(self.rows / f, 2) if f else 0.0,
                **({"batch_graph_captures": self.graphs.captures, "batch_graph_replays": self.graphs.replays}
                   if self.graphs.captures or self.graphs.failed else {}),
                **({"batch_graph_failures": sorted({why for _, why in self.graphs.failed.values()})}
                   if self.graphs.failed else {})}


@dataclass
class Member:
    """One sequence of a batch: its prompt, options and result."""
    prompt: list[int]
    opts: object  # RunOptions
    on_token: object = None
    progress: object = None
    tokens: list[int] | None = None  # the result (new token ids)
    stats: object = None  # its Stats
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    joined_round: int = 0  # the batch round it joined at

    def result(self):
        """(tokens, Stats), or the error it ended with."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.tokens, self.stats


def _solo(loaded, prompt, opts, on_token=None, progress=None):
    return loaded.generate(prompt, opts, on_token, progress)


class Batch:
    """Sequences decoding together on one loaded model. `add` a sequence (any thread), then
    `drain` (run rounds until every member finished) or `step` rounds from a serving loop."""

    def __init__(self, loaded, generate=None, prefill_budget: int | None = None,
                 max_stall: float | None = None):
        # a sequence's run: `generate(loaded, prompt, opts, on_token, progress)`, by default
        # the loaded model's own (`api.Loaded.generate`: api imports this package, not back);
        # `prefill_budget`: prompt tokens all sequences prefill in one round (None: no cap)
        self.loaded, self.generate = loaded, generate or _solo
        self.batcher = Batcher(torch.get_num_threads(), prefill_budget, max_stall)  # the creating thread's count drives
        self.members: list[Member] = []

    def add(self, prompt: list[int], opts, on_token=None, progress=None) -> Member:
        """Start a sequence; it joins the next round."""
        m = Member(list(prompt), opts, on_token, progress, joined_round=self.batcher.rounds)
        self.members.append(m)

        def body():
            try:
                m.tokens, m.stats = self.generate(self.loaded, m.prompt, m.opts, m.on_token, m.progress)
            except BaseException as e:  # noqa: BLE001 - handed to whoever reads the result
                m.error = e
            finally:
                m.done.set()
        self.spawn(body, f"triforce-seq-{len(self.members)}")
        return m

    def spawn(self, body, name: str = "triforce-seq", after=None):
        """Run `body()` (which generates: a server's request) as a member: in its own thread,
        its forwards in this batch's rounds; then `after()` in the same thread, no longer a
        member (a --kv-dir save: the rounds do not wait for it). Neither may raise (they
        own their errors)."""
        order = self.batcher.join()  # before the thread starts: a round never runs without it
        try:
            threading.Thread(target=self._member, args=(body, after, order), daemon=True, name=name).start()
        except BaseException:
            self.batcher.leave()
            raise

    def _member(self, body, after=None, order: int = 0):
        member.enter(self.batcher, order)
        # a member thread samples and keeps its engine's books; the forwards run in the
        # driving thread. One thread: an OpenMP team per member thread would spin beside
        # the forwards (libgomp keeps a team per thread that starts parallel regions)
        torch.set_num_threads(1)
        try:
            with torch.inference_mode():
                body()
        finally:
            member.leave()
            self.batcher.leave()
        if after is not None:
            after()

    @property
    def running(self) -> int:
        """Members whose thread has not finished."""
        return self.batcher.running

    def step(self, timeout: float | None = None) -> bool:
        """Run one round (waiting up to `timeout` for the members); False when none runs."""
        return self.batcher.round(timeout)

    def drain(self):
        """Run rounds until every member finished; add the batch's figures to their Stats."""
        while self.batcher.round(0.05) or self.batcher.running:
            pass
        for m in self.members:
            m.done.wait()
        f = self.batcher.figures()  # the batch's, the same for every member
        for m in self.members:
            if m.stats is not None:
                m.stats.extra.update(f, batch_size=len(self.members))
                if f.get("batch_graph_replays"):  # its steps ran in the rounds' graphs
                    m.stats.extra["graphs"] = True


def generate_batch(loaded, prompts: list[list[int]], opts, on_token=None, memory: int | None = None,
                   prefixes: list[tuple] = (), hold=None) -> list:
    """Each prompt's (new token ids, Stats), generated together. `opts`: one RunOptions for
    all, or one per prompt; `on_token(i, t)`: sequence i produced t (True ends it). The
    batch's caches are priced first (`memory.check_batch`: `memory` bytes, default what is
    free; shared `prefixes` held once): one that does not fit is refused before anything is
    allocated. The sequences run inside `hold()`, a context (which holds the shared
    prefixes, prefilled once, while they run). Raises the first sequence's error after every sequence ended
    (the others' results stand)."""
    if not prompts:
        raise TriforceError("the batch is empty: give at least one prompt")
    per = opts if isinstance(opts, (list, tuple)) else [opts] * len(prompts)
    if len(per) != len(prompts):
        raise TriforceError(f"{len(prompts)} prompts but {len(per)} option sets")
    if world_size() > 1:
        raise TriforceError("a batch under --tp is not supported yet: run the sequences one by one")
    pairs = [(p, o) for p, o in zip(prompts, per) if p]  # an empty prompt fails alone, later
    check_batch(loaded, [p for p, _ in pairs], [o for _, o in pairs], memory, prefixes)
    with hold() if hold is not None else nullcontext():
        b = Batch(loaded)
        ms = [b.add(p, o, None if on_token is None else (lambda t, i=i: on_token(i, t)))
              for i, (p, o) in enumerate(zip(prompts, per))]
        b.drain()
    for m in ms:
        if m.error is not None:
            raise m.error
    return [m.result() for m in ms]
