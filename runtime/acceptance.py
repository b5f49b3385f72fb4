"""The acceptance rule of speculative sampling, as small pure functions (vectorised over the drafted tokens).

A draft d_1..d_g drawn from q is checked against the target's p at the same positions
plus one more: accept d_i with probability min(1, p(d_i)/q(d_i)) until the first
rejection; there, sample from norm(max(0, p - q)); if all are accepted, sample a bonus
token from p_{g+1}. The output is distributed exactly as sampling from p. Greedy needs no
special case: `sampling.probs` makes p and q one-hot, so acceptance is argmax agreement.
A deterministic drafter (n-gram) has one-hot q and stays lossless the same way.
"""
from __future__ import annotations

import torch

from .sampling import sample


def one_hot(tokens: list[int], vocab: int, device="cpu") -> torch.Tensor:
    """q of a deterministic drafter: [g] ids -> [g, V] one-hot rows."""
    q = torch.zeros(len(tokens), vocab, device=device)
    if tokens:
        q[torch.arange(len(tokens)), torch.tensor(tokens, device=device)] = 1.0
    return q


def n_accepted(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, u: torch.Tensor) -> int:
    """Leading drafts accepted: draft [g], q [g, V], p [>=g, V], uniforms u [g]."""
    g = draft.shape[0]
    idx = draft[:, None]
    pd, qd = p[:g].gather(1, idx)[:, 0], q.gather(1, idx)[:, 0]  # [g]
    ok = u * qd < pd  # u < p/q without dividing; p = 0 never accepts
    return int(ok.long().cumprod(0).sum())


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) for [V] rows; p itself if the difference vanishes (p == q)."""
    r = (p - q).clamp_min(0)
    s = r.sum()
    return r / s if s > 0 else p


def accept(draft: list[int], q: torch.Tensor, p: torch.Tensor, gen=None) -> tuple[int, int]:
    """Verify a draft: q [g, V] (draft probs), p [g+1, V] (target probs) -> (k accepted, next token)."""
    g = len(draft)
    if g == 0:
        return 0, int(sample(p[0], gen))
    d = torch.tensor(draft, device=p.device)
    u = torch.rand(g, generator=gen, device=p.device)
    k = n_accepted(d, q, p, u)
    nxt = p[g] if k == g else residual(p[k], q[k])
    return k, int(sample(nxt, gen))
