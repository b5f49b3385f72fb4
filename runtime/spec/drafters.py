"""Levels of the speculative hierarchy: a model over a cache, and the n-gram drafter.

Both follow `protocols.Level`; a model level also `protocols.VerifyingLevel`. Every level
shares one token list `seq` (prompt + generated + tentative tokens) and a model level
tracks `held`: how many leading positions of `seq` its cache holds (committed or
pending). Only the level writes `held` (its forwards feed, `commit`/`rollback` set it)
and only its `commit`/`rollback` move its cache's length; the engine drives both. A
forward feeds `seq[held:]`, so a level catches up on tokens accepted by the levels above
without the engine spelling them out. `draft(seq, g, sp, gen)` appends up to g tokens to
`seq` and returns their draft distributions q [g', V].
"""
from __future__ import annotations

import time

import torch

from ..errors import TriforceError
from ..graphs import Step, run_model
from ..hostread import to_device, to_host
from ..sampling import draw, probs
from .acceptance import one_hot
from .engine import KAPPA


class ModelLevel:
    """A model over one cache: the target over full/retrieval caches, or a draft model."""

    def __init__(self, model, cache, name: str, graphs: bool = False, held: int = 0,
                 compile: bool = False, steps=Step):
        self.model, self.cache, self.name = model, cache, name
        self.device = next(model.parameters()).device
        # CUDA graphs (compiled) over a static cache; `steps`: graphs.Kept.step, kept across runs
        self.step = steps(model, cache, graphs, compile)
        self.held = held  # leading positions of seq held by the cache (it may arrive filled)
        self.time = 0.0  # seconds spent in forwards
        self.token_bytes: int | None = None  # weight bytes a step reads (spec.modes.read_ratio, a draft model's)

    @torch.inference_mode()
    def forward(self, seq: list[int], rows: int) -> torch.Tensor:
        """Feed seq[held:]; fp32 logits of the last `rows` positions [rows, V]."""
        t0 = time.perf_counter()
        ids = to_device([seq[self.held:]], self.device)
        out = self.step(ids, self.held, last_only=rows == 1)[0, -rows:].float()
        self.held = len(seq)
        self.time += time.perf_counter() - t0
        return out

    def commit(self, n: int):
        """Keep positions < n (n >= the cache's length); pending ones above leave no trace."""
        self.held = n
        self.cache.commit(n)

    def rollback(self, n: int):
        """A level above accepted positions < n: pending tokens below n are committed,
        everything from n on (committed or pending) is forgotten."""
        n = min(self.held, n)
        if n >= self.cache.length:
            self.commit(n)
        else:
            self.held = n
            self.cache.rollback(n)

    def draft(self, seq, g, sp, gen) -> torch.Tensor:
        """g tokens, one forward each; each needs its token on the host (one read)."""
        qs = []
        for _ in range(g):
            p = probs(self.forward(seq, 1)[0], sp)  # [V]
            seq.append(to_host(draw(p, sp, gen, len(seq))))
            qs.append(p)
        return torch.stack(qs)

    @torch.inference_mode()
    def resume(self, seq: list[int], top):
        """A model drafter that was skipped (the engine's bypass) catches up to the top
        level's `held` positions: the target itself (`--draft self`) copies its streaming
        cache's sink and window from the top's cache (exact KV); a draft model runs over the
        last `window` of the tokens it missed (those before would be evicted; what it
        drafts is checked, so a draft that misses older context costs acceptance, never
        correctness)."""
        n, c = top.held, self.cache
        if self.model is not top.model:
            lo = max(self.held, n - c.window, c.sink)
            if lo > c.length:
                c.skip_to(lo)
            self.prefill(seq[:n], c.pending, start=c.length)
            return
        t0 = time.perf_counter()
        c.load_from(top.cache, n)
        self.held = n
        self.time += time.perf_counter() - t0

    @torch.inference_mode()
    def prefill(self, prompt: list[int], prefill_chunk: int, start: int = 0):
        """Run the prompt (from position `start`, what the cache holds) through this level's
        own cache (a draft model's streaming cache)."""
        t0 = time.perf_counter()
        for s in range(start, len(prompt), prefill_chunk):
            ids = to_device([prompt[s: s + prefill_chunk]], self.device)
            run_model(self.model, self.cache, ids, s, last_only=True)
            self.cache.commit(min(s + prefill_chunk, len(prompt)))
        self.cache.prefetch()
        self.held = len(prompt)
        self.time += time.perf_counter() - t0


class NgramIndex:
    """Where each n-gram of a token list last occurred, kept up to date incrementally.

    `at[n][gram]` is the latest start i of `gram` with i + n <= len - 1: an occurrence that
    a later token follows (never the suffix itself). `prev[n][i]` is the start of the same
    n-gram before i (-1: none), so truncating restores what appending replaced. `toks` is
    the indexed copy of the tokens (the caller's list changes under it).
    """

    def __init__(self, ns):
        self.at = {n: {} for n in ns}  # n -> {n-gram tuple: latest start}
        self.prev = {n: [] for n in ns}  # n -> [earlier start of the n-gram at i, per start i]
        self.toks: list[int] = []

    def extend(self, seq: list[int]):
        """Index seq[len(toks):] (seq[:len(toks)] must be the indexed tokens)."""
        toks = self.toks
        toks.extend(seq[len(toks):])
        for n, at in self.at.items():
            prev = self.prev[n]
            i0, end = len(prev), len(toks) - n  # new eligible starts: i0 .. end-1
            for i, gram in enumerate(zip(*(toks[i0 + j: end + j] for j in range(n))), i0):
                prev.append(at.get(gram, -1))
                at[gram] = i

    def truncate(self, m: int):
        """Forget tokens from position m on."""
        toks = self.toks
        for n, at in self.at.items():
            prev = self.prev[n]
            lo = max(m - n, 0)  # starts >= lo are no longer followed by a kept token
            for i in range(len(prev) - 1, lo - 1, -1):
                gram = tuple(toks[i: i + n])
                if prev[i] < 0:
                    del at[gram]
                else:
                    at[gram] = prev[i]
            del prev[lo:]
        del toks[m:]

    def last(self, n: int, gram: tuple) -> int | None:
        """The latest eligible start of `gram`, or None."""
        return self.at[n].get(gram)


MATCH_BUCKETS = (2, 3, 4, 6, 10, 16)  # a suffix match of at least b tokens: bucket b


class MatchAcceptance:
    """Per-token acceptance of n-gram proposals by the length of the suffix match behind
    them (a match of 12 tokens in a loop of the text predicts far better than one of two in
    prose): decayed counts of accepted and rejected tokens per bucket of MATCH_BUCKETS, each
    with a prior of one accepted and three rejected (a few lucky matches are no verdict;
    below what a verification row costs on a CPU, so an unseen bucket does not draft)."""

    def __init__(self, decay: float = 0.98):
        self.counts = {b: [0.0, 0.0] for b in MATCH_BUCKETS}
        self.decay = decay  # per token judged: the figures follow the latest ~50 tokens of a bucket

    @staticmethod
    def bucket(match: int) -> int:
        return max(b for b in MATCH_BUCKETS if b <= max(match, MATCH_BUCKETS[0]))

    def add(self, match: int, accepted: int, rejected: int):
        c, d = self.counts[self.bucket(match)], self.decay ** (accepted + rejected)
        c[0], c[1] = d * c[0] + accepted, d * c[1] + rejected

    def rate(self, match: int) -> float:
        a, r = self.counts[self.bucket(match)]
        return (a + 1.0) / (a + r + 4.0)


DRAFT_MARGIN = 1.1  # a draft must be expected to beat a plain decode by this much (estimates err)


def draft_size(a: float, n: int, cost, margin: float = DRAFT_MARGIN) -> int:
    """How many of n proposed tokens to draft at per-token acceptance a, where a forward of
    w tokens costs cost(w) forwards of one: the h that maximises the expected tokens of the
    verification, 1 + a + ... + a^h, over its cost, if that beats a plain decode (h = 0) by
    `margin`."""
    best, best_h, tokens, p = 0.0, 0, 1.0, 1.0
    for h in range(1, n + 1):
        p *= a
        tokens += p
        pays = tokens / cost(h + 1)
        if pays > best:
            best, best_h = pays, h
    return best_h if best > margin / cost(1) else 0


NO_ROWS = torch.zeros(0)  # the q of a greedy n-gram draft: never read


class NgramDrafter:
    """Prompt lookup: find the last n tokens earlier in the context, propose what followed.

    Tries n = max_n .. min_n; among the latest `candidates` occurrences of the longest
    n-gram found it takes the one whose match extends furthest back (up to `reach` tokens;
    the most recent on a tie): the suffix match length. (Single-token matches are mostly
    noise on prose: they cost verification rows and are rarely accepted.) Deterministic,
    so q is one-hot. The drafts are host data (token lists): no device read. The n-gram
    index grows with each appended token and is truncated on rollback (`NgramIndex`), so
    a draft costs O(n) at any context length.

    Each draft is sized by what it is expected to pay (`draft_size`): the per-token
    acceptance of proposals with that match length (`MatchAcceptance`) against what the
    verifying level's wider forward costs (`price`, set by the engine from its measured
    forwards). Every lookup's whole proposal is judged against the verified text once it
    shows (`judge`), drafted or not, so the acceptance figures are measured at the cost of
    lookups alone: the drafter drafts nothing where the text does not repeat (a decode
    then costs what a plain one does) and long drafts in a loop of the text.
    """

    name = "ngram"
    cache = None  # model-free: no cache to absorb into, roll back or graph
    step = None

    def __init__(self, vocab: int, max_n: int = 3, device="cpu", min_n: int = 2,
                 candidates: int = 8, reach: int = 32, propose: int = 8, size: bool = True):
        self.vocab, self.max_n, self.min_n, self.device = vocab, max_n, min_n, device
        self.size = size  # size drafts (False: draft whatever the lookup finds, up to g; timing-free)
        self.candidates, self.reach, self.propose = candidates, reach, propose
        self.time = 0.0  # seconds spent looking up
        self.index = NgramIndex(range(min_n, max_n + 1))
        self._seq = None  # the list indexed (the engine's shared token list)
        self.accept = MatchAcceptance()
        # (position, proposal, match, tokens judged) awaiting the text
        self.pending: list[tuple[int, list[int], int, int]] = []
        self.match = 0  # the suffix match length of the latest lookup (0: none)
        # cost(w): a forward of w tokens of the level drafted for, in forwards of one (the engine's figures)
        self.price = None
        self.agree = int  # makes a value every tensor-parallel rank's (the engine passes its own)
        self.sized = [0, 0]  # drafts sized (a lookup found a match), tokens they drafted

    def sync(self, seq: list[int]):
        """Bring the index up to seq. Another list than last time: keep the index only if
        it starts with the indexed tokens (checked once per list, e.g. prompt -> engine)."""
        ix = self.index
        if seq is not self._seq:
            n = len(ix.toks)
            if len(seq) < n or seq[:n] != ix.toks:
                self.index = ix = NgramIndex(list(ix.at))
                self.pending.clear()
            self._seq = seq
        elif len(seq) < len(ix.toks):  # truncated without a rollback: forget the tail
            ix.truncate(len(seq))
        ix.extend(seq)

    def lookup(self, seq: list[int], g: int) -> list[int]:
        """Up to g tokens that followed the best earlier match of seq's suffix; sets `match`."""
        self.sync(seq)
        L = len(seq)
        self.match = 0
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            i = self.index.last(n, tuple(seq[L - n:]))
            if i is None:
                continue
            best, m_best, prev = i, -1, self.index.prev[n]
            for _ in range(self.candidates):
                m = n  # how far the match at start i extends back
                while m < self.reach and i - 1 - (m - n) >= 0 and seq[i - 1 - (m - n)] == seq[L - 1 - m]:
                    m += 1
                if m > m_best:
                    best, m_best = i, m
                i = prev[i]
                if i < 0 or m_best >= self.reach:
                    break
            self.match = m_best
            return seq[best + n: best + n + g]
        return []

    def draft(self, seq, g, sp, gen) -> torch.Tensor:
        t0 = time.perf_counter()
        toks = self.lookup(seq, max(g, self.propose))
        if toks:
            if self.pending and self.pending[-1][0] == len(seq):  # drafting again at a position: judged once
                self.pending.pop()
            self.pending.append((len(seq), toks, self.match, 0))
            cost = self.price or (lambda w: 1.0 + KAPPA["cpu"] * (w - 1))  # unpriced: the CPU prior
            n = min(g, len(toks))
            # priced by local timings: tensor-parallel ranks take rank 0's size (the proposal,
            # from the shared text, is every rank's)
            toks = toks[:self.agree(draft_size(self.accept.rate(self.match), n, cost)) if self.size else n]
            self.sized = [self.sized[0] + 1, self.sized[1] + len(toks)]
        seq.extend(toks)
        self.time += time.perf_counter() - t0
        # greedy verification reads the verifier's argmax alone (accept_greedy): no rows for it
        return NO_ROWS if sp is not None and sp.greedy else one_hot(toks, self.vocab, self.device)

    def figures(self) -> dict:
        """Lookups that found a match, tokens drafted from them, and the acceptance per
        match-length bucket."""
        return {"matches": self.sized[0], "drafted": self.sized[1],
                "acceptance_by_match": {f"{b}+": round(self.accept.rate(b), 3) for b in MATCH_BUCKETS}}

    def judge(self, seq: list[int], n: int):
        """seq[:n] is verified text: each pending proposal's tokens it shows are judged."""
        left = []
        for pos, prop, match, seen in self.pending:
            k = self._judged(seq, n, pos, prop, match, seen)
            if k is not None:
                left.append((pos, prop, match, k))
        self.pending = left

    def _judged(self, seq: list[int], n: int, pos: int, prop: list[int], match: int, seen: int = 0) -> int | None:
        """Judge the tokens from `seen` on of a proposal made at `pos` against the verified
        seq[:n] (a match accepted, the first mismatch rejected, which ends the proposal) into
        the figures; the tokens judged so far where the text has not yet decided it, else None."""
        k = seen
        while k < len(prop) and pos + k < n and prop[k] == seq[pos + k]:
            k += 1
        done = k == len(prop) or pos + k < n  # its whole length, or a mismatch
        self.accept.add(match, k - seen, int(k < len(prop) and done))
        return None if done else k

    def learn(self, seq: list[int], last: int = 256):
        """Judge the proposals the drafter would have made at each of seq's last `last`
        positions (a prompt: how repetitive its text is), the index growing token by token
        as it would have: the acceptance figures start from the prompt, not the prior."""
        head = seq[: max(len(seq) - last, 1)]  # one list, growing: each lookup indexes one token more
        for p in range(len(head), len(seq)):
            prop = self.lookup(head, self.propose)
            head.append(seq[p])
            if prop:  # judged as far as the prompt shows (the rest of a proposal at its end: never)
                self._judged(seq, len(seq), p, prop, self.match)
        self._seq = None  # the next list is checked against the indexed tokens

    def rollback(self, n: int):
        """Positions from n on are forgotten (the engine truncates the shared list); so are
        proposals made past n (their context was not accepted)."""
        if n < len(self.index.toks):
            self.index.truncate(n)
        if self.pending and self.pending[-1][0] > n:
            self.pending = [p for p in self.pending if p[0] <= n]


def check_vocab(target_tok, draft_tok, show: int = 5):
    """A draft model must share the target's tokenizer: compare vocabularies id by id."""
    a = {i: t for t, i in target_tok.get_vocab().items()}
    b = {i: t for t, i in draft_tok.get_vocab().items()}
    bad = [i for i in sorted(a.keys() | b.keys()) if a.get(i) != b.get(i)]
    if not bad:
        return
    eg = ", ".join(f"id {i}: target {a.get(i)!r} vs draft {b.get(i)!r}" for i in bad[:show])
    raise TriforceError(f"--draft model's tokenizer differs from the target's ({len(a)} vs {len(b)} "
                        f"tokens, {len(bad)} ids differ; e.g. {eg}); use a draft model with the "
                        "same tokenizer, or --draft ngram|self")
