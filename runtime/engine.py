"""The N-level speculative engine: each level drafts for the one above with its gamma.

`levels[0]` is a drafter (n-gram or a model level); `levels[1:]` are model levels, the
last being the target over the full cache. Level i produces tokens distributed exactly
as its own model by verifying drafts of level i-1 (`verify`), and those tokens with
their probabilities are the draft for level i+1. TriForce is [drafter, target+retrieval,
target+full]; `retrieval` and `draft` modes are two-level lists.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .errors import TriforceError
from .hostread import READS
from .protocols import RetrievalKV, VerifyingLevel
from .sampling import SamplingParams, probs
from .acceptance import accept


@dataclass
class LevelStats:
    verifications: int = 0  # verification passes this level ran
    drafted: int = 0  # draft tokens it checked
    accepted: int = 0  # of which accepted
    produced: int = 0  # tokens it emitted (accepted + corrected/bonus)
    rejected: int = 0  # verifications that rejected a draft token (k < g)
    host_reads: int = 0  # blocking device-to-host reads of its verifications (the levels below not counted)
    max_host_reads: int = 0  # the most in one verification (the goal: 1)

    def add(self, g: int, k: int):
        self.verifications += 1
        self.drafted += g
        self.accepted += k
        self.produced += k + 1
        self.rejected += k < g

    def read(self, n: int):
        """One verification made n blocking host reads."""
        self.host_reads += n
        self.max_host_reads = max(self.max_host_reads, n)

    @property
    def per_token(self) -> float:
        """Acceptance of the draft tokens the verifier judged: a rejection ends a round, so
        the tokens after it are drafted but never judged. Estimates the per-token rate
        alpha of Leviathan et al.; `accepted / drafted` (TriForce's figure) also counts the
        unjudged tail and so depends on gamma."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else 0.0


class AutoGamma:
    """Pick the top level's gamma from measured acceptance and draft/verify cost.

    Expected tokens per verification with per-token acceptance a is (1 - a^(g+1)) / (1 - a)
    and the cost of a round is t_verify + g * t_draft; take the g that maximises their
    ratio (SpecDec++ and HF's dynamic lookahead adapt the same quantity heuristically).
    """

    def __init__(self, gamma: int, hi: int = 16, decay: float = 0.8):
        self.gamma, self.hi, self.decay = gamma, hi, decay
        self.acc, self.trials = 4.0, 5.0  # prior: a = 0.8
        self.t_draft, self.t_verify = None, None  # EMA seconds per draft token / per verify

    def update(self, g: int, k: int, t_draft: float, t_verify: float) -> int:
        d = self.decay
        self.acc = d * self.acc + k
        self.trials = d * self.trials + k + (k < g)
        if g:
            self.t_draft = self._ema(self.t_draft, t_draft / g)
        self.t_verify = self._ema(self.t_verify, t_verify)
        if self.t_draft is not None:
            self.gamma = self.best(self.acc / self.trials, self.t_draft / self.t_verify)
        return self.gamma

    def _ema(self, old, new):
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def best(self, a: float, c: float) -> int:
        a = min(a, 0.999)
        return max(range(1, self.hi + 1), key=lambda g: (1 - a ** (g + 1)) / ((1 - a) * (1 + g * c)))


@dataclass
class Rebuild:
    """When to rebuild the retrieval cache: `never`, `every:N` tokens, or `adaptive`."""

    kind: str = "never"  # never | every | adaptive
    every: int = 0  # tokens between rebuilds for `every`
    threshold: float = 0.6  # adaptive: rebuild when the middle level's acceptance EMA drops below
    min_tokens: int = 32  # adaptive: at least this many tokens between rebuilds

    @classmethod
    def parse(cls, spec: str) -> "Rebuild":
        if spec in ("never", "adaptive"):
            return cls(spec)
        kind, _, n = spec.partition(":")
        if kind == "every" and n.isdigit() and int(n) > 0:
            return cls("every", int(n))
        raise TriforceError(f"--rebuild {spec!r}: allowed are never, every:N (N >= 1), adaptive")

    def due(self, since: int, acc_ema: float) -> bool:
        if self.kind == "every":
            return since >= self.every
        return self.kind == "adaptive" and since >= self.min_tokens and acc_ema < self.threshold


@dataclass
class Engine:
    levels: list  # [drafter, model levels ..., target over the full cache]
    gammas: list[int]  # gammas[i]: tokens level i proposes per verification by level i+1
    sp: SamplingParams  # the target's sampling (every level samples with it)
    gen: torch.Generator  # randomness for drafts, acceptance and resampling
    auto: AutoGamma | None = None  # adapt gammas[-1]
    rebuild: Rebuild = field(default_factory=Rebuild)  # retrieval cache policy
    accept_fn: object = None  # the acceptance rule; None: acceptance.accept (looked up per call)
    agree: object = int  # makes a value every tensor-parallel rank's (spec_modes passes tp.agree)
    stats: list = field(default_factory=list)  # LevelStats per verifying level
    rebuilds: int = 0  # retrieval cache rebuilds
    reads0: dict = field(default_factory=dict)  # hostread.READS counts when the engine was made
    _since_build: int = 0
    _acc_ema: float = 1.0

    def __post_init__(self):
        for g in self.gammas:
            if g < 1:
                raise TriforceError(f"gamma {g}: must be >= 1")
        for lv in self.levels[1:]:
            if not isinstance(lv, VerifyingLevel):
                raise TypeError(f"level {lv.name!r} cannot verify: only levels[0] may be a drafter")
        self.stats = [LevelStats() for _ in self.levels[1:]]
        self.reads0 = dict(READS.count)

    @property
    def top(self):
        return self.levels[-1]

    def produce(self, i: int, seq: list[int], n: int) -> torch.Tensor:
        """Append >= n tokens (fewer for a drafter) from level i's distribution; their probs [t, V]."""
        if i == 0:
            with READS.at(self.levels[0].name):  # a model drafter reads each token back
                return self.levels[0].draft(seq, n, self.sp, self.gen)
        rows, m0 = [], len(seq)
        while len(seq) - m0 < n:
            rows.append(self.verify(i, seq))
        return torch.cat(rows)

    def verify(self, i: int, seq: list[int]) -> torch.Tensor:
        """Level i checks a draft of level i-1 appended to seq; returns probs of the kept
        tokens. Its own blocking host reads (one: the accepted count and the next token
        together) are counted under its name; the levels below count theirs."""
        name = self.levels[i].name
        n0 = READS.count[name]
        with READS.at(name):
            p = self._verify(i, seq)
        self.stats[i - 1].read(READS.count[name] - n0)
        return p

    def _verify(self, i: int, seq: list[int]) -> torch.Tensor:
        m, lv, top = len(seq), self.levels[i], i == len(self.levels) - 1
        f0 = lv.held
        if top:
            lv.cache.prefetch()  # the link is idle while lower levels draft
        t0 = time.perf_counter()
        q = self.produce(i - 1, seq, self.gammas[i - 1])
        t1 = time.perf_counter()
        draft = seq[m:]
        p = probs(lv.forward(seq, len(draft) + 1), self.sp)  # [g+1, V]
        k, x = (self.accept_fn or accept)(draft, q, p, self.gen)
        del seq[m + k:]
        seq.append(x)
        lv.commit(m + k)
        if top:  # the next verification streams while the levels below sync and draft
            lv.cache.prefetch()
        self._sync_lower(i, f0, m + k)
        self.stats[i - 1].add(len(draft), k)
        if top:
            self._after_top(len(draft), k, t1 - t0, time.perf_counter() - t1)
        return p[: k + 1]

    def _sync_lower(self, i: int, f0: int, n: int):
        for lv in self.levels[:i]:
            lv.rollback(n)
        lower = self.levels[i - 1]
        if isinstance(lower.cache, RetrievalKV):
            lower.cache.absorb(self.levels[i].cache, f0, n)  # exact target KV of verified tokens
            lower.commit(n)

    def _after_top(self, g: int, k: int, t_draft: float, t_verify: float):
        self._since_build += k + 1
        if g:
            self._acc_ema = 0.8 * self._acc_ema + 0.2 * (k / g)
        if self.auto:
            # timings differ between tensor-parallel ranks: all take rank 0's choice
            self.gammas[-1] = self.agree(self.auto.update(g, k, t_draft, t_verify))
        cache = self.levels[-2].cache
        if isinstance(cache, RetrievalKV):
            need = sum(self.gammas) + 2  # pending tokens of one round at most
            if cache.room() < need or self.rebuild.due(self._since_build, self._acc_ema):
                self.rebuild_retrieval()

    def rebuild_retrieval(self):
        """Re-select chunks from the full cache with the verifier's latest queries (its
        cache a `protocols.RecordingKV`)."""
        mid, top = self.levels[-2], self.top
        mid.cache.build(top.cache, top.cache.q, top.held)
        mid.commit(top.held)
        self.rebuilds += 1
        self._since_build, self._acc_ema = 0, 1.0

    def run(self, seq: list[int], max_new: int, eos: set[int], on_token=None) -> list[int]:
        """Decode after prefill: seq ends with the first new token (already sampled).
        `on_token(t)` returning True ends decoding after t (within one verification)."""
        start, out = len(seq) - 1, []
        while True:
            new = seq[start + len(out):]
            for t in new:
                out.append(t)
                if (on_token and on_token(t)) or t in eos or len(out) >= max_new:
                    return out
            self.verify(len(self.levels) - 1, seq)

    def figures(self) -> dict:
        """Statistics for Stats.extra: acceptance per drafting level, mean accepted, times."""
        names = [lv.name for lv in self.levels]
        acc = {names[i]: s.accepted / s.drafted if s.drafted else 0.0 for i, s in enumerate(self.stats)}
        top = self.stats[-1]
        return {
            "acceptance": acc,
            "acceptance_per_token": {names[i]: s.per_token for i, s in enumerate(self.stats)},
            "mean_accepted": top.produced / max(top.verifications, 1),
            "level_time_s": {n: round(lv.time, 3) for n, lv in zip(names, self.levels)},
            "levels": {names[i + 1]: vars(s).copy() for i, s in enumerate(self.stats)},
            "gammas": list(self.gammas),
            "rebuilds": self.rebuilds,
            "host_reads": self.host_reads(),
        }

    def host_reads(self) -> dict:
        """Blocking device-to-host reads per verification of the top level, by the level
        that made them (the top's own: 1; a model drafter: one per drafted token)."""
        n = max(self.stats[-1].verifications, 1)
        return {lv.name: round((READS.count[lv.name] - self.reads0.get(lv.name, 0)) / n, 3)
                for lv in self.levels}
