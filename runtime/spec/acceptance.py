"""Acceptance rules, as small pure functions (vectorised over the drafted tokens).

The engine's: greedy (`accept_greedy`: the verifier's argmax) and sampled (`accept_drawn`:
the token the verifier picks at each index, sampling.py), both a leading-match
count and the next token, so a sequence's text does not depend on the speculative path.

The classic rule of speculative sampling (`accept`, `verdict`; an engine's `accept_fn` may
use it): a draft d_1..d_g drawn from q is checked against the target's p at the same positions
plus one more: accept d_i with probability min(1, p(d_i)/q(d_i)) until the first
rejection; there, sample from norm(max(0, p - q)); if all are accepted, sample a bonus
token from p_{g+1}. The output is distributed exactly as sampling from p. Greedy needs no
special case: `sampling.probs` makes p and q one-hot, so acceptance is argmax agreement.
A deterministic drafter (n-gram) has one-hot q and stays lossless the same way.

The accepted count and the next token are computed on the device and read back together:
one blocking host read per verification (`hostread.to_host`).
"""
from __future__ import annotations

import torch

from ..hostread import to_device, to_host
from ..sampling import argmax, pick, sample


def one_hot(tokens: list[int], vocab: int, device="cpu") -> torch.Tensor:
    """q of a deterministic drafter: [g] ids -> [g, V] one-hot rows."""
    q = torch.zeros(len(tokens), vocab, device=device)
    if tokens:  # everything on the device: no index tensor copied from the host
        q.scatter_(1, to_device(tokens, device)[:, None], 1.0)
    return q


def n_accepted(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Leading drafts accepted, a 0-dim long on the device: draft [g], q [g, V], p [>=g, V], uniforms u [g]."""
    g = draft.shape[0]
    idx = draft[:, None]
    pd, qd = p[:g].gather(1, idx)[:, 0], q.gather(1, idx)[:, 0]  # [g]
    ok = u * qd < pd  # u < p/q without dividing; p = 0 never accepts
    return ok.long().cumprod(0).sum()


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) for [V] rows; p itself if the difference vanishes (p == q).
    Chosen on the device (no host read of the sum)."""
    r = (p - q).clamp_min(0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s, p)


def verdict(draft: list[int], q: torch.Tensor, p: torch.Tensor, gen=None) -> torch.Tensor:
    """[k accepted, next token] as one long tensor on p's device: q [g, V], p [g+1, V]."""
    g = len(draft)
    if g == 0:
        return torch.stack([torch.zeros((), dtype=torch.long, device=p.device), sample(p[0], gen)])
    d = to_device(draft, p.device)
    u = torch.rand(g, generator=gen, device=p.device)
    k = n_accepted(d, q, p, u)  # [] on the device
    pk = p.index_select(0, k.view(1))[0]  # [V]: p_{k+1}, the bonus row when k == g
    qk = q.index_select(0, k.clamp_max(g - 1).view(1))[0]
    nxt = torch.where(k == g, pk, residual(pk, qk))
    return torch.stack([k, sample(nxt, gen)])


def greedy_verdict(draft: list[int], p: torch.Tensor) -> torch.Tensor:
    """`verdict` where p (and q) are one-hot (greedy): a draft token is accepted iff it is
    p's argmax, and the next token is the argmax of the first row not accepted (the
    residual of a one-hot p is p). The same result without random draws: a draw from a
    one-hot row costs an exponential per vocabulary entry."""
    top = argmax(p)  # [g+1]
    g = len(draft)
    k = ((top[:g] == to_device(draft, p.device)).long().cumprod(0).sum() if g
         else torch.zeros((), dtype=torch.long, device=p.device))
    return torch.stack([k, top.index_select(0, k.view(1))[0]])


def accept_greedy(draft: list[int], q: torch.Tensor, p: torch.Tensor, gen=None) -> tuple[int, int]:
    """`accept` for greedy decoding (p one-hot, or the logits it is the one-hot of: only
    each row's argmax is read; q is not read), with one blocking host read. On the CPU the
    verdict is read off the rows' argmax, without greedy_verdict's tensor ops (the same
    result; each op costs a decode step ~10 us with the caches cold from the forward)."""
    if p.device.type == "cpu":
        top = to_host(argmax(p))  # [g+1] ints
        k = next((i for i, t in enumerate(draft) if top[i] != t), len(draft))
        return k, top[k]
    k, x = to_host(greedy_verdict(draft, p))
    return k, x


def accept_drawn(draft: list[int], p: torch.Tensor, draws, t0: int) -> tuple[int, int]:
    """`accept_greedy` for a sampled sequence (sampling.py): row r of p [g+1, V] picks its
    token at index t0 + r; the draft's leading tokens that are those picks are accepted,
    the next token is the pick after them. One blocking host read."""
    top = to_host(pick(p, draws, t0))
    k = next((i for i, t in enumerate(draft) if top[i] != t), len(draft))
    return k, top[k]


def accept(draft: list[int], q: torch.Tensor, p: torch.Tensor, gen=None) -> tuple[int, int]:
    """Verify a draft: q [g, V] (draft probs), p [g+1, V] (target probs) -> (k accepted,
    next token), with one blocking host read."""
    k, x = to_host(verdict(draft, q, p, gen))
    return k, x
