"""Sampling: temperature, top-k, top-p, seed. Greedy is the one-hot distribution at the
argmax, so speculative acceptance needs no special case for it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import TriforceError


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    seed: int | None = None  # for reproducible sampling

    def __post_init__(self):
        if self.temperature < 0:
            raise TriforceError(f"--temperature {self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise TriforceError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise TriforceError(f"--top-k {self.top_k}: must be >= 0 (0 keeps all tokens)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device="cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


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
