"""Attention over a KV cache: the torch reference, which is also the CPU path.

Queries are grouped by KV head (grouped-query attention) by folding the group into the
query-length axis, so K and V are never repeated in memory. Causality is by absolute
position: a query at position p sees keys at positions <= p.

`softcap` (Gemma 2's attention logit soft-capping; None or 0: off) turns the scaled scores
into softcap * tanh(scores / softcap) before the mask and the softmax, as transformers'
eager attention does. Every path takes it: the native C kernel, flash-attn's kvcache
kernel (its `softcap`), the Triton kernel, and `softcapped` (explicit fp32 scores) where
SDPA or torch's flash kernels would run, since they cannot.
"""
from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from . import native
from ..settings import env


def _fold(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[B, Hq, T, D] -> [B, Hkv, G*T, D] (the G query heads of a KV head side by side)."""
    B, Hq, T, D = q.shape
    return q.reshape(B, n_kv, (Hq // n_kv) * T, D)


def _unfold(o: torch.Tensor, hq: int) -> torch.Tensor:
    B, _, GT, D = o.shape
    return o.reshape(B, hq, GT * o.shape[1] // hq, D)


def causal_mask(q_pos0: int, T: int, k_pos0: int, S: int, group: int, device) -> torch.Tensor | None:
    """Boolean [G*T, S] mask (True = may attend), or None when every key is visible."""
    if k_pos0 + S - 1 <= q_pos0:
        return None
    qp = torch.arange(q_pos0, q_pos0 + T, device=device)
    kp = torch.arange(k_pos0, k_pos0 + S, device=device)
    return (kp[None, :] <= qp[:, None]).repeat(group, 1)


# Split-K on the CPU: below this many keys per split the extra merge costs more than the
# better thread balance gains.
MIN_SPLIT_KEYS = 1024


def cpu_splits(batch_heads: int, free_keys: int, threads: int | None = None) -> int:
    """How many pieces to cut the always-visible keys into so that every CPU thread gets
    the same number of (head, piece) work items: 1 when the heads already balance."""
    threads = threads or torch.get_num_threads()
    s = 1
    while (batch_heads * s) % threads and batch_heads * s < 4 * threads:
        s += 1
    while s > 1 and free_keys // s < MIN_SPLIT_KEYS:
        s -= 1
    return s


# ---- GPU: which kernel attention runs on ----
#
# SDPA picks the cuDNN backend on Hopper, and cuDNN builds a new plan for every key count:
# 57-79 ms per call while a cache grows by one token a step (docs/gpu.md). So on CUDA
# SDPA is restricted to its flash / memory-efficient backends, and the fixed-capacity
# (CUDA-graph) path below uses flash-attn's kvcache kernel or our Triton kernel.

STATIC_PATHS = ("flash-attn", "triton", "sdpa")
_NO_CUDNN = None  # backends SDPA may use on CUDA (built on first use)


def _sdpa_backends():
    global _NO_CUDNN
    if _NO_CUDNN is None:
        from torch.nn.attention import SDPBackend
        _NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return _NO_CUDNN


def sdpa(q, k, v, softcap: float | None = None, **kw):
    """F.scaled_dot_product_attention; on CUDA never the cuDNN backend (re-plans per shape).
    K and V in q's dtype (`like_q`). With a `softcap` (SDPA has none): `softcapped`."""
    k, v = like_q(q, k, v)
    if softcap:
        return softcapped(q, k, v, kw.get("scale"), softcap, kw.get("attn_mask"))
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **kw)
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(_sdpa_backends()):
        return F.scaled_dot_product_attention(q, k, v, **kw)


@functools.lru_cache(maxsize=None)
def _flash_attn_reason() -> str:
    """'' when flash-attn's kvcache kernel can run here, else why not."""
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn not installed (pip install '.[gpu]')"
    try:
        from flash_attn import flash_attn_with_kvcache  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken build is "not available"
        return f"flash-attn does not import ({type(e).__name__})"
    return ""


@torch.compiler.assume_constant_result  # a compiled step takes the path it was traced with
def static_path(device) -> tuple[str, str]:
    """(kernel, why) of the fixed-capacity attention path on `device`.

    `TRIFORCE_OFFLOAD_ATTENTION=flash-attn|triton|sdpa` forces one (tests force `sdpa` or
    `triton` on CPU tensors); by default CUDA takes flash-attn when installed, else the
    Triton kernel, else SDPA over the whole buffer with a length mask (flash/efficient
    backends, never cuDNN); the CPU takes the masked SDPA."""
    return _static_path(env("attention"), torch.device(device).type)


@functools.lru_cache(maxsize=None)
def _static_path(forced: str, device_type: str) -> tuple[str, str]:
    if forced in STATIC_PATHS:
        return forced, "forced by TRIFORCE_OFFLOAD_ATTENTION"
    if device_type != "cuda":
        return "sdpa", "CPU: length-masked SDPA (the graph path's reference)"
    from . import triton_attention  # imports triton: only where CUDA is
    why = _flash_attn_reason()
    if not why:
        return "flash-attn", ("flash_attn_with_kvcache (cache_seqlens on the device; fp16/bf16 and "
                              "head_dim % 8 == 0 up to 256, else the Triton kernel)")
    if triton_attention.available():
        return "triton", f"package Triton split-K kernel ({why})"
    return "sdpa", f"length-masked SDPA, flash/efficient backends ({why}; {triton_attention.reason()})"


def status(device) -> str:
    """One phrase for `info`: what attention runs on `device` and why (and for models with
    attention soft-capping, which SDPA cannot do)."""
    if torch.device(device).type != "cuda":
        return native.status()
    path, why = static_path(device)
    if path == "triton":
        why += _triton_gaps(torch.device(device))
    capped = {"flash-attn": "flash-attn's softcap", "triton": "the Triton kernel"}.get(path, "explicit fp32 scores")
    return (f"decode/verify (graphs): {path}: {why}; other shapes: SDPA without cuDNN; "
            f"soft-capped attention (Gemma 2): {capped} on the graph path, explicit fp32 scores elsewhere")


def _triton_gaps(device) -> str:
    """Where the Triton kernel has no tile that fits this card: the fallback, and why."""
    from .triton_attention import fits
    gaps = [w for dt in (torch.float16, torch.bfloat16, torch.float32) for D in (64, 128, 256)
            if (w := fits(dt, D, 1, device))]
    return "".join(f"; {g}: length-masked SDPA there" for g in gaps)


def static_attention(q, k, v, length: torch.Tensor, shared: dict | None = None,
                     softcap: float | None = None):
    """Causal attention of the last T of `length` tokens over whole fixed-capacity buffers.

    q [B, Hq, T, D] at positions length-T .. length-1; k, v [B, Hkv, cap, D] hold keys at
    positions 0 .. cap-1, valid below `length` (int64 device tensor [B]). Shapes do not
    depend on the length, so a step replays as a CUDA graph; nothing reads `length` on the
    host. Returns [B, Hq, T, D]. `shared`: a dict that lives for one forward (a static
    cache's per-forward state): what every layer derives from `length` alone (flash-attn's
    int32 lengths, the SDPA path's mask) the first layer makes and the others reuse.
    `softcap`: soft-capped scores (flash-attn's softcap, the Triton kernel, else `softcapped`)."""
    shared = {} if shared is None else shared
    softcap = float(softcap or 0.0)
    k, v = like_q(q, k, v)
    path = static_path(q.device)[0]
    B = q.shape[0]
    if path == "flash-attn" and not flash_attn_fits(q):  # fp32 (tests) or an odd head size
        from . import triton_attention
        path = "triton" if triton_attention.available() else "sdpa"
    if path == "flash-attn":
        lens = _once(shared, ("lens", B), lambda: length.to(torch.int32).expand(B).contiguous())  # [B]
        return (flash_decode if torch.compiler.is_compiling() else _flash_decode)(q, k, v, lens, softcap)
    if path == "triton" and not _triton_fits(q, k):
        path = "sdpa"
    if path == "triton":
        return (triton_decode if torch.compiler.is_compiling() else _triton_decode)(q, k, v, length, softcap)
    if softcap:
        FALLBACKS.setdefault("attention soft-capping: explicit fp32 scores where SDPA would run")
    return _masked_attention(q, k, v, length, shared, softcap)


def _flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                  softcap: float = 0.0) -> torch.Tensor:
    from flash_attn import flash_attn_with_kvcache
    o = flash_attn_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                cache_seqlens=lens, causal=True, softcap=softcap)  # [B, T, Hq, D]
    return o.transpose(1, 2)


def _triton_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor,
                   softcap: float = 0.0) -> torch.Tensor:
    from .triton_attention import decode_attention
    return decode_attention(q, k, v, length, softcap=softcap)  # [B, Hq, T, D] contiguous


# The two kernels as custom ops for a compiled step (--compile, runtime/graphs.py): opaque
# to torch.compile (one graph around them, no tracing into flash-attn's binding or the
# Triton launcher's host logic); their fakes give the real outputs' shapes and strides.
flash_decode = torch.library.custom_op("triforce_offload::flash_decode", _flash_decode, mutates_args=())
triton_decode = torch.library.custom_op("triforce_offload::triton_decode", _triton_decode, mutates_args=())


@flash_decode.register_fake
def _(q, k, v, lens, softcap=0.0):  # flash-attn allocates its output like the q it is given ([B, T, Hq, D])
    return torch.empty_like(q.transpose(1, 2)).transpose(1, 2)


@triton_decode.register_fake
def _(q, k, v, length, softcap=0.0):
    return q.new_empty(q.shape)


def _once(shared: dict, key, make):
    """shared[key], made by the first layer that asks."""
    if key not in shared:
        shared[key] = make()
    return shared[key]


FALLBACKS: dict[str, None] = {}  # why static attention left the Triton kernel, each once


def _triton_fits(q, k) -> bool:
    """The Triton kernel has a tile that fits this device's shared memory; if not, the
    masked SDPA runs instead, and why is kept for the stats line (`fallback_notes`)."""
    from .triton_attention import fits
    why = fits(k.dtype, q.shape[-1], (q.shape[1] // k.shape[1]) * q.shape[2], q.device)
    if why:
        FALLBACKS.setdefault(f"{why}: length-masked SDPA instead")
    return not why


def fallback_notes() -> list[str]:
    return list(FALLBACKS)


def flash_attn_fits(q) -> bool:
    """Flash attention kernels (flash-attn's, and SDPA's flash backend) take fp16/bf16 and
    head sizes that are multiples of 8 up to 256 (others they refuse, or pad a copy of the
    whole cache on every call), on sm_80 and newer."""
    D = q.shape[-1]
    ok = q.dtype in (torch.float16, torch.bfloat16) and D % 8 == 0 and D <= 256
    return ok and (q.device.type != "cuda" or sm80(q.device.index))


@functools.lru_cache(maxsize=None)
def sm80(index: int | None) -> bool:
    """Compute capability 8.0 or newer (Ampere on): what flash attention kernels need."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _masked_attention(q, k, v, length, shared: dict | None = None, softcap: float | None = None):
    """The reference of `static_attention`: SDPA over every slot with a [B, 1, G*T, cap]
    mask built on the device from `length` (slots past it must hold finite values: zeros);
    with `shared`, once per forward. With a `softcap`: `softcapped` (SDPA has none)."""
    B, Hq, T, D = q.shape
    n_kv, cap = k.shape[1], k.shape[2]
    make = lambda: static_mask(length, T, Hq // n_kv, cap)  # noqa: E731
    # keyed without `cap`: hashing it would specialize a compiled step on the capacity
    mask = make() if shared is None else _once(shared, ("mask", T, Hq // n_kv), make)
    return _unfold(sdpa(_fold(q, n_kv), k, v, attn_mask=mask, softcap=softcap), Hq)


def static_mask(length: torch.Tensor, T: int, group: int, cap: int) -> torch.Tensor:
    """[B, 1, G*T or 1, cap] bool: folded query row g*T + t (position length - T + t) sees
    slots < length - (T-1) + t; one comparison for a decode step."""
    limit = length.view(-1, 1, 1, 1)  # [B, 1, 1, 1]
    if T > 1:
        t = torch.arange(1 - T, 1, device=length.device).repeat(group)  # [G*T]
        limit = limit + t[:, None]  # [B, 1, G*T, 1]
    return torch.arange(cap, device=length.device) < limit


def like_q(q, k, v):
    """K and V in q's dtype: a KV cache may store bfloat16 beside float32 queries (--kv-dtype),
    which the native CPU kernel reads as it is; every other path computes in q's dtype."""
    if k.dtype == q.dtype:
        return k, v
    return k.to(q.dtype), v.to(q.dtype)


def attention(q, k, v, q_pos0: int, k_pos0: int = 0, scale: float | None = None,
              softcap: float | None = None):
    """Softmax attention of q [B, Hq, T, D] over k, v [B, Hkv, S, D] -> [B, Hq, T, D].

    `q_pos0` is the absolute position of the first query, `k_pos0` that of the first key.
    `softcap`: the scaled scores soft-capped (module docstring).
    """
    B, Hq, T, D = q.shape
    n_kv = k.shape[1]
    if native.supports(q, k):
        return native.attend(q, k, v, q_pos0, k_pos0, scale, softcap=softcap)[0]
    k, v = like_q(q, k, v)
    if softcap:  # SDPA and torch's flash kernels cannot soft-cap
        return _unfold(softcapped(_fold(q, n_kv), k, v, scale, softcap, causal=(q_pos0, T, k_pos0)), Hq)
    if q.device.type == "cpu" and B == 1:
        free = max(0, min(q_pos0 - k_pos0, k.shape[2]))  # keys every query sees
        splits = cpu_splits(n_kv, free)
        if splits > 1:
            return _split_attention(q, k, v, q_pos0, k_pos0, scale, splits, free)
    if q.device.type == "cuda" and T > 1 and q_pos0 == k_pos0 + k.shape[2] - T:
        return _prefix_and_causal(q, k, v, scale)  # a prefill chunk: no mask in memory
    mask = causal_mask(q_pos0, T, k_pos0, k.shape[2], Hq // n_kv, q.device)
    o = sdpa(_fold(q, n_kv), k, v, attn_mask=mask, scale=scale)
    return _unfold(o, Hq)


def _prefix_and_causal(q, k, v, scale, path: str | None = None):
    """The last T of S keys' queries (a prefill chunk, a verification): the S-T keys before
    them, which every query sees, in one fused kernel, and the T own tokens with a causal
    diagonal in another, merged by log-sum-exp. On CUDA this replaces a [G*T, S] mask that
    SDPA would turn into a dense one (GBs for a 4K-token chunk at 128K keys)."""
    from .chunked import StreamedAttention
    T, S = q.shape[2], k.shape[2]
    s = StreamedAttention(q, k.shape[1], scale, path)
    if S > T:
        s.add(k[:, :, : S - T], v[:, :, : S - T])
    s.add_causal(k[:, :, S - T:], v[:, :, S - T:], 0, 0)
    return s.result(q.dtype)


def _split_attention(q, k, v, q_pos0, k_pos0, scale, splits, free):
    """CPU flash-decoding: the keys all queries see are cut into `splits` equal pieces that
    run as separate (piece, head) work items of one flash-attention call (with 3 KV heads
    on 2 threads, one thread would otherwise do two heads and the other one); the rest
    (the causal tail) is one more call; the partial results merge by log-sum-exp."""
    B, Hq, T, D = q.shape
    n_kv = k.shape[1]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qf = _fold(q, n_kv)  # [1, Hkv, G*T, D]
    a = free - free % splits
    # [splits, Hkv, a/splits, D] views of the first `a` keys: the piece is the batch axis
    ka = k[0, :, :a].unflatten(1, (splits, a // splits)).transpose(0, 1)
    va = v[0, :, :a].unflatten(1, (splits, a // splits)).transpose(0, 1)
    o, lse = flash(qf.expand(splits, -1, -1, -1), ka, va, scale=scale)
    outs, lses = [o], [lse]
    if a < k.shape[2]:  # the tail: key `a` is visible to every query, so no row is empty
        kt, vt = k[:, :, a:], v[:, :, a:]
        mask = causal_mask(q_pos0, T, k_pos0 + a, kt.shape[2], Hq // n_kv, q.device)
        if mask is not None:  # the raw op takes an additive mask of the query's dtype
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        o, lse = flash(qf, kt, vt, attn_mask=mask, scale=scale)
        outs.append(o)
        lses.append(lse)
    lse = torch.cat(lses)  # [P, Hkv, G*T]
    w = torch.softmax(lse, dim=0).unsqueeze(-1)  # weight of each piece per query row
    o = (w * torch.cat(outs).float()).sum(0, keepdim=True)
    return _unfold(o.to(q.dtype), Hq)


def attention_lse(q, k, v, q_pos0: int, k_pos0: int = 0, scale: float | None = None,
                  softcap: float | None = None):
    """Attention over one block of keys, returning (out [B,Hq,T,D] fp32, lse [B,Hq,T] fp32).

    Partial results over disjoint key blocks combine exactly with `merge` (soft-capping is
    per score, so capped blocks merge alike). A query that sees no key of the block gets
    out 0 and lse -inf.
    """
    B, Hq, T, D = q.shape
    n_kv = k.shape[1]
    if native.supports(q, k):
        return native.attend(q, k, v, q_pos0, k_pos0, scale, out_dtype=torch.float32, softcap=softcap)
    k, v = like_q(q, k, v)
    scale = D ** -0.5 if scale is None else scale
    s = (_fold(q, n_kv).float() @ k.float().transpose(-1, -2)) * scale  # [B, Hkv, G*T, S]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    mask = causal_mask(q_pos0, T, k_pos0, k.shape[2], Hq // n_kv, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)  # [B, Hkv, G*T, 1]
    p = torch.exp(s - torch.nan_to_num(lse, neginf=0.0))
    o = p @ v.float()
    return _unfold(o, Hq), lse.reshape(B, Hq, T)


# `softcapped` materialises fp32 scores; rows go through in slices that keep them under this
SCORE_BYTES = 64 << 20


def softcapped(q, k, v, scale: float | None, softcap: float, mask: torch.Tensor | None = None,
               causal: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Attention with soft-capped scores, which SDPA cannot do: q [B, H, R, D] (folded rows)
    over k, v [B, H, S, D] (same head count, q's dtype) -> [B, H, R, D] in q's dtype.

    As transformers' eager attention: scores = q k^T * scale (fp32), then softcap *
    tanh(scores / softcap), then the mask (bool, True = may attend, broadcast to
    [B, H, R, S]; or `causal` = (q_pos0, T, k_pos0): folded row r is the query at position
    q_pos0 + r % T), then the softmax. A row that sees no key gets 0. Rows run in slices
    that keep the scores under SCORE_BYTES (a prefill chunk over a long cache)."""
    B, H, R, D = q.shape
    S = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    kt, vf = k.float().transpose(-1, -2), v.float()
    out = q.new_empty(q.shape)
    step = max(1, SCORE_BYTES // max(1, B * H * S * 4))
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        s = (q[:, :, r0:r1].float() @ kt) * scale  # [B, H, r, S]
        s = torch.tanh(s / softcap) * softcap
        m = _rows_mask(mask, causal, r0, r1, S, q.device)
        if m is not None:
            s = s.masked_fill(~m, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num_(0.0)  # a row that sees nothing: 0, not NaN
        out[:, :, r0:r1] = (p @ vf).to(q.dtype)
    return out


def _rows_mask(mask, causal, r0: int, r1: int, S: int, device):
    """Rows r0..r1 of a [.., R or 1, S] mask, or of the causal mask `causal` describes."""
    if causal is not None:
        q_pos0, T, k_pos0 = causal
        if k_pos0 + S - 1 <= q_pos0:
            return None  # every key precedes every query
        qp = q_pos0 + torch.arange(r0, r1, device=device) % T
        return torch.arange(k_pos0, k_pos0 + S, device=device)[None, :] <= qp[:, None]
    if mask is None or mask.shape[-2] == 1:
        return mask
    return mask[..., r0:r1, :]


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]):
    """Combine partial attention results over disjoint key blocks (log-sum-exp merge)."""
    lse = torch.stack(lses)  # [N, B, H, T]
    total = torch.logsumexp(lse, dim=0)
    w = torch.exp(lse - torch.nan_to_num(total, neginf=0.0)).unsqueeze(-1)  # [N, B, H, T, 1]
    return (w * torch.stack(outs)).sum(0), total
