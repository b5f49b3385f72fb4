"""Host KV store: the full KV of the offloaded layers, in (pinned) host memory.

One store per tensor-parallel rank, holding that rank's KV heads. Layout is token-major,
[S, B, Hkv, D] per layer, so a chunk of tokens is one contiguous block: one DMA per chunk
on a GPU, one memcpy on the CPU. `view()` gives the usual [B, Hkv, S, D] view.

Memory is checked before anything is allocated (`check_memory`), so an impossible context
is refused with the numbers instead of an allocator trace half-way through.
"""
from __future__ import annotations

import os
import weakref
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


def ranks_on_host() -> int:
    """Processes of this job that allocate host memory on this machine at the same time
    (tensor-parallel ranks: torchrun's LOCAL_WORLD_SIZE, our launcher's WORLD_SIZE)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1))


def check_memory(host_bytes: int, device_bytes: int, device, host_hint: str, device_hint: str,
                 reserve: float = 0.9):
    """Refuse a placement that cannot fit, naming GB needed vs available and the flag to lower.

    On the CPU the device is host memory, so both needs add up against host RAM. Host
    memory is shared by the job's ranks on this machine, which allocate at once: each may
    take its share.
    """
    dev_free = device_available(device)
    if dev_free is None:
        host_bytes, device_bytes = host_bytes + device_bytes, 0
    ranks = ranks_on_host()
    avail = host_available() * reserve / ranks
    if host_bytes > avail:
        share = f" (this rank's share of {ranks})" if ranks > 1 else ""
        raise OffloadError(f"the KV cache needs {host_bytes / GB:.1f} GB of host memory but "
                           f"{avail / GB:.1f} GB is available{share}; {host_hint}")
    if dev_free is not None and device_bytes > dev_free * reserve:
        raise OffloadError(f"on-device KV and staging need {device_bytes / GB:.1f} GB but "
                           f"{dev_free * reserve / GB:.1f} GB is free on {device}; {device_hint}")


CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context (flag of cudaHostRegister)


def _unregister(cudart, ptrs: list[int]):
    for p in ptrs:
        cudart.cudaHostUnregister(p)


def pin_in_place(tensors: list[torch.Tensor], owner) -> bool:
    """Page-lock `tensors` where they are (cudaHostRegister), exactly their size, until
    `owner` is collected. torch's `pin_memory=True` goes through its caching host
    allocator, which rounds every block up to a power of two: a 1.03 GiB layer of a 128K
    cache would lock 2 GiB, up to twice what `check_memory` counted. False (nothing left
    registered) if the driver refuses; the caller then falls back to `pin_memory`."""
    cudart, done = torch.cuda.cudart(), []
    for t in tensors:
        if t.numel() == 0:
            continue
        if int(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(),
                                       CUDA_HOST_REGISTER_PORTABLE)) != 0:
            # e.g. 712, already registered: small tensors sharing a page. Clear the error,
            # or the next kernel launch check would raise it.
            getattr(cudart, "cudaGetLastError", lambda: 0)()
            _unregister(cudart, done)
            return False
        done.append(t.data_ptr())
    # unregister before the memory is freed: the finalizer holds the tensors until it ran
    weakref.finalize(owner, lambda: (_unregister(cudart, done), tensors.clear()))
    return True


class HostKVStore:
    """Per offloaded layer K and V, [S, B, Hkv, D], in pinned memory when CUDA is present."""

    def __init__(self, spec: StoreSpec, pin: bool | None = None):
        self.spec = spec
        self.pinned = torch.cuda.is_available() if pin is None else pin
        shape = (spec.capacity, spec.batch, spec.n_kv_heads, spec.head_dim)  # [S, B, Hkv, D]
        if not spec.token_major:
            shape = (spec.batch, spec.n_kv_heads, spec.capacity, spec.head_dim)  # [B, Hkv, S, D]
        zeros = lambda pin: {layer: torch.zeros(shape, dtype=spec.dtype, pin_memory=pin)  # noqa: E731
                             for layer in spec.layers}
        self.k, self.v = zeros(False), zeros(False)
        if self.pinned and not pin_in_place([*self.k.values(), *self.v.values()], self):
            self.k = self.v = None  # freed first: never both copies at once
            self.k, self.v = zeros(True), zeros(True)  # torch's pinned allocator (rounds up)

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
