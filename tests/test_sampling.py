import math

import pytest
import torch

from triforce_offload.runtime.errors import TriforceError
from triforce_offload.runtime.sampling import Draws, SamplingParams, draw, draws, next_token, pick, probs, sample


def test_greedy_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]])
    p = probs(logits, SamplingParams())
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_next_token_is_draw_of_probs():
    """The greedy shortcut takes the logits' argmax: the token draw(probs(...)) gives, ties
    (the first maximum) and bf16 logits included; sampled tokens are draw's at the index."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=g)
    logits[1, [7, 900]] = 50.0  # a tie: both take the first
    for x in (logits, logits.bfloat16()):
        assert torch.equal(next_token(x, SamplingParams()), draw(probs(x, SamplingParams()), SamplingParams()))
    assert next_token(logits, SamplingParams())[1].item() == 7
    sp = SamplingParams(temperature=0.8, seed=3)
    for t in range(5):
        a = next_token(logits[t], sp, draws(sp), 100 + t)
        assert a.shape == () and a == draw(probs(logits[t], sp), sp, draws(sp), 100 + t)
        assert next_token(logits[t:t + 1], sp, draws(sp), 100 + t).tolist() == [a.item()]


def test_seeded_draws_are_reproducible_by_index_and_follow_p():
    """Token index t's exponentials depend on the seed and t alone; picks at 4000 indices
    follow p; a token of probability 0 is never picked."""
    p = torch.tensor([0.5, 0.3, 0.0, 0.2])
    a, b, c = Draws(7), Draws(7), Draws(8)
    assert torch.equal(a.rows(0, 50, 4, "cpu"), b.rows(0, 50, 4, "cpu"))
    assert not torch.equal(a.rows(0, 50, 4, "cpu"), c.rows(0, 50, 4, "cpu"))
    assert torch.equal(Draws(7).rows(10, 5, 4, "cpu"), a.rows(0, 15, 4, "cpu")[10:])  # by index alone
    toks = pick(p.expand(4000, 4), a, 0)
    freq = torch.bincount(toks, minlength=4).float() / 4000
    assert (freq - p).abs().max() < 0.03 and freq[2] == 0
    e = a.rows(0, 200, 100, "cpu")
    assert e.min() > 0 and abs(e.mean().item() - 1) < 0.02  # Exp(1)
    assert abs((e < 0.1).float().mean().item() - (1 - math.exp(-0.1))) < 0.01


def test_classic_sampling_with_a_torch_generator():
    p = torch.tensor([0.5, 0.3, 0.2])
    a = sample(p.expand(4000, 3), torch.Generator().manual_seed(7))
    b = sample(p.expand(4000, 3), torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=3).float() / 4000
    assert (freq - p).abs().max() < 0.03


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2)])
def test_invalid_values_are_refused(kw):
    with pytest.raises(TriforceError):
        SamplingParams(**kw)
