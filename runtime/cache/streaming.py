"""StreamingLLM cache for drafters: `sink` first tokens + the `window` most recent ones.

Keys carry their absolute RoPE positions, so dropping old tokens leaves the relative
distances of the rest intact. Layout in the preallocated buffer: slots [0, sink_slots)
hold positions [0, sink_slots) (the sink; sink_slots = min(sink, run_start)), the slots
after them hold the contiguous run of positions run_start .. followed by pending tokens.
Evicting shifts the run left once per commit; rolling back only shortens the run (evicted
tokens stay evicted, which costs draft quality, never correctness). A sliding-window
layer's band counts the sink slots as the positions just before the run, like the rest;
built with a `ring_depth`, such a layer keeps just a ring (`cache.WindowRing`: exact).
"""
from __future__ import annotations

import torch

from .kv import KVCache, WindowRing, window_attention
from ..errors import TriforceError


class StreamingCache(KVCache):
    def __init__(self, cfg, sink: int = 16, window: int = 240, pending: int = 64,
                 batch: int = 1, dtype=torch.float32, device="cpu", ring_depth: int | None = None):
        super().__init__(cfg, batch, WindowRing.of(cfg, ring_depth, batch, dtype, device))
        self.sink, self.window, self.pending = sink, window, pending
        self.cap = sink + window + pending  # slots; `pending` bounds tokens per uncommitted run
        shape = (batch, cfg.n_kv_heads, self.cap, cfg.head_dim)  # [B, Hkv, cap, D]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) if i in self.full_layers else None
                  for i in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) if i in self.full_layers else None
                  for i in range(cfg.n_layers)]
        self.run_start = 0  # first position of the contiguous run

    @property
    def sink_slots(self) -> int:
        """Slots holding sink tokens ahead of the run."""
        return min(self.sink, self.run_start)

    def _slot(self, pos: int) -> int:
        return self.sink_slots + pos - self.run_start

    def attend(self, layer, q, k, v, start):
        if self.ring is not None and layer in self.ring:
            return self.ring.attend(layer, q, k, v, start)
        s, T = self._slot(start), q.shape[2]
        if start < self.run_start or s + T > self.cap:
            raise TriforceError(f"streaming cache: {T} tokens at position {start} do not fit "
                                f"(run starts at {self.run_start}, {self.cap} slots); commit more often")
        K, V = self.k[layer], self.v[layer]
        K[:, :, s: s + T] = k
        V[:, :, s: s + T] = v
        # sink slots pretend to sit just before r0: they stay visible to every query
        return window_attention(q, K[:, :, : s + T], V[:, :, : s + T], start, self.run_start - self.sink_slots,
                                self.windows[layer], self.softcap)

    def commit(self, n: int):
        super().commit(n)
        if n - max(self.run_start, self.sink) > self.window:
            self._evict(n - self.window)

    def rollback(self, n: int):
        super().rollback(n)
        self.run_start = min(self.run_start, n)

    def _evict(self, run_start: int):
        src, n = self._slot(run_start), self.length - run_start
        for t in self.k + self.v:
            if t is None:
                continue
            t[:, :, self.sink: self.sink + n] = t[:, :, src: src + n].clone()
        self.run_start = run_start

    def skip_to(self, pos: int):
        """Forget the run: the sink stays, the next token fed sits at position `pos` (>= the
        sink and the length). Not with window rings (a window layer would miss its band)."""
        if pos < max(self.sink, self.length) or self.ring is not None:
            raise TriforceError(f"streaming cache: cannot skip to position {pos}")
        self.run_start = self.length = pos

    @torch.inference_mode()
    def load_from(self, full, length: int):
        """Take sink + last `window` tokens of a full cache's first `length` tokens."""
        run_start = max(length - self.window, self.sink) if length > self.sink + self.window else 0
        sink = min(self.sink, run_start)
        for layer in range(self.n_layers):
            if self.ring is not None and layer in self.ring:
                lo = self.ring.first(length)
                self.ring.put(layer, lo, *full.recent(layer, lo, length))
                self.ring.hold_from(lo)  # older slots may be stale (a drafter skipped a while)
                continue
            K, V = full.keys(layer, length)
            for dst, src in ((self.k[layer], K), (self.v[layer], V)):
                dst[:, :, :sink] = src[:, :, :sink]
                dst[:, :, sink: sink + length - run_start] = src[:, :, run_start:length]
        self.run_start, self.length = run_start, length

    def nbytes(self) -> int:
        ring = self.ring.nbytes() if self.ring is not None else 0
        return ring + sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)
