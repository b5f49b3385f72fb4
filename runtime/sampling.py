"""Sampling: temperature, top-k, top-p, seed. Greedy is the one-hot distribution at the
argmax, so speculative acceptance needs no special case for it."""
from __future__ import annotations

import numpy
import torch

from .options import SamplingParams  # noqa: F401  (defined with the other options)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1): the first maximum of each row (a NaN counts as the maximum). On the
    CPU in float32, numpy's: torch's CPU reduction took 48 us for one row of a 49K
    vocabulary against numpy's 5 (one thread), and greedy decoding takes one or more per token."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() and x.shape[-1]
            and not x.requires_grad and not torch.compiler.is_compiling()):
        return torch.from_numpy(numpy.asarray(x.numpy().argmax(-1)))  # host tensor: not a device read
    return x.argmax(-1)


def probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from: [..., V] logits -> [..., V] fp32 probs."""
    logits = logits.float()
    if sp.greedy:
        out = torch.zeros_like(logits)
        return out.scatter_(-1, argmax(logits).unsqueeze(-1), 1.0)
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
    return argmax(p) if sp.greedy else sample(p, gen)


def next_token(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None = None) -> torch.Tensor:
    """`draw(probs(logits, sp), sp, gen)`: greedy straight from the logits' argmax (the
    same token: the one-hot's argmax is the logits' first maximum), without building the
    one-hot distribution over the vocabulary each step."""
    return argmax(logits) if sp.greedy else draw(probs(logits, sp), sp, gen)
