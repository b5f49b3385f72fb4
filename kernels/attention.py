"""Attention over a KV cache: the torch reference, which is also the CPU path.

Queries are grouped by KV head (grouped-query attention) by folding the group into the
query-length axis, so K and V are never repeated in memory. Causality is by absolute
position: a query at position p sees keys at positions <= p.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native


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


def attention(q, k, v, q_pos0: int, k_pos0: int = 0, scale: float | None = None):
    """Softmax attention of q [B, Hq, T, D] over k, v [B, Hkv, S, D] -> [B, Hq, T, D].

    `q_pos0` is the absolute position of the first query, `k_pos0` that of the first key.
    """
    B, Hq, T, D = q.shape
    n_kv = k.shape[1]
    if native.supports(q, k):
        return native.attend(q, k, v, q_pos0, k_pos0, scale)[0]
    if q.device.type == "cpu" and B == 1:
        free = max(0, min(q_pos0 - k_pos0, k.shape[2]))  # keys every query sees
        splits = cpu_splits(n_kv, free)
        if splits > 1:
            return _split_attention(q, k, v, q_pos0, k_pos0, scale, splits, free)
    mask = causal_mask(q_pos0, T, k_pos0, k.shape[2], Hq // n_kv, q.device)
    o = F.scaled_dot_product_attention(_fold(q, n_kv), k, v, attn_mask=mask, scale=scale)
    return _unfold(o, Hq)


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


def attention_lse(q, k, v, q_pos0: int, k_pos0: int = 0, scale: float | None = None):
    """Attention over one block of keys, returning (out [B,Hq,T,D] fp32, lse [B,Hq,T] fp32).

    Partial results over disjoint key blocks combine exactly with `merge`. A query that
    sees no key of the block gets out 0 and lse -inf.
    """
    B, Hq, T, D = q.shape
    n_kv = k.shape[1]
    if native.supports(q, k):
        return native.attend(q, k, v, q_pos0, k_pos0, scale, out_dtype=torch.float32)
    scale = D ** -0.5 if scale is None else scale
    s = (_fold(q, n_kv).float() @ k.float().transpose(-1, -2)) * scale  # [B, Hkv, G*T, S]
    mask = causal_mask(q_pos0, T, k_pos0, k.shape[2], Hq // n_kv, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)  # [B, Hkv, G*T, 1]
    p = torch.exp(s - torch.nan_to_num(lse, neginf=0.0))
    o = p @ v.float()
    return _unfold(o, Hq), lse.reshape(B, Hq, T)


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]):
    """Combine partial attention results over disjoint key blocks (log-sum-exp merge)."""
    lse = torch.stack(lses)  # [N, B, H, T]
    total = torch.logsumexp(lse, dim=0)
    w = torch.exp(lse - torch.nan_to_num(total, neginf=0.0)).unsqueeze(-1)  # [N, B, H, T, 1]
    return (w * torch.stack(outs)).sum(0), total


class PartialAttention:
    """Running log-sum-exp accumulator: feed key blocks as they arrive, read the result."""

    def __init__(self):
        self.out = None  # [B, Hq, T, D] fp32
        self.lse = None  # [B, Hq, T] fp32

    def add(self, out: torch.Tensor, lse: torch.Tensor):
        if self.out is None:
            self.out, self.lse = out, lse
        else:
            self.out, self.lse = merge([self.out, out], [self.lse, lse])

    def result(self, dtype) -> torch.Tensor:
        return self.out.to(dtype)
