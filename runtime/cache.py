"""KV caches. A cache owns its tensors and its length; only the engine commits.

Protocol every cache follows (the model calls `attend`, the engine calls `commit`):

- `attend(layer, q, k, v, start)`: q [B, Hq, T, D] and k, v [B, Hkv, T, D] are the rotated
  projections of T new tokens at absolute positions start .. start+T-1. The cache stores
  k, v as *pending* entries and returns the attention output [B, Hq, T, D], causal by
  position. Several forwards may add pending tokens one after another (drafting).
- `commit(n)`: the sequence is now n tokens long. Pending tokens below n become part of
  the cache; everything written at positions >= n leaves no trace. `n` below the current
  length rolls back (where the cache still holds those tokens).
- `length`: committed tokens.
- `prefetch()`: optional hint that a forward over this cache comes next.

Caches with `static = True` also take `start` as an int64 device tensor [1]: they then
write and attend with shapes that do not depend on its value and never read it on the
host, so the forward can be captured and replayed as a CUDA graph (runtime/graphs.py).
"""
from __future__ import annotations

import os

import torch

from ..kernels.attention import attention, static_attention
from .config import ModelConfig
from .errors import TriforceError


class KVCache:
    """Base class: shapes and the commit bookkeeping shared by every cache."""

    static = False  # takes a device-tensor `start` (fixed shapes, CUDA graphs)

    def __init__(self, cfg: ModelConfig, batch: int = 1):
        self.n_layers, self.n_kv_heads, self.head_dim = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        self.batch = batch
        self.length = 0

    def attend(self, layer, q, k, v, start):  # pragma: no cover - interface
        raise NotImplementedError

    def commit(self, n: int):
        self.length = n

    def end_of(self, q, start: int) -> int:
        """Position after the new tokens; refuses to write past a preallocated capacity."""
        return self.check_end(start + q.shape[2])

    def check_end(self, end: int) -> int:
        """`end` if the cache has room for tokens up to it, else a TriforceError."""
        if end > getattr(self, "capacity", end):
            raise TriforceError(f"context of {end} tokens exceeds the cache capacity "
                                f"{self.capacity}; raise --max-context")
        return end

    def prefetch(self):
        """Hint from the engine: a verification forward over this cache comes next (an
        offloaded cache starts streaming its first layers; others ignore it)."""

    def nbytes(self) -> int:
        return 0


def write_and_attend(K, V, q, k, v, slot: torch.Tensor):
    """The fixed-shape step of a preallocated cache: write k, v [B, Hkv, T, D] into the
    buffers K, V [B, Hkv, cap, D] at slots slot + [0, T) (`slot` an int64 device tensor
    [1]) and attend causally over the whole buffers up to slot + T."""
    T = q.shape[2]
    pos = slot if T == 1 else slot + torch.arange(T, device=q.device, dtype=slot.dtype)
    K.index_copy_(2, pos, k)
    V.index_copy_(2, pos, v)
    return static_attention(q, K, V, slot + T)


class FullCache(KVCache):
    """Every token's K and V, preallocated to `capacity` tokens (no growth by copying)."""

    def __init__(self, cfg: ModelConfig, capacity: int, batch: int = 1,
                 dtype=torch.float32, device="cpu", static: bool | None = None):
        super().__init__(cfg, batch)
        self.capacity = capacity
        # the static path (default on CUDA; TRIFORCE_OFFLOAD_STATIC=1 anywhere) reads whole
        # buffers through the length-masked reference: slots must then hold finite values
        if static is None:
            static = torch.device(device).type == "cuda" or os.environ.get("TRIFORCE_OFFLOAD_STATIC") == "1"
        self.static = static
        alloc = torch.zeros if self.static else torch.empty
        shape = (batch, cfg.n_kv_heads, capacity, cfg.head_dim)  # [B, Hkv, S, D]
        self.k = [alloc(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [alloc(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]

    def attend(self, layer, q, k, v, start):
        if isinstance(start, torch.Tensor):
            return self._attend_static(layer, q, k, v, start)
        end = self.end_of(q, start)
        K, V = self.k[layer], self.v[layer]
        K[:, :, start:end] = k
        V[:, :, start:end] = v
        return attention(q, K[:, :, :end], V[:, :, :end], start)

    def _attend_static(self, layer, q, k, v, start: torch.Tensor):
        """The same with `start` on the device (the caller checked the capacity on the host)."""
        return write_and_attend(self.k[layer], self.v[layer], q, k, v, start)

    def keys(self, layer: int, end: int | None = None):
        """Committed (or up to `end`) K and V of a layer: [B, Hkv, S, D] views."""
        end = self.length if end is None else end
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
