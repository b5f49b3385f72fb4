"""Sampling: temperature, top-k, top-p, seed. Greedy is the one-hot distribution at the
argmax, so speculative acceptance needs no special case for it.

A sampled sequence draws token t (its index in the sequence) as `pick(p_t, E_t)`: the
token of the largest p_t(v) / E_t(v), where E_t is a vector of exponential variables that
depends on the seed and t alone (`Draws`): an exponential race, exact sampling from p_t
(the Gumbel-max trick). Each token is distributed exactly as p_t, and the text is a
function of the seed, the prompt and the model: not of the speculative path that produced
it (which levels ran, how many tokens they drafted: choices made from timings), nor of the
batch it ran in. So a seeded request gives the same text alone or beside others, in every
mode, and equals autoregressive sampling with the same seed token for token, as greedy
decoding does. A draft token at index t is accepted iff it is the token the verifier picks
there (`acceptance.accept_drawn`): a deterministic draft d with probability p_t(d), as
speculative sampling's min(1, p/q) gives a one-hot q; a model drafter races with the same
E_t, so where its q_t is near p_t it picks the same token (the Gumbel coupling: near
speculative sampling's sum of min(p, q), and not tied to the vocabulary's order as one
shared uniform through the CDF is: that coupling halved the retrieval level's acceptance).
"""
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
    """Draw one token per row of p [..., V] -> [...] (long) from a torch generator (the
    classic speculative-sampling rule, `acceptance.verdict`; sequences sample with `Draws`)."""
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=gen).reshape(p.shape[:-1])


_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: 64 well-mixed bits of x."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Draws:
    """A sampled sequence's exponential variables: E_t [V] for token index t, from the seed
    and t alone (module docstring), made on the device of the rows that race with them
    (torch's generator there: the CPU's and CUDA's give other numbers). The last few are
    kept: the levels of a speculative round race at the same indices."""

    KEEP = 16

    def __init__(self, seed: int):
        self.seed, self._key = seed, _mix(seed & _M64)
        self._kept: dict = {}

    def exp(self, t: int, vocab: int, device) -> torch.Tensor:
        key = (t, vocab, str(device))
        e = self._kept.get(key)
        if e is None:
            g = torch.Generator(device=device)
            g.manual_seed(_mix(self._key ^ t) >> 1)  # < 2**63
            # -log(u), u in [0, 1): in (0, inf], so no token's p / E is a NaN (argmax would take
            # it); 5x faster than exponential_ on a CPU (0.12 ms for 49K, 2 threads)
            e = torch.rand(vocab, generator=g, device=device).log_().neg_()
            if len(self._kept) >= self.KEEP:
                self._kept.pop(next(iter(self._kept)))
            self._kept[key] = e
        return e

    def rows(self, t0: int, n: int, vocab: int, device) -> torch.Tensor:
        return torch.stack([self.exp(t, vocab, device) for t in range(t0, t0 + n)])


def draws(sp: SamplingParams) -> Draws:
    """A sequence's Draws: from its seed, else from a fresh random one."""
    return Draws(sp.seed if sp.seed is not None else torch.seed())


def pick(p: torch.Tensor, draws: Draws, t0: int) -> torch.Tensor:
    """Rows p [T, V] of token indices t0.. -> [T] tokens: each row's largest p(v) / E(v)
    (a token of probability 0 is never picked while another has some)."""
    return argmax(p.float() / draws.rows(t0, p.shape[0], p.shape[-1], p.device))


def draw(p: torch.Tensor, sp: SamplingParams, draws: Draws | None = None, t: int = 0) -> torch.Tensor:
    """Token index t's token from p [V] = `probs(logits, sp)`: greedy takes the one-hot's
    argmax (the same token a pick would give, without a cumulative sum; rows [..., V] too);
    else `pick` at index t (a 0-dim tensor)."""
    return argmax(p) if sp.greedy else pick(p[None], draws, t)[0]


def next_token(logits: torch.Tensor, sp: SamplingParams, draws: Draws | None = None, t: int = 0) -> torch.Tensor:
    """`draw(probs(logits, sp), sp, draws, t)` for logits [1, V] (-> [1]) or [V] (-> []):
    greedy straight from the logits' argmax (the same token: the one-hot's argmax is the
    logits' first maximum), without building the one-hot distribution each step."""
    if sp.greedy:
        return argmax(logits)
    p = probs(logits, sp)
    return pick(p.reshape(1, -1), draws, t).reshape(p.shape[:-1])
