"""The quantized linear kernels against their torch reference, and GGUF blocks against gguf's
own dequantization: every exact format must give gguf's values bit for bit."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from triforce_offload.kernels import qlinear
from triforce_offload.kernels.qlinear import QEmbedding, QLinear, QPart, pack4, quantize
from triforce_offload.runtime.model import gguf_weights

from qlinear_sweep import part  # random parts, shared with the sanitizer sweep


def _part(bits, N, K, G, f16, with_min, seed=0):
    return part(bits, N, K, G, f16, with_min, torch.Generator().manual_seed(seed))


CASES = [(8, 37, 64, 16, True, False), (8, 8, 576, 32, True, False), (8, 19, 96, 96, False, True),
         (4, 41, 64, 32, True, True), (4, 16, 1536, 32, False, True), (4, 9, 128, 64, True, True)]


@pytest.mark.parametrize("bits,N,K,G,f16,with_min", CASES)
def test_kernel_matches_reference_and_rows_do_not_depend_on_the_batch(bits, N, K, G, f16, with_min):
    if qlinear.load() is None:
        pytest.skip(f"native kernel unavailable: {qlinear.reason()}")
    part = _part(bits, N, K, G, f16, with_min)
    bias = torch.randn(N)
    lin = QLinear([part], bias)
    x = torch.randn(2, 7, K)
    y = lin(x)
    ref = F.linear(x.double(), part.dequantize().double(), bias.double()).float()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    rows = torch.cat([lin(x[b, t:t + 1]) for b in range(2) for t in range(7)]).view(2, 7, N)
    assert torch.equal(y, rows)  # a verification's rows are the decodes' rows, bit for bit


@pytest.mark.parametrize("bits,N,K,G,f16,with_min", CASES)
def test_int8_activations_match_their_reference_and_rows_do_not_depend_on_the_batch(bits, N, K, G, f16, with_min):
    """x quantized per row and 32 inputs, integer dots: the float64 product of the quantized x
    and the weights; a layout the kernel does not take (K = 96) keeps float x, bit for bit."""
    if qlinear.load() is None:
        pytest.skip(f"native kernel unavailable: {qlinear.reason()}")
    part = _part(bits, N, K, G, f16, with_min)
    bias = torch.randn(N)
    lin = QLinear([part], bias, act="int8")
    # 70 rows: lanes along rows of x (groups of 16, the last one partial); each row alone: lanes
    # along weight rows; blocks of very different scales
    x = torch.randn(2, 35, K) * torch.logspace(-2, 1, K)
    y = lin(x)
    if part.q8_ok():
        ref = F.linear(qlinear.quantize_x(x).double(), part.dequantize().double(), bias.double()).float()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
        assert not torch.equal(y, QLinear([part], bias)(x))  # x was quantized
    else:
        assert torch.equal(y, QLinear([part], bias)(x))
    rows = torch.cat([lin(x[b, t:t + 1]) for b in range(2) for t in range(35)]).view(2, 35, N)
    assert torch.equal(y, rows)
    assert torch.equal(lin(x[:, :5]), y[:, :5])  # a few rows together


@pytest.mark.parametrize("bits,N,K,G,f16,with_min", [c for c in CASES if c[2] % 64 == 0]
                         + [(8, 70, 128, 128, False, False), (4, 33, 256, 128, True, False)])
def test_packed_columns_give_the_bits_of_the_transposing_calls(monkeypatch, bits, N, K, G, f16, with_min):
    """The columns packed once at load (`TRIFORCE_OFFLOAD_CPU_COLUMNS`) give every call of
    1-70 rows the bits of the kernel that transposes W per call: plain, fused (norm, SwiGLU,
    residual), one tile and several, an odd number of tiles for one row's pairs."""
    if qlinear.load() is None or not qlinear.vnni():
        pytest.skip("the packed columns are the AVX-512 VNNI kernel's")
    p = _part(bits, N, K, G, f16, with_min)
    assert p.q8_ok()
    bias = torch.randn(N)

    def lin(mode):
        monkeypatch.setenv("TRIFORCE_OFFLOAD_CPU_COLUMNS", mode)
        fresh = QLinear([QPart(p.q, p.scale, p.minv, bits, G, K)], bias, act="int8")
        fresh.native_calls()
        assert (fresh.parts[0].columns() is not None) == (mode == "1")
        return fresh

    plain, packed = lin("0"), lin("1")
    norm = torch.nn.RMSNorm(K, eps=1e-5)
    norm.plus_one = False
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    for M in (1, 2, 3, 4, 5, 7, 16, 29, 63, 64, 70):
        x = torch.randn(M, K) * torch.logspace(-2, 1, K)
        assert torch.equal(plain(x), packed(x)), M
        res = torch.randn(M, N)
        assert torch.equal(plain.fused(x, norm, residual=res), packed.fused(x, norm, residual=res)), M
        xg = torch.randn(M, 2 * K)
        assert torch.equal(plain.fused(xg, glu=True), packed.fused(xg, glu=True)), M


def test_packed_columns_follow_the_budget_and_the_weights(monkeypatch):
    """auto packs while the columns fit the budget; a part moved or copied packs its own."""
    if qlinear.load() is None or not qlinear.vnni():
        pytest.skip("the packed columns are the AVX-512 VNNI kernel's")
    import copy
    monkeypatch.setenv("TRIFORCE_OFFLOAD_CPU_COLUMNS", "auto")
    monkeypatch.setattr(qlinear, "_budget", lambda: qlinear._packed[0])  # no room left
    lin = QLinear([_part(8, 37, 64, 16, True, False)], act="int8")
    x = torch.randn(3, 64)
    y = lin(x)
    assert lin.parts[0].columns() is None
    monkeypatch.setattr(qlinear, "_budget", lambda: 1 << 40)
    lin2 = QLinear([lin.parts[0]], act="int8")
    assert lin2.parts[0].columns() is None  # decided once per part
    before = qlinear._packed[0]
    dup = copy.deepcopy(lin)
    assert dup.parts[0].columns() is not None and qlinear._packed[0] > before
    assert torch.equal(dup(x), y)
    dup.to(torch.float32)  # buffers may move: columns made again from where q is
    assert "_columns" not in dup.parts[0].__dict__ and torch.equal(dup(x), y)


@pytest.mark.parametrize("glu", [False, True])
def test_fused_norm_swiglu_and_residual_are_the_ops_around_the_projection(glu):
    """QLinear.fused: the RMSNorm (or SwiGLU) and the residual add in the int8 kernel's pass
    give the composed ops' result to float rounding (the norm is summed in another order, so
    a quantized value may flip: a tolerance, not equality), and a row never depends on the
    others of the batch, bit for bit."""
    if qlinear.load() is None or not qlinear.vnni():
        pytest.skip("the fused pass runs with int8 activations")
    from triforce_offload.runtime.model.transformer import RMSNorm, project
    K, N = 576, 40
    lin = QLinear([_part(4, N, K, 32, True, True)], torch.randn(N), act="int8")
    norm = RMSNorm(K, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(K) + 0.5)
    x = torch.randn(2, 5, 2 * K if glu else K) * 3
    res = torch.randn(2, 5, N)
    y = lin.fused(x, None if glu else norm, glu, res)
    h = F.silu(x[..., :K]) * x[..., K:] if glu else norm(x)
    ref = res + lin(h)
    err = (y - ref).abs().max() / ref.abs().max()
    assert y is not None and err < 2e-3, err
    rows = torch.cat([lin.fused(x[b, t:t + 1], None if glu else norm, glu, res[b, t:t + 1])
                      for b in range(2) for t in range(5)]).view(2, 5, N)
    assert torch.equal(y, rows)
    assert torch.equal(project(lin, x, None if glu else norm, glu, res), y)  # the model's entry takes it
    gemma = RMSNorm(K, 1e-6, plus_one=True)  # (1 + w): not this kernel's: the ops composed
    assert lin.fused(x[..., :K], gemma) is None and QLinear([_part(4, N, K, 32, True, True)]).fused(x[..., :K]) is None


def test_fused_plan_is_kept_and_follows_a_replaced_norm_weight():
    """fused() decides what to call once per (norm, SwiGLU) and keeps it; a norm whose weight
    was replaced since (another tensor: the pointer the plan holds would be stale) is planned
    again, and the result follows the new weight; moving the linear drops its plans."""
    if qlinear.load() is None or not qlinear.vnni():
        pytest.skip("the fused pass runs with int8 activations")
    from triforce_offload.runtime.model.transformer import RMSNorm
    K, N = 128, 24
    lin = QLinear([_part(4, N, K, 32, True, True)], act="int8")
    norm = RMSNorm(K, 1e-5)
    x = torch.randn(3, K)
    y1 = lin.fused(x, norm)
    plan = lin._plans[(norm, False)]
    assert lin.fused(x, norm) is not None and lin._plans[(norm, False)] is plan  # kept
    norm.weight = torch.nn.Parameter(torch.rand(K) + 2.0)
    y2 = lin.fused(x, norm)
    assert lin._plans[(norm, False)] is not plan and lin._plans[(norm, False)][3] == norm.weight.data_ptr()
    assert torch.allclose(y2, lin(norm(x)), rtol=2e-3, atol=2e-3) and not torch.allclose(y1, y2)
    lin.act = "fp32"  # float activations: the fused kernel does not run, nothing stale is used
    assert lin.fused(x, norm) is None
    lin.act = "int8"
    lin.to(torch.device("cpu"))  # _apply: the calls and plans are built again
    assert lin._calls is None and torch.equal(lin.fused(x, norm), y2)


def test_quantize_x_is_per_row_and_block():
    x = torch.randn(3, 64)
    x[1, 40] = 100.0  # one outlier: only its own block of row 1 gets the coarse scale
    q = qlinear.quantize_x(x)
    err = (q - x).abs()
    assert err[1, 40] == 0 and err[1, 32:].max() <= 100 / 127 / 2 + 1e-6
    for r, blk in ((0, slice(0, 32)), (1, slice(0, 32)), (2, slice(32, 64))):
        assert err[r, blk].max() <= x[r, blk].abs().max() / 127 / 2 + 1e-6
    assert torch.equal(qlinear.quantize_x(x[1:2]), q[1:2])
    assert torch.equal(qlinear.quantize_x(torch.zeros(1, 32)), torch.zeros(1, 32))


def test_activations_auto_is_int8_only_where_vnni_runs_it():
    assert qlinear.activations("auto", "cpu") == ("int8" if qlinear.vnni() else "fp32")
    assert qlinear.activations("auto", "cuda") == "fp32"
    assert qlinear.activations("int8", "cuda") == "int8" and qlinear.activations("fp32", "cpu") == "fp32"
    if qlinear.vnni():
        assert "VNNI" in qlinear.kernel("cpu", "int8")


def test_int8_activations_torch_reference(monkeypatch):
    """Without the native kernel (or on a GPU) int8 activations run the torch reference,
    which quantizes x the same way."""
    part = _part(4, 16, 128, 32, True, True)
    lin, x = QLinear([part], act="int8"), torch.randn(3, 128)
    monkeypatch.setattr(qlinear, "load", lambda: None)
    torch.testing.assert_close(lin(x), F.linear(qlinear.quantize_x(x), part.dequantize()))


def test_parts_side_by_side_and_strided_input():
    if qlinear.load() is None:
        pytest.skip("native kernel unavailable")
    a, b = _part(4, 24, 64, 32, True, True, 1), _part(8, 13, 64, 16, False, False, 2)
    bias = torch.randn(37)
    lin = QLinear([a, b], bias)
    x = torch.randn(5, 128)[:, ::2]  # a strided view
    ref = F.linear(x, torch.cat([a.dequantize(), b.dequantize()]), bias)
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-4)


def test_torch_path_is_the_reference(monkeypatch):
    part = _part(4, 16, 64, 32, True, True)
    lin, x = QLinear([part]), torch.randn(3, 64)
    monkeypatch.setattr(qlinear, "load", lambda: None)  # as without a C compiler
    assert "torch" in qlinear.kernel("cpu")
    torch.testing.assert_close(lin(x), F.linear(x, part.dequantize()))


def test_embedding_rows_and_out_of_range():
    part = _part(8, 50, 32, 16, True, True)
    emb = QEmbedding(part)
    ids = torch.tensor([[3, 49, 0]])
    assert torch.equal(emb(ids), part.dequantize()[ids])
    if qlinear.load() is not None:
        with pytest.raises(IndexError):
            emb(torch.tensor([[50]]))


@pytest.mark.parametrize("bits,group", [(8, None), (8, 32), (4, 32), (4, 64)])
def test_quantize_error_is_bounded_by_half_a_step(bits, group):
    w = torch.randn(33, 128)
    p = quantize(w, bits, group)
    G = group or 128
    step = p.scale.float().repeat_interleave(G, dim=1)
    assert ((p.dequantize() - w).abs() <= 0.5 * step + 1e-6).all()
    with pytest.raises(ValueError):
        quantize(torch.randn(4, 40), 4, 32)


def _random_blocks(kind: str, N: int, K: int, seed=0) -> np.ndarray:
    """Random raw GGUF blocks of `kind` with sane float16 d/dmin fields."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    qt = GGMLQuantizationType[kind]
    bs, size = GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N, K // bs, size), dtype=np.uint8)
    halves = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[kind]
    for off in halves:
        raw[..., off:off + 2] = (rng.random((N, K // bs)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8).reshape(N, K // bs, 2)
    return raw.reshape(N, -1), qt


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_convert_exactly(kind):
    from gguf import dequantize
    N, K = 6, 512
    raw, qt = _random_blocks(kind, N, K)
    part = gguf_weights.convert(kind, raw, K)
    ref = torch.from_numpy(np.asarray(dequantize(raw, qt), dtype=np.float32).reshape(N, K))
    assert part.bits == (4 if kind in gguf_weights.INT4_TYPES else 8)
    torch.testing.assert_close(part.dequantize(), ref, rtol=1e-6, atol=1e-7)


def test_permuted_rows_match_transformers():
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor
    w = torch.randn(48, 32)
    part = quantize(w, 8, 32)
    back = gguf_weights.permute_rows(part, 3).dequantize().numpy()
    ref = TensorProcessor()._reverse_permute_weights(part.dequantize().numpy(), 3, 3) \
        if hasattr(TensorProcessor, "_reverse_permute_weights") else None
    if ref is None:
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
        ref = LlamaTensorProcessor()._reverse_permute_weights(part.dequantize().numpy(), 3, 3)
    np.testing.assert_array_equal(back, ref)
