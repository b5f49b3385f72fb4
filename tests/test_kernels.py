"""CPU kernels: the oneDNN linear and split-K (flash-decoding) attention against references."""
import pytest
import torch
import torch.nn.functional as F

from triforce_offload.kernels import attention as A
from triforce_offload.kernels import linear as lin

from helpers_spec import repetitive_prompt, run, tiny


@pytest.mark.parametrize("shape", [(5, 40), (1, 1, 40), (2, 7, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(300, 40, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    with torch.inference_mode():
        torch.testing.assert_close(lin.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_keeps_autograd_and_other_dtypes():
    layer = lin.Linear(8, 4)
    x = torch.randn(3, 8)
    y = layer(x)  # grad enabled and weight requires grad: F.linear, differentiable
    y.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == (4, 8)
    xb, wb = x.bfloat16(), layer.weight.detach().bfloat16()
    assert lin.linear(xb, wb).dtype == torch.bfloat16


def test_linear_env_forces_torch(monkeypatch):
    monkeypatch.setenv("TRIFORCE_OFFLOAD_LINEAR", "torch")
    assert lin._probe() is False
    monkeypatch.delenv("TRIFORCE_OFFLOAD_LINEAR")
    # the probe's verdict is whatever the op gives; when on, it must agree with F.linear
    assert lin._probe() in (True, False)


def test_cpu_splits_balance_threads():
    assert A.cpu_splits(3, 8192, threads=2) == 2  # SmolLM2: 3 KV heads on 2 threads
    assert A.cpu_splits(8, 8192, threads=2) == 1  # already balanced
    assert A.cpu_splits(3, 8192, threads=4) == 4
    assert A.cpu_splits(3, 1500, threads=2) == 1  # too few keys to be worth a split
    assert A.cpu_splits(1, 3 * A.MIN_SPLIT_KEYS, threads=8) == 3  # capped by the keys


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("S,T,k_pos0,splits", [
    (301, 1, 0, 2), (301, 7, 0, 3), (300, 5, 0, 4),  # pieces that do and do not divide
    (120, 3, 500, 2),   # keys start past 0 (streaming / retrieval caches)
    (64, 4, 0, 7),      # seven pieces of 8 keys, the tail holds the rest
])
def test_split_attention_matches_reference(monkeypatch, dtype, tol, S, T, k_pos0, splits):
    monkeypatch.setattr(A, "cpu_splits", lambda bh, free, threads=None: splits if free >= splits * 8 else 1)
    g = torch.Generator().manual_seed(S + T)
    cap = S + 5
    K = torch.randn(1, 3, cap, 16, generator=g).to(dtype)[:, :, :S]  # a view of a preallocated cache
    V = torch.randn(1, 3, cap, 16, generator=g).to(dtype)[:, :, :S]
    q = torch.randn(1, 6, T, 16, generator=g).to(dtype)
    q_pos0 = k_pos0 + S - T  # the new tokens are the last T keys
    ref, _ = A.attention_lse(q, K, V, q_pos0, k_pos0)
    got = A.attention(q, K, V, q_pos0, k_pos0)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


def test_greedy_modes_unchanged_with_forced_splits(monkeypatch):
    """Every cache's attention through the split path: speculative output still equals
    autoregressive output, and both equal the unsplit run."""
    L = tiny(scale=3.0, seed=1)
    prompt = repetitive_prompt(300, L.cfg.vocab_size, seed=3)
    plain, _ = run(L, prompt, "autoregressive", 24)
    monkeypatch.setattr(A, "cpu_splits", lambda bh, free, threads=None: 3 if free >= 24 else 1)
    ref, _ = run(L, prompt, "autoregressive", 24)
    assert ref == plain
    for mode, extra in [("triforce", {"budget": 64}), ("draft", {"draft": "self", "draft_window": 16})]:
        out, _ = run(L, prompt, mode, 24, **extra)
        assert out == ref, mode
