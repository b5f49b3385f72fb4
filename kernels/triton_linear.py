"""Row-exact projections on CUDA: a Triton GEMM that sums every row the same way whatever
the other rows of its call.

cuBLAS picks its kernel (tile shape, split-K, stream-K) by the call's shape, so a row of a
7-row verification, or a sequence's row among a batch's rows in one forward, comes out of
cuBLAS different in the last bits from the same row alone: a speculative mode's tokens may
then differ from plain decoding's, and a sequence's from its solo run. This kernel takes
every choice that sets a row's order of summation from the weight alone:
- tiles of BLOCK_M (16) rows by BLOCK_N columns; each program walks K from 0 up in
  BLOCK_K steps, each step one `tl.dot` into a float32 accumulator (every row of a tile
  takes the same instructions; rows past M are zeros that no other row reads);
- BLOCK_N, BLOCK_K, warps and stages are a function of (N, K, dtype, the device's SM
  count), never of M; no split-K, no autotuning, and M is not specialised on.
So row i of x @ W^T + b depends on row i of x alone (bit for bit): a decode's row, a
verification's and a batch's ragged forward's agree, the ragged forward on CUDA needs no
other linear (runtime/batch/rows.py), and a speculative mode's rows equal its decodes' in
what the linears compute.

Used for forwards of up to `kernels.linear.EXACT_ROWS` rows (decodes, verifications,
draft steps) and inside a ragged forward; prefill chunks stay on cuBLAS (a prompt's
chunks are its solo run's). `TRIFORCE_OFFLOAD_GPU_LINEAR=cublas` turns it off (a batch
then runs each sequence's forward by itself, as before). `reason()` says which runs, for
`info`. The module imports without triton; `TRITON_INTERPRET=1` runs it on CPU tensors
(tests).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..settings import env
from . import triton_attention as _ta

triton, tl = _ta.triton, _ta.tl

BLOCK_M = 16  # rows per tile (tl.dot's smallest)


def _rows_body(X, W, Bias, Y, M, N, K, sxm, swn, sym,
               HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pm = tl.program_id(0)  # the row tiles of a column tile run together: W is read once
    pn = tl.program_id(1)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < M
    c_ok = cols < N
    kk = tl.arange(0, BLOCK_K)
    x_ptr = X + rows[:, None].to(tl.int64) * sxm + kk[None, :]
    w_ptr = W + cols[:, None].to(tl.int64) * swn + kk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # one order for every row: K from 0 up
        k_ok = (k0 + kk) < K
        x = tl.load(x_ptr + k0, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + k0, mask=c_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_F32:  # fp32 weights (and bf16 under the interpreter, whose bf16 dot is broken)
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    y_ptr = Y + rows[:, None].to(tl.int64) * sym + cols[None, :]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])


_KERNELS: dict[bool, object] = {}


def _kernel():
    """The kernel jitted for the current mode (built on first use: TRITON_INTERPRET set
    after import still counts). M and the row strides are not specialised on: a call of 1
    row and one of 16 run the same code."""
    mode = _ta._interpret()
    if mode not in _KERNELS:
        _KERNELS[mode] = triton.jit(_rows_body, do_not_specialize=["M", "sxm", "sym"])
    return _KERNELS[mode]


@dataclass(frozen=True)
class Tiles:
    """One weight's launch: tile columns, K step, warps, stages (never a function of M)."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def smem_bytes(t: Tiles, dtype: torch.dtype) -> int:
    """Shared memory of a launch as Triton pipelines it: each stage holds an x tile and a
    W tile of block_k inputs (the accumulator stays in registers)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return t.num_stages * (BLOCK_M + t.block_n) * t.block_k * elem + 1024


@functools.lru_cache(maxsize=None)
def tiles(N: int, K: int, dtype: torch.dtype, sms: int, cap: int = 80) -> Tiles:
    """The launch for an N x K weight of `dtype` on a device of `sms` SMs of sm_`cap`: the
    widest tile (128 columns, 64 for float32, down to 16) that still gives every SM a program
    (a decode's few rows make the call a read of W: it needs every SM reading), 128 inputs a
    step for 16-bit weights (64 for float32), 4 pipeline stages (3 for float32), then fewer stages
    and shorter steps until the target's shared memory per block holds it."""
    f32 = dtype == torch.float32
    block_n = 64 if f32 else 128  # float32's dot runs on FMAs: 128 columns spill on sm_80
    while block_n > 16 and -(-N // block_n) < sms:
        block_n //= 2
    t = Tiles(block_n, 64 if f32 else 128, 4, 3 if f32 else 4)
    limit = _ta.smem_limit(cap)
    while smem_bytes(t, dtype) > limit and (t.num_stages > 2 or t.block_k > 32):
        t = (Tiles(t.block_n, t.block_k, t.num_warps, t.num_stages - 1) if t.num_stages > 2
             else Tiles(t.block_n, t.block_k // 2, t.num_warps, t.num_stages))
    return t


def reason(device: torch.device | str = "cuda") -> str:
    """'' where projections of up to EXACT_ROWS rows on `device` run this kernel, else why not."""
    if env("gpu_linear") == "cublas":
        return "TRIFORCE_OFFLOAD_GPU_LINEAR=cublas"
    if triton is None:
        return f"triton is not importable ({_ta._IMPORT_ERROR})"
    if torch.device(device).type != "cuda" and not _ta._interpret():
        return "not a CUDA device"
    if not torch.cuda.is_available() and not _ta._interpret():
        return "no CUDA device"
    return ""


def status(device: torch.device | str = "cuda") -> str:
    """For `info`: which kernel a step's projections run on `device`, and why."""
    why = reason(device)
    if why:
        return f"cuBLAS (not row-exact: {why}; a batch runs each sequence's forward by itself)"
    return (f"row-exact Triton GEMM up to 64 rows (triton {triton.__version__}; each row's bits "
            "independent of the call's other rows: batches share forwards), cuBLAS past them")


def usable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether x @ weight^T (+ bias) can run the kernel: one floating dtype throughout, a
    2-D weight with unit stride along K on x's device."""
    return (x.dtype == weight.dtype and weight.dim() == 2 and weight.stride(1) == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and weight.device == x.device
            and (bias is None or (bias.dim() == 1 and bias.stride(0) == 1 and bias.device == x.device)))


def plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         capability: int | None = None):
    """The launch of `linear` as (kernel, grid, args, kwargs) with the output it writes, y
    [M, N]: what runs, and what tests/test_triton_compile.py binds and compiles for each
    GPU target (`capability`, e.g. 89: tiles that fit its shared memory; default the
    device's)."""
    N, K = weight.shape
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    cap = capability or _ta.device_capability(x.device)
    t = tiles(N, K, weight.dtype, _ta._sm_count(x.device), cap)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, t.block_n))  # rows fastest: W read once, not per 16 rows
    args = (x2, weight, weight if bias is None else bias, y, M, N, K, x2.stride(0), weight.stride(0), y.stride(0))
    kwargs = dict(HAS_BIAS=bias is not None, DOT_F32=weight.dtype == torch.float32 or _ta._interpret(),
                  PRECISION="ieee", BLOCK_M=BLOCK_M, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                  num_warps=t.num_warps, num_stages=t.num_stages,
                  enable_fp_fusion=True)  # said, not Triton's default (3.10 turns it off)
    return (_kernel(), grid, args, kwargs), y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, each row summed
    in one order whatever the other rows (`usable` holds)."""
    (kernel, grid, args, kwargs), y = plan(x, weight, bias)
    if y.shape[0]:
        kernel[grid](*args, **kwargs)
    return y.view(*x.shape[:-1], weight.shape[0])
