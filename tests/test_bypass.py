"""Speculation that never loses: the level bypass starts plain and runs a level only where
its measured acceptance and forward costs predict that it pays (`Engine.predict`: the
n-gram drafter judged in the shadow of plain decoding, the retrieval level scored by one
teacher-forced forward) or where a probe measures it; and the measurements behind it.
The controller against fixed costs (no timing noise), then the engine on a tiny model."""
import pytest
import torch

from triforce_offload.runtime.spec import engine as E
from triforce_offload.runtime.spec.engine import Acceptance, Bypass, expected_tokens

from helpers_spec import repetitive_prompt, run, tiny


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _decode(b: Bypass, cost, toks, n: int) -> float:
    """Seconds per token over n tokens: rounds of toks(c) tokens at cost(c) seconds each."""
    t = made = 0
    while made < n:
        c = b.choose()
        k = toks(c, made)
        b.record(c, cost(c, made) * k, k)
        t, made = t + cost(c, made) * k, made + k
    return t / made


def _plain_best():
    b = Bypass([0, 1], warm=5, start_plain=True)
    none, ngram, ret, plain = b.configs
    cost = {none: 0.040, ngram: 0.050, ret: 0.030, plain: 0.0244}
    return b, cost, {none: 3, ngram: 3, ret: 1, plain: 1}


def test_starts_plain_and_never_runs_what_the_prediction_says_loses():
    b, cost, toks = _plain_best()
    b.predict = lambda c: cost[c]  # a prediction that is right
    assert b.current == b.configs[-1]
    spt = _decode(b, lambda c, _: cost[c], lambda c, _: toks[c], 64)
    assert spt == pytest.approx(cost[b.configs[-1]])  # within 64 tokens: nothing explored
    assert all(b.seen[c] == 0 for c in b.configs[:-1])


def test_without_predictions_probes_measure_as_before():
    b, cost, toks = _plain_best()
    spt = _decode(b, lambda c, _: cost[c], lambda c, _: toks[c], 64)
    assert b.current == b.configs[-1] and sum(b.seen[c] for c in b.configs[:-1]) >= 3
    assert spt > cost[b.configs[-1]]  # the probes cost: what predictions save


def test_a_level_that_starts_to_pay_is_probed_before_the_next_cycle_and_kept():
    b = Bypass([0, 1], warm=5, start_plain=True)
    none, ngram, ret, plain = b.configs
    turn = 20  # the text turns repetitive: drafting by n-gram alone starts to pay
    cost = lambda c, made: 0.012 if c == ret and made >= turn else {none: 0.040, ngram: 0.050, ret: 0.030,
                                                                     plain: 0.0244}[c]
    made = [0]
    b.predict = lambda c: cost(c, made[0])
    seen = []
    while made[0] < 64:
        c = b.choose()
        seen.append((made[0], c))
        b.record(c, cost(c, made[0]), 1)
        made[0] += 1
    first = next(m for m, c in seen if c == ret)
    assert turn <= first < turn + 3  # a probe cycle would have waited for 64 tokens
    assert b.current == ret and b.switches == 1


def test_a_wrong_prediction_costs_one_probe_per_interval():
    """Predicted to pay, measured not to: probed at most once per `base` tokens."""
    b, cost, toks = _plain_best()
    none, ngram, ret, plain = b.configs
    b.predict = lambda c: 0.010 if c == ret else cost[c]  # wrong for n-gram drafting
    _decode(b, lambda c, _: cost[c], lambda c, _: toks[c], 96)
    assert b.current == plain and 1 <= b.seen[ret] <= 96 // b.base + 1


def test_exploring_within_its_share_of_the_time():
    """With a cap (`explore`, what `bypass_for` sets), wrong predictions and probes that
    lose cost at most about that share of the decode time: within 5% of plain decoding over
    64 tokens, where the uncapped controller loses more; over many tokens the levels are
    still re-tried (a text that turns repetitive gets them back)."""
    def wrong(explore):
        b, cost, toks = _plain_best()
        none, ngram, ret, plain = b.configs
        b.explore = explore
        b.predict = lambda c: 0.010 if c in (ret, none) else cost[c]  # wrong for both levels
        return b, _decode(b, lambda c, _: cost[c], lambda c, _: toks[c], 64), cost[plain]
    b, capped, plain = wrong(0.03)
    _, free, _ = wrong(None)
    assert capped <= 1.05 * plain < free
    assert 0 < b.spent <= 0.03 * b.elapsed + 0.05  # one probe round may overshoot the share
    b, cost, toks = _plain_best()
    b.explore = 0.03
    b.predict = lambda c: 0.010 if c == b.configs[2] else cost[c]
    _decode(b, lambda c, _: cost[c], lambda c, _: toks[c], 2000)
    assert b.current == b.configs[-1] and b.seen[b.configs[2]] >= 3
    assert b.spent <= 0.03 * b.elapsed + 0.05


def test_a_capped_controller_still_finds_a_level_that_starts_to_pay():
    b = Bypass([0, 1], warm=5, start_plain=True, explore=0.03)
    none, ngram, ret, plain = b.configs
    cost = lambda c, made: 0.012 if c == ret and made >= 20 else {none: 0.040, ngram: 0.050, ret: 0.030,
                                                                   plain: 0.0244}[c]
    made = [0]
    b.predict = lambda c: cost(c, made[0])
    while made[0] < 64:
        c = b.choose()
        b.record(c, cost(c, made[0]), 1)
        made[0] += 1
    assert b.current == ret and b.seen[ret] > 30


def test_expected_tokens_and_acceptance_counts():
    assert expected_tokens(0.0, 4) == 1 and expected_tokens(1.0, 4) == pytest.approx(5, rel=0.01)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    a = Acceptance()
    assert a.rate is None
    a.add(0, 0, 0)  # an empty n-gram proposal: its length, no verdict
    assert a.rate is None and a.length == 0
    for _ in range(20):
        a.add(3, 1, 4)
    assert a.rate == pytest.approx(0.75, abs=0.05) and a.length == pytest.approx(4, abs=0.1)


def _spy(monkeypatch, name):
    calls = []
    orig = getattr(E.Engine, name)

    def spy(self, *a):
        calls.append(self)
        return orig(self, *a)
    monkeypatch.setattr(E.Engine, name, spy)
    return calls


@pytest.fixture(scope="module")
def model():
    return tiny(scale=3.0, seed=1)


def test_sized_ngram_drafts_pay_where_the_text_repeats(model, monkeypatch):
    """The n-gram drafter judges every lookup against the text: repetitive text gets long
    drafts (several tokens per verification), and the run is lossless. Widths are priced
    as a CPU's prior (a tiny model's sub-millisecond timings are noise). (Random text that
    earns no drafts: test_speculative; a tiny random model's output loops soon anyway.)"""
    monkeypatch.setattr(E.Engine, "relative", lambda self, i: lambda w: 1 + 0.25 * (w - 1))
    rep = repetitive_prompt(200, model.cfg.vocab_size, seed=3)
    ref, _ = run(model, rep, "autoregressive", 48, ignore_eos=True)
    out, st = run(model, rep, "draft", 48, ignore_eos=True)
    assert out == ref
    sized = st.extra["sized_drafts"]
    assert sized["drafted"] >= 24 and st.extra["mean_accepted"] > 2
    assert max(sized["acceptance_by_match"].values()) > 0.8


def test_widths_and_sized_ngram_drafts_are_priced_from_measured_forwards(model):
    """Engine.relative: a forward of w rows in forwards of one (the prior 1 + kappa (w - 1)
    until measured, then the line through the measured widths); Engine.predict prices the
    sized n-gram drafter by its measured tokens per verification at its mean draft length."""
    from triforce_offload.runtime.cache.kv import FullCache
    from triforce_offload.runtime.spec.drafters import ModelLevel, NgramDrafter
    from triforce_offload.runtime.sampling import SamplingParams
    top = ModelLevel(model.model, FullCache(model.cfg, 64), "full")
    eng = E.Engine([NgramDrafter(model.cfg.vocab_size), top], [4], SamplingParams(), torch.Generator())
    assert eng._sizing and eng.relative(1)(3) == pytest.approx(1 + 2 * E.KAPPA["cpu"])
    eng.forward_s = {(1, 1): 0.010, (1, 2): 0.012}
    assert eng.relative(1)(2) == pytest.approx(1.2) and eng.relative(1)(4) == pytest.approx(1.6)
    assert eng.predict(frozenset()) is None  # nothing verified yet
    eng.accept[0].add(1, 0, 1, 2)  # one drafted token, accepted: 2 tokens for a forward of 2
    assert eng.predict(frozenset()) == pytest.approx(0.012 / 2)
    for _ in range(40):
        eng.accept[0].add(0, 0, 0, 1)  # then no drafts: a plain decode's cost
    assert eng.predict(frozenset()) == pytest.approx(0.010, rel=0.01)
    eng._timed(1, 1, 0.030)  # a stall moves the figure a fifth, a faster forward half way
    assert eng.forward_s[(1, 1)] == pytest.approx(0.014)
    eng._timed(1, 1, 0.004)
    assert eng.forward_s[(1, 1)] == pytest.approx(0.009)


def test_graph_captures_are_not_a_widths_cost(model, monkeypatch):
    """A forward that captured a CUDA graph (step.capture_s grew) is timed without the
    capture: a width priced by its capture would never be drafted again."""
    from triforce_offload.runtime.spec.drafters import ModelLevel
    engines, orig = _spy(monkeypatch, "round"), ModelLevel.forward

    def capturing(self, seq, rows):
        self.step.capture_s += 1.0  # as if every forward captured for a second
        return orig(self, seq, rows)
    monkeypatch.setattr(ModelLevel, "forward", capturing)
    rep = repetitive_prompt(200, model.cfg.vocab_size, seed=3)
    out, _ = run(model, rep, "draft", 24, ignore_eos=True)
    assert engines and engines[-1].forward_s and max(engines[-1].forward_s.values()) < 0.5


def test_scoring_measures_the_retrieval_level_and_restores_its_cache(model, monkeypatch):
    """Engine.score: one teacher-forced forward of the retrieval level; afterwards its cache
    holds the full cache's exact KV again, bit for bit, and the output is the target's."""
    monkeypatch.setattr(E, "EAGER", 0.0)  # scored at once, as a level that may pay much
    monkeypatch.setattr(E.Bypass, "_early", lambda self: False)  # scored, not probed at once
    snaps = []
    orig = E.Engine.score

    def score(self, seq):
        self.catch_up()  # what a bypassed level absorbs late (score does it first): not the scoring's
        mid = self.levels[self._scored()].cache
        before = [t.clone() for t in mid.k + mid.v if t is not None]
        held, n = self.levels[self._scored()].held, self.scores
        orig(self, seq)
        after = [t for t in mid.k + mid.v if t is not None]
        snaps.append((self.scores - n, held == self.levels[self._scored()].held,
                      all(torch.equal(a, b) for a, b in zip(before, after)), self.accept[self._scored()].rate))
    monkeypatch.setattr(E.Engine, "score", score)
    prompt = torch.randint(0, model.cfg.vocab_size, (400,), generator=torch.Generator().manual_seed(5)).tolist()
    ref, _ = run(model, prompt, "autoregressive", 40, ignore_eos=True)
    for mode in ("triforce", "retrieval"):
        snaps.clear()
        out, st = run(model, prompt, mode, 40, ignore_eos=True, budget=64)
        assert out == ref, mode
        assert snaps and st.extra["retrieval_scorings"] == sum(s[0] for s in snaps)
        assert all(done == 1 and same_held and same_kv and 0 < rate < 1 for done, same_held, same_kv, rate in snaps)


def test_a_level_that_may_pay_much_is_probed_after_the_first_round(model, monkeypatch):
    """A retrieval level whose best case promises much (`lenient`) runs from the second
    round, not after `warm` plain rounds (a short request would decode its first tokens
    plain); a level that promises little waits for the cycle at `warm`. Both lossless."""
    prompt = torch.randint(0, model.cfg.vocab_size, (400,), generator=torch.Generator().manual_seed(5)).tolist()
    ref, _ = run(model, prompt, "autoregressive", 40, ignore_eos=True)
    firsts, seen, orig = {}, [], E.Bypass.record

    def record(self, c, seconds, tokens):
        seen.append((self.rounds, c))
        return orig(self, c, seconds, tokens)
    monkeypatch.setattr(E.Bypass, "record", record)
    for eager in (0.0, 1e9):
        monkeypatch.setattr(E, "EAGER", eager)
        seen.clear()
        out, st = run(model, prompt, "retrieval", 40, ignore_eos=True, budget=64)
        assert out == ref
        firsts[eager] = next((r for r, c in seen if 0 not in c), None)
        warm = st.extra["gammas"][0] + 1
    assert firsts[0.0] == 1  # the round after the first plain one
    assert firsts[1e9] is None or firsts[1e9] >= warm


def test_scoring_with_an_offloaded_full_cache_is_lossless(model, monkeypatch):
    from triforce_offload.runtime.spec import modes as spec_modes
    monkeypatch.setattr(spec_modes, "EXPLORE", None)  # every probe cycle scores: 40 tokens are few
    prompt = torch.randint(0, model.cfg.vocab_size, (400,), generator=torch.Generator().manual_seed(6)).tolist()
    ref, _ = run(model, prompt, "autoregressive", 40, ignore_eos=True)
    out, st = run(model, prompt, "triforce", 40, ignore_eos=True, budget=64, offload="on", transfer_chunk=48)
    assert out == ref and st.extra.get("retrieval_scorings", 0) >= 1


def test_an_unready_configuration_is_not_probed():
    """Bypass.unready: a configuration whose measurement is due first (a scoring that
    waits) is skipped by every probe cycle without sitting out; once ready it is probed."""
    b, cost, toks = _plain_best()
    ready = [False]
    b.unready = lambda c: 1 not in c and not ready[0]  # configurations running level 1
    _decode(b, lambda c, _: cost[c], lambda c, _: toks[c], 64)
    assert b.seen[b.configs[0]] == b.seen[b.configs[1]] == 0 and b.seen[b.configs[2]] > 0
    assert all(b.rest[c][0] <= 0 for c in b.configs)
    ready[0] = True
    b.since_probe = b.interval  # the next cycle
    _decode(b, lambda c, _: cost[c], lambda c, _: toks[c], 64)
    assert b.seen[b.configs[0]] + b.seen[b.configs[1]] > 0


@pytest.mark.parametrize("ratio, explore, scored", [(0.99, 0.03, False), (0.01, 0.03, True), (0.99, None, True)])
def test_a_retrieval_level_that_can_pay_little_is_scored_once_the_run_affords_it(model, monkeypatch, ratio,
                                                                                  explore, scored):
    """Engine._eager: a retrieval level whose best case (every draft accepted, its forward
    priced by the bytes it reads) cannot pay EAGER times is neither scored nor probed until
    the exploring share covers a scoring (40 tokens do not); one that may pay more is
    probed at once (Bypass._early: its drafts judged); without a share (EXPLORE None) it is
    scored as before. Lossless alike."""
    from triforce_offload.runtime.spec import modes as spec_modes
    monkeypatch.setattr(spec_modes, "EXPLORE", explore)
    monkeypatch.setattr(spec_modes, "read_ratio", lambda levels, loaded: lambda i: ratio)
    prompt = torch.randint(0, model.cfg.vocab_size, (400,), generator=torch.Generator().manual_seed(5)).tolist()
    ref, _ = run(model, prompt, "autoregressive", 40, ignore_eos=True)
    out, st = run(model, prompt, "triforce", 40, ignore_eos=True, budget=64)
    assert out == ref
    judged = st.extra.get("retrieval_scorings", 0) >= 1 or st.extra["drafts"]["retrieval"]["drafted"] > 0
    assert judged == scored
    if ratio > 0.5 and explore is None:
        assert st.extra.get("retrieval_scorings", 0) >= 1
    if not scored:  # never run (nor probed): every round with the retrieval level bypassed
        assert st.extra["bypassed_tokens"]["retrieval"] >= len(out) - 1


def _forced(monkeypatch, pattern):
    """Bypass.choose follows `pattern` (indices into its configurations), round by round."""
    monkeypatch.setattr(Bypass, "choose", lambda self: self.configs[pattern[self.rounds % len(pattern)]])


def _draft_model(monkeypatch, seed: int = 11):
    """`--draft` a second tiny model (same vocabulary): make_drafter builds its level."""
    from triforce_offload.runtime.cache.streaming import StreamingCache
    from triforce_offload.runtime.spec import modes as spec_modes
    from triforce_offload.runtime.spec.drafters import ModelLevel
    other = tiny(scale=3.0, seed=seed)

    def make(o, loaded, prompt, full):
        lv = ModelLevel(other.model, StreamingCache(other.cfg, o.draft_sink, o.draft_window, max(64, o.gamma1 + 16)),
                        "draft")
        lv.prefill(prompt, prefill_chunk=lv.cache.pending)
        return lv
    monkeypatch.setattr(spec_modes, "make_drafter", make)


@pytest.mark.parametrize("mode, drafter, pattern", [
    ("draft", "self", [1, 1, 1, 0, 0]),  # configs: () runs the drafter, (0,) skips it
    ("draft", "model", [1, 1, 1, 1, 0, 0, 1]),
    ("triforce", "self", [3, 3, 0, 1, 2, 0]),  # (), (0,), (1,), (0, 1)
    ("triforce", "model", [2, 3, 3, 0, 0, 1]),
])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_model_drafter_skipped_and_resumed_is_lossless(model, monkeypatch, mode, drafter, pattern, temperature):
    """A model drafter that the bypass skips falls behind; when it runs again it catches up
    (`ModelLevel.resume`: the target copies its sink and window from the full cache, a draft
    model runs over the last window of what it missed). Greedy and seeded sampled output
    stay the target's own, token for token, however the rounds alternate."""
    if drafter == "model":
        _draft_model(monkeypatch)
    _forced(monkeypatch, pattern)
    prompt = repetitive_prompt(300, model.cfg.vocab_size, seed=3)
    ref, _ = run(model, prompt, "autoregressive", 60, temperature=temperature, seed=4, ignore_eos=True)
    out, st = run(model, prompt, mode, 60, temperature=temperature, seed=4, ignore_eos=True, budget=64,
                  draft="self", draft_sink=4, draft_window=16)
    assert out == ref
    name = "self" if drafter == "self" else "draft"
    assert st.extra["bypassed_tokens"][name] > 0 and st.extra["drafts"][name]["drafted"] > 0


def test_resume_copies_the_targets_sink_and_window(model):
    """After a skip, the self drafter's streaming cache holds exactly what a drafter built
    from the full cache at that length holds."""
    from triforce_offload.runtime.cache.kv import FullCache
    from triforce_offload.runtime.cache.streaming import StreamingCache
    from triforce_offload.runtime.spec.drafters import ModelLevel
    seq = torch.randint(0, model.cfg.vocab_size, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    full = FullCache(model.cfg, 256)
    top = ModelLevel(model.model, full, "full")
    top.forward(seq[:100], 1)
    top.commit(100)
    lv = ModelLevel(model.model, StreamingCache(model.cfg, 4, 16, 64), "self", held=60)
    lv.cache.load_from(full, 60)
    top.forward(seq[:110], 1)
    top.commit(110)
    lv.resume(seq, top)
    fresh = StreamingCache(model.cfg, 4, 16, 64)
    fresh.load_from(full, 110)
    assert lv.held == 110 and lv.cache.length == 110 and lv.cache.run_start == fresh.run_start
    assert all(torch.equal(a, b) for a, b in zip(lv.cache.k + lv.cache.v, fresh.k + fresh.v))


@pytest.mark.parametrize("ratio, runs", [(0.9, False), (0.01, True)])
def test_a_model_drafter_is_probed_only_where_its_priced_best_case_pays(model, monkeypatch, ratio, runs):
    """Engine.unready: a model drafter that never ran is probed only where its best case
    (every draft accepted, its forwards priced by the bytes it reads: `read_ratio`) promises
    EAGER times the plain decode; else the run decodes plain throughout (what it costs on a
    CPU at a short context, where the weights set a step's time). Lossless alike."""
    from triforce_offload.runtime.spec import modes as spec_modes
    monkeypatch.setattr(spec_modes, "read_ratio", lambda levels, loaded: lambda i: ratio)
    prompt = repetitive_prompt(300, model.cfg.vocab_size, seed=3)
    ref, _ = run(model, prompt, "autoregressive", 48, ignore_eos=True)
    out, st = run(model, prompt, "draft", 48, ignore_eos=True, draft="self", draft_sink=4, draft_window=16)
    assert out == ref
    assert (st.extra["drafts"]["self"]["drafted"] > 0) == runs
    if not runs:
        assert st.extra["bypassed_tokens"]["self"] >= len(out) - 1


def test_a_lenient_configuration_is_probed_first_whatever_the_share():
    """Bypass.lenient: a configuration that may pay a lot (the engine: the retrieval level's
    best case promises EAGER) is probed at the first cycle where predicted no slower than
    the best measured, even when its scoring just spent the exploring share; a plain one
    waits for the share and needs the `trust` margin. (Here it was not lenient before the
    cycle at `warm`: else `_early` would have probed it after the first round.)"""
    for lenient in (False, True):
        b, cost, toks = _plain_best()
        b._early = lambda: False
        none = b.configs[0]
        b.explore = 0.03
        b.predict = lambda c: 0.0240 if c == none else cost[c]  # barely faster than plain
        b.lenient = (lambda c: c == none) if lenient else None
        for _ in range(b.warm):
            c = b.choose()
            b.record(c, cost[c] * toks[c], toks[c])
        b.explored(1.0)  # a scoring that spent far more than the share
        assert (b.choose() == none) == lenient


def test_the_early_cycle_is_one_and_the_cycle_at_warm_still_follows():
    """Bypass._early: at most one early cycle; a lenient configuration beaten there (its
    prediction a little worse) does not start a cycle every round until `warm`, nor move
    the probe interval; and where early probes run past `warm`, the cycle at `warm` follows
    them, so the configurations it judges are probed."""
    b = Bypass([0], warm=6, start_plain=True)
    none, plain = b.configs
    b.lenient = lambda c: c == none
    b.predict = lambda c: 0.030 if c == none else 0.025
    starts = []
    for _ in range(6):
        c = b.choose()
        starts.append(b.probes[:])
        b.record(c, 0.025, 1)
    assert b.early and b.interval == 32  # one early cycle; the interval only moves at warm
    b = Bypass([0, 1], warm=4, start_plain=True)
    b.lenient = lambda c: 1 not in c  # the two running level 1 may pay a lot
    seen = set()
    for _ in range(30):
        c = b.choose()
        seen.add(c)
        b.record(c, 0.025 if c == b.configs[-1] else 0.02, 1)
    assert seen == set(b.configs)  # the n-gram-only one too: the cycle at warm ran
