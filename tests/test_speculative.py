"""Acceptance rule, drafters, gamma adaptation, option checks."""
from types import SimpleNamespace

import pytest
import torch

from triforce_offload.runtime.spec.drafters import NgramDrafter, check_vocab, draft_size
from triforce_offload.runtime.spec.engine import AutoGamma, LevelStats, Rebuild
from triforce_offload.runtime.errors import TriforceError
from triforce_offload.runtime.options import RunOptions
from triforce_offload.runtime.spec.acceptance import (accept, accept_drawn, accept_greedy, greedy_verdict, n_accepted, one_hot,
                                                  residual)
from triforce_offload.runtime.hostread import to_host
from triforce_offload.runtime.sampling import SamplingParams, draw, draws, pick, probs, sample


def test_greedy_accepts_while_argmax_agrees():
    p = one_hot([3, 1, 2, 0], 5)  # target argmaxes at 4 positions
    k, x = accept([3, 1, 4], one_hot([3, 1, 4], 5), p)
    assert (k, x) == (2, 2)  # third draft rejected: the target's own token replaces it
    k, x = accept([3, 1, 2], one_hot([3, 1, 2], 5), p)
    assert (k, x) == (3, 0)  # all accepted: bonus token


def test_greedy_rule_equals_the_sampling_rule_on_one_hot_rows():
    """accept_greedy (argmax, no draws) gives what accept gives when p is one-hot, for any q."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = trial % 5
        logits = torch.randn(n + 1, 12, generator=g)
        p = probs(logits, SamplingParams())
        top = logits.argmax(-1).tolist()
        draft = [top[i] if torch.rand(1, generator=g) < 0.7 else int(torch.randint(12, (1,), generator=g))
                 for i in range(n)]
        q = one_hot(draft, 12) if trial % 2 else torch.softmax(torch.randn(n, 12, generator=g), -1)
        assert accept_greedy(draft, q, p) == accept(draft, q, p, torch.Generator().manual_seed(trial))
        # on logits, the CPU's host-side verdict is the device path's (greedy_verdict)
        assert accept_greedy(draft, None, logits) == tuple(to_host(greedy_verdict(draft, logits)))


def test_draw_is_the_argmax_when_greedy_and_a_pick_otherwise():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams()
    assert draw(probs(logits, greedy), greedy).tolist() == logits.argmax(-1).tolist()
    assert draw(probs(logits, greedy), greedy).tolist() == sample(probs(logits, greedy)).tolist()
    hot = SamplingParams(temperature=0.8, seed=3)
    p, d = probs(logits, hot), draws(hot)
    assert [draw(p[t], hot, d, 40 + t).item() for t in range(6)] == pick(p, d, 40).tolist()


def test_sampled_acceptance_is_the_leading_picks():
    """accept_drawn: the draft's leading tokens that are the verifier's picks at their
    indices, then the next pick; a one-hot draft d is accepted as often as p(d)."""
    from triforce_offload.runtime.sampling import Draws
    p = torch.tensor([[0.6, 0.4, 0.0], [0.0, 0.5, 0.5], [0.2, 0.2, 0.6]])
    d = Draws(11)
    picks = pick(p, d, 20).tolist()
    assert accept_drawn(picks[:2], p, d, 20) == (2, picks[2])
    assert accept_drawn([2], p, d, 20) == (0, picks[0])  # probability 0 at index 20: never accepted
    hits = sum(accept_drawn([0], p[:2], Draws(s), 5)[0] for s in range(3000))
    assert abs(hits / 3000 - 0.6) < 0.03


def test_n_accepted_is_vectorised_prefix():
    p = torch.tensor([[0.5, 0.5], [0.0, 1.0], [0.9, 0.1]])
    q = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    d = torch.tensor([0, 0])
    assert n_accepted(d, q, p, torch.tensor([0.4, 0.0])) == 1  # p(0)/q(0) = 0.5 > 0.4; then p = 0
    assert n_accepted(d, q, p, torch.tensor([0.6, 0.0])) == 0


def test_level_stats_per_token_acceptance_ignores_the_unjudged_tail():
    st = LevelStats()
    st.add(6, 6)  # all accepted
    st.add(6, 2)  # third token rejected: tokens 4..6 were drafted but never judged
    st.add(6, 0)  # first token rejected
    assert (st.drafted, st.accepted, st.rejected, st.produced) == (18, 8, 2, 11)
    assert st.per_token == pytest.approx(8 / 10)  # 10 tokens judged, 8 accepted
    assert st.accepted / st.drafted == pytest.approx(8 / 18)
    assert LevelStats().per_token == 0.0


def test_residual():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.7, 0.1, 0.2])
    assert torch.allclose(residual(p, q), torch.tensor([0.0, 1.0, 0.0]))
    assert torch.equal(residual(p, p), p)


def test_single_step_output_is_distributed_as_p():
    """One draft token from q, verified against p: the first output token must follow p."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    q = torch.tensor([[0.5, 0.2, 0.3]])
    counts = torch.zeros(3)
    for _ in range(6000):
        d = int(torch.multinomial(q[0], 1, generator=g))
        k, x = accept([d], q, p, g)
        counts[d if k else x] += 1
    assert torch.allclose(counts / counts.sum(), p[0], atol=0.02)


def test_ngram_lookup_takes_most_recent_longest_match():
    dr = NgramDrafter(vocab=10, max_n=3)
    assert dr.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 3) == [7, 8, 5]
    assert dr.lookup([4, 5, 6, 4, 5], 4) == [6, 4, 5]
    assert dr.lookup([1, 2, 3], 2) == []
    assert dr.lookup([1, 2, 1], 2) == [] and NgramDrafter(10, min_n=1).lookup([1, 2, 1], 2) == [2, 1]
    # the latest [1 2 3] follows 9 9; an earlier one follows 5 6 as the suffix does: the longer match
    assert dr.lookup([5, 6, 1, 2, 3, 8, 9, 9, 1, 2, 3, 7, 5, 6, 1, 2, 3], 2) == [8, 9] and dr.match == 5
    assert dr.lookup([1, 2, 3, 8, 1, 2, 3, 7, 1, 2, 3], 1) == [7] and dr.match == 3  # a tie: the most recent
    seq = [1, 2, 1, 2]
    assert dr.draft(seq, 5, None, None).shape == (0, 10) and seq == [1, 2, 1, 2]  # the prior: no draft
    dr.accept.counts = {b: [50.0, 0.0] for b in dr.accept.counts}  # everything accepted so far
    q = dr.draft(seq, 5, None, None)
    assert seq == [1, 2, 1, 2, 1, 2] and q.shape == (2, 10) and q[0, 1] == 1
    seq = [1, 2, 1, 2]  # --no-bypass: unsized, whatever the lookup finds up to g
    assert NgramDrafter(10, size=False).draft(seq, 1, None, None).shape == (1, 10) and seq == [1, 2, 1, 2, 1]
    # greedy: the verifier's argmax alone decides (accept_greedy), so no one-hot rows are built
    seq = [1, 2, 1, 2]
    greedy = NgramDrafter(10, size=False).draft(seq, 1, SamplingParams(0.0), None)
    assert greedy.numel() == 0 and seq == [1, 2, 1, 2, 1]


def test_draft_size_weighs_expected_tokens_against_the_wider_forward():
    flat = lambda w: 1.0 + 0.25 * (w - 1)  # noqa: E731
    assert draft_size(0.15, 8, flat) == 0  # rarely accepted: a plain decode pays best
    assert draft_size(0.95, 8, flat) == 8 and draft_size(0.95, 3, flat) == 3  # capped by the proposal
    sizes = [draft_size(a, 8, flat) for a in (0.3, 0.5, 0.7, 0.9)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    assert draft_size(0.7, 8, lambda w: float(w)) == 0  # each row costs a forward: nothing pays
    assert draft_size(0.7, 8, lambda w: 1.0) == 8  # rows free (a GPU's few rows): draft all


def test_sized_ngram_drafter_learns_acceptance_by_match_length():
    """Judged against the text, drafted or not: a loop's long matches earn long drafts, text
    that does not continue its matches earns none (a lookup's price); proposals made past a
    rollback's position are never judged (their context was rejected)."""
    gen = torch.Generator().manual_seed(0)
    loop = torch.randint(0, 50, (12,), generator=gen).tolist()
    dr, seq = NgramDrafter(vocab=50), loop * 3
    for t in range(40):  # the loop goes on: every proposal is right
        n = len(seq)
        dr.draft(seq, 4, None, None)
        del seq[n:]
        seq.append(loop[n % 12])
        dr.judge(seq, len(seq))
    assert dr.accept.rate(dr.match) > 0.9 and dr.match >= 16
    n = len(seq)
    dr.draft(seq, 4, None, None)
    assert seq[n:] == [loop[(n + j) % 12] for j in range(4)]  # a full draft
    del seq[n:]
    rnd, seq2 = NgramDrafter(vocab=50), loop * 2
    for t in torch.randint(0, 50, (300,), generator=gen).tolist():  # random text: matches by chance
        n = len(seq2)
        rnd.draft(seq2, 4, None, None)
        del seq2[n:]
        seq2.append(t)
        rnd.judge(seq2, len(seq2))
    assert rnd.accept.rate(2) < 0.15
    n = len(seq2)
    seq2 += [seq2[-3], seq2[-2]]  # a short match again
    rnd.draft(seq2, 4, None, None)
    assert len(seq2) == n + 2  # proposed and judged later, but nothing drafted
    dr.rollback(len(seq) - 5)
    assert all(p[0] <= len(seq) - 5 for p in dr.pending)


def test_auto_gamma_grows_with_acceptance_and_shrinks_without():
    ag = AutoGamma(6)
    for _ in range(10):
        g = ag.update(ag.gamma, ag.gamma, 0.01 * ag.gamma, 0.1)  # everything accepted, cheap drafts
    assert g == ag.hi
    for _ in range(40):
        g = ag.update(ag.gamma, 0, 0.01 * ag.gamma, 0.1)  # nothing accepted
    assert g == 1
    assert AutoGamma(4).best_priced(0.8, 1.0, lambda w: 1.0) == 1  # drafts as costly as verification: no speculation pays


def test_auto_gamma_prices_the_verification_by_its_width():
    """With the verifier's cost by width (Engine.cost), a verification whose rows cost
    compute (a CPU's attention over a long cache) gets a shorter gamma than one whose width
    is nearly free (a GPU's); the same acceptance and draft cost."""
    ag = AutoGamma(6)
    flat = ag.best_priced(0.9, 0.002, lambda w: 0.030 + 0.0005 * w)
    steep = ag.best_priced(0.9, 0.002, lambda w: 0.030 * (1 + 0.6 * (w - 1)))
    assert flat >= 10 and steep <= 4 and steep >= 1
    g = ag.update(6, 6, 0.06, 0.1, verify_cost=lambda w: 0.030 * (1 + 0.6 * (w - 1)))
    assert g < 6


def test_rebuild_policy():
    assert Rebuild.parse("every:16").due(16, 1.0) and not Rebuild.parse("every:16").due(15, 0.0)
    ad = Rebuild.parse("adaptive")
    assert ad.due(40, 0.3) and not ad.due(40, 0.9) and not ad.due(5, 0.0)
    assert not Rebuild.parse("never").due(10**6, 0.0)
    for bad in ("every:0", "sometimes", "every:x"):
        with pytest.raises(TriforceError, match="--rebuild"):
            Rebuild.parse(bad)


@pytest.mark.parametrize("extra,msg", [
    ({"budget": 15, "retrieval_chunk": 8}, "--budget 15: must be at least 2 chunks"),
    ({"gamma1": 0}, "--gamma1 0"),
    ({"gamma2": "0"}, "--gamma2 '0'"),
    ({"gamma2": "lots"}, "--gamma2 'lots'"),
    ({"retrieval_chunk": 0}, "--retrieval-chunk 0"),
    ({"mode": "fast"}, "--mode 'fast': allowed are"),
    ({"max_new_tokens": 0}, "--max-new-tokens 0"),
    ({"temperature": -1.0}, "--temperature -1.0"),
    ({"stage_depth": 0}, "--stage-depth 0"),
    ({"transfer_chunk": 0}, "--transfer-chunk 0"),
])
def test_bad_options(extra, msg):
    with pytest.raises(TriforceError, match=msg):
        RunOptions.of(**extra)


def test_vocab_mismatch_names_tokens():
    a = SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1, "c": 2})
    b = SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1, "z": 2})
    check_vocab(a, a)
    with pytest.raises(TriforceError, match=r"1 ids differ; e.g. id 2: target 'c' vs draft 'z'"):
        check_vocab(a, b)


def test_run_options_route_flat_options_once_and_refuse_unknown_ones():
    from triforce_offload.runtime.api import RunOptions
    o = RunOptions.of(**{"budget": 512, "transfer_chunk": 64, "on_chip": None, "gamma2": 3})
    assert o.retrieval.budget == 512 and o.generation.gamma2 == "3" and o.offload.transfer_chunk == 64
    assert o.offload.on_chip == 0  # None: the default
    with pytest.raises(TriforceError, match="unknown option 'budgte'; known are .*budget"):
        RunOptions.of(**{"budgte": 512})
    with pytest.raises(TriforceError, match="--offload 'maybe'"):
        RunOptions.of(**{"offload": "maybe"})


def test_option_names_are_unique_across_option_types():
    """RunOptions.of routes a flat name to the one type that has it, and the CLI makes one
    flag per field: a name in two types (other than a subclass's inherited fields) is a bug."""
    from triforce_offload.runtime import options as o
    types = [o.ModelOptions, o.ParallelOptions, o.ReuseOptions, *o.GROUPS.values()]
    seen = {}
    for t in types:
        for n in t.names():
            other = seen.setdefault(n, t)
            assert other is t or issubclass(t, other) or issubclass(other, t), (n, other, t)
