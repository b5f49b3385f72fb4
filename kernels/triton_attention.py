"""Triton decode/verify attention: split-K flash-decoding over a fixed-capacity KV buffer.

Shapes never change from step to step (what CUDA graphs need): K and V are the whole
[B, Hkv, S_cap, D] buffers and the number of valid keys is a device tensor, read by the
kernel. Two launches per call:

1. `_split_kernel`, grid (B*Hkv, splits, row blocks): the G query heads of a KV head times
   the T new tokens form the rows of one tile (grouped-query attention folded, K and V read
   once per tile, never repeated); each program walks its share of the valid keys in blocks
   and writes a partial max, sum of exponentials and unnormalised output (fp32) to scratch.
   The share is cut from the device-side length inside the kernel, so the grid is static
   and a short context in a long buffer still spreads over every split; programs whose
   share is empty write max -inf, sum 0.
2. `_merge_kernel`, one program per (batch, KV head, row): log-sum-exp merge of the splits.

Keys past the length are never loaded (masked loads), so the buffer's tail may hold
anything. The number of splits is a static function of the buffer capacity, the batch and
head counts and the device. Scores run in base 2 (scale * log2 e folded in); the returned
lse is natural-log. A `softcap` (Gemma 2) turns the scaled scores into
softcap * tanh(score / softcap) before the mask, tanh by exp2 (a constexpr: no cost
without it).

The module imports without triton; `available()` and `reason()` say whether it can run.
Kernels are built on first use, so `TRITON_INTERPRET=1` (CPU tensors, tests) takes effect
whenever it is set before the first call.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from ..runtime.hostread import to_device

try:
    import triton
    import triton.language as tl
    _IMPORT_ERROR = ""
except Exception as e:  # noqa: BLE001 - any failure to import means "not available"
    triton = tl = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

LOG2E = 1.4426950408889634
MAX_ROWS = 128  # rows (G*T) per tile; more rows take a second row block
MAX_SPLITS = 64


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def available() -> bool:
    """Triton imports and there is something to run it on (a CUDA device or the interpreter)."""
    return triton is not None and (torch.cuda.is_available() or _interpret())


def reason() -> str:
    """Why the kernel can or cannot run, in words."""
    if triton is None:
        return f"triton is not importable ({_IMPORT_ERROR})"
    if _interpret():
        return f"triton {triton.__version__} under TRITON_INTERPRET=1 (CPU tensors)"
    if torch.cuda.is_available():
        return f"triton {triton.__version__} on CUDA"
    return f"triton {triton.__version__} is installed but there is no CUDA device"


# --------------------------------------------------------------------------- kernels

def _split_body(Q, K, V, Lens, QPos, qpos_val, Acc, Mx, Sm,
                sqb, sqh, sqt, skb, skh, skn, svb, svh, svn, sl, sqp,
                n_kv, G, T, R, D, splits, qk_scale, softcap,
                QPOS_MODE: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr,
                PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    s = tl.program_id(1)
    mb = tl.program_id(2)
    b = bh // n_kv
    kvh = bh % n_kv
    length = tl.load(Lens + b * sl).to(tl.int32)
    if QPOS_MODE == 0:  # the queries are the last T tokens
        qpos0 = length - T
    elif QPOS_MODE == 1:
        qpos0 = tl.load(QPos + b * sqp).to(tl.int32)
    else:
        qpos0 = qpos_val
    if CAUSAL:  # no query sees past its own position
        kv_end = tl.maximum(tl.minimum(length, qpos0 + T), 0)
    else:
        kv_end = length
    per = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), splits) * BLOCK_N  # keys per split
    lo = s * per
    hi = tl.minimum(lo + per, kv_end)

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # row = g * T + t
    g = rows // T
    t = rows % T
    row_ok = rows < R
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    head = (kvh * G + g).to(tl.int64)
    q_ptr = Q + b.to(tl.int64) * sqb + head[:, None] * sqh + t[:, None] * sqt + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:  # fp32 operands (fp32 caches; bf16 under the interpreter, whose bf16 dot is broken)
        q = q.to(tl.float32)
    else:
        q = q.to(K.dtype.element_ty)
    last = qpos0 + t  # [BLOCK_M] last key each row sees (causal)
    k_base = K + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None].to(tl.int64) * skn + d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N], log2 units
        if SOFTCAP:  # qk_scale is the plain scale here: softcap * tanh(qk / softcap), then log2 units
            e = tl.exp2(tl.abs(qk / softcap) * -2.8853900817779268)  # exp(-2|y|), in (0, 1]
            th = (1.0 - e) / (1.0 + e)
            qk = tl.where(qk < 0, -th, th) * (softcap * 1.4426950408889634)
        vis = n_ok[None, :]
        if CAUSAL:
            vis = vis & (n[None, :] <= last[:, None])
        qk = tl.where(vis, qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None].to(tl.int64) * svn + d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # fp32 acc
        m = m_new

    part = bh * splits + s  # scratch: [B*Hkv, splits, R(, D)]
    tl.store(Acc + (part * R + rows[:, None]) * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(Mx + part * R + rows, m, mask=row_ok)
    tl.store(Sm + part * R + rows, l, mask=row_ok)


def _merge_body(Acc, Mx, Sm, Out, Lse, sob, soh, sot, n_kv, G, T, R, D, splits,
                SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)  # (batch, KV head, row)
    bh = pid // R
    r = pid % R
    sp = tl.arange(0, SPLITS)
    sp_ok = sp < splits
    part = bh * splits + sp
    m = tl.load(Mx + part * R + r, mask=sp_ok, other=float("-inf"))
    l = tl.load(Sm + part * R + r, mask=sp_ok, other=0.0)
    mx = tl.max(m, 0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(m - mx_safe)  # 0 for empty splits
    total = tl.sum(w * l, 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    a = tl.load(Acc + (part[:, None] * R + r) * D + d[None, :],
                mask=sp_ok[:, None] & d_ok[None, :], other=0.0)  # [SPLITS, BLOCK_D]
    o = tl.sum(a * w[:, None], 0)
    seen = total > 0.0
    o = tl.where(seen, o / tl.where(seen, total, 1.0), 0.0)
    lse = tl.where(seen, (mx_safe + tl.log2(tl.where(seen, total, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    b = bh // n_kv
    head = (bh % n_kv) * G + r // T
    t = r % T
    base = b.to(tl.int64) * sob + head.to(tl.int64) * soh + t * sot
    tl.store(Out + base + d, o.to(Out.dtype.element_ty), mask=d_ok)
    tl.store(Lse + (b * n_kv * G + head) * T + t, lse)


_KERNELS: dict[bool, tuple] = {}


def _kernels():
    """(split, merge) jitted for the current mode; built on first use so that
    TRITON_INTERPRET set after this module was imported still counts."""
    mode = _interpret()
    if mode not in _KERNELS:
        _KERNELS[mode] = (triton.jit(_split_body, do_not_specialize=["qpos_val"]),
                          triton.jit(_merge_body))
    return _KERNELS[mode]


# --------------------------------------------------------------------------- launch

MERGE_WARPS = 4


@dataclass(frozen=True)
class Launch:
    """Tile sizes and launch options of the split kernel for one (dtype, head size, rows)."""
    block_m: int  # rows (query heads of a KV group x new tokens) per tile
    block_n: int  # keys per step
    block_d: int  # head_dim padded to a power of two
    num_warps: int
    num_stages: int
    dot_f32: bool  # widen the dot operands to fp32

    def constexprs(self, block_n: int | None = None) -> dict:
        return dict(DOT_F32=self.dot_f32, PRECISION="ieee" if self.dot_f32 else None,
                    BLOCK_M=self.block_m, BLOCK_N=block_n or self.block_n, BLOCK_D=self.block_d)


def launch_config(dtype: torch.dtype, D: int, R: int, interpret: bool = False,
                  cap: int = 80) -> Launch | None:
    """Tiles that fit the registers and sm_`cap`'s shared memory (None: none does): chosen
    from ptxas's own report on the launches as the runtime makes them (divisibility
    specialization included) for sm_80/86/89/90, without a GPU: tests/test_triton_compile.py
    compiles them and fails on any spill or shared memory over the target's.

    16-bit: up to 128 rows at head_dim <= 64, else 64 (more rows take another row block);
    64 keys per step, 32 from 8K-element tiles at head_dim 256; 8 warps from 4K-element
    (rows x head_dim) tiles. fp32 (tests, fp32 models): operands twice the size and the dot
    in full precision, so tiles of at most 4K elements, 16 keys per step, 8 warps (16 at
    head_dim 256, where 4 or 8 spill a few bytes on sm_80-90 as launched), 2 stages. Then
    `fit_smem` drops stages, then keys per step, until the tile fits sm_`cap`.
    Under the interpreter bf16 operands are widened to fp32 too: its bf16 dot multiplies
    bit patterns (triton #11584)."""
    block_d = max(16, triton.next_power_of_2(D))
    dot_f32 = dtype == torch.float32 or (interpret and dtype == torch.bfloat16)
    if dtype == torch.float32:
        max_m = max(16, 4096 // block_d)
        block_n, warps, stages = 16, 8 if block_d < 256 else 16, 2  # 4 or 8 spill at 256
    else:
        max_m = MAX_ROWS if block_d <= 64 else MAX_ROWS // 2
        block_n, warps, stages = 64, 4, 3
    block_m = min(max_m, max(16, triton.next_power_of_2(R)))  # tl.dot needs >= 16 rows
    if dtype != torch.float32:
        if block_d >= 256 and block_m * block_d >= 8192:
            block_n = 32
        if block_m * block_d >= 4096:
            warps = 8
    return fit_smem(Launch(block_m, block_n, block_d, warps, stages, dot_f32), dtype, cap)


# shared memory one block may use, bytes, per compute capability (CUDA's table of
# technical specifications per compute capability: 163 KB on sm_80/87, 99 KB on sm_86/89
# and sm_120, 227 KB on sm_90/100)
SMEM = {70: 96 << 10, 75: 64 << 10, 80: 163 << 10, 86: 99 << 10, 87: 163 << 10,
        89: 99 << 10, 90: 227 << 10, 100: 227 << 10, 120: 99 << 10}


def smem_limit(cap: int) -> int:
    """Shared memory per block on sm_`cap` (an unknown one: the largest known at or below it)."""
    known = [c for c in SMEM if c <= cap]
    return SMEM[max(known)] if known else 48 << 10


def device_capability(device: torch.device) -> int:
    """sm number of a CUDA device (89 for 8.9); 80 for the interpreter (its tiles)."""
    if device.type != "cuda":
        return 80
    major, minor = _capability(device.index)
    return 10 * major + minor


@functools.lru_cache(maxsize=None)
def _capability(index) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fit_smem(cfg: Launch, dtype: torch.dtype, cap: int) -> Launch | None:
    """`cfg`, with fewer pipeline stages, then fewer keys per step, until its shared memory
    fits sm_`cap`; None where nothing does."""
    while smem_bytes(cfg, dtype, cap) > smem_limit(cap):
        if cfg.num_stages > 1:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_n > 16:
            cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2, num_stages=2)
        else:
            return None
    return cfg


def fits(dtype: torch.dtype, D: int, R: int, device: torch.device) -> str:
    """'' when a tile of the split kernel fits `device`'s shared memory, else why not."""
    cap = device_capability(device)
    if launch_config(dtype, D, R, _interpret(), cap) is not None:
        return ""
    return (f"no Triton tile fits sm_{cap}'s {smem_limit(cap) >> 10} KB of shared memory per "
            f"block at head_dim {D} ({str(dtype).replace('torch.', '')})")


def smem_bytes(cfg: Launch, dtype: torch.dtype, cap: int = 80) -> int:
    """Shared memory of the split kernel as Triton lays it out with 16-byte-aligned
    pointers and strides (what the runtime passes): K and V tiles for each stage in flight
    (cp.async: stages - 1; every stage on sm_90, whose pipeliner keeps one more), and the
    dot operands' q and p tiles. ptxas's figures from
    tests/test_triton_compile.py: bf16, head_dim 256, 16 x 64 tiles: 141,312 B at 3 stages,
    75,776 B at 2 (that test checks this bound against every configuration compiled)."""
    elem = 4 if cfg.dot_f32 else torch.empty(0, dtype=dtype).element_size()
    stages = cfg.num_stages if cap >= 90 else max(cfg.num_stages - 1, 1)
    kv = 2 * cfg.block_n * cfg.block_d * elem * stages
    return kv + cfg.block_m * (cfg.block_d + cfg.block_n) * elem + 1024  # + reduction scratch


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits, so tests exercise the merge


def default_splits(batch_heads: int, row_blocks: int, s_cap: int, block_n: int,
                   device: torch.device) -> int:
    """Enough splits for about two programs per SM; a static function of the shapes."""
    want = triton.cdiv(2 * _sm_count(device), batch_heads * row_blocks)
    return max(1, min(want, triton.cdiv(s_cap, block_n), MAX_SPLITS))


def _as_index(x, B: int, device, name: str) -> tuple[torch.Tensor, int]:
    """A [B] or [1] integer device tensor and its stride (0 for a shared value)."""
    if not torch.is_tensor(x):
        x = to_device([int(x)], device, torch.int32)  # no blocking pageable copy
    if x.dim() == 0:
        x = x.reshape(1)
    if x.dim() != 1 or x.numel() not in (1, B):
        raise ValueError(f"{name} must have shape [B] or [1], got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, the cache on {device}")
    return x, (0 if x.numel() == 1 else x.stride(0))


def _qpos_args(q_pos0, lens, B: int):
    """(mode, pointer, stride, int) for the kernel: 0 derived from the length, 1 a device
    tensor, 2 a Python int (baked into a captured graph, so keep it fixed there)."""
    if q_pos0 is None:
        return 0, lens, 0, 0
    if torch.is_tensor(q_pos0):
        return (1, *_as_index(q_pos0, B, lens.device, "q_pos0"), 0)
    return 2, lens, 0, int(q_pos0)


def decode_attention_lse(q, k, v, length, q_pos0=None, scale=None, block_n=None, splits=None,
                         causal: bool = True, out_dtype=None, softcap: float | None = None):
    """Attention of the last T query tokens over a fixed-capacity KV buffer.

    q [B, Hq, T, D]; k, v [B, Hkv, S_cap, D] (any strides, head_dim contiguous);
    `length` [B] or [1] int device tensor: keys [0, length) are valid. Causal: query t sits
    at position q_pos0 + t (q_pos0 defaults to length - T, a tensor, an int or omitted) and
    sees keys j <= q_pos0 + t. Non-causal (`causal=False`): every query sees [0, length).
    `softcap` (None or 0: off): scaled scores soft-capped, softcap * tanh(score / softcap).
    Returns out [B, Hq, T, D] (q's dtype, or `out_dtype`) and lse [B, Hq, T] fp32 (natural
    log of the sum of exp of the scaled scores; -inf with out 0 for a row that sees no key).
    """
    if not available():
        raise RuntimeError(f"triton decode attention unavailable: {reason()}")
    launches, out, lse = plan(q, k, v, length, q_pos0, scale, block_n, splits, causal, out_dtype,
                              softcap=softcap)
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)
    return out, lse


def plan(q, k, v, length, q_pos0=None, scale=None, block_n=None, splits=None,
         causal: bool = True, out_dtype=None, capability: int | None = None,
         softcap: float | None = None):
    """The two launches of `decode_attention_lse` as (kernel, grid, args, kwargs), with the
    outputs they write: what runs, and what tests/test_triton_compile.py binds and compiles
    for each GPU target through Triton's own launcher (same constexprs, same divisibility
    specialization). `capability` (e.g. 89) picks tiles that fit that target's shared
    memory; default: the device's."""
    B, Hq, T, D = q.shape
    Bk, n_kv, s_cap, Dk = k.shape
    if v.shape != k.shape or Bk != B or Dk != D or Hq % n_kv:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous head_dim (stride 1)")
    if q.stride(-1) != 1:
        q = q.contiguous()
    G, R = Hq // n_kv, (Hq // n_kv) * T
    lens, sl = _as_index(length, B, k.device, "length")
    qpos_mode, qpos, sqp, qpos_val = _qpos_args(q_pos0, lens, B)
    scale = D ** -0.5 if scale is None else float(scale)

    cap = capability or device_capability(k.device)
    cfg = launch_config(k.dtype, D, R, _interpret(), cap)
    if cfg is None:
        raise RuntimeError(f"no tile of the Triton kernel fits sm_{cap} at head_dim {D} ({k.dtype})")
    row_blocks = triton.cdiv(R, cfg.block_m)
    splits = splits or default_splits(B * n_kv, row_blocks, s_cap, block_n or cfg.block_n, k.device)

    f32 = dict(dtype=torch.float32, device=k.device)
    acc = torch.empty(B * n_kv, splits, R, D, **f32)
    mx = torch.empty(B * n_kv, splits, R, **f32)
    sm = torch.empty(B * n_kv, splits, R, **f32)
    out = torch.empty(B, Hq, T, D, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty(B, Hq, T, **f32)

    split_k, merge_k = _kernels()
    split = (split_k, (B * n_kv, splits, row_blocks), (
        q, k, v, lens, qpos, qpos_val, acc, mx, sm,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), sl, sqp,
        n_kv, G, T, R, D, splits, scale if softcap else scale * LOG2E, float(softcap or 1.0)),
        dict(QPOS_MODE=qpos_mode, CAUSAL=bool(causal), SOFTCAP=bool(softcap), **cfg.constexprs(block_n),
             num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    merge = (merge_k, (B * n_kv * R,), (
        acc, mx, sm, out, lse, out.stride(0), out.stride(1), out.stride(2),
        n_kv, G, T, R, D, splits),
        dict(SPLITS=triton.next_power_of_2(splits), BLOCK_D=cfg.block_d, num_warps=MERGE_WARPS))
    return [split, merge], out, lse


def decode_attention(q, k, v, length, q_pos0=None, scale=None, block_n=None, splits=None,
                     causal: bool = True, softcap: float | None = None):
    """`decode_attention_lse` without the lse: out [B, Hq, T, D] in q's dtype."""
    return decode_attention_lse(q, k, v, length, q_pos0, scale, block_n, splits, causal,
                                softcap=softcap)[0]
