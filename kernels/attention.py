"""Attention over a KV cache: the torch reference, which is also the CPU path.

Queries are grouped by KV head (grouped-query attention) by folding the group into the
query-length axis, so K and V are never repeated in memory. Causality is by absolute
position: a query at position p sees keys at positions <= p.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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


def attention(q, k, v, q_pos0: int, k_pos0: int = 0, scale: float | None = None):
    """Softmax attention of q [B, Hq, T, D] over k, v [B, Hkv, S, D] -> [B, Hq, T, D].

    `q_pos0` is the absolute position of the first query, `k_pos0` that of the first key.
    """
    B, Hq, T, D = q.shape
    n_kv = k.shape[1]
    mask = causal_mask(q_pos0, T, k_pos0, k.shape[2], Hq // n_kv, q.device)
    o = F.scaled_dot_product_attention(_fold(q, n_kv), k, v, attn_mask=mask, scale=scale)
    return _unfold(o, Hq)


def attention_lse(q, k, v, q_pos0: int, k_pos0: int = 0, scale: float | None = None):
    """Attention over one block of keys, returning (out [B,Hq,T,D] fp32, lse [B,Hq,T] fp32).

    Partial results over disjoint key blocks combine exactly with `merge`. A query that
    sees no key of the block gets out 0 and lse -inf.
    """
    B, Hq, T, D = q.shape
    n_kv = k.shape[1]
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
