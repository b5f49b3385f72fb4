"""Sampling: temperature, top-k, top-p, seed. Greedy is the one-hot distribution at the
argmax, so speculative acceptance needs no special case for it."""
from __future__ import annotations

import torch

from .options import SamplingParams  # noqa: F401  (defined with the other options)


def probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from: [..., V] logits -> [..., V] fp32 probs."""
    logits = logits.float()
    if sp.greedy:
        out = torch.zeros_like(logits)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / sp.temperature
    if sp.top_k and sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    if sp.top_p < 1:
        p = _top_p(p, sp.top_p)
    return p


def _top_p(p: torch.Tensor, top_p: float) -> torch.Tensor:
    sp, idx = p.sort(dim=-1, descending=True)
    drop = (sp.cumsum(-1) - sp) >= top_p  # mass before this token already reaches top_p
    sp = sp.masked_fill(drop, 0.0)
    out = torch.zeros_like(p).scatter_(-1, idx, sp)
    return out / out.sum(-1, keepdim=True)


def sample(p: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row of p [..., V] -> [...] (long)."""
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=gen).reshape(p.shape[:-1])


def draw(p: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None = None) -> torch.Tensor:
    """A token per row of `probs(logits, sp)`: greedy takes the one-hot's argmax (the same
    token a draw would give, without an exponential per vocabulary entry); else `sample`."""
    return p.argmax(-1) if sp.greedy else sample(p, gen)


def next_token(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None = None) -> torch.Tensor:
    """`draw(probs(logits, sp), sp, gen)`: greedy straight from the logits' argmax (the
    same token: the one-hot's argmax is the logits' first maximum), without building the
    one-hot distribution over the vocabulary each step."""
    return logits.argmax(-1) if sp.greedy else draw(probs(logits, sp), sp, gen)
