"""The row-exact Triton projection (kernels/triton_linear.py): close to a float64 reference,
and each row's bits independent of the other rows of its call (alone, among 3, 17 or 40
rows, in another order).

Without a GPU the kernel runs on CPU tensors under TRITON_INTERPRET=1, in a child process
(this file as a script: the variable must be set before triton is first imported), as
tests/test_triton_attention.py does. With a GPU the same cases also run on CUDA (marked
`cuda`), where the invariance is the point: cuBLAS does not give it.
"""
import sys

import pytest
import torch
from helpers_triton import interpreted as interpreted_run

from triforce_offload.kernels import triton_linear as tl_

# name: (N, K, dtype, bias, x strided): shapes off the tiles, every dtype the GPU runs
CASES = {
    "fp32_bias": (40, 72, torch.float32, True, False),
    "fp32_wide": (300, 64, torch.float32, False, True),
    "bf16": (136, 200, torch.bfloat16, True, False),
    "fp16_strided": (72, 136, torch.float16, False, True),
}
ROWS = (1, 3, 17, 40)


def make(name, device="cpu"):
    N, K, dtype, bias, strided = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    w = torch.randn(N, K, generator=g).to(dtype).to(device)
    b = torch.randn(N, generator=g).to(dtype).to(device) if bias else None
    x = torch.randn(max(ROWS), K + 8 if strided else K, generator=g).to(dtype).to(device)
    return (x[:, :K] if strided else x), w, b


def run(name, device="cpu") -> dict:
    """The outputs of one case: every prefix of the rows as one call, each row alone, and
    the rows reversed."""
    x, w, b = make(name, device)
    out = {f"m{m}": tl_.linear(x[:m], w, b).cpu() for m in ROWS}
    out["alone"] = torch.cat([tl_.linear(x[i: i + 1], w, b) for i in range(x.shape[0])]).cpu()
    out["reversed"] = tl_.linear(x.flip(0), w, b).flip(0).cpu()
    return out


def check(name, out):
    x, w, b = make(name)
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    full = out[f"m{max(ROWS)}"]
    assert full.dtype == x.dtype and full.shape == ref.shape
    low = x.dtype != torch.float32
    torch.testing.assert_close(full.double(), ref, **(dict(atol=0.15, rtol=2e-2) if low else
                                                      dict(atol=1e-4, rtol=1e-5)))
    for m in ROWS:  # every row: the same bits whatever the call's other rows
        assert torch.equal(out[f"m{m}"], full[:m]), m
    assert torch.equal(out["alone"], full)
    assert torch.equal(out["reversed"], full)


def _interpreted_main(path):
    assert tl_.reason("cpu") == "", tl_.reason("cpu")
    torch.save({name: run(name) for name in CASES}, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    if tl_.triton is None:
        pytest.skip("triton is not importable")
    return interpreted_run(__file__, tmp_path_factory.mktemp("triton_linear"))


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_rows_are_exact_and_close_to_the_reference(interpreted, name):
    check(name, interpreted[name])


def test_tiles_give_every_sm_a_program_and_never_depend_on_rows():
    """A 4096-column weight on 132 SMs: 16-column tiles (256 programs; 32 columns would give
    128, fewer than the SMs); on 32 SMs, or a wide weight, 128; the K step by dtype. `tiles` takes no row count:
    the launch, hence each row's order of summation, is the weight's alone."""
    assert tl_.tiles(4096, 4096, torch.bfloat16, 132).block_n == 16
    assert tl_.tiles(4096, 4096, torch.bfloat16, 32).block_n == 128
    assert tl_.tiles(49152, 576, torch.bfloat16, 132).block_n == 128
    assert tl_.tiles(64, 64, torch.float32, 132) == tl_.Tiles(16, 64, 4, 3)
    assert "M" not in tl_.tiles.__wrapped__.__code__.co_varnames


def test_usable_refuses_mixed_dtypes_and_strided_weights():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    assert tl_.usable(x, w, None)
    assert not tl_.usable(x.bfloat16(), w, None)
    assert not tl_.usable(x, w.t().contiguous().t(), None)  # stride along K is not 1
    assert not tl_.usable(x, w, torch.randn(8, 2)[:, 0])


def test_cublas_choice_turns_it_off(monkeypatch):
    monkeypatch.setenv("TRIFORCE_OFFLOAD_GPU_LINEAR", "cublas")
    assert tl_.reason("cuda") == "TRIFORCE_OFFLOAD_GPU_LINEAR=cublas"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or tl_.triton is None, reason="needs triton and a GPU")
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_rows_are_exact_and_close_to_the_reference(name):
    check(name, run(name, "cuda"))


if __name__ == "__main__":
    _interpreted_main(sys.argv[1])
