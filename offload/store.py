"""Host KV store: the full KV of the offloaded layers, in (pinned) host memory.

One store per tensor-parallel rank, holding that rank's KV heads. Layout is token-major
with K and V interleaved, [S, 2, B, Hkv, D] per layer, so a chunk of tokens, K and V both,
is one contiguous block: one DMA per chunk on a GPU, one memcpy on the CPU (`chunk`,
`pack`). `k[layer]`/`v[layer]` are its [S, B, Hkv, D] halves (strided views) and `view()`
gives the usual [B, Hkv, S, D] views.

Memory is checked before anything is allocated (`check_memory`), so an impossible context
is refused with the numbers instead of an allocator trace half-way through.
"""
from __future__ import annotations

import ctypes
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
    token_major: bool = True  # [S, 2, B, Hkv, D] (chunk = one block, for streaming) or K, V [B, Hkv, S, D]

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
    """Free bytes on a CUDA device, or None for the CPU (where host RAM is the limit):
    the driver's free memory and what torch's caching allocator holds but no tensor uses
    (a kept cache dropped before a new one is allocated, runtime/graphs.py: Kept)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return torch.cuda.mem_get_info(device)[0] + cached


def ranks_on_host() -> int:
    """Processes of this job that allocate host memory on this machine at the same time
    (tensor-parallel ranks: torchrun's LOCAL_WORLD_SIZE, our launcher's WORLD_SIZE)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1))


def check_memory(host_bytes: int, device_bytes: int, device, host_hint: str, device_hint: str,
                 device_what: str = "on-device KV and staging", reserve: float = 0.9):
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
        raise OffloadError(f"{device_what} need {device_bytes / GB:.1f} GB but "
                           f"{dev_free * reserve / GB:.1f} GB is free on {device}; {device_hint}")


CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context (flag of cudaHostRegister)
PAGE = 4096  # cudaHostRegister locks whole pages: a range no other allocation shares


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def page_aligned(nbytes: int) -> torch.Tensor:
    """Zeroed uint8 [nbytes rounded up to whole pages], starting on a page boundary: an
    over-allocated buffer sliced to its first aligned byte, so its pages are its own."""
    size = _pages(nbytes)
    raw = torch.zeros(size + PAGE, dtype=torch.uint8)
    off = -raw.data_ptr() % PAGE
    return raw[off: off + size]


def carve(buf: torch.Tensor, shapes: list[tuple], dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors of `shapes` as views into `buf`, each starting on a page boundary."""
    out, off = [], 0
    for shape in shapes:
        n = _elem(dtype) * int(torch.Size(shape).numel())
        out.append(buf[off: off + n].view(dtype).view(shape))
        off += _pages(n)
    return out


TORCH_CUDA_LIBS = ("libtorch_cuda", "libc10_cuda")  # torch's own CUDA code (its launch checks)
MAPS = "/proc/self/maps"


def _mapped(name: str) -> list[str]:
    """Paths of the loaded shared objects `name`.so* (from /proc/self/maps), sorted."""
    try:
        with open(MAPS) as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(name + ".so"))


def _torch_get_last_error():
    """cudaGetLastError of the CUDA runtime torch itself calls, or None. torch.cuda.cudart()
    if it binds one; else looked up through the handle of torch's CUDA library: dlsym on a
    handle searches that library, then the libraries it was linked with, so it finds the
    libcudart torch resolved when it loaded, not another copy some other package mapped
    (the per-thread last error is per copy: clearing the wrong one leaves torch's pending)."""
    rt = torch.cuda.cudart()
    if hasattr(rt, "cudaGetLastError"):
        return rt.cudaGetLastError
    for name in TORCH_CUDA_LIBS:
        for path in _mapped(name):
            try:  # RTLD_NOLOAD: the instance already loaded, or nothing
                return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).cudaGetLastError
            except (OSError, AttributeError):  # not loaded; a cudart linked in statically
                continue
    return None


def clear_last_error() -> bool:
    """Reset the CUDA runtime's last error after a refused call, or torch's next kernel
    launch check (`cudaGetLastError`) raises it. Call torch's runtime's cudaGetLastError;
    without one, let one tiny launch's check consume it (that check is a cudaGetLastError
    of torch's runtime, which resets)."""
    get = _torch_get_last_error()
    if get is not None:
        get()
        return True
    try:
        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        pass  # the pending error, raised once and thereby reset
    return False


def pin_in_place(buf: torch.Tensor, owner) -> bool:
    """Page-lock the page-aligned flat buffer `buf` where it is (one cudaHostRegister),
    until `owner` is collected. torch's `pin_memory=True` goes through its caching host
    allocator, which rounds every block up to a power of two: a 1.03 GiB layer of a 128K
    cache would lock 2 GiB, up to twice what `check_memory` counted. False, with nothing
    registered and no CUDA error left pending, where there is no CUDA or the driver
    refuses; the caller then falls back to `pin_memory`."""
    if not torch.cuda.is_available() or buf.numel() == 0:
        return False
    if buf.data_ptr() % PAGE or buf.numel() % PAGE:
        raise ValueError("pin_in_place takes whole pages (page_aligned)")
    cudart, ptr = torch.cuda.cudart(), buf.data_ptr()
    if int(cudart.cudaHostRegister(ptr, buf.numel(), CUDA_HOST_REGISTER_PORTABLE)) != 0:
        clear_last_error()
        return False
    # unregister before the memory is freed: the finalizer holds the buffer until it ran
    weakref.finalize(owner, lambda b: cudart.cudaHostUnregister(b.data_ptr()), buf)
    return True


class HostKVStore:
    """Per offloaded layer K and V, interleaved [S, 2, B, Hkv, D] (token-major) or apart
    [B, Hkv, S, D], in pinned memory when CUDA is present."""

    def __init__(self, spec: StoreSpec, pin: bool | None = None):
        self.spec = spec
        self.pinned = torch.cuda.is_available() and pin is not False  # nothing to pin for without CUDA
        B, H, S, D = spec.batch, spec.n_kv_heads, spec.capacity, spec.head_dim
        shape = (S, 2, B, H, D) if spec.token_major else (B, H, S, D)
        per_layer = 1 if spec.token_major else 2  # tensors per layer
        n = len(spec.layers) * per_layer
        # one page-aligned buffer for every layer: one registration, pages of its own
        buf = page_aligned(n * _pages(_elem(spec.dtype) * torch.Size(shape).numel()))
        views = carve(buf, [shape] * n, spec.dtype)
        if self.pinned and not pin_in_place(buf, self):
            views = buf = None  # freed first: never both copies at once
            views = [torch.zeros(shape, dtype=spec.dtype, pin_memory=True) for _ in range(n)]  # rounds up
        if spec.token_major:
            self.kv = dict(zip(spec.layers, views))  # [S, 2, B, Hkv, D]
            self.k = {layer: t[:, 0] for layer, t in self.kv.items()}  # [S, B, Hkv, D] views
            self.v = {layer: t[:, 1] for layer, t in self.kv.items()}
        else:
            self.kv = None
            self.k = dict(zip(spec.layers, views[0::2]))
            self.v = dict(zip(spec.layers, views[1::2]))

    def chunk(self, layer: int, c0: int, c1: int) -> tuple[torch.Tensor, ...]:
        """What one copy of positions [c0, c1) of `layer` moves: the contiguous
        [n, 2, B, Hkv, D] block (token-major), else K and V [B, Hkv, n, D]."""
        if self.kv is not None:
            return (self.kv[layer][c0:c1],)
        return self.k[layer][:, :, c0:c1], self.v[layer][:, :, c0:c1]

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Device k, v [B, Hkv, T, D] laid out as `chunk` of T positions: one stack (a
        contiguous [T, 2, B, Hkv, D]) for the token-major store."""
        if self.kv is not None:
            return (torch.stack((k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)), dim=1),)
        return k, v

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
