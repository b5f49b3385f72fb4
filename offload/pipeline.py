"""Pipeline scheduler: which chunk of which layer streams into which staging slot, when.

A *pass* streams the committed prefix [0, end) of every offloaded layer, layer after
layer, chunk after chunk, through a ring of `depth` staging slots of one transfer chunk
each (double-buffered by default: `costmodel.staging_bytes`, the size `plan` counts), not
whole layers: the pass runs on across layer boundaries, so the next layer's first chunks
stream while this layer's last ones are computed. A slot is refilled with the next chunk
of the pass as soon as the attention that read it has been issued, so the copier never
waits on compute and compute waits only for chunks that have not landed yet.

A pass can start early (`start`): on a cache's `prefetch()`, which the engine and
`generate` call right after a commit, so the first offloaded layers of the next
verification stream while the draft levels run. A pass whose prefix no longer matches
the forward (rollback, different start) is simply abandoned: its copies finish into
slots nobody reads, and copies run in order, so the next pass's copies land after them.
A pass's copies that started before the forward that consumes it are on the `prefetch`
thread of that forward's `--profile` trace. The ring bounds them: at most `depth`
transfer chunks stream ahead of the forward.

Per streamed chunk the host only pops a slot and submits one fetch, then waits for and
hands out one chunk: the slots' fetch and read views are made once, the store's views
of whole chunks are kept (`_pair`), and the timeline (spans, marks) is there only under
`--profile`. Without it a CPU wait is timed by two clock reads (`waited`, for the
per-forward overlap summary).

`overlap=False` gives the serialized reference: each group of slots is copied in full
and waited for before its compute starts, and nothing streams ahead.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .copier import ChunkCopier
from .costmodel import STAGE_DEPTH
from .errors import OffloadError
from .store import HostKVStore
from .timeline import Span, Timeline


@dataclass
class Pass:
    end: int  # stream positions [0, end) of each layer
    jobs: list  # (layer, c0, c1) in stream order
    first: dict  # layer -> index of its first job in `jobs`
    next_job: int = 0  # next job to submit
    next_layer: int = 0  # index into the layer order of the next layer to consume
    inflight: dict = field(default_factory=dict)  # job index -> (slot, Signal)

    def layer_at(self, i: int) -> int | None:
        """The i-th layer this pass streams (None past the end)."""
        order = list(self.first)
        return order[i] if i < len(order) else None


class TransferPipeline:
    def __init__(self, store: HostKVStore, copier: ChunkCopier, transfer_chunk: int, device,
                 depth: int = STAGE_DEPTH, overlap: bool = True, timeline: Timeline | None = None):
        if transfer_chunk < 1:
            raise OffloadError(f"transfer chunk of {transfer_chunk} tokens: must be >= 1")
        if depth < 1:
            raise OffloadError(f"staging depth {depth}: must be >= 1 slot")
        self.store, self.copier, self.transfer_chunk = store, copier, transfer_chunk
        self.layers = list(store.spec.layers)
        self.overlap, self.timeline = overlap, timeline
        s = store.spec
        self.n_slots = depth
        if not s.token_major:
            raise OffloadError("the pipeline streams a token-major store ([S, 2, B, Hkv, D])")
        shape = (self.n_slots, transfer_chunk, 2, s.batch, s.n_kv_heads, s.head_dim)  # [N, C, 2, B, Hkv, D]
        self.kv = torch.empty(shape, dtype=s.dtype, device=device)
        self.free = list(range(self.n_slots))
        self.current = None  # the Pass streaming now (None: none)
        self.dst = [(self.kv[i],) for i in range(depth)]  # fetch targets [C, 2, B, Hkv, D]: one copy
        self.read = [(self.kv[i, :, 0].permute(1, 2, 0, 3), self.kv[i, :, 1].permute(1, 2, 0, 3))
                     for i in range(depth)]  # what attention reads, K and V [B, Hkv, C, D]
        self.views = {}  # (layer, c0) -> the store's block of a whole chunk (made once)
        self.waited = 0.0  # seconds blocked in CPU waits (the cheap overlap summary)

    def nbytes(self) -> int:
        """Device bytes of the ring: `costmodel.staging_bytes(transfer_chunk, bytes per token, depth)`."""
        return self.kv.numel() * self.kv.element_size()

    def start(self, end: int, first_layer: int | None = None):
        """Begin streaming the prefix [0, end) of the offloaded layers from `first_layer`
        (default: the first offloaded layer) on; a no-op if that pass is already running."""
        first_layer = self.layers[0] if first_layer is None else first_layer
        p = self.current
        if p is not None and p.end == end and p.next_layer == 0 and p.layer_at(0) == first_layer:
            return
        self.reset()
        jobs, first, step = [], {}, self.transfer_chunk
        for layer in self.layers[self.layers.index(first_layer):]:
            first[layer] = len(jobs)
            jobs += [(layer, c, min(c + step, end)) for c in range(0, end, step)]
        self.current = Pass(end, jobs, first)
        if self.overlap:
            self._fill(after=self.copier.marker())  # slots the last forward read are free only after it (CUDA)

    def reset(self):
        """Drop the current pass; its in-flight copies land in slots nobody will read."""
        if self.current is not None:
            self.free += [slot for slot, _ in self.current.inflight.values()]
        self.current = None

    def _fill(self, limit: int | None = None, after=None):
        p = self.current
        limit = len(p.jobs) if limit is None else limit
        while self.free and p.next_job < limit:
            layer, c0, c1 = p.jobs[p.next_job]
            slot = self.free.pop()
            dst, src = self._pair(slot, layer, c0, c1)
            p.inflight[p.next_job] = (slot, self.copier.fetch(dst, src, (layer, c0), after))
            p.next_job += 1

    def _pair(self, slot: int, layer: int, c0: int, c1: int):
        """(staging block; store block) of one fetch, K and V together: views made once for
        whole chunks."""
        if c1 - c0 < self.transfer_chunk:  # the last, partial chunk of a prefix
            return (self.kv[slot, : c1 - c0],), self.store.chunk(layer, c0, c1)
        src = self.views.get((layer, c0))
        if src is None:
            src = self.views[layer, c0] = self.store.chunk(layer, c0, c1)
        return self.dst[slot], src

    def stream(self, layer: int, end: int):
        """Yield (c0, k [B,Hkv,n,D], v [B,Hkv,n,D]) for the chunks of `layer`'s prefix
        [0, end), each only after its copy is signalled. Consume before advancing."""
        p = self.current
        if p is None or p.end != end or p.layer_at(p.next_layer) != layer:
            self.start(end, layer)
            p = self.current
        lo = p.first[layer]
        nxt = p.layer_at(p.next_layer + 1)
        hi = len(p.jobs) if nxt is None else p.first[nxt]
        p.next_layer += 1
        for j in range(lo, hi):
            if j not in p.inflight:  # serialized mode, or the ring ran dry: issue a group
                # after the compute queued so far: its slots are the ones refilled (CUDA)
                self._fill(limit=hi if not self.overlap else None, after=self.copier.marker())
            yield self._take(p, j)
            slot = p.inflight.pop(j)[0]
            self.free.append(slot)
            if self.overlap:
                self._fill(after=self.copier.marker())
        if p.layer_at(p.next_layer) is None:
            self.current = None

    def _take(self, p: Pass, j: int):
        layer, c0, c1 = p.jobs[j]
        slot, sig = p.inflight[j]
        if not self.overlap:
            self._wait_group(p, j)
        if self.timeline is not None:
            with Span(self.timeline, "wait", f"wait L{layer} @{c0}", until=sig.end):
                sig.wait()  # CUDA: a stream-side wait, the span ends at the copy's end event
            self.timeline.mark("read", (layer, c0))
        elif sig.cuda:
            sig.wait()
        else:
            t = time.perf_counter()
            sig.wait()
            self.waited += time.perf_counter() - t
        k, v = self.read[slot]  # [B, Hkv, C, D]
        if c1 - c0 < self.transfer_chunk:
            k, v = k[:, :, : c1 - c0], v[:, :, : c1 - c0]
        return c0, k, v

    def _wait_group(self, p: Pass, j: int):
        """Serialized reference: wait for every in-flight copy before computing any."""
        sigs = [sig for _, sig in p.inflight.values()]  # in submission (stream) order
        with Span(self.timeline, "wait", "wait group", until=sigs[-1].end if sigs else None):
            for sig in sigs:
                sig.wait()

