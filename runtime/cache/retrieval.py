"""The middle level's cache: a fixed budget of retrieved KV chunks plus appended tokens.

Built from a full cache (`protocols.FullKV`, in memory or offloaded: it reads each layer
through `device_keys`, verified tokens through `recent`). Each layer and KV head keeps its
own top `budget // chunk` chunks, scored by the last query against the chunk's mean key
(kernels/retrieval.py). The incomplete last chunk (the most recent < chunk tokens) is
always kept. Keys carry their absolute RoPE positions, so
selected chunks need no re-rotation; every selected token precedes `base` (the length at
build time) and every appended token follows it, which is all causal masking needs.

Verified tokens are absorbed from the full cache (`absorb`): the retrieval cache then
holds the target's exact KV for them rather than its own approximation. An offloaded full
cache hands them over from the verification forward's device tensors (`recent`), so the
update never waits for a write-back to the host.

A sliding-window layer (Gemma, Mistral) keeps the last tokens instead of scored chunks: the
same number of slots, consecutive positions, so its band of the last `window` keys is
exact whenever the budget covers the window. Built with a `ring_depth`, window layers keep just
a ring (`cache.WindowRing`, exact at any budget): built and absorbed from the full cache's
latest positions (`recent`).
"""
from __future__ import annotations

import torch

from ...kernels import native
from ...kernels.retrieval import chunk_means, chunk_scores, gather_chunks, top_chunks
from .kv import KVCache, PerForward, Settles, WindowRing, static_slots, window_attention, write_and_attend
from ..errors import TriforceError


class Recorder:
    """A full cache (`protocols.RecordingKV`) over another (`inner`, offloaded or not)
    that also keeps the last query row of each layer (for retrieval scoring). It forwards
    `protocols.FullKV`, member by member, to `inner`; what an offloaded cache offers
    beyond it (timings, the trace) is read from `inner`."""

    def __init__(self, cache):
        self.inner = cache
        # layer -> the last forward's last query: [B, Hq, D], or a one-token step's q
        # [B, Hq, 1, D] as given (sliced when read: a decode step adds no op per layer)
        self._q = {}
        self._static_q = {}  # layer -> the buffer graphed forwards write that query to

    @property
    def q(self) -> dict:
        """layer -> [B, Hq, D] query of the last token of the last forward."""
        return {layer: t if t.dim() == 3 else t[:, :, -1] for layer, t in self._q.items()}

    @q.setter
    def q(self, qs: dict):
        """Queries to select with as if a forward had just recorded them (layer -> [B, Hq, D]):
        a benchmark or test that decodes again from one prefill's cache."""
        self._q = dict(qs)

    def attend(self, layer, q, k, v, start):
        if isinstance(start, torch.Tensor):  # a graphed step: a buffer its replays update
            buf = self._static_q.get(layer)
            if buf is None:
                buf = self._static_q[layer] = torch.empty_like(q[:, :, -1])
            buf.copy_(q[:, :, -1])
            self._q[layer] = buf
        else:  # a one-token step's q whole (nothing else of its activations kept alive)
            self._q[layer] = q if q.shape[2] == 1 else q[:, :, -1]
        return self.inner.attend(layer, q, k, v, start)

    def rope_attend(self, layer, qkv, cos, sin, start, heads: int):
        """The inner cache's `rope_attend` (None where it does not apply), recording the
        last token's rotated queries as `attend` does."""
        r = self.inner.rope_attend(layer, qkv, cos, sin, start, heads)
        if r is not None:
            self.record(layer, r[1], qkv.shape[1])
        return r

    def one_call_layers(self, start, n_tokens: int):
        """The inner cache's, recording here as `rope_attend` does."""
        one = self.inner.one_call_layers(start, n_tokens)
        return None if one is None or one[2] is not None else (one[0], one[1], self)  # one recorder

    def record(self, layer: int, qf: torch.Tensor, T: int):
        """Keep the last of T tokens' rotated queries from qf [Hkv, G*T, D] (folded: row
        g*T + t of KV head h for query head h*G + g, as the one native call gives them)."""
        H, R, D = qf.shape
        self._q[layer] = qf.view(H, R // T, T, D)[:, :, -1].reshape(1, H * (R // T), D)

    def one_call_rows(self, heads: int, D: int):
        return None

    def record_layers(self, qf: torch.Tensor, T: int):
        """`record` of every layer at once from qf [L, Hkv, G*T, D] (model/program.py)."""
        L, H, R, D = qf.shape
        last = qf.unflatten(2, (R // T, T))[:, :, :, -1].reshape(L, 1, H * (R // T), D)
        self._q = dict(enumerate(last.unbind(0)))

    def on_replay(self):
        """A graph replay wrote the queries (no Python ran): they are the latest again,
        even if an eager forward pointed `q` elsewhere since the capture."""
        self._q.update(self._static_q)
        self.inner.on_replay()

    # the rest of protocols.FullKV, as the wrapped cache has it
    static = property(lambda self: self.inner.static)
    layer_major = property(lambda self: self.inner.layer_major)
    capacity = property(lambda self: self.inner.capacity)
    length = property(lambda self: self.inner.length)

    def begin_forward(self, start, n_tokens: int):
        self.inner.begin_forward(start, n_tokens)

    def end_forward(self):
        self.inner.end_forward()

    def commit(self, n: int):
        self.inner.commit(n)

    def rollback(self, n: int):
        self.inner.rollback(n)

    def check_end(self, end: int) -> int:
        return self.inner.check_end(end)

    def prefetch(self):
        self.inner.prefetch()

    def hold(self, layer: int | None, end: int = 0):
        self.inner.hold(layer, end)

    def keys(self, layer: int, end: int | None = None):
        return self.inner.keys(layer, end)

    def device_keys(self, layer: int, end: int | None = None):
        return self.inner.device_keys(layer, end)

    def recent(self, layer: int, lo: int, hi: int):
        return self.inner.recent(layer, lo, hi)

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def stats(self) -> dict:
        return self.inner.stats()

    def close(self):
        self.inner.close()


class RetrievalCache(Settles, KVCache):
    """`budget` tokens of selected chunks per layer and KV head + room for `extra` new tokens.

    Static (CUDA graphs): with `start` a device tensor, the slot of a position is
    `start + offset`, `offset` (= n_retrieved - base) a device tensor that `build` updates in
    place, so a graph captured before a rebuild stays right after it."""

    static = True

    def __init__(self, cfg, budget: int, retrieval_chunk: int, extra: int, batch: int = 1,
                 dtype=torch.float32, device="cpu", slots: int = 0, ring_depth: int | None = None):
        # `ring_depth`: window layers in a WindowRing (None: selected like the others)
        super().__init__(cfg, batch, WindowRing.of(cfg, ring_depth, batch, dtype, device))
        self.retrieval_chunk = retrieval_chunk  # tokens per scored and selected chunk
        self.n_chunks = budget // retrieval_chunk
        # selected + tail + appended, or `slots` if more (a size class kept across runs)
        self.slots = max(self.slots_for(budget, retrieval_chunk, extra), slots)
        shape = (batch, cfg.n_kv_heads, self.slots, cfg.head_dim)  # [B, Hkv, slots, D]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) if i in self.full_layers else None
                  for i in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) if i in self.full_layers else None
                  for i in range(cfg.n_layers)]
        self.base = 0  # absolute position of the first appended token
        self.n_retrieved = 0  # slots holding retrieved tokens (all before `base`)
        self.holds_all = False  # the context fitted the budget: nothing was dropped
        self.offset = torch.zeros(1, dtype=torch.int64, device=device)  # n_retrieved - base, on the device
        # a fixed-shape forward's slots (start + offset ..) and length, once for every layer
        self._slots = PerForward(lambda start, T: static_slots(start + self.offset, T))
        self._done: dict = {}  # layer -> the next attend's output, computed with other sequences' (`settle`)

    @staticmethod
    def slots_for(budget: int, retrieval_chunk: int, extra: int) -> int:
        """Slots a cache of `budget` tokens with room for `extra` appended ones needs."""
        return (budget // retrieval_chunk + 1) * retrieval_chunk + extra

    @staticmethod
    def bytes_for(cfg, slots: int, dtype, batch: int = 1, ring_depth: int | None = None) -> int:
        """Device bytes of a retrieval cache with `slots` slots (0: none), as `nbytes()` will
        count them: every layer's K and V, or with a `ring_depth` the global layers' slots and
        the window layers' rings (window + depth each)."""
        if not slots:
            return 0
        return cfg.kv_bytes(slots, torch.empty(0, dtype=dtype).element_size(), ring_depth, batch)

    def reset(self, budget: int, retrieval_chunk: int):
        """Empty, in place, for another run with this budget (graphs.Kept): the buffers and
        the offset keep their addresses, so graphs captured over them replay."""
        self.retrieval_chunk, self.n_chunks = retrieval_chunk, budget // retrieval_chunk
        for t in self.k + self.v:
            if t is not None:
                t.zero_()
        if self.ring is not None:
            self.ring.reset()
        self.offset.zero_()
        self.base = self.n_retrieved = self.length = 0
        self.holds_all = False

    # What a ragged forward needs to attend this cache with other sequences' in one native
    # call (batch.rows.Ragged; the rest is `Settles`'): slots are consecutive positions
    # from base - n_retrieved (the selected chunks first, all before base), so `own` is a
    # full cache's buffer at that offset, and the kernel gives each row the bits of
    # `attend` (the solo path's `window_attention` over the same buffer from the same key).
    prefix = None  # no shared prefix before `own`

    @property
    def first_position(self) -> int:
        """The position slot 0 stands for: the rows' causal order in one call with others."""
        return self.base - self.n_retrieved

    def direct(self, layer: int, q, start) -> bool:
        return (isinstance(start, int) and start >= self.base and self.plain(layer)
                and native.supports(q, self.k[layer]))

    @staticmethod
    def fits(length: int, budget: int, retrieval_chunk: int) -> bool:
        """Whether a context of `length` tokens fits the budget whole (nothing to select)."""
        return length // retrieval_chunk <= budget // retrieval_chunk

    @torch.inference_mode()
    def build(self, full, qs: dict, length: int):
        """Select chunks from full.keys(layer) of the first `length` tokens with queries qs[layer]."""
        c = self.retrieval_chunk
        n_full = length // c
        self.holds_all = self.fits(length, self.n_chunks * c, c)
        for layer in range(self.n_layers):
            if self.ring is not None and layer in self.ring:  # the band a forward at `length` sees
                lo = self.ring.first(length)
                self.ring.put(layer, lo, *full.recent(layer, lo, length))
                continue
            K, V = full.device_keys(layer, length)  # [B, Hkv, S, D]; offloaded: scored on the device
            if self.holds_all:
                k, v = K, V
            elif self.windows[layer] is not None:  # the most recent tokens, as many as selected
                keep = self.n_chunks * c + length - n_full * c
                k, v = K[:, :, length - keep:], V[:, :, length - keep:]
            else:
                k, v = self._select(K, V, qs[layer], n_full * c)
            self.n_retrieved = k.shape[2]
            self.k[layer][:, :, : self.n_retrieved].copy_(k)
            self.v[layer][:, :, : self.n_retrieved].copy_(v)
        self.base = self.length = length
        self.offset.fill_(self.n_retrieved - self.base)

    def _select(self, K, V, q, end):
        c = self.retrieval_chunk
        idx = top_chunks(chunk_scores(q.to(K.device), chunk_means(K, c)), self.n_chunks)
        k = torch.cat([gather_chunks(K, idx, c), K[:, :, end:]], 2)
        v = torch.cat([gather_chunks(V, idx, c), V[:, :, end:]], 2)
        return k, v

    def _slot(self, pos: int) -> int:
        return self.n_retrieved + pos - self.base

    def room(self) -> int:
        """Tokens that can still be appended after the committed length."""
        return self.slots - self._slot(self.length)

    def check_end(self, end: int) -> int:
        if self._slot(end) > self.slots:
            raise TriforceError(f"retrieval cache: position {end - 1} is past its last slot "
                                f"({self.base + self.slots - self.n_retrieved - 1})")
        if self.ring is not None:
            self.ring.reach(end)
        return end

    def attend(self, layer, q, k, v, start):
        if self.ring is not None and layer in self.ring:
            shared = self._slots.get(start, q.shape[2])[2] if isinstance(start, torch.Tensor) else None
            return self.ring.attend(layer, q, k, v, start, shared)
        if isinstance(start, torch.Tensor):  # slots as positions: the same causal order
            return write_and_attend(self.k[layer], self.v[layer], q, k, v, self._slots.get(start, q.shape[2]),
                                    self.windows[layer], self.softcap)
        s, T = self._slot(start), q.shape[2]
        if start < self.base or s + T > self.slots:
            raise TriforceError(f"retrieval cache: positions {start}..{start + T - 1} are outside "
                                f"its range {self.base}..{self.base + self.slots - self.n_retrieved - 1}")
        K, V = self.k[layer], self.v[layer]
        K[:, :, s: s + T] = k
        V[:, :, s: s + T] = v
        done = self.settled(layer)
        if done is not None:
            return done
        # slots as consecutive positions (exact for a sliding layer)
        return window_attention(q, K[:, :, : s + T], V[:, :, : s + T], start, self.first_position,
                                self.windows[layer], self.softcap)

    def rope_attend(self, layer, qkv, cos, sin, start, heads: int):
        """`attend` in one native call, as FullCache.rope_attend; None where it does not
        apply (attend then raises what is wrong)."""
        s = self.one_call_slot(layer, start, qkv.shape[1])
        if s is None:
            return None
        return native.rope_attend(qkv, cos, sin, self.k[layer], self.v[layer], s, start, self.first_position,
                                  heads, self.softcap)

    def one_call_slot(self, layer: int, start, n_tokens: int) -> int | None:
        """As FullCache.one_call_slot: appended tokens' slots follow the selected chunks'."""
        if not isinstance(start, int) or self._done or not self.plain(layer) or start < self.base:
            return None
        s = self._slot(start)
        return s if s + n_tokens <= self.slots else None

    @torch.inference_mode()
    def absorb(self, full, lo: int, hi: int):
        """Copy the full cache's exact KV of positions lo..hi-1 in (the engine commits)."""
        lo = max(lo, self.base)
        if hi > lo:
            s = self._slot(lo)
            for layer in range(self.n_layers):
                k, v = full.recent(layer, lo, hi)  # offloaded: from the device, not the host store
                if self.ring is not None and layer in self.ring:
                    self.ring.put(layer, lo, k, v)
                    continue
                self.k[layer][:, :, s: s + hi - lo].copy_(k)
                self.v[layer][:, :, s: s + hi - lo].copy_(v)

    def rollback(self, n: int):
        if n < self.base:
            raise TriforceError(f"retrieval cache cannot roll back to {n} < its base {self.base}")
        super().rollback(n)

    def nbytes(self) -> int:
        ring = self.ring.nbytes() if self.ring is not None else 0
        return ring + sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

