"""Model steps over a static cache as CUDA graphs: capture once per shape, replay after.

A *step* is one forward of T tokens over one cache. Over a cache with `static = True` the
forward takes its start position as a device tensor, so its kernels, shapes and addresses
are the same at every position (tests/test_graphs.py checks this on the CPU). `Step`
captures one graph per (T, last_only) the first time that shape runs, with the token ids
and start in static buffers, and afterwards only copies new ids and the start in and
replays. Prefill (long, varying chunks) stays eager; so does everything on the CPU, over
a cache that is not static (offloaded, streaming), or with graphs turned off (`--no-graphs`).
A replay runs no Python: the cache's `begin_forward`/`end_forward`, which the forward
calls, run at capture only, so a static cache keeps them free of host work (the device
ops a static cache issues there, its slots and length once per forward, are captured
with the rest); after every replay the step calls `cache.on_replay()` instead.
If a capture fails the step runs that shape on the cache's dynamic eager forward (an int
start, not the fixed-shape one that may be what broke) and says so once (in `notes`, shown
on the stats line). `TRIFORCE_OFFLOAD_STATIC=1` runs the fixed-shape
forward without graphs wherever the cache allows it, the CPU included: the tests check
the graph path's arithmetic end to end that way.

gpt-fast's `generate.py` does the same with `torch.compile(mode="reduce-overhead")`; a
hand-made `torch.cuda.CUDAGraph` keeps the dependency surface to torch itself.

Capture once: a model's static caches and the Steps captured over them outlive a run
(`Kept`, one per model: `kept(model)`). A graph replays fixed addresses, so what it reads
and writes must be the same objects at the next run: the full cache (one per capacity
class, a multiple of `ROOM` tokens), its `Recorder` and the retrieval cache (one per slot
class) are handed out again reset in place (zeroed, length 0), and the next run's levels
get the same Steps with their graphs. A run whose shapes match the last one's captures
nothing; one that needs other shapes drops the kept caches (and their graphs) first, so a
model keeps one set on the device. A kept full cache that a prefix store (`serve`) also
keeps is copied out to a new cache before it is reset, so the kept KV survives.

`compile=True` (`--compile`) puts `torch.compile` (inductor, no cudagraphs of its own:
this step captures) under the fixed-shape forward: it fuses each layer's norms, rotary,
KV write, SwiGLU and residual adds into a few generated kernels, so a captured graph holds
fewer, larger kernels. The attention kernels stay opaque (custom ops,
`kernels.attention`), the KV buffers are written in place (inductor keeps the
`index_copy_` on the cache's buffer). Compiles happen in the capture's warm-up (so in
`capture_s`), which runs until dynamo compiles nothing new (a first forward can change
what the next one guards on: the Recorder's query buffers); the capture itself refuses a
recompile. The cache capacity becomes symbolic once it changes (dynamo's automatic dynamic
shapes): a second prompt length compiles once more, later ones reuse that graph. Each
verification width compiles once (the forward specializes on its token count). Off by
default until a GPU measurement says it pays; it never applies where the step is not
fixed-shape (the CPU without `TRIFORCE_OFFLOAD_STATIC=1`, offloaded or streaming caches,
`--tp`, `--no-graphs`): that is said once.
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass

import torch
from ..kernels.attention import fallback_notes
from ..settings import env
from .cache.kv import FullCache, depth_of
from .cache.retrieval import Recorder
from .batch import member
from .model.distributed import world_size

TP_NOTE = ("CUDA graphs off under tensor parallelism: a captured graph would not replay the "
           "all_reduce hooks as collectives")
COMPILE_NOTE = "--compile not applied {why}: it compiles fixed-shape steps, which run on CUDA over a resident cache"
RECOMPILE_LIMIT = 64  # compiled graphs per code object (levels x last_only x static/symbolic)
ROOM = 1024  # kept static caches hold a multiple of this many tokens (cache.prefix.ROOM too)


def room_for(tokens: int) -> int:
    """The capacity class of `tokens`: rounded up to a multiple of ROOM."""
    return -(-tokens // ROOM) * ROOM


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph
    ids: torch.Tensor  # [B, T] static token ids
    out: torch.Tensor  # logits written by every replay


class Step:
    """`step(ids, start, last_only)` = `model(ids, start, cache, last_only)`, graphed where it can be."""

    def __init__(self, model, cache, graphs: bool = True, compile: bool = False):
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device
        static = cache.static
        self.notes: list[str] = []  # one line per capture failure, or why graphs are off
        tp = graphs and static and world_size() > 1
        if tp:
            graphs = False
            self.notes.append(TP_NOTE)
        self.graphed = bool(graphs and static and self.device.type == "cuda")
        self.static = self.graphed or (static and env("static"))
        why = compile_gap(self.device) if compile and self.static else None
        self.compiled = bool(compile and self.static and not why)
        self.forward = compiled(model) if self.compiled else model  # the fixed-shape forward
        if compile and not self.static:
            self.notes.append(COMPILE_NOTE.format(why=self._where(static, tp)))
        elif why:
            self.notes.append(f"--compile not applied: {why}")
        self.start = torch.zeros(1, dtype=torch.int64, device=self.device)  # static start
        self.graphs: dict[tuple, _Graph | None] = {}  # None: capture failed, run eager
        self.pool = None  # one memory pool shared by this step's graphs
        self.fresh()

    def fresh(self) -> "Step":
        """Zero the per-run figures (a kept Step starts another run with its graphs)."""
        self.replays = 0
        self.eager = 0  # steps run on the dynamic eager forward after a failed capture
        self.captures = 0  # graphs captured in this run
        self.capture_s = 0.0  # warm-ups and captures, inside the decode time a user sees
        return self

    def _where(self, static: bool, tp: bool) -> str:
        """Where --compile does not apply (one note per run: the levels' notes are merged)."""
        if self.device.type != "cuda":
            return f"on {self.device.type}"
        if not static:
            return "over a cache with dynamic shapes (offloaded)"
        return "under tensor parallelism" if tp else "with --no-graphs"

    def figures(self) -> dict:
        """For Stats.extra: whether steps replayed as graphs, how many were captured and
        in how long (γ2 auto captures one per verification length it tries), failures."""
        return combined([self])


    def shareable(self, T: int, last_only: bool) -> bool:
        """Whether a ragged forward (runtime/batch/rows.py) computes this step's forward of T
        tokens as it would alone: the same ops eager (a graph replays the ops it captured;
        the cache's fixed-shape attention gets a device start there too), so not a compiled
        step (inductor fuses otherwise) nor a shape whose capture failed (it runs the
        dynamic forward alone)."""
        return not self.compiled and (not self.graphed or self.graphs.get(self.key(T, last_only), True) is not None)

    @staticmethod
    def key(T: int, last_only: bool) -> tuple:
        """A step's graph: one per (T, last_only), its ids [1, T]."""
        return (1, T), last_only

    def __call__(self, ids: torch.Tensor, start: int, last_only: bool = False) -> torch.Tensor:
        b = member.current()  # a sequence of a batch: the forward waits for its round
        return self.alone(ids, start, last_only) if b is None else b.ask(self, ids, start, last_only)

    def alone(self, ids: torch.Tensor, start: int, last_only: bool = False) -> torch.Tensor:
        """This step's forward by itself (a batch's round runs it so where it cannot share)."""
        if not self.static:
            return self.model(ids, start, self.cache, last_only)
        self.cache.check_end(start + ids.shape[1])  # on the host: the graph cannot check
        self.start.fill_(start)
        key = self.key(ids.shape[1], last_only)
        if self.graphed and key not in self.graphs:
            self.graphs[key] = self._capture(ids, last_only)
            self.captures += self.graphs[key] is not None
        g = self.graphs.get(key)
        if g is None and key in self.graphs:  # the capture failed: whatever broke it may
            self.eager += 1  # break the fixed-shape forward too, so the cache's dynamic one
            return self.model(ids, start, self.cache, last_only)
        if g is None:  # not graphed (TRIFORCE_OFFLOAD_STATIC=1): the fixed-shape forward, eager
            return self.forward(ids, self.start, self.cache, last_only)
        g.ids.copy_(ids, non_blocking=True)
        g.graph.replay()
        self.replays += 1
        self.cache.on_replay()  # state the replay updated behind Python's back
        return g.out.clone()  # the next replay overwrites g.out

    def _capture(self, ids, last_only) -> _Graph | None:
        static_ids = ids.clone()
        run = lambda: self.forward(static_ids, self.start, self.cache, last_only)  # noqa: E731
        t0 = time.perf_counter()
        try:
            return self._capture_on(self.device, static_ids, run)
        except Exception as e:  # noqa: BLE001 - any capture failure: eager for this shape
            self.notes.append(f"CUDA graph capture failed for {ids.shape[1]} tokens "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                              "running that shape eager (int start, dynamic shapes)")
            return None
        finally:
            self.capture_s += time.perf_counter() - t0

    def _capture_on(self, device, static_ids, run) -> _Graph:
        graph, out, self.pool = capture(device, run, self.pool, self.compiled)
        return _Graph(graph, static_ids, out)


def capture(device, run, pool=None, compiled: bool = False, mode: str = "global"):
    """(graph, run()'s output as captured, the memory pool): `run()` warmed up on a side
    stream (kernels compile, workspaces allocate; it writes the same KV at the same
    positions as the replays will), then captured into a graph in `pool` (shared with the
    caller's other graphs; None: a new one). `mode`: CUDA's capture error mode
    ("thread_local": other threads' CUDA calls do not break it)."""
    with torch.cuda.device(device):  # capture streams belong to the model's device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(side):
                settle(run, compiled)
        finally:  # a warm-up that raised still has kernels queued: the eager fallback waits
            torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()  # a finalizer run by a collection inside the capture (a finished
        try:  # sequence's copier synchronizing its stream) would break the capture
            with no_recompile(compiled), torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                out = run()
        finally:
            if collecting:
                gc.enable()
        return graph, out, graph.pool()


def compile_gap(device) -> str | None:
    """Why torch.compile cannot build the fixed-shape step on `device`, or None: inductor
    generates Triton kernels on CUDA (C++ on the CPU, where the tests run it)."""
    if torch.device(device).type != "cuda":
        return None
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"inductor needs triton on CUDA ({e})"
    return None


def compile_status(device) -> str:
    """What `--compile` does on `device`, for `info`."""
    if torch.device(device).type != "cuda":
        return "not applied (no CUDA device): steps there are not fixed-shape"
    gap = compile_gap(device)
    if gap:
        return f"unavailable: {gap}"
    import triton
    return (f"--compile: torch.compile (inductor, Triton {triton.__version__}) under the captured "
            "step; off by default until measured on a GPU")


def compiled(model):
    """`model` under torch.compile for the fixed-shape step: inductor's default mode (the
    caller captures the graph), dynamo's automatic dynamic shapes."""
    import torch._dynamo
    cfg = torch._dynamo.config
    if torch.torch_version.TorchVersion(torch.__version__) >= (2, 7):  # renamed in 2.7
        cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    else:
        cfg.cache_size_limit = max(cfg.cache_size_limit, RECOMPILE_LIMIT)
    return torch.compile(model)


def compiles() -> int:
    """Graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def settle(run, compiled: bool, tries: int = 3):
    """The warm-up before a capture: `run()` once, and while compiled, again until dynamo
    compiles nothing new (a recompile inside a capture fails it)."""
    run()
    for _ in range(tries if compiled else 0):
        before = compiles()
        run()
        if compiles() == before:
            return


def no_recompile(compiled: bool):
    """Around a capture of a compiled forward: a recompile raises (the capture then fails
    and that shape runs eager, said on the stats line) instead of compiling mid-capture."""
    if not compiled:
        return contextlib.nullcontext()
    import torch._dynamo
    return torch._dynamo.config.patch(error_on_recompile=True)


def combined(steps) -> dict:
    """The figures of several levels' steps as one (the stats line shows them)."""
    d = {"graphs": any(s.replays for s in steps)}
    if any(s.compiled for s in steps):
        d["compiled"] = True
    captures = sum(s.captures for s in steps)  # in this run: a kept Step replays earlier ones
    if captures:
        d.update(graph_captures=captures, capture_s=round(sum(s.capture_s for s in steps), 3))
    notes = list(dict.fromkeys([*(n for s in steps for n in s.notes), *fallback_notes()]))
    if notes:
        d["notes"] = notes
    return d


def kept(model) -> "Kept":
    """The static caches and Steps `model` keeps across runs (made on first use)."""
    k = model.__dict__.get("_kept_steps")
    if k is None:
        k = model.__dict__["_kept_steps"] = Kept()
    return k


class Direct:
    """`model(ids, start, cache, last_only)` as a one-off step (a prefill chunk): run at
    once, or in its batch's round when the thread's sequence belongs to one."""

    static = False  # the dynamic-shape forward (an int start), whatever the cache
    prefill = True  # a batch's per-round prefill budget counts its tokens

    def __init__(self, model, cache):
        self.model, self.cache = model, cache

    def shareable(self, T: int, last_only: bool) -> bool:
        return True  # the ragged forward's dynamic path (an int start) is its own

    def alone(self, ids: torch.Tensor, start: int, last_only: bool = False) -> torch.Tensor:
        return self.model(ids, start, self.cache, last_only)


class Call:
    """A piece of model work that runs by itself in its batch's round (an offloaded cache's
    layer-major prefill): `alone()` calls it."""

    static = True  # never shares a forward
    prefill = True  # a layer-major prefill: the round's whole prefill budget

    def __init__(self, fn):
        self.fn = fn

    def shareable(self, T: int, last_only: bool) -> bool:
        return False

    def alone(self, *_):
        return self.fn()


def run_alone(fn):
    """`fn()`; in a batch, by itself inside a round (the others wait, not beside it)."""
    b = member.current()
    return fn() if b is None else b.ask(Call(fn), None, 0, False)


def prefill_tokens(model, cache, chunk: int) -> int:
    """Tokens of a prompt's next prefill forward: `chunk`, or fewer in a batch while other
    sequences decode (`runner.Batcher.chunk_tokens`)."""
    b = member.current()
    return chunk if b is None else b.chunk_tokens(model, cache, chunk)


def run_model(model, cache, ids: torch.Tensor, start: int, last_only: bool = False) -> torch.Tensor:
    """`model(ids, start, cache, last_only)`; in a batch, inside its round (runtime/batch)."""
    b = member.current()
    return model(ids, start, cache, last_only) if b is None else b.ask(Direct(model, cache), ids, start, last_only)


def graphable(device) -> bool:
    """Whether Steps over static caches on `device` run the fixed-shape forward (CUDA, or
    TRIFORCE_OFFLOAD_STATIC=1): only then are caches and Steps kept across runs."""
    return torch.device(device).type == "cuda" or bool(env("static"))


def keeps(device) -> bool:
    """Whether a run on `device` takes its static caches from the model's `Kept`: where
    steps are fixed-shape, and not in a batch (its sequences' caches are their own)."""
    return graphable(device) and member.current() is None


class Kept:
    """One model's static caches and the Steps captured over them, kept across runs so a
    second run with the same shapes captures nothing (module docstring). It holds at most
    one full cache (with its Recorder) and one retrieval cache; Steps are kept only over
    those, keyed by (the cache a Step runs over, graphs, compile)."""

    def __init__(self):
        self.full = None  # FullCache: the last static full cache handed out
        self.recorder = None  # the Recorder over `full` (the verifier's queries)
        self.retrieval = None  # RetrievalCache: the last one handed out
        self.steps: dict[tuple, Step] = {}

    def holds(self, cache) -> bool:
        return any(cache is c for c in (self.full, self.recorder, self.retrieval) if c is not None)

    def step(self, model, cache, graphs: bool = True, compile: bool = False) -> Step:
        """The kept Step over `cache` (per-run figures zeroed), or a new one; kept when the
        cache is. A static full cache (or Recorder over one) not kept yet, such as one a
        prefix store handed back, becomes the kept one: its graphs serve the next runs."""
        if member.current() is not None:  # a sequence of a batch: its caches are its own
            return Step(model, cache, graphs, compile)
        if not self.holds(cache):
            base = cache.inner if isinstance(cache, Recorder) else cache
            if not (isinstance(base, FullCache) and base.static and graphable(base.k[0].device)):
                return Step(model, cache, graphs, compile)
            self.adopt(base, cache if cache is not base else None)
        key = (id(cache), graphs, compile)
        if key not in self.steps:
            self.steps[key] = Step(model, cache, graphs, compile)
        return self.steps[key].fresh()

    def full_cache(self, capacity: int, depth: int | None = None):
        """The kept full cache for a run needing `capacity` (a multiple of ROOM) tokens and
        window rings of `depth` when it has exactly those and no run holds it; else None,
        and a kept one of another shape is dropped (its memory goes before a new cache is
        allocated)."""
        w = self.full
        if w is not None and w.capacity == capacity and depth_of(w) in (None, depth) and not w.leased:
            return w
        self.forget(w)
        return None

    def adopt(self, cache, recorder=None):
        """Keep `cache` as the full cache (and `recorder` as its Recorder, if given)."""
        if cache is not self.full:
            self.keep_full(cache)
        if recorder is not None and recorder is not self.recorder:
            self.steps = {k: s for k, s in self.steps.items() if k[0] != id(self.recorder)}
            self.recorder = recorder

    def keep_full(self, cache):
        """`cache`, a new static full cache, is the one kept from now on."""
        self.forget(self.full)
        self.full = cache
        return cache

    def recorder_for(self, cache, make):
        """The kept Recorder over the kept full cache (its query buffers are what the
        verifier's graphs write), else `make(cache)`."""
        if cache is not self.full:
            return make(cache)
        if self.recorder is None:
            self.recorder = make(cache)
        return self.recorder

    def retrieval_cache(self, slots: int, depth: int | None = None):
        """The kept retrieval cache if it has `slots` slots and rings of `depth`, else None
        (a kept one of another size is dropped)."""
        r = self.retrieval
        if r is not None and r.slots == slots and depth_of(r) in (None, depth):
            return r
        self.forget(r)
        return None

    def keep_retrieval(self, cache):
        self.forget(self.retrieval)
        self.retrieval = cache
        return cache

    def forget(self, cache):
        """Drop `cache` (and its Recorder) and every Step over them."""
        if cache is None:
            return
        gone = [cache]
        if cache is self.full:
            gone.append(self.recorder)
            self.full = self.recorder = None
        if cache is self.retrieval:
            self.retrieval = None
        ids = {id(c) for c in gone if c is not None}
        self.steps = {k: s for k, s in self.steps.items() if k[0] not in ids}

    def nbytes(self) -> int:
        """Device bytes of the kept caches."""
        return sum(c.nbytes() for c in (self.full, self.retrieval) if c is not None)
