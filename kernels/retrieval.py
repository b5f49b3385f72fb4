"""Retrieval scoring: chunk mean keys, per-KV-head chunk scores, top-k, gather.

The torch reference, which is also the CPU path. Grouped-query models score a chunk
with every query head of the KV head's group and keep the max (as ShadowKV does): a
chunk matters if any head that reads it would attend to it.
"""
from __future__ import annotations

import torch


def chunk_means(k: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean key of every full chunk: k [B, Hkv, S, D] -> [B, Hkv, S // chunk, D] (fp32).

    Accumulates in fp32 without an fp32 copy of the keys (any strides, e.g. the offloaded
    host store's token-major view: a 7B layer at 128K is 1 GiB of bf16 that `.float()`
    would have doubled and read twice; bitwise the same means at half the time)."""
    B, H, S, D = k.shape
    n = S // chunk
    return k[:, :, : n * chunk].reshape(B, H, n, chunk, D).mean(3, dtype=torch.float32)


def chunk_scores(q: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """Scores of chunks for one query per head: q [B, Hq, D], means [B, Hkv, C, D] -> [B, Hkv, C].

    Each KV head's score is the max over the query heads of its group.
    """
    B, Hq, D = q.shape
    Hkv = means.shape[1]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D)  # [B, Hkv, G, D]
    s = qg @ means.transpose(-1, -2)  # [B, Hkv, G, C]
    return s.amax(2)


def top_chunks(scores: torch.Tensor, n: int, keep_first: bool = True) -> torch.Tensor:
    """Indices of the `n` best chunks per (batch, KV head), ascending: [B, Hkv, C] -> [B, Hkv, n].

    The first chunk (the attention sink) is always kept when `keep_first`.
    """
    C = scores.shape[-1]
    n = min(n, C)
    s = scores.clone()
    if keep_first:
        s[..., 0] = float("inf")
    idx = torch.topk(s, n, dim=-1).indices
    return idx.sort(-1).values


def gather_chunks(x: torch.Tensor, idx: torch.Tensor, chunk: int) -> torch.Tensor:
    """Tokens of the chosen chunks: x [B, Hkv, S, D], idx [B, Hkv, n] -> [B, Hkv, n*chunk, D]."""
    B, H, _, D = x.shape
    tok = (idx[..., None] * chunk + torch.arange(chunk, device=idx.device)).reshape(B, H, -1)
    return torch.gather(x, 2, tok.to(x.device)[..., None].expand(-1, -1, -1, D))
