"""What stands in for CUDA: `torch.cuda`'s functions, events, graphs, cudart, a CUDA
generator, and flash-attn and Triton at their call boundary (`flash_attn_with_kvcache`, a
Triton kernel launch), computing their real results with torch ops on the fake tensors.
"""
from __future__ import annotations

import importlib.machinery
import inspect
import math
import sys
import types
from types import SimpleNamespace

import torch

from .gpu import CUDA, Event, Gpu, Stream
from .tensor import CUDA_ONLY, DryTensor, _leaves, _map, _unwrap

GPU: Gpu = None  # the device of the active dry run
CHECKER = None  # its dispatch mode (replays apply accesses through it)


def _caller() -> str:
    f = sys._getframe(2)
    owner = f.f_locals.get("self")
    return f"{type(owner).__name__}.{f.f_code.co_name}" if owner is not None else f.f_code.co_name


def new_stream(device=None, priority=0, **kw) -> Stream:
    return Stream(GPU, f"{len(GPU.streams)} ({_caller()})")


class _Op:
    """One aten op recorded in a capture: replayed on the recorded tensors."""

    __slots__ = ("func", "args", "kwargs", "fresh", "acc", "name")

    def __init__(self, func, args, kwargs, wrapped, acc):
        self.func, self.args, self.kwargs, self.acc, self.name = func, args, kwargs, acc, str(func)
        ins = {id(t) for t in _leaves((args, kwargs)) if isinstance(t, DryTensor)}
        # outputs the op allocated (an in-place op's output is its input, mutated again by the replay)
        self.fresh = [(i, w) for i, w in enumerate(_leaves(wrapped)) if isinstance(w, DryTensor) and id(w) not in ins]

    def replay(self):
        kw = {k: (torch.device("cpu") if k == "device" else _unwrap(v)) for k, v in self.kwargs.items()}
        out = CUDA_ONLY.get(self.func, self.func)(*_map(_unwrap, self.args), **kw)
        if self.fresh:
            res = list(_leaves(out))
            for i, w in self.fresh:
                w.elem.copy_(res[i])


class CUDAGraph:
    """torch.cuda.CUDAGraph: the capture's aten ops, run again (on the recorded tensors,
    with their accesses on the current stream) at every replay."""

    def __init__(self, keep_graph=False):
        self.ops, self._pool = [], object()

    def capture_begin(self, pool=None, capture_error_mode="global"):
        if GPU.capture is not None:
            raise RuntimeError("a capture is under way already")
        self.ops, GPU.capture = [], self

    def capture_end(self):
        GPU.capture = None

    def record(self, func, args, kwargs, wrapped, acc):
        self.ops.append(_Op(func, args, kwargs, wrapped, acc))

    def replay(self):
        GPU.capture_check("a graph replay")
        with torch.utils._python_dispatch._disable_current_modes(), torch._C.DisableTorchFunction():
            for op in self.ops:
                op.replay()
        for op in self.ops:
            CHECKER.apply(op.acc, GPU.current, f"{op.name} (graph replay)")

    def pool(self):
        return self._pool

    def reset(self):
        self.ops = []


class graph:
    """torch.cuda.graph: synchronises the device, then captures on a side stream."""

    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        self.g, self.pool = cuda_graph, pool
        if GPU.capture_stream is None:
            GPU.capture_stream = Stream(GPU, f"{len(GPU.streams)} (graph capture)")
        self.stream = stream or GPU.capture_stream

    def __enter__(self):
        GPU.synchronize("torch.cuda.graph (it synchronises the device before a capture)")
        self.prev, GPU.current = GPU.current, self.stream
        self.g.capture_begin(self.pool)

    def __exit__(self, *exc):
        self.g.capture_end()
        GPU.current = self.prev


class _StreamContext:
    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        self.prev = GPU.current
        if self.stream is not None:
            GPU.current = self.stream

    def __exit__(self, *exc):
        GPU.current = self.prev


class _DeviceContext:
    def __init__(self, device=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Cudart:
    """torch.cuda.cudart(): host registration of pinned memory, the last error."""

    def cudaHostRegister(self, ptr, nbytes, flags):
        GPU.pin_range(ptr, nbytes)
        return 0

    def cudaHostUnregister(self, ptr):
        GPU.unpin_range(ptr)
        return 0

    def cudaGetLastError(self):
        return 0

    def cudaGetErrorString(self, err):
        return "no error"


class DryGenerator(torch._C.Generator):
    """torch.Generator(device=...): a CPU generator that says which device it is for."""

    def __new__(cls, device="cpu"):
        g = super().__new__(cls, "cpu")
        d = torch.device(device)
        g.dry_device = CUDA if d.type == "cuda" else d
        return g

    device = property(lambda self: self.dry_device)


def _props(device=None):
    return SimpleNamespace(name="dry-run GPU", total_memory=GPU.mem_total, multi_processor_count=132,
                           major=9, minor=0)


def cuda_namespace() -> dict:
    """torch.cuda attributes to replace: name -> fake."""
    cudart = Cudart()
    return dict(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
        set_device=lambda device: None, is_initialized=lambda: True, _lazy_init=lambda: None,
        init=lambda: None, get_device_capability=lambda device=None: (9, 0),
        get_device_properties=_props, get_device_name=lambda device=None: "dry-run GPU",
        is_bf16_supported=lambda including_emulation=True: True,
        mem_get_info=lambda device=None: (GPU.mem_free, GPU.mem_total),
        max_memory_allocated=lambda device=None: GPU.allocated,
        memory_allocated=lambda device=None: GPU.allocated,
        reset_peak_memory_stats=lambda device=None: None, empty_cache=lambda: None,
        synchronize=lambda device=None: GPU.synchronize(),
        Stream=new_stream, Event=Event, current_stream=lambda device=None: GPU.current,
        default_stream=lambda device=None: GPU.default, stream=_StreamContext, device=_DeviceContext,
        graph=graph, CUDAGraph=CUDAGraph, graph_pool_handle=lambda: object(), cudart=lambda: cudart,
        manual_seed=lambda seed: None, manual_seed_all=lambda seed: None, seed=lambda: None,
        seed_all=lambda: None,
    )


# ---- flash-attn, at its call boundary

def _must_be_cuda(what: str, **tensors):
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and not isinstance(t, DryTensor):
            GPU.violate("device", f"{what}: {name} is a CPU tensor")
            raise RuntimeError(f"{what}: {name} must be on CUDA")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn's kvcache kernel: q [B, T, Hq, D] over k_cache, v_cache [B, S, Hkv, D], the
    first cache_seqlens[b] keys valid; causal aligns the queries to the end of those keys.
    Its argument rules are checked; the result is computed with torch ops."""
    what = "flash_attn_with_kvcache"
    GPU.launches[what] += 1
    _must_be_cuda(what, q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens)
    if k is not None or block_table is not None or alibi_slopes is not None:
        raise NotImplementedError(f"{what}: only the arguments the runtime passes are faked")
    if q.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    B, T, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    if D % 8 or D > 256 or Hq % Hkv or k_cache.shape != v_cache.shape or k_cache.shape[0] != B:
        raise RuntimeError(f"{what}: shapes q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise RuntimeError(f"{what}: tensors must have contiguous last dimension")
    if cache_seqlens is None or cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (B,):
        raise RuntimeError(f"{what}: cache_seqlens must be int32 of shape [batch]")
    G = Hq // Hkv
    qh = q.transpose(1, 2).float()  # [B, Hq, T, D]
    kh = k_cache.transpose(1, 2).float().repeat_interleave(G, 1)  # [B, Hq, S, D]
    vh = v_cache.transpose(1, 2).float().repeat_interleave(G, 1)
    keys = torch.arange(S, device=q.device)
    last = cache_seqlens.long().view(B, 1, 1, 1) - 1  # the last valid key
    if causal:
        last = last - (T - 1) + torch.arange(T, device=q.device).view(1, 1, T, 1)
    mask = keys.view(1, 1, 1, S) <= last  # [B, 1, T, S]
    o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=softmax_scale)
    return o.to(q.dtype).transpose(1, 2)  # [B, T, Hq, D]


def flash_attn_module() -> types.ModuleType:
    m = types.ModuleType("flash_attn")
    m.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    m.__version__ = "dry-run"
    m.flash_attn_with_kvcache = flash_attn_with_kvcache
    return m


# ---- Triton, at a kernel launch

class _Kernel:
    """A jitted kernel: `kernel[grid](*args, **kwargs)` checks the launch and computes what
    the kernel writes (`_split_body`: one split holds every key; `_merge_body`: the merge)."""

    SKIP = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion")

    def __init__(self, fn):
        self.fn, self.sig = fn, inspect.signature(fn)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        GPU.launches[self.fn.__name__] += 1
        a = self.sig.bind(*args, **{k: v for k, v in kwargs.items() if k not in self.SKIP}).arguments
        _must_be_cuda(f"Triton launch of {self.fn.__name__}",
                      **{k: v for k, v in a.items() if isinstance(v, torch.Tensor)})
        {"_split_body": _split, "_merge_body": _merge, "_rows_body": _rows}[self.fn.__name__](SimpleNamespace(**a))


def _rows(a):
    """The row-exact linear (kernels/triton_linear.py): each row by itself, so each row's
    bits are the same whatever the call's other rows, as the kernel's are."""
    w = a.W.float().t()
    for i in range(a.M):
        y = a.X[i: i + 1].float() @ w
        if a.HAS_BIAS:
            y = y + a.Bias.float()
        a.Y[i: i + 1].copy_(y)


def _split(a):
    B, Hq, T, D = a.Q.shape
    n_kv, G, R, S = a.n_kv, a.G, a.R, a.K.shape[2]
    length = a.Lens.long().reshape(-1).expand(B)  # [B]
    qpos0 = (length - T if a.QPOS_MODE == 0 else a.QPos.long().reshape(-1).expand(B) if a.QPOS_MODE == 1
             else length * 0 + a.qpos_val)
    q = a.Q.float().reshape(B * n_kv, R, D)  # rows g * T + t of KV head kvh
    k, v = a.K.float().reshape(B * n_kv, S, D), a.V.float().reshape(B * n_kv, S, D)
    s = (q @ k.transpose(1, 2)) * a.qk_scale  # [BH, R, S], log2 units
    keys = torch.arange(S, device=q.device)
    end = (torch.minimum(length, qpos0 + T).clamp_min(0) if a.CAUSAL else length).repeat_interleave(n_kv)
    vis = keys.view(1, 1, S) < end.view(-1, 1, 1)
    if a.CAUSAL:
        t = torch.arange(R, device=q.device) % T
        last = qpos0.repeat_interleave(n_kv).view(-1, 1) + t.view(1, -1)  # [BH, R]
        vis = vis & (keys.view(1, 1, S) <= last.unsqueeze(-1))
    s = s.masked_fill(~vis, -math.inf)
    m = s.amax(-1)
    p = torch.exp2(s - torch.where(m == -math.inf, 0.0, m).unsqueeze(-1))
    a.Acc.zero_()
    a.Mx.fill_(-math.inf)
    a.Sm.zero_()
    a.Acc[:, 0] = p @ v
    a.Mx[:, 0] = m
    a.Sm[:, 0] = p.sum(-1)


def _merge(a):
    mx = a.Mx.amax(1)  # [BH, R]
    safe = torch.where(mx == -math.inf, 0.0, mx)
    w = torch.exp2(a.Mx - safe.unsqueeze(1))  # [BH, splits, R]
    total = (w * a.Sm).sum(1)
    o = (a.Acc * w.unsqueeze(-1)).sum(1)  # [BH, R, D]
    seen = total > 0
    one = torch.where(seen, total, 1.0)
    o = torch.where(seen.unsqueeze(-1), o / one.unsqueeze(-1), 0.0)
    lse = torch.where(seen, (safe + torch.log2(one)) * math.log(2), -math.inf)
    B, Hq, T, D = a.Out.shape
    a.Out.copy_(o.reshape(B, Hq, T, D))
    a.Lse.copy_(lse.reshape(B, Hq, T))


class FakeTriton:
    __version__ = "dry-run"

    @staticmethod
    def jit(fn=None, **kw):
        return _Kernel(fn) if fn is not None else _Kernel

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)

    @staticmethod
    def next_power_of_2(n):
        return 1 << max(0, int(n) - 1).bit_length()
