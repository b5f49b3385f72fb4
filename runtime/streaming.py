"""StreamingLLM cache for drafters: `sink` first tokens + the `window` most recent ones.

Keys carry their absolute RoPE positions, so dropping old tokens leaves the relative
distances of the rest intact. Layout in the preallocated buffer: slots [0, hs) hold
positions [0, hs) (the sink, hs = min(sink, r0)), slots from hs hold the contiguous run
of positions r0 .. followed by pending tokens. Evicting shifts the run left once per
commit; rolling back only shortens the run (evicted tokens stay evicted, which costs
draft quality, never correctness).
"""
from __future__ import annotations

import torch

from ..kernels.attention import attention
from .cache import KVCache
from .errors import TriforceError


class StreamingCache(KVCache):
    def __init__(self, cfg, sink: int = 16, window: int = 240, pending: int = 64,
                 batch: int = 1, dtype=torch.float32, device="cpu"):
        super().__init__(cfg, batch)
        self.sink, self.window, self.pending = sink, window, pending
        self.cap = sink + window + pending  # slots; `pending` bounds tokens per uncommitted run
        shape = (batch, cfg.n_kv_heads, self.cap, cfg.head_dim)  # [B, Hkv, cap, D]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.r0 = 0  # first position of the contiguous run

    @property
    def hs(self) -> int:
        """Slots holding sink tokens ahead of the run."""
        return min(self.sink, self.r0)

    def _slot(self, pos: int) -> int:
        return self.hs + pos - self.r0

    def attend(self, layer, q, k, v, start):
        s, T = self._slot(start), q.shape[2]
        if start < self.r0 or s + T > self.cap:
            raise TriforceError(f"streaming cache: {T} tokens at position {start} do not fit "
                                f"(run starts at {self.r0}, {self.cap} slots); commit more often")
        K, V = self.k[layer], self.v[layer]
        K[:, :, s: s + T] = k
        V[:, :, s: s + T] = v
        # sink slots pretend to sit just before r0: they stay visible to every query
        return attention(q, K[:, :, : s + T], V[:, :, : s + T], start, self.r0 - self.hs)

    def commit(self, n: int):
        self.r0 = min(self.r0, n)
        self.length = n
        if n - max(self.r0, self.sink) > self.window:
            self._evict(n - self.window)

    def _evict(self, r0: int):
        src, n = self._slot(r0), self.length - r0
        for t in self.k + self.v:
            t[:, :, self.sink: self.sink + n] = t[:, :, src: src + n].clone()
        self.r0 = r0

    @torch.inference_mode()
    def load_from(self, full, length: int):
        """Take sink + last `window` tokens of a full cache's first `length` tokens."""
        r0 = max(length - self.window, self.sink) if length > self.sink + self.window else 0
        hs = min(self.sink, r0)
        for layer in range(self.n_layers):
            K, V = full.keys(layer, length)
            for dst, src in ((self.k[layer], K), (self.v[layer], V)):
                dst[:, :, :hs] = src[:, :, :hs]
                dst[:, :, hs: hs + length - r0] = src[:, :, r0:length]
        self.r0, self.length = r0, length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
