"""The N-level speculative engine: each level drafts for the one above with its gamma.

`levels[0]` is a drafter (n-gram or a model level); `levels[1:]` are model levels, the
last being the target over the full cache. Level i produces tokens distributed exactly
as its own model by verifying drafts of level i-1 (`verify`), and those tokens with
their probabilities are the draft for level i+1. TriForce is [drafter, target+retrieval,
target+full]; `retrieval` and `draft` modes are two-level lists.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import TriforceError
from ..batch.member import clock
from ..hostread import READS, to_device, to_host
from ..options import Rebuild  # noqa: F401  (a policy value: parsed with the other options)
from ..protocols import RetrievalKV, SizingDrafter, VerifyingLevel
from ..sampling import SamplingParams, argmax, probs
from .acceptance import accept_drawn, accept_greedy


@dataclass
class DraftStats:
    """Draft tokens judged: one drafter's (whichever level verified them), or one verifier's
    (whichever level drafted them: a bypass round's draft comes from further down)."""
    drafted: int = 0  # draft tokens checked
    accepted: int = 0  # of which accepted
    rejected: int = 0  # verifications that rejected a draft token (k < g)

    def judged(self, g: int, k: int):
        """One verification kept k of g draft tokens."""
        self.drafted += g
        self.accepted += k
        self.rejected += k < g

    @property
    def rate(self) -> float:
        """accepted / drafted: TriForce's figure."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_token(self) -> float:
        """Acceptance of the draft tokens the verifier judged: a rejection ends a round, so
        the tokens after it are drafted but never judged. Estimates the per-token rate
        alpha of Leviathan et al.; `accepted / drafted` (TriForce's figure) also counts the
        unjudged tail and so depends on gamma."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else 0.0


@dataclass
class LevelStats(DraftStats):
    """A verifying level's passes: the drafts it judged, what it produced, its host reads."""
    verifications: int = 0  # verification passes this level ran (bypassed drafters too)
    produced: int = 0  # tokens it emitted (accepted + corrected/bonus)
    host_reads: int = 0  # blocking device-to-host reads of its verifications (the levels below not counted)
    max_host_reads: int = 0  # the most in one verification (the goal: 1)

    def add(self, g: int, k: int):
        """One verification kept k of g draft tokens."""
        self.verifications += 1
        self.produced += k + 1
        self.judged(g, k)

    def read(self, n: int):
        """One verification made n blocking host reads."""
        self.host_reads += n
        self.max_host_reads = max(self.max_host_reads, n)


GAMMA_MAX = 16  # AutoGamma's largest gamma


def rollback_depth(g) -> int:
    """Positions a level's cache may hold above the length it is later committed or rolled
    back to (GenerationOptions `g`): what a window layer's ring keeps beyond its window
    (cache.WindowRing). In a round of `_verify` starting with len(seq) = m, every level is
    left at m + k >= m; the retrieval level verifies up to γ2 tokens in steps of at most
    γ1 + 1, so it and the drafter write up to position m + γ2 + γ1 - 2, and the top's
    forward of those drafts up to m + γ1 + γ2 - 1 (one bypassed level only shortens
    this). With γ2 'auto' up to GAMMA_MAX; 2 more, as `_after_top`'s room."""
    g2 = max(g.gamma2_start, GAMMA_MAX) if g.gamma2 == "auto" else int(g.gamma2)
    return g.gamma1 + g2 + 2


class AutoGamma:
    """Pick the top level's gamma from measured acceptance and draft/verify cost.

    Expected tokens per verification with per-token acceptance a is (1 - a^(g+1)) / (1 - a)
    and the cost of a round is t_verify(g + 1) + g * t_draft (the verifier's forward of g+1
    tokens, as the engine measured its widths); take the g that maximises their
    ratio (SpecDec++ and HF's dynamic lookahead adapt the same quantity heuristically).
    """

    def __init__(self, gamma: int, hi: int = GAMMA_MAX, decay: float = 0.8):
        self.gamma, self.hi, self.decay = gamma, hi, decay
        self.acc, self.trials = 4.0, 5.0  # prior: a = 0.8
        self.t_draft, self.t_verify = None, None  # EMA seconds per draft token / per verify

    def update(self, g: int, k: int, t_draft: float, t_verify: float, verify_cost=None) -> int:
        """One verification of g drafts kept k; t_draft and t_verify its seconds.
        `verify_cost(w)`: seconds of the verifier's forward of w tokens (the engine's measured
        widths, `Engine.cost`); without it a verification costs t_verify at any width."""
        d = self.decay
        self.acc = d * self.acc + k
        self.trials = d * self.trials + k + (k < g)
        if g:
            self.t_draft = self._ema(self.t_draft, t_draft / g)
        self.t_verify = self._ema(self.t_verify, t_verify)
        if self.t_draft is not None:
            self.gamma = self.best_priced(self.acc / self.trials, self.t_draft,
                                          verify_cost or (lambda w: self.t_verify))
        return self.gamma

    def _ema(self, old, new):
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def best_priced(self, a: float, t_draft: float, verify_cost) -> int:
        """The g that maximises tokens per second when a verification of g+1 tokens costs
        verify_cost(g + 1): where computing the rows sets its time (a CPU's attention over a
        long cache), each draft widens it, and a shorter γ pays more."""
        return max(range(1, self.hi + 1), key=lambda g: expected_tokens(a, g) / (g * t_draft + verify_cost(g + 1)))


# a forward of w tokens costs 1 + kappa (w - 1) of one, until the top measured two widths:
# a CPU is compute-bound at a few rows (measured: 5 rows ~1.9x one), a GPU reads the weights once
KAPPA = {"cpu": 0.25, "cuda": 0.02}
# a retrieval level whose best case promises at least this speedup is scored at once; one
# that promises less waits until the exploring share covers its scoring (Engine._eager).
# The best case counts every draft accepted: at a per-token acceptance of 0.8 (high for
# retrieval drafts of essays) a round of 6 drafts yields 3.95 of its 7 tokens, so a best
# case below ~1.75x likely loses; 1.5 leaves room for the error of its price
EAGER = 1.5


def expected_tokens(a: float, g: int) -> float:
    """Tokens one verification of g drafts yields at per-token acceptance a (the corrected
    or bonus token included): 1 + a + ... + a^g."""
    a = min(a, 0.999)
    return (1 - a ** (g + 1)) / (1 - a)


class Acceptance:
    """One level's drafts as the levels above judge them: per-token acceptance as decayed
    counts of accepted and rejected tokens, the mean length of its drafts (an n-gram lookup
    often proposes fewer than its gamma, a sized one often none) and the mean tokens a
    verification of them yields. The prior is one accepted and two rejected tokens (a few
    early n-gram matches move it slowly), or one of each for a model level, whose every
    scored row is a verdict (`prior_rejected`)."""

    def __init__(self, decay: float = 0.9, prior_rejected: float = 2.0):
        self.prior_rejected = prior_rejected
        self.acc = self.rej = 0.0
        self.length: float | None = None
        self.tokens: float | None = None  # tokens per verification (accepted + 1)
        self.n, self.decay = 0, decay

    def add(self, accepted: float, rejected: float, drafted: int | None = None, tokens: int | None = None):
        if accepted or rejected:
            self.acc = self.decay * self.acc + accepted
            self.rej = self.decay * self.rej + rejected
            self.n += 1
        if drafted is not None:
            self.length = self._ema(self.length, drafted)
        if tokens is not None:
            self.tokens = self._ema(self.tokens, tokens)

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        return new if old is None else 0.8 * old + 0.2 * new

    @property
    def rate(self) -> float | None:
        # the prior: one accepted, two rejected (a few lucky early matches are no verdict); a
        # model level's (every row a verdict, none a lucky match): one of each
        return (self.acc + 1.0) / (self.acc + self.rej + 1.0 + self.prior_rejected) if self.n else None


class Bypass:
    """Which levels below the top run: speculation never costs more than it saves.

    A configuration is a set of skipped levels (the drafter, the retrieval level; never the
    top). Each is judged by what it delivers: seconds per produced token, as decayed sums of
    the seconds and tokens of its top-level rounds (a round yields 1 to γ+1 tokens, so a
    ratio of sums, not a mean of ratios). The run starts with every level; after `warm`
    rounds each other configuration is probed until it produced `probe_tokens` tokens (at
    most `probe_rounds` rounds, fewer once it is `hopeless` times slower than the best known),
    and the cheapest runs. Every round counts (levels pay their one-time costs, such as
    indexing the prompt's n-grams, before the first), except with `first_per_config` (CUDA
    graphs: a new verification width captures) each configuration's first round. Probes
    repeat every `interval` tokens, the interval doubling while the choice holds (up to
    `max_interval`) and falling back when it changes, so a level that stopped paying is
    bypassed and one that pays again (text turned repetitive) comes back. Skipped levels
    stay in sync (the retrieval cache absorbs every verified token; the n-gram index reads
    the shared sequence), so switching costs nothing. Tokens per skipped level go to the stats."""

    def __init__(self, optional: list[int], warm: int = 1, interval: int = 32, max_interval: int = 512,
                 probe_tokens: int = 8, probe_rounds: int = 3, margin: float = 0.97, decay: float = 0.8,
                 hopeless: float = 1.2, first_per_config: bool = False, bound=None, predict=None,
                 start_plain: bool = False, trust: float = 0.85, explore: float | None = None,
                 unready=None, lenient=None):
        import itertools
        self.configs = [frozenset(c) for r in range(len(optional) + 1)
                        for c in itertools.combinations(optional, r)]
        self.sums = {c: [0.0, 0.0] for c in self.configs}  # decayed seconds, tokens
        self.seen = {c: 0 for c in self.configs}  # rounds run per configuration
        # every level runs; or none (`start_plain`): plain decoding until a prediction or probe says otherwise
        self.current = self.configs[-1 if start_plain else 0]
        self.warm, self.base, self.max_interval, self.margin, self.decay = warm, interval, max_interval, margin, decay
        self.probe_tokens, self.probe_rounds = probe_tokens, probe_rounds
        self.hopeless, self.first_per_config = hopeless, first_per_config
        self.bound = bound  # bound(c): seconds per token c costs at best (None: unknown)
        self.predict = predict  # predict(c): seconds per token c is expected to cost (None: unknown)
        self.trust = trust  # probe what `predict` expects below trust x the best measured: its error margin
        self.unready = unready  # unready(c): c may not be probed yet (a measurement of it is due first)
        # lenient(c): c may pay a lot at best: probed where predicted no slower than the best
        # measured, not `trust` faster (its prediction rests on a few scored tokens)
        self.lenient = lenient
        self.rest = {c: [0, 0] for c in self.configs}  # a hopeless probe's: tokens to sit out, next wait
        self.interval = interval
        self.probes: list[frozenset] = []
        self.probe = [0, 0]  # tokens, rounds of the probe under way
        self.rounds, self.since_probe = 0, 0
        self.skipped: dict[int, int] = {i: 0 for i in optional}  # tokens produced with level i skipped
        self.tokens = 0  # tokens produced so far
        self.probed_at = {c: -interval for c in self.configs}  # self.tokens when c's latest probe ended
        self.switches = 0
        # the early cycle (`_early`): at most one, before `warm`; it neither moves the
        # interval nor stands in for the cycle at `warm` (which follows it once it ends)
        self.early, self._in_early, self._warmed = False, False, False
        # exploring's price cap: the seconds probes cost beyond what the running configuration
        # would have taken for their tokens, plus scorings (`explored`), stay within `explore`
        # x the decode time so far before another probe or scoring starts (None: no cap)
        self.explore, self.spent, self.elapsed = explore, 0.0, 0.0

    def may_explore(self, reserve: float = 0.0) -> bool:
        """Exploring's cost so far, plus `reserve` seconds a step about to start is known to
        cost, is within its share of the time decoded so far."""
        return self.explore is None or self.spent + reserve <= self.explore * self.elapsed

    def explored(self, seconds: float):
        """Seconds of measuring outside the rounds (a scoring forward): all exploring."""
        self.spent += seconds
        self.elapsed += seconds

    def spt(self, c: frozenset) -> float | None:
        s, t = self.sums[c]
        return s / t if t else None

    def cycle_due(self) -> bool:
        """The next `choose` starts a probe cycle."""
        return not self.probes and (self.may_explore() or any(
            self.waiting(c) and self._first_lenient(c) for c in self.configs)) and (
            self.rounds == self.warm or self._early() or (self.rounds > self.warm and (
                self.since_probe >= self.interval or (self.early and not self._warmed))))

    def _early(self) -> bool:
        """Before `warm` rounds, once the first is timed: a configuration that may pay a lot
        and never ran (`_first_lenient`: the retrieval level at long context) is probed at
        once, not after `warm` plain rounds (a short request would decode a tenth of its
        tokens plain); the probe's own rounds measure it. The other configurations wait for
        the cycle at `warm`."""
        return (not self.early and 0 < self.rounds < self.warm
                and any(self.waiting(c) and self._first_lenient(c) for c in self.configs))

    def waiting(self, c: frozenset) -> bool:
        """c is neither running nor sitting out: the next probe cycle judges it."""
        return c != self.current and self.rest[c][0] <= 0

    def choose(self) -> frozenset:
        """The configuration of the next top-level round."""
        if self.cycle_due():
            early = self.rounds < self.warm
            self.early, self._in_early = self.early or early, early
            self._warmed = self._warmed or not early
            self.probes = [c for c in sorted(self.configs, key=len, reverse=True)
                           if c != self.current and self.rest[c][0] <= 0 and (not early or self._first_lenient(c))]
            self.since_probe, self.probe = 0, [0, 0]
        elif not self.probes and self.rounds % 4 == 0 and self.may_explore():  # predictions cost
            self.probes = self._promising()  # microseconds: not every round
        # judged by the latest measurements just before it would start; none starts once
        # exploring has spent its share (the cycle's rest waits for the next one)
        while self.probes and self.probe == [0, 0] and (not (self.may_explore() or self._first_lenient(self.probes[0]))
                                                        or self._beaten(self.probes[0])):
            self._probed(ran=False)
        return self.probes[0] if self.probes else self.current

    def _first_lenient(self, c: frozenset) -> bool:
        """c may pay a lot (`lenient`) and never ran: its first probe does not wait for the
        exploring share (which its scoring, just before, may have spent), as the first
        scoring does not."""
        return self.seen[c] == 0 and bool(self.lenient) and self.lenient(c)

    def _promising(self) -> list:
        """Between probe cycles: the configuration `predict` expects to beat the best
        measured one by the margin (its acceptance measured as the text goes: the n-gram
        drafter's judged proposals, the retrieval level's scorings), probed at once; each at most once per `base` tokens (a prediction is an
        estimate: the probe's measurement decides)."""
        known = self._known()
        if not self.predict or not known:
            return []
        best = self.trust * min(known.values())
        cands = [(p, i) for i, c in enumerate(self.configs)  # a prediction outranks a rest
                 if c != self.current and self.tokens - self.probed_at[c] >= self.base
                 and (p := self.predict(c)) is not None and p < best]
        return [self.configs[min(cands)[1]]] if cands else []

    def record(self, c: frozenset, seconds: float, tokens: int):
        self.rounds += 1
        self.tokens += tokens
        self.since_probe += tokens
        for r in self.rest.values():
            r[0] -= tokens
        for i in c:
            self.skipped[i] += tokens
        self.seen[c] += 1
        probing = bool(self.probes) and c == self.probes[0]
        self.elapsed += seconds
        if probing:  # what the probe cost beyond the running configuration's pace
            pace = self.spt(self.current)
            self.spent += seconds if pace is None else max(0.0, seconds - tokens * pace)
        if not self.first_per_config or self.seen[c] > 1:  # a first round captures graphs
            s = self.sums[c]
            # a probe's rounds count alike, and a new probe outweighs what was measured before
            d = (0.25 if self.probe[1] == 0 else 1.0) if probing else self.decay
            s[0], s[1] = d * s[0] + seconds, d * s[1] + tokens
            if probing:
                self.probe = [self.probe[0] + tokens, self.probe[1] + 1]
        if probing:
            hopeless = self._hopeless(c)
            if hopeless and self.seen[c] >= 2:  # one unlucky round is no verdict: rest after two
                self._rest(c)
            if self.probe[0] >= self.probe_tokens or self.probe[1] >= self.probe_rounds or hopeless:
                if not hopeless:
                    self.rest[c] = [0, 0]
                self._probed()
        elif not self.probes and self.rounds > self.warm:
            self._switch()  # the running configuration got slower than a probed one

    def _known(self, but: frozenset | None = None) -> dict:
        """Seconds per token of every measured configuration (`but` left out)."""
        return {c: v for c in self.configs if c != but and (v := self.spt(c)) is not None}

    def _hopeless(self, c: frozenset) -> bool:
        """A probe `hopeless` times slower than the best known after one counted round ends early."""
        known = self._known(but=c)
        return self.probe[1] >= 1 and bool(known) and self.spt(c) > self.hopeless * min(known.values())

    def _probed(self, ran: bool = True):
        """The probe at the head of the list is done (`ran`: it ran, rather than judged
        beaten); after the last, the choice is made."""
        c = self.probes.pop(0)
        if ran:
            self.probed_at[c] = self.tokens
        self.probe = [0, 0]
        if not self.probes:
            if self._in_early:  # the early cycle: the choice, not the interval's clock
                self._in_early = False
                self._switch()
                return
            self.since_probe = 0
            if not self._switch():
                self.interval = min(2 * self.interval, self.max_interval)  # the choice holds

    def _beaten(self, c: frozenset) -> bool:
        """No probe for c when the best measured configuration beats it anyway: by its
        predicted seconds per token (measured acceptance and forward costs: skipped this
        cycle, and sits out for a while when `hopeless` times slower), or else even at full
        acceptance (`bound`) by `hopeless` times (an estimate: it sits out for a while).
        An `unready` one is skipped this cycle (it does not sit out)."""
        if self.unready and self.unready(c):
            return True
        known = self._known()
        if not known:
            return False
        best = min(known.values())
        p = self.predict(c) if self.predict else None
        if p is not None:
            if p > self.hopeless * best:
                self._rest(c)
            return p >= (1.0 if self.lenient and self.lenient(c) else self.trust) * best
        b = self.bound(c) if self.bound else None
        if b is None or b <= self.hopeless * best:
            return False
        self._rest(c)
        return True

    def _rest(self, c: frozenset):
        """A hopeless configuration sits out probe cycles: 4 intervals, twice as long each
        time it is found hopeless again (a probe that is not resets it). Measured ones rest
        after two rounds at least: one round's acceptance is luck."""
        r = self.rest[c]
        r[1] = 2 * r[1] if r[1] else 4 * self.base
        r[0] = r[1]

    def _switch(self) -> bool:
        known = self._known()
        if not known:
            return False
        best = min(known, key=known.get)
        if best == self.current or (self.current in known and known[best] >= self.margin * known[self.current]):
            return False
        if known.get(self.current, 0) > self.hopeless * known[best] and self.seen[self.current] >= 2:
            self._rest(self.current)
        self.current, self.interval = best, self.base
        self.switches += 1
        return True

    def figures(self, names: list[str]) -> dict:
        return {"bypassed_tokens": {names[i]: n for i, n in self.skipped.items()},
                "bypass_switches": self.switches,
                "exploring_ms": round(self.spent * 1e3, 1),
                "ms_per_token_by_skipped": {"+".join(names[i] for i in sorted(c)) or "none": round(v * 1e3, 2)
                                            for c, v in self._known().items()},
                "running": [n for i, n in enumerate(names) if i not in self.current]}


@dataclass
class Engine:
    levels: list  # [drafter, model levels ..., target over the full cache]
    gammas: list[int]  # gammas[i]: tokens level i proposes per verification by level i+1
    sp: SamplingParams  # the target's sampling (every level samples with it)
    gen: object  # sampling.Draws: the uniform each token index is picked with
    auto: AutoGamma | None = None  # adapt gammas[-1]
    rebuild: Rebuild = field(default_factory=Rebuild)  # retrieval cache policy
    accept_fn: object = None  # an acceptance rule (draft, q, p, gen) -> (k, x); None: accept_greedy, or accept_drawn when sampled
    agree: object = int  # makes a value every tensor-parallel rank's (spec.modes passes tp.agree)
    stats: list = field(default_factory=list)  # LevelStats per verifying level
    drafts: list = field(default_factory=list)  # DraftStats per drafting level (levels[:-1])
    rebuilds: int = 0  # retrieval cache rebuilds
    reads0: dict = field(default_factory=dict)  # hostread.READS counts when the engine was made
    bypass: Bypass | None = None  # skip levels that do not pay (None: every level always runs)
    skip: frozenset = frozenset()  # levels the current round skips
    forward_s: dict = field(default_factory=dict)  # (level index, tokens) -> seconds of its forwards (smoothed)
    accept: dict = field(default_factory=dict)  # level index -> Acceptance of its drafts
    scores: int = 0  # teacher-forced scorings of the retrieval level (`score`)
    kappa: float = KAPPA["cpu"]  # the width cost prior of `cost` (KAPPA: by device)
    # read_ratio(i): bytes a one-token forward of level i reads (weights and the KV it
    # attends) over the top level's; prices a level that has not run yet (None: unknown)
    read_ratio: object = None
    _deferring: bool = False  # a scoring waits for the exploring share (`_score_due`)
    _sizing: bool = False  # levels[0] sizes its drafts (protocols.SizingDrafter): priced and shown the text
    _retrieval: list = field(default_factory=list)  # per level: its cache is a protocols.RetrievalKV
    _behind: int | None = None  # the bypassed retrieval level has absorbed up to here (None: all)
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
        self.drafts = [DraftStats() for _ in self.levels[:-1]]
        self.reads0 = dict(READS.count)
        self.accept = {j: Acceptance(prior_rejected=2.0 if self.levels[j].cache is None else 1.0)
                       for j in range(len(self.levels) - 1)}
        self._sizing = isinstance(self.levels[0], SizingDrafter)
        if self._sizing:
            self.levels[0].agree = self.agree  # its sizes, priced by local timings, are rank 0's
        # which levels run over a retrieval cache (a protocol isinstance costs ~25 us: not per round)
        self._retrieval = [isinstance(lv.cache, RetrievalKV) for lv in self.levels]
        if self.bypass is not None:
            self.bypass.bound = self.bypass.bound or self.best_case
            self.bypass.predict = self.bypass.predict or self.predict
            self.bypass.unready = self.bypass.unready or self.unready
            self.bypass.lenient = self.bypass.lenient or self.lenient

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
        tokens (greedy: their logits, whose argmax is all `accept_greedy` reads of them).
        Its own blocking host reads (one: the accepted count and the next token together)
        are counted under its name; the levels below count theirs."""
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
        t0 = clock()
        j = next((j for j in range(i - 1, -1, -1) if j not in self.skip), None)  # who drafts
        if j == 0 and self._sizing:
            self.levels[0].price = self.relative(i)
        q = torch.zeros(0) if j is None else self.produce(j, seq, self.gammas[j])
        t1, cap = clock(), self._capture_s(lv)
        draft = seq[m:]
        p = lv.forward(seq, len(draft) + 1)  # [g+1, V] logits: row r picks token index m + r
        if self.accept_fn is not None or not self.sp.greedy:  # accept_greedy reads the argmax alone
            p = probs(p, self.sp)
        self._timed(i, len(draft) + 1, clock() - t1 - (self._capture_s(lv) - cap))
        if self.accept_fn is not None:
            k, x = self.accept_fn(draft, q, p, self.gen)
        elif self.sp.greedy:
            k, x = accept_greedy(draft, q, p)
        else:  # the token each row picks at its index's uniform (sampling.py): as greedy's argmax
            k, x = accept_drawn(draft, p, self.gen, m)
        if j is not None:
            self.accept[j].add(k, int(k < len(draft)), len(draft), k + 1)
        del seq[m + k:]
        seq.append(x)
        lv.commit(m + k)
        if top:  # the next verification streams while the levels below sync and draft
            lv.cache.prefetch()
            if self._sizing:
                self.levels[0].judge(seq, len(seq))
        self._sync_lower(i, f0, m + k)
        self.stats[i - 1].add(len(draft), k)
        if j is not None:
            self.drafts[j].judged(len(draft), k)
        if top:  # the whole chain drafted (no level skipped): what AutoGamma and the rebuild policy learn from
            self._after_top(len(draft), k, t1 - t0, clock() - t1, j == i - 1 and not self.skip)
        return p[: k + 1]

    def _sync_lower(self, i: int, f0: int, n: int):
        for lv in self.levels[:i]:
            lv.rollback(n)
        lower = self.levels[i - 1]
        if self._retrieval[i - 1]:
            if i - 1 in self.skip and self._may_defer(i):
                # bypassed: it takes the verified tokens in one copy when it runs again (catch_up)
                self._behind = f0 if self._behind is None else min(self._behind, f0)
                return
            lower.cache.absorb(self.levels[i].cache, f0, n)  # exact target KV of verified tokens
            lower.commit(n)

    def _may_defer(self, i: int) -> bool:
        """Level i-1's absorbing may wait: the full cache holds the tokens on the device
        (an offloaded one would stream them again) and every layer whole (a window layer's
        ring moves on)."""
        return not self.levels[i].cache.layer_major and self.levels[i - 1].cache.ring is None

    def catch_up(self):
        """The bypassed retrieval level takes the verified tokens it missed in one copy per
        layer (rebuilt instead where its room would not hold them and a round)."""
        if self._behind is None:
            return
        mid, top, lo = self.levels[-2], self.top, self._behind
        self._behind = None
        if mid.cache.room() < top.held - lo + self._round_room():
            self.rebuild_retrieval()
            return
        mid.cache.absorb(top.cache, lo, top.held)
        mid.commit(top.held)

    def _after_top(self, g: int, k: int, t_draft: float, t_verify: float, full_chain: bool = True):
        self._since_build += k + 1
        if g and full_chain:
            self._acc_ema = 0.8 * self._acc_ema + 0.2 * (k / g)
        if self.auto and full_chain:
            # timings differ between tensor-parallel ranks: all take rank 0's choice
            top = len(self.levels) - 1
            self.gammas[-1] = self.agree(self.auto.update(g, k, t_draft, t_verify, lambda w: self.cost(top, w)))
        cache = self.levels[-2].cache
        if self._retrieval[-2]:
            if cache.room() < self._round_room() or self.rebuild.due(self._since_build, self._acc_ema):
                self.rebuild_retrieval()

    def _round_room(self) -> int:
        """Pending tokens one round may append to the retrieval cache, at most."""
        return sum(self.gammas) + 2

    def rebuild_retrieval(self):
        """Re-select chunks from the full cache with the verifier's latest queries (its
        cache a `protocols.RecordingKV`)."""
        mid, top = self.levels[-2], self.top
        self._behind = None  # a rebuild selects from the full cache as it is now
        mid.cache.build(top.cache, top.cache.q, top.held)
        mid.commit(top.held)
        self.rebuilds += 1
        self._since_build, self._acc_ema = 0, 1.0

    def best_case(self, skip: frozenset, priced: bool = False) -> float | None:
        """Seconds per token a round with `skip` costs at best: every draft accepted, so a
        model level proposing g tokens runs ceil(g / (its drafter's γ + 1)) forwards of that
        width per call, each costing its latest measured forward of that width (a forward of
        γ+1 tokens costs several of one: a decode's cost is not a verification's), and a
        model drafter one forward of one token per drafted token (an n-gram lookup: next to
        nothing). None until each level that runs has been timed at the width it would run;
        `priced`: a level never timed is priced instead (`_priced`)."""
        run = [i for i in range(len(self.levels)) if i not in skip]

        def cost(i: int, w: int) -> float | None:
            return self._priced(i, w) if priced else self.forward_s.get((i, w))

        def make(n: int, want: int) -> float | None:  # seconds for level run[n] to produce `want` tokens
            i = run[n]
            if self.levels[i].cache is None:
                return 0.0
            below = self.gammas[run[n - 1]] + 1 if n else 1  # tokens one forward yields at best
            t = cost(i, below)
            sub = make(n - 1, self.gammas[run[n - 1]]) if n else 0.0
            if t is None or sub is None:
                return None
            return math.ceil(want / below) * (t + sub)

        per = self.gammas[run[-2]] + 1 if len(run) > 1 else 1
        secs = make(len(run) - 1, per)
        return None if secs is None else secs / per

    def _priced(self, i: int, w: int) -> float | None:
        """Seconds of a forward of w tokens by level i: `cost`'s, or for a level that never
        ran, the top's one-token forward scaled by what level i reads (`read_ratio`: an
        estimate from below where compute, not reading, sets the time, as on a CPU) and by
        the width's cost (`_width`). None while neither is known."""
        t = self.cost(i, w)
        if t is not None:
            return t
        t1, ratio = self.cost(len(self.levels) - 1, 1), self.read_ratio(i) if self.read_ratio else None
        if t1 is None or ratio is None:
            return None
        return t1 * ratio * self._width(w) / self._width(1)

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
            self.round(seq)

    def round(self, seq: list[int]):
        """One verification by the top level, with the levels `bypass` chooses."""
        if self.bypass is None:
            self.verify(len(self.levels) - 1, seq)
            return
        b = self.bypass
        # timings differ between tensor-parallel ranks: all take rank 0's decisions
        due = 1 if self._score_due() else 0  # a host bool (no tensor)
        if self.agree(due):
            self.score(seq)
        c = b.configs[self.agree(b.configs.index(b.choose()))]
        if len(self.levels) - 2 not in c:
            self.catch_up()  # the level below the top runs again
        if 0 not in c and self.levels[0].cache is not None and self.levels[0].held < self.top.held:
            self.levels[0].resume(seq, self.top)  # a model drafter skipped until now
        self.skip, n0, t0 = c, len(seq), clock()
        try:
            self.verify(len(self.levels) - 1, seq)
        finally:
            self.skip = frozenset()
        b.record(c, clock() - t0, len(seq) - n0)

    def _scored(self) -> int | None:
        """The retrieval level (the one `score` measures), if the bypass may skip it."""
        r = next((i for i, ret in enumerate(self._retrieval[:-1]) if ret), None)
        return r if r is not None and self.bypass is not None and any(r in c for c in self.bypass.configs) else None

    def _score_due(self) -> bool:
        """A probe cycle starts next and would judge a configuration running the retrieval
        level that `predict` cannot price from measurements since the last cycle, and the
        exploring share covers the scoring: its measured cost, once there is one; before,
        nothing where the level may pay a lot (`_eager`: only the first scoring may
        overshoot), else the top level's forward of as many rows (an estimate from above: a
        level that can at best pay a little waits until the run is long enough to afford
        learning whether it does; `_deferring` holds its probes back meanwhile)."""
        r, b = self._scored(), self.bypass
        if not (r is not None and b.cycle_due() and r in b.current
                and any(r not in c and b.waiting(c) for c in b.configs)):
            return False
        w = self._score_rows(r)
        cost = self.forward_s.get((r, w))
        if cost is None:
            cost = 0.0 if self._eager(r) else self.cost(len(self.levels) - 1, w) or 0.0
        ok = b.may_explore(cost)
        self._deferring = not ok and self.accept[r].rate is None
        return ok

    def _eager(self, r: int) -> bool:
        """Level r (drafting for the top, never run) may pay `EAGER` times or more: at its
        best (every draft accepted) a round of its γ drafts and the top's verification
        costs that much less per token than the top's one-token forward, its own forward
        priced by what it reads (`read_ratio`: an estimate from below where compute, not
        reading, sets the time, as on a CPU). True while a price is unknown."""
        if r != len(self.levels) - 2:
            return True
        p = self._promises(frozenset(range(r)))  # r drafting alone for the top
        return p is None or p

    def _promises(self, skip: frozenset) -> bool | None:
        """A round with `skip` costs at best (`best_case`, levels that never ran priced by
        the bytes they read) `EAGER` times less per token than the top's one-token forward;
        None while a price is unknown."""
        t1, best = self.cost(len(self.levels) - 1, 1), self.best_case(skip, priced=True)
        return None if t1 is None or best is None else t1 >= EAGER * best

    def lenient(self, c: frozenset) -> bool:
        """c runs the retrieval level, drafting for the top, whose best case promises `EAGER`
        times the top's plain decode (`_eager`): its prediction rests on a scoring of a few
        tokens and a prior (Acceptance), so a prediction of no loss earns it a probe, whose
        measurement decides."""
        r = self._scored()
        return r is not None and r not in c and r == len(self.levels) - 2 and self._eager(r)

    def unready(self, c: frozenset) -> bool:
        """c may not be probed yet: it runs the retrieval level whose scoring waits
        (`_score_due`: no probe of it before its acceptance is measured, a probe costs more
        than the scoring), or a model drafter that never ran and whose best case (every
        draft accepted, levels that never ran priced by the bytes they read: `best_case`)
        promises less than `EAGER` times the top's plain decode (a probe round of γ drafts
        costs several decodes; the promise grows with the context)."""
        r = self._scored()
        if self._deferring and r is not None and r not in c and self.accept[r].rate is None:
            return True
        if 0 in c or self.levels[0].cache is None or self.accept[0].rate is not None:
            return False
        return not self._promises(c)

    def _score_rows(self, r: int) -> int:
        """Rows of a scoring forward of level r: its verification width."""
        return self.gammas[r - 1] + 1 if r else min(self.gammas[r], 8)

    def score(self, seq: list[int]):
        """Measure the bypassed retrieval level's acceptance without speculating: one forward
        of it over the last w verified tokens (w = its verification width), teacher-forced,
        each row judged against the token the target chose next (greedy: the argmax;
        sampled: the probability it gave that token). Its cache is rolled back for it and,
        where the full cache holds those positions on the device, given their exact KV
        again; an offloaded full cache would stream them, so the level keeps its own."""
        self.catch_up()
        r = self._scored()
        lv, top = self.levels[r], self.top
        end = top.held
        w = min(self._score_rows(r), end - lv.cache.base)
        if w < 2:
            return
        lo = end - w
        lv.rollback(lo)
        t0, cap = clock(), self._capture_s(lv)
        with READS.at(lv.name):
            rows = lv.forward(seq[:end], w)  # [w, V]: row j predicts position lo + 1 + j
            truth = to_device(seq[lo + 1: end + 1], rows.device)
            if self.sp.greedy:
                hit = to_host((argmax(rows) == truth).sum())
            else:
                hit = to_host(probs(rows, self.sp).gather(1, truth[:, None]).sum())
        dt = clock() - t0
        self._timed(r, w, dt - (self._capture_s(lv) - cap))
        self.bypass.explored(dt)
        if not top.cache.layer_major:
            lv.rollback(lo)
            lv.cache.absorb(top.cache, lo, end)
        lv.commit(end)
        self.accept[r].add(hit, w - hit)
        self.scores += 1

    @staticmethod
    def _capture_s(lv) -> float:
        """Seconds level lv's step has spent capturing CUDA graphs (not a forward's cost: a
        width timed with its capture would be priced too high to be drafted again)."""
        return lv.step.capture_s

    def _timed(self, i: int, width: int, seconds: float):
        """Smoothed seconds of level i's forwards of `width` tokens: a faster one moves the
        figure half way, a slower one a fifth (a stall of the machine is not the forward's
        cost, and a width priced too high by one would not be drafted again to correct it)."""
        old = self.forward_s.get((i, width))
        w = 0.5 if old is None or seconds < old else 0.2
        self.forward_s[(i, width)] = seconds if old is None else (1 - w) * old + w * seconds

    def cost(self, i: int, w: int) -> float | None:
        """Seconds of a forward of w tokens by level i: measured, or scaled from its nearest
        measured width along the top level's measured widths (a line through its two
        nearest; with fewer, 1 + kappa (w - 1)). None: level i never ran a forward."""
        f = self.forward_s
        if (i, w) in f:
            return f[(i, w)]
        mine = [u for j, u in f if j == i]
        if not mine:
            return None
        u = min(mine, key=lambda u: (abs(u - w), u))
        return f[(i, u)] * self._width(w) / self._width(u)

    def relative(self, i: int):
        """cost(w): a forward of w tokens by level i in forwards of one (`cost`'s figures;
        1 + kappa (w - 1) before level i ran one): what a sized draft weighs its rows by."""
        one = self.cost(i, 1)

        def cost(w: int) -> float:
            t = self.cost(i, w)
            return t / one if one and t is not None else 1 + self.kappa * (w - 1)
        return cost

    def _width(self, w: int) -> float:
        top = len(self.levels) - 1
        pts = sorted((u, t) for (j, u), t in self.forward_s.items() if j == top)
        if len(pts) < 2:
            return 1 + self.kappa * (w - 1)
        (u1, t1), (u2, t2) = sorted(sorted(pts, key=lambda p: abs(p[0] - w))[:2])
        slope = max((t2 - t1) / (u2 - u1), 0.0)
        return max(t1 + slope * (w - u1), 0.05 * t1)

    def predict(self, skip: frozenset) -> float | None:
        """Expected seconds per token of a round with `skip`: each running level verifies
        its drafter's proposals (the drafter's measured acceptance and mean draft length:
        expected_tokens per forward) until it has what the level above asks of it, at the
        forward costs `cost` gives; an n-gram lookup costs nothing. None while an
        acceptance or a cost is unknown."""
        run = [i for i in range(len(self.levels)) if i not in skip]

        def make(n: int, want: float):  # seconds for level run[n] to produce `want` tokens
            i = run[n]
            if self.levels[i].cache is None:  # the model-free n-gram drafter
                return 0.0
            if n == 0:
                t = self.cost(i, 1)
                return None if t is None else want * t
            j = run[n - 1]
            if self.levels[j].cache is None:  # sized n-gram drafts: tokens and width per verification as measured
                y, wd = self.accept[j].tokens, self.accept[j].length
                lo = None if wd is None else int(wd)
                t0, t1 = (None, None) if lo is None else (self.cost(i, lo + 1), self.cost(i, lo + 2))
                if y is None or t0 is None or t1 is None:
                    return None
                return want / y * (t0 + (wd - lo) * (t1 - t0))
            a, ln = self.accept[j].rate, self.accept[j].length
            g = self.gammas[j] if self.levels[j].cache is not None or ln is None else max(1, round(ln))
            t, below = self.cost(i, g + 1), make(n - 1, g)
            if a is None or t is None or below is None:
                return None
            return want / expected_tokens(a, g) * (t + below)

        return make(len(run) - 1, 1)

    def figures(self) -> dict:
        """Statistics for Stats.extra: acceptance per drafting level, mean accepted, times."""
        names = [lv.name for lv in self.levels]
        top = self.stats[-1]
        return {
            "acceptance": {names[j]: d.rate for j, d in enumerate(self.drafts)},  # by drafter
            "acceptance_per_token": {names[j]: d.per_token for j, d in enumerate(self.drafts)},
            "drafts": {names[j]: vars(d).copy() for j, d in enumerate(self.drafts)},
            "mean_accepted": top.produced / max(top.verifications, 1),
            "level_time_s": {n: round(lv.time, 3) for n, lv in zip(names, self.levels)},
            "levels": {names[i + 1]: vars(s).copy() for i, s in enumerate(self.stats)},
            "gammas": list(self.gammas),
            "rebuilds": self.rebuilds,
            "host_reads": self.host_reads(),
            **(self.bypass.figures(names) if self.bypass else {}),
            **({"retrieval_scorings": self.scores} if self.scores else {}),
            **({"sized_drafts": self.levels[0].figures()} if self._sizing else {}),
            **({"acceptance_estimate": {names[j]: round(a.rate, 3) for j, a in self.accept.items()
                                        if a.rate is not None}} if self.bypass else {}),
        }

    def host_reads(self) -> dict:
        """Blocking device-to-host reads per verification of the top level, by the level
        that made them (the top's own: 1; a model drafter: one per drafted token)."""
        n = max(self.stats[-1].verifications, 1)
        return {lv.name: round((READS.count[lv.name] - self.reads0.get(lv.name, 0)) / n, 3)
                for lv in self.levels}
