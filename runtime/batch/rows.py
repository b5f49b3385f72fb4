"""The ragged forward: rows of many sequences through one model forward.

A `Row` set is what one sequence asks of a model this round: T token ids at positions
start.., attending over its own cache, and whether it needs the logits of its last row
only. `forward(model, sets)` runs them all as one forward of N = sum(T) rows: the
embedding, every linear and norm over all rows at once (the weights are read once per
forward, not once per sequence), RoPE per row at its own position, and attention per
sequence through `Ragged`, which hands each sequence's slice of q, k, v to that
sequence's cache exactly as its solo forward would (`cache.attend(layer, q, k, v, start)`
with the same shapes). What a row computes depends on its own values alone where the
linears are row-exact (`exact(model)`), so each sequence gets the logits its solo forward
gives, bit for bit.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from ...kernels import native
from ...kernels.linear import EXACT_ROWS, exact_rows
from ...kernels.qlinear import rows_exact
from ..cache.kv import ROWWISE_MAX, FullCache, exact_bands
from ..cache.retrieval import Recorder
from ..protocols import DirectKV
from ..hostread import to_device


@dataclass
class Rows:
    """One sequence's part of a ragged forward."""
    ids: torch.Tensor  # [1, T] token ids
    start: int  # position of the first
    cache: object  # the sequence's cache (a protocols.Cache)
    last_only: bool = False  # logits of the last row only
    fixed: bool = False  # its solo step is the fixed-shape forward (start a device tensor: graphs.Step.static)
    attention_s: float = 0.0  # seconds its attention took in the forward (Ragged fills it in)

    @property
    def n(self) -> int:
        return self.ids.shape[1]


class Ragged:
    """The caches of a ragged forward's sequences behind the one cache interface the model
    calls: each layer's q [1, Hq, N, D], k, v [1, Hkv, N, D] are cut into the sequences'
    row slices, each attended by its own cache at its own start, and put back in order.
    Lengths stay the sequences' own (each commits or rolls back its cache itself)."""

    def __init__(self, sets: list[Rows], device=None, starts: list | None = None):
        self.sets = sets
        self._threads = torch.get_num_threads()  # a call's thread-seconds over this: its wall share
        # a fixed-shape step's cache (CUDA's, graphed, or any under TRIFORCE_OFFLOAD_STATIC=1)
        # takes its start as a device tensor, as alone: the same attention, the same bits
        # (`starts`: the steps' own start buffers, a captured ragged forward's inputs)
        self._starts = (list(starts) if starts is not None else
                        [to_device([s.start], device or "cpu") if s.fixed else s.start for s in sets])
        self._fulls = [None if isinstance(st, torch.Tensor) else direct_cache(s.cache)
                       for s, st in zip(sets, self._starts)]
        self._plans: dict[tuple, list] = {}  # layer kind -> `_groups`
        self._one_call: dict[tuple, object] = {}  # layer kind -> `rope_attend`'s plan, or None
        # the sets whose cache records the full level's queries (retrieval scoring)
        self._recorders = [(i, s.cache) for i, s in enumerate(sets) if isinstance(s.cache, Recorder)]
        self.bounds = []  # (first row, rows) per set
        a = 0
        for s in sets:
            self.bounds.append((a, s.n))
            a += s.n

    def begin_forward(self, start, n_tokens: int):
        for s, st in zip(self.sets, self._starts):
            s.cache.begin_forward(st, s.n)

    def one_call_layers(self, start, n_tokens: int):
        """None: a ragged forward's layers take `one_call_rows`."""
        return None

    def one_call_rows(self, heads: int, D: int):
        """(plan, K/V pointers [L, 2, nseq], KV dtype, softcap) where every layer of this
        forward would take `rope_attend`'s one call with one plan (each sequence's cache
        holding every layer whole at one slot: `KVCache.one_call_layers`), so that a forward
        can take all its layers in one native call (model/program.py; `one_call_done` after
        it); else None."""
        def slot(f, start, n):
            one = f.one_call_layers(start, n)
            return None if one is None else one[1]
        fulls = self._fulls
        plan = self._seq_steps(slot, 0, heads, D)
        if plan is None:
            return None
        K = fulls[0].own(0)[0]
        if K.device.type != "cpu" or K.dtype not in (torch.float32, torch.bfloat16):  # what the kernel takes
            return None
        H, ptrs = K.shape[1], []
        for layer in range(fulls[0].n_layers):
            kv = [f.own(layer) for f in fulls]
            if not plan.takes(kv, K.dtype, H, D):
                return None
            ptrs += [k.data_ptr() for k, _ in kv] + [v.data_ptr() for _, v in kv]
        return plan, torch.tensor(ptrs, dtype=torch.int64), K.dtype, fulls[0].softcap

    def one_call_done(self, plan, qf: torch.Tensor, secs: torch.Tensor):
        """After a forward's layers in one call (`one_call_rows`): each sequence's attention
        time (secs [L, nseq] thread-seconds), and the recorders' queries from qf [L, H,
        plan.rows, D], as `rope_attend` keeps them layer by layer."""
        for s, t in zip(self.sets, secs.sum(0).tolist()):
            s.attention_s += t / self._threads
        for i, rec in self._recorders:
            r0, n = plan.folded[i]
            rec.record_layers(qf[:, :, r0: r0 + n], self.sets[i].n)

    def rope_attend(self, layer, qkv, cos, sin, start, heads: int):
        """Every sequence's RoPE, K/V write and attention in one native call
        (`native.rope_attend_seqs`) where each would take its own step in one call alone
        (`DirectKV.one_call_slot`: the native kernel over its own buffers, no shared prefix,
        a step of at most ONE_CALL_TOKENS tokens): (o [1, N, heads * D], the folded rotated
        queries); else None, and the model rotates and calls `attend`. The same bits as the
        separate steps, which are each sequence's solo bits."""
        fulls = self._fulls
        if qkv.dtype != torch.float32 or not native.rope_tables(cos, sin, qkv.shape[1], qkv.shape[-1]):
            return None  # tables sliced per layer kind (a local RoPE), other dtypes: the separate steps
        kind = tuple(f is not None and f.plain(layer) for f in fulls)
        plan = self._one_call.get(kind, False)
        if plan is False:
            plan = self._one_call[kind] = self._one_call_plan(layer, qkv, heads)
        if plan is None:
            return None
        secs = torch.zeros(len(fulls), dtype=torch.float64)
        o, qf = native.rope_attend_seqs(qkv, cos, sin, plan, [f.own(layer) for f in fulls], heads,
                                        fulls[0].softcap, secs)
        for s, t in zip(self.sets, secs.tolist()):
            s.attention_s += t / self._threads
        for i, rec in self._recorders:  # the retrieval level scores with the full level's queries
            r0, n = plan.folded[i]
            rec.record(layer, qf[:, r0: r0 + n], self.sets[i].n)
        return o, qf

    def _one_call_plan(self, layer, qkv, heads: int):
        """`rope_attend`'s plan (native.SeqSteps) for this layer's kind, or None where some
        sequence's step would not take one call alone (its buffers as the plan's call takes
        them: `SeqSteps.takes`), or the call would not fit its scratch."""
        plan = self._seq_steps(lambda f, start, n: f.one_call_slot(layer, start, n), layer, heads, qkv.shape[-1])
        if plan is None:
            return None
        kv = [f.own(layer) for f in self._fulls]
        K = kv[0][0]
        if not all(native.supports(qkv, k) for k, _ in kv):
            return None
        return plan if plan.takes(kv, K.dtype, K.shape[1], qkv.shape[-1]) else None

    def _seq_steps(self, slot, layer: int, heads: int, D: int):
        """native.SeqSteps of every sequence's step where each would take one call alone
        (`slot(cache, start, n)` its slot, None where not: a window or ring layer, a shared
        prefix, a step over ONE_CALL_TOKENS tokens), the caches agree on soft-capping and
        their `layer` has head size D and a head count `heads` folds onto; else None. The
        caller checks the buffers (`SeqSteps.takes`)."""
        rows, fulls = [], self._fulls
        for s, (a, n), f in zip(self.sets, self.bounds, fulls):
            if f is None or f.prefix is not None or n > native.ONE_CALL_TOKENS:
                return None
            at = slot(f, s.start, n)
            if at is None:
                return None
            K = f.own(layer)[0]
            rows.append((a, n, s.start, f.first_position, at, K.stride(1), K.stride(2)))
        if not rows:
            return None
        K = fulls[0].own(layer)[0]
        H = K.shape[1]
        if heads % H or K.shape[-1] != D or len({f.softcap for f in fulls}) != 1:
            return None
        plan = native.SeqSteps(rows, heads // H)
        return plan if plan.fits(H, D) else None

    def attend(self, layer, q, k, v, start):
        groups = self._groups(layer, q)
        out = None
        if groups:  # their rows' outputs land here (`_direct`): each cache returns its slice
            out = torch.empty(q.shape, dtype=torch.float32)
            for _, members, _ in groups:
                for i, full in members:
                    a, n = self.bounds[i]
                    full.settle(layer, out[:, :, a: a + n])
        outs = []
        for s, (a, n), st in zip(self.sets, self.bounds, self._starts):
            t0 = time.perf_counter()
            outs.append(s.cache.attend(layer, q[:, :, a: a + n], k[:, :, a: a + n], v[:, :, a: a + n], st))
            s.attention_s += time.perf_counter() - t0
        for plan, members, base in groups:
            self._direct(layer, q, plan, members, base, out)
        if len(outs) == 1:
            return outs[0]
        if groups and sum(len(m) for _, m, _ in groups) == len(self.sets):
            return out  # every sequence's rows: no copy
        return torch.cat(outs, 2)  # [1, Hq, N, D]

    def _groups(self, layer, q) -> list:
        """This layer's groups of two or more sequences whose attention is the native kernel
        over their own keys (`FullCache.direct`, `RetrievalCache.direct`: the full and the
        retrieval level's caches alike), by the prefix they share (or none) and the KV's
        dtype: (native.Seqs, [(set index, cache)], the shared prefix's cache or None).
        The same for every layer of a kind (window layers, whole ones): planned once per
        forward and kind."""
        fulls = self._fulls
        kind = tuple(f is not None and f.plain(layer) for f in fulls)
        got = self._plans.get(kind)
        if got is not None:
            return got
        by: dict[tuple, list] = {}
        for i, (s, (a, n), f) in enumerate(zip(self.sets, self.bounds, fulls)):
            if (f is not None and n <= ROWWISE_MAX and q.dtype == torch.float32
                    and f.direct(layer, q[:, :, a: a + n], s.start)):
                by.setdefault((id(f.prefix), f.k[layer].dtype), []).append((i, f))
        got = []
        for members in by.values():
            if len(members) < 2:
                continue  # alone: its cache attends itself
            first = members[0][1]
            H = first.n_kv_heads
            G, npre = q.shape[1] // H, (first.first_position // native.BLOCK if first.prefix is not None else 0)
            for part in self._within_scratch(members, H * G * (q.shape[-1] + 2) * 4, npre):
                rows = []
                for i, f in part:
                    K = f.own(layer)[0]
                    a, n = self.bounds[i]
                    s = self.sets[i]
                    p0 = f.first_position
                    rows.append((a, n, s.start, p0, s.start + n - p0, K.stride(1), K.stride(2)))
                got.append((native.Seqs(rows, G, q.shape[2]), part, first.prefix))
        self._plans[kind] = got
        return got

    def _within_scratch(self, members: list, row_block_bytes: int, npre: int) -> list[list]:
        """`members` in consecutive runs whose calls' per-block results (each sequence's
        rows x its blocks, and the shared prefix's blocks) stay under native.SCRATCH_BYTES,
        as `native.attend` slices its rows (one sequence a run at least)."""
        runs, run, used = [], [], 0
        for i, f in members:
            s = self.sets[i]
            blocks = npre + -(-(s.start + s.n - f.first_position) // native.BLOCK)
            need = row_block_bytes * s.n * blocks
            if run and used + need > native.SCRATCH_BYTES:
                runs.append(run)
                run, used = [], 0
            run.append((i, f))
            used += need
        return runs + [run]

    def _direct(self, layer, q, plan, members, base, out):
        """One group's rows in one native call (`native.attend_seqs`) into `out`, after every
        cache wrote this forward's K, V; a shared prefix's keys read once for all of them
        (`native.attend_parts`, its time split evenly among them). Each sequence's share of
        the call is its own work's (the kernel times it)."""
        first = members[0][1]
        qf = plan.fold(q)
        pre = None
        if base is not None:
            t0 = time.perf_counter()
            pre = native.attend_parts(qf, *base.keys(layer, first.first_position), softcap=first.softcap)
            each = (time.perf_counter() - t0) / len(members)
            for i, _ in members:
                self.sets[i].attention_s += each
        secs = torch.zeros(len(members), dtype=torch.float64)
        native.attend_seqs(plan, qf, [f.own(layer) for _, f in members], out,
                           first.k[layer].dtype == torch.bfloat16, pre, softcap=first.softcap, secs=secs)
        for (i, _), t in zip(members, secs.tolist()):
            self.sets[i].attention_s += t / self._threads

    def end_forward(self):
        for s in self.sets:
            s.cache.end_forward()


def direct_cache(cache):
    """The cache behind a ragged set's cache (a Recorder's inner one) that can attend in one
    native call with others' (`protocols.DirectKV`: a FullCache, a RetrievalCache), else None."""
    c = cache.inner if isinstance(cache, Recorder) else cache
    kind = _DIRECT.get(type(c))
    if kind is None:  # a protocol check probes every member (~20 us): once per cache class
        kind = _DIRECT[type(c)] = isinstance(c, DirectKV)
    return c if kind else None


_DIRECT: dict[type, bool] = {}  # cache class -> a DirectKV


def exact(model, rows: int = 1) -> bool:
    """Whether a forward of `rows` rows of `model` computes each row independently of the
    other rows (every projection on a row-exact kernel: `kernels.qlinear.rows_exact`), so
    that it may share a forward with other sequences' rows without changing any output.
    Past EXACT_ROWS rows (a prefill chunk) a float32 dense projection runs oneDNN alone,
    so such a forward shares only where every projection is quantized (on the CPU: on CUDA
    every projection of more rows runs cuBLAS alone)."""
    v = model.__dict__.get("_rows_exact")
    if v is None:
        dense = any(isinstance(m, torch.nn.Linear) for m in model.modules())
        cpu = next(model.parameters()).device.type == "cpu"
        v = model.__dict__["_rows_exact"] = (rows_exact(model), cpu and not dense)
    return v[0] and (rows <= EXACT_ROWS or v[1])


def chunk_invariant(model, cache) -> bool:
    """Whether a prefill of `model` into `cache` gives the same KV and logits whatever its
    chunk sizes: an in-memory cache on a CPU (`FullCache`), every projection row-exact at
    any row count (`rows.exact`), attention on the native kernel (each row over fixed key
    blocks: float32 or bfloat16 KV, head size a multiple of 16 up to 256), window layers'
    rows too (`cache.kv._cpu_bands`: a prompt's chunks may end anywhere)."""
    cfg = model.config
    if type(cache) is not FullCache:
        return False
    held = [t for t in cache.k if t is not None] + (list(cache.ring.k.values())
                                                     if cache.ring is not None else [])
    return (bool(held) and held[0].dtype in (torch.float32, torch.bfloat16) and exact(model, 1 << 20)
            and exact_bands(cfg, held[0].device))


def kept(sets: list[Rows]) -> tuple[list[int], list[int]]:
    """(the rows whose logits a ragged forward returns, each set's end among them)."""
    keep, ends = [], []
    a = 0
    for s in sets:
        keep.extend(range(a + s.n - 1, a + s.n) if s.last_only else range(a, a + s.n))
        ends.append(len(keep))
        a += s.n
    return keep, ends


@torch.inference_mode()
def forward(model, sets: list[Rows], ids: torch.Tensor | None = None, starts: list | None = None,
            keep: torch.Tensor | None = None) -> list[torch.Tensor]:
    """One forward of every set's rows; per set its logits [1, T, V] ([1, 1, V] with
    last_only), as `model(ids, start, cache, last_only)` gives them alone. A captured one
    (`Graphs`) passes its static inputs: `ids` [1, N] (the sets' ids are its slices), the
    steps' start buffers `starts` (positions computed on the device from them), `keep`."""
    ids = torch.cat([s.ids for s in sets], 1) if ids is None else ids  # [1, N]
    dev = ids.device
    if starts is None:
        pos = torch.cat([torch.arange(s.start, s.start + s.n, device=dev) for s in sets])  # [N]
    else:
        pos = torch.cat([st + torch.arange(s.n, device=dev, dtype=st.dtype) for st, s in zip(starts, sets)])
    rows, ends = kept(sets)
    if keep is None:
        keep = to_device(rows, dev)
    with exact_rows([s.n for s in sets]):
        logits = model.forward_rows(ids, pos, Ragged(sets, dev, starts), keep)  # [1, R, V]
    return list(torch.tensor_split(logits, ends[:-1], dim=1))


class Graphs:
    """CUDA graphs of ragged forwards (a batch's rounds on a GPU): one per class of round,
    the same graphed steps (hence caches) with the same widths in joining order, captured
    and replayed after, so a round launches one graph instead of every op of every layer
    and every sequence's attention. Inputs: a static ids buffer and each step's own start
    buffer (`graphs.Step.start`, which its fixed-shape cache reads its slots from, as in its
    solo graph). A class is captured the `AGAIN`-th time it runs (speculating sequences
    at different levels make many classes that may never come back: those run eager, not
    captured once each); a class whose steps are gone (a member finished) is dropped; at
    most `LIMIT` are kept (least recently used first out). A failed capture runs that
    class eagerly from then on. Where captures do not pay (after `TRIAL` captures, fewer
    than `PAYS` replays per capture: classes that keep changing), no new class is
    captured; the graphs kept still replay. Classes are keyed by step ids and checked
    against weak references to the steps (a step's id may be another's later)."""

    LIMIT = 32
    AGAIN = 2
    TRIAL, PAYS = 8, 2

    def __init__(self):
        self._g: dict[tuple, tuple] = {}  # class -> (weakrefs to its steps, graph, ids, keep, outs)
        self._seen: dict[tuple, tuple] = {}  # class -> (weakrefs, rounds it ran eagerly so far)
        self.pool = None
        self.captures = self.replays = 0
        self.failed: dict[tuple, tuple] = {}  # class -> (weakrefs, why its capture failed)

    @staticmethod
    def _same(refs, asks) -> bool:
        return all(r() is a.step for r, a in zip(refs, asks))

    def run(self, model, asks) -> list[torch.Tensor] | None:
        """The asks' logits (per ask, as `forward` gives them) from this class's graph,
        captured now if new; None where it cannot be graphed (the caller runs it eager)."""
        key = tuple((id(a.step), a.ids.shape[1], a.last_only) for a in asks)
        bad = self.failed.get(key)
        if bad is not None and self._same(bad[0], asks):
            return None
        got = self._g.pop(key, None)
        if got is not None and not self._same(got[0], asks):
            got = None  # a step of that id is another object now
        for k in [k for k, v in self._g.items() if any(r() is None for r in v[0])]:
            del self._g[k]  # its steps are gone: nothing may replay over their freed caches
        if got is None:
            if self.captures >= self.TRIAL and self.replays < self.PAYS * self.captures:
                return None  # captures do not pay here: eager
            seen = self._seen.get(key)
            n = 1 + (seen[1] if seen is not None and self._same(seen[0], asks) else 0)
            if n < self.AGAIN:
                if len(self._seen) >= 64 * self.LIMIT:  # bounded: start over
                    self._seen = {}
                self._seen[key] = (_refs(asks), n)
                return None
            self._seen.pop(key, None)
        fresh = torch.cat([a.ids for a in asks], 1)
        for a in asks:  # the graph's inputs (a capture's warm-up reads them too)
            a.step.start.fill_(a.start)
        if got is None:
            got = self._capture(model, asks, key, fresh)
            if got is None:
                return None
        self._g[key] = got  # most recent last
        while len(self._g) > self.LIMIT:
            del self._g[next(iter(self._g))]
        _, graph, ids, _, outs = got
        ids.copy_(fresh, non_blocking=True)
        graph.replay()
        self.replays += 1
        for a in asks:
            a.step.cache.on_replay()  # state the replay updated behind Python's back
        return [o.clone() for o in outs]  # the next replay overwrites them

    def _capture(self, model, asks, key, fresh: torch.Tensor):
        """The class's graph over a static copy of `fresh` (the round's ids) and the steps'
        start buffers (filled by the caller), or None (the failure noted)."""
        from ..graphs import capture
        dev = fresh.device
        ids = fresh.clone()
        sets, a0 = [], 0
        for a in asks:
            n = a.ids.shape[1]
            sets.append(Rows(ids[:, a0: a0 + n], a.start, a.step.cache, a.last_only, True))
            a0 += n
        starts = [a.step.start for a in asks]
        keep = to_device(kept(sets)[0], dev)  # before the capture: a copy inside would replay
        try:  # other members' threads may touch the device meanwhile (a finished one's clean-up)
            graph, outs, self.pool = capture(dev, lambda: forward(model, sets, ids, starts, keep), self.pool,
                                             mode="thread_local")
        except Exception as e:  # noqa: BLE001 - any capture failure: that class runs eager
            self.failed[key] = (_refs(asks), f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            return None
        self.captures += 1
        return _refs(asks), graph, ids, keep, outs


def _refs(asks) -> list:
    """Weak references to the asks' steps (what a class's entries are checked against)."""
    return [weakref.ref(a.step) for a in asks]
