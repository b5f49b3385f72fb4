"""Linear layers: which GEMM kernel a projection runs on.

On the CPU, float32 `F.linear` in this torch build does not reach oneDNN: a matrix-vector
product over the 49152x576 LM head of SmolLM2 reads its weights at about a third of the
memory bandwidth oneDNN reaches, and a 7-row verification costs 3-4x one row. oneDNN's
linear (the op torch.compile's CPU backend emits) takes the same plain weight tensor, so
nothing is repacked or duplicated (tied embeddings stay shared). bfloat16/float16 and
CUDA already use the fast path through `F.linear` and stay on it.

The choice is probed once: when the op is missing (a torch built without oneDNN, a
non-x86 wheel) or disagrees with `F.linear`, everything uses `F.linear`.
`TRIFORCE_OFFLOAD_LINEAR=torch` forces `F.linear` (for comparisons).

Row-exact: oneDNN's (and MKL's) GEMM sums a row differently depending on how many rows
the call has, so a 7-row verification's rows differ from 7 one-row decodes in the last
bits, and rows of several sequences in one call from each alone. Up to `EXACT_ROWS` rows
(decodes, verifications, draft steps), and for any number inside `exact_rows()` (a
batch's ragged forward), float32 projections on the CPU run the native kernel's dense
path instead (`triforce_linear_f32`, kernels/cpu_linear.c), whose every row is summed in
one fixed order whatever the call: a sequence's tokens then never depend on its
verification widths or on the batch. Prefill chunks (more rows) stay on oneDNN.
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from ..settings import env
from .native_linear import load

_onednn: bool | None = None


def _probe() -> bool:
    if env("linear") == "torch":
        return False
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 3, 40, generator=g)
        w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
        with torch.inference_mode():
            y = op(x, w, b, "none", [], "")
        return bool(torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4))
    except Exception:  # noqa: BLE001 - any failure means: use F.linear
        return False


def onednn_enabled() -> bool:
    global _onednn
    if _onednn is None:
        _onednn = _probe()
    return _onednn


EXACT_ROWS = 64  # float32 CPU projections of up to this many rows run the row-exact kernel
_forced = threading.local()  # exact_rows() is on in this thread


GRAIN = 32768  # torch's elementwise CPU kernels split an op of this many elements or more between threads
VECTOR = 16  # floats per vector (AVX-512; a multiple of AVX2's 8 and NEON's 4)


@contextmanager
def exact_rows(segments: list[int] | None = None):
    """Inside the block every float32 CPU projection of this thread runs the row-exact
    kernel, whatever its number of rows (a batch's ragged forward); `segments`: the rows of
    each sequence, in order, for `by_rows`."""
    outer = getattr(_forced, "on", False), getattr(_forced, "segments", None)
    _forced.on, _forced.segments = True, segments
    try:
        yield
    finally:
        _forced.on, _forced.segments = outer


def by_rows(fn, *xs, dims: tuple[int, ...]):
    """fn(*xs), elementwise along the rows at `dims` (one per x). Inside a ragged forward
    (`exact_rows(segments)`) it runs per sequence where the whole op might compute a row
    otherwise than that sequence's op alone: torch splits an op of GRAIN elements or more
    between threads, and an element past a split's last whole vector takes the scalar path
    (exp, tanh and fused multiply-adds can differ there in the last bit)."""
    seg = getattr(_forced, "segments", None)
    x = xs[0]
    if (seg is None or len(seg) < 2 or x.device.type != "cpu"  # CUDA's elementwise kernels: per element
            or (x.numel() < GRAIN and (x.numel() // x.shape[dims[0]]) % VECTOR == 0)):
        return fn(*xs)
    outs, a = [], 0
    for n in seg:
        outs.append(fn(*(t.narrow(d, a, n) for t, d in zip(xs, dims))))
        a += n
    if isinstance(outs[0], tuple):  # several outputs, each with its rows along dims[0]
        return tuple(torch.cat(parts, dims[0]) for parts in zip(*outs))
    return torch.cat(outs, dims[0])


def _exact_lib():
    """The native library with the dense row-exact kernel, or None (no compiler, disabled,
    TRIFORCE_OFFLOAD_LINEAR=torch)."""
    if env("linear") == "torch":
        return None
    return load()


def exact_ok(weight: torch.Tensor) -> bool:
    """Whether projections by `weight` can run the row-exact kernel."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.stride(1) == 1 and weight.shape[1] % 16 == 0 and _exact_lib() is not None)


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) on the row-exact kernel (float32 CPU; `exact_ok(weight)`)."""
    K, N = weight.shape[1], weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], N, dtype=torch.float32)
    b = None if bias is None else bias.contiguous()
    rc = _exact_lib().triforce_linear_f32(x2.data_ptr(), x2.shape[0], K, x2.stride(0), weight.data_ptr(),
                                          weight.stride(0), None if b is None else b.data_ptr(), N,
                                          out.data_ptr(), N)
    if rc:
        raise RuntimeError(f"row-exact linear refused a {N}x{K} weight ({rc})")
    return out.view(*x.shape[:-1], N)


def gpu_exact(device) -> bool:
    """Whether projections on the CUDA `device` of up to EXACT_ROWS rows (any number inside
    `exact_rows()`) run the row-exact Triton kernel (kernels/triton_linear.py)."""
    return _gpu_exact(torch.device(device), env("gpu_linear"))


@functools.lru_cache(maxsize=None)
def _gpu_exact(device: torch.device, choice: str) -> bool:
    from . import triton_linear
    return triton_linear.reason(device) == ""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; float32 on the CPU without a gradient: the row-exact kernel for up to
    EXACT_ROWS rows (any number inside `exact_rows()`), else oneDNN; on CUDA the same rows
    on the row-exact Triton kernel (`gpu_exact`), else cuBLAS."""
    if x.device.type == "cuda":
        if ((x.numel() <= EXACT_ROWS * x.shape[-1] or getattr(_forced, "on", False)) and gpu_exact(x.device)
                and not (torch.is_grad_enabled() and weight.requires_grad)
                and not torch.compiler.is_compiling()):
            from . import triton_linear
            if triton_linear.usable(x, weight, bias):
                return triton_linear.linear(x, weight, bias)
        return F.linear(x, weight, bias)
    if (x.dtype == torch.float32 and x.device.type == "cpu" and weight.dtype == torch.float32
            and not (torch.is_grad_enabled() and weight.requires_grad)
            and not torch.compiler.is_compiling()):  # inductor lowers F.linear
        if ((x.numel() <= EXACT_ROWS * x.shape[-1] or getattr(_forced, "on", False)) and exact_ok(weight)
                and (bias is None or bias.dtype == torch.float32)):
            return exact_linear(x, weight, bias)
        if weight.is_contiguous() and onednn_enabled():
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose forward picks the kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
