"""Host KV store: the full KV of the offloaded layers, in (pinned) host memory.

One store per tensor-parallel rank, holding that rank's KV heads. Layout is token-major,
[S, B, Hkv, D] per layer, so a chunk of tokens is one contiguous block: one DMA per chunk
on a GPU, one memcpy on the CPU. `view()` gives the usual [B, Hkv, S, D] view.

Memory is checked before anything is allocated (`check_memory`), so an impossible context
is refused with the numbers instead of an allocator trace half-way through.
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from .errors import OffloadError

GB = 2 ** 30


@dataclass
class StoreSpec:
    layers: list[int]  # model layer indices this store holds (the offloaded ones)
    n_kv_heads: int  # KV heads of this rank
    head_dim: int  # per-head width
    capacity: int  # tokens per layer (the maximum context)
    batch: int = 1  # sequences
    dtype: torch.dtype = torch.float32  # KV dtype
    token_major: bool = True  # [S, B, Hkv, D] (chunk = one block, for streaming) or [B, Hkv, S, D]

    def bytes_per_token(self) -> int:
        """K and V bytes of one token in one layer."""
        return 2 * self.batch * self.n_kv_heads * self.head_dim * _elem(self.dtype)

    def nbytes(self) -> int:
        return len(self.layers) * self.capacity * self.bytes_per_token()


def _elem(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def host_available() -> int:
    return psutil.virtual_memory().available


def device_available(device) -> int | None:
    """Free bytes on a CUDA device, or None for the CPU (where host RAM is the limit)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def check_memory(host_bytes: int, device_bytes: int, device, host_hint: str, device_hint: str,
                 reserve: float = 0.9):
    """Refuse a placement that cannot fit, naming GB needed vs available and the flag to lower.

    On the CPU the device is host memory, so both needs add up against host RAM.
    """
    dev_free = device_available(device)
    if dev_free is None:
        host_bytes, device_bytes = host_bytes + device_bytes, 0
    avail = host_available() * reserve
    if host_bytes > avail:
        raise OffloadError(f"the KV cache needs {host_bytes / GB:.1f} GB of host memory but "
                           f"{avail / GB:.1f} GB is available; {host_hint}")
    if dev_free is not None and device_bytes > dev_free * reserve:
        raise OffloadError(f"on-device KV and staging need {device_bytes / GB:.1f} GB but "
                           f"{dev_free * reserve / GB:.1f} GB is free on {device}; {device_hint}")


class HostKVStore:
    """Per offloaded layer K and V, [S, B, Hkv, D], in pinned memory when CUDA is present."""

    def __init__(self, spec: StoreSpec, pin: bool | None = None):
        self.spec = spec
        self.pinned = torch.cuda.is_available() if pin is None else pin
        shape = (spec.capacity, spec.batch, spec.n_kv_heads, spec.head_dim)  # [S, B, Hkv, D]
        if not spec.token_major:
            shape = (spec.batch, spec.n_kv_heads, spec.capacity, spec.head_dim)  # [B, Hkv, S, D]
        self.k, self.v = {}, {}
        for layer in spec.layers:
            self.k[layer] = torch.zeros(shape, dtype=spec.dtype, pin_memory=self.pinned)
            self.v[layer] = torch.zeros(shape, dtype=spec.dtype, pin_memory=self.pinned)

    @property
    def capacity(self) -> int:
        return self.spec.capacity

    def view(self, layer: int, end: int):
        """K, V of positions [0, end) as [B, Hkv, S, D] views (no copy)."""
        if not self.spec.token_major:
            return self.k[layer][:, :, :end], self.v[layer][:, :, :end]
        k, v = self.k[layer][:end], self.v[layer][:end]
        return k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Synchronous write of k, v [B, Hkv, T, D] at positions start.. (host-side callers)."""
        K, V = self.view(layer, start + k.shape[2])
        K[:, :, start:].copy_(k)
        V[:, :, start:].copy_(v)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))
