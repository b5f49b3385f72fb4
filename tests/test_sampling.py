import pytest
import torch

from triforce_offload.runtime.errors import TriforceError
from triforce_offload.runtime.sampling import SamplingParams, probs, sample


def test_greedy_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]])
    p = probs(logits, SamplingParams())
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0]]


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
