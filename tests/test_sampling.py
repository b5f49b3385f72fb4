import pytest
import torch

from triforce_offload.runtime.errors import TriforceError
from triforce_offload.runtime.sampling import SamplingParams, draw, next_token, probs, sample


def test_greedy_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]])
    p = probs(logits, SamplingParams())
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_next_token_is_draw_of_probs():
    """The greedy shortcut takes the logits' argmax: the token draw(probs(...)) gives, ties
    (the first maximum) and bf16 logits included; sampled draws are draw's own."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=g)
    logits[1, [7, 900]] = 50.0  # a tie: both take the first
    for x in (logits, logits.bfloat16()):
        assert torch.equal(next_token(x, SamplingParams()), draw(probs(x, SamplingParams()), SamplingParams()))
    assert next_token(logits, SamplingParams())[1].item() == 7
    sp = SamplingParams(temperature=0.8, seed=3)
    a = next_token(logits, sp, sp.generator("cpu"))
    b = draw(probs(logits, sp), sp, sp.generator("cpu"))
    assert torch.equal(a, b)


def test_temperature_top_k_top_p():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    p = probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(p, torch.softmax(logits / 0.5, -1))
    p = probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and abs(p.sum().item() - 1) < 1e-6
    full = torch.softmax(logits, -1)  # [0.644, 0.237, 0.087, 0.032]
    p = probs(logits, SamplingParams(temperature=1.0, top_p=0.85))
    assert (p > 0).tolist() == [True, True, False, False]  # 0.644 < 0.85 <= 0.644+0.237
    p = probs(logits, SamplingParams(temperature=1.0, top_p=0.9))
    assert (p > 0).tolist() == [True, True, True, False]  # 0.881 < 0.9 needs a third
    torch.testing.assert_close(p[:3], full[:3] / full[:3].sum())


def test_seeded_sampling_is_reproducible_and_follows_p():
    p = torch.tensor([0.5, 0.3, 0.2])
    sp = SamplingParams(temperature=1.0, seed=7)
    a = sample(p.expand(4000, 3), sp.generator())
    b = sample(p.expand(4000, 3), sp.generator())
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=3).float() / 4000
    assert (freq - p).abs().max() < 0.03


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2)])
def test_invalid_values_are_refused(kw):
    with pytest.raises(TriforceError):
        SamplingParams(**kw)
