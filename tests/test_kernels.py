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
    monkeypatch.setattr(A.native, "supports", lambda q, k: False)  # the torch path
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
    monkeypatch.setattr(A.native, "supports", lambda q, k: False)  # the torch path
    L = tiny(scale=3.0, seed=1)
    prompt = repetitive_prompt(300, L.cfg.vocab_size, seed=3)
    plain, _ = run(L, prompt, "autoregressive", 24)
    monkeypatch.setattr(A, "cpu_splits", lambda bh, free, threads=None: 3 if free >= 24 else 1)
    ref, _ = run(L, prompt, "autoregressive", 24)
    assert ref == plain
    for mode, extra in [("triforce", {"budget": 64}), ("draft", {"draft": "self", "draft_window": 16})]:
        out, _ = run(L, prompt, mode, 24, **extra)
        assert out == ref, mode


# ---- the native CPU kernel (kernels/cpu_attention.c) ----

from triforce_offload.kernels import native  # noqa: E402
from native_sweep import reference  # noqa: E402  (plain float64 attention)
from native_sweep import separate_steps  # noqa: E402  (what the model computes without rope_attend)


def test_native_kernel_builds_here():
    """This machine (and CI) has a C compiler: the kernel must build and load. Without one,
    `available()` is False and attention stays on torch (the tests above)."""
    import shutil
    if not native.compiler():
        assert not native.available() and "compiler" in native.reason()
        return
    assert shutil.which(native.compiler())
    assert native.available(), native.reason()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("D", [16, 64, 80, 128])
@pytest.mark.parametrize("S,T,k_pos0,G", [
    (1000, 1, 0, 3),   # decode over several blocks, a partial last block
    (513, 7, 0, 3),    # verification: 21 folded rows (the tiled score path)
    (300, 5, 40, 2),   # keys starting past 0 (streaming / retrieval caches)
    (5, 2, 0, 3),      # fewer keys than a vector
    (40, 9, 0, 1),     # more queries than keys before them: early rows see few keys
])
def test_native_attention_matches_reference(dtype, tol, D, S, T, k_pos0, G):
    g = torch.Generator().manual_seed(S * T + D)
    cap = S + 9
    K = torch.randn(1, 3, cap, D, generator=g).to(dtype)[:, :, :S]  # views of a preallocated cache
    V = torch.randn(1, 3, cap, D, generator=g).to(dtype)[:, :, :S]
    q = torch.randn(1, 3 * G, T, D, generator=g).to(dtype)
    q_pos0 = k_pos0 + S - T
    ref, ref_lse = reference(q, K, V, q_pos0, k_pos0)
    out, lse = native.attend(q, K, V, q_pos0, k_pos0, out_dtype=torch.float32)
    # bfloat16 KV on a CPU with AVX512_BF16: the probabilities are rounded to bfloat16 too
    lse_tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(lse, ref_lse, rtol=lse_tol, atol=lse_tol)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_native_rows_are_independent():
    """Within a path (decode: < 8 folded rows; verification: 8 and more) a row's output does
    not depend on which other rows share the call; across the paths it agrees to float32
    rounding."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        K = torch.randn(1, 3, 700, 64, generator=g).to(dtype)
        V = torch.randn(1, 3, 700, 64, generator=g).to(dtype)
        q = torch.randn(1, 9, 7, 64, generator=g).to(dtype)
        many, _ = native.attend(q, K, V, 693, out_dtype=torch.float32)  # 21 rows: lanes path
        some, _ = native.attend(q[:, :, :3], K[:, :, :696], V[:, :, :696], 693, out_dtype=torch.float32)  # 9 rows
        assert torch.equal(some, many[:, :, :3])
        for t in range(7):  # 3 rows: the decode path
            one, _ = native.attend(q[:, :, t:t + 1], K[:, :, :694 + t], V[:, :, :694 + t], 693 + t,
                                   out_dtype=torch.float32)
            torch.testing.assert_close(one[:, :, 0], many[:, :, t], rtol=2e-6, atol=2e-6)


def test_native_slices_rows_over_many_blocks(monkeypatch):
    """A prefill chunk (many rows) runs in row slices that bound the scratch memory, over
    many blocks of keys: same results as the plain reference."""
    g = torch.Generator().manual_seed(5)
    K = torch.randn(1, 2, 1000, 32, generator=g)
    V = torch.randn(1, 2, 1000, 32, generator=g)
    q = torch.randn(1, 4, 40, 32, generator=g)  # 80 rows per KV head
    ref, ref_lse = reference(q, K, V, 960)
    monkeypatch.setattr(native, "SCRATCH_BYTES", 1)  # 16-row slices
    monkeypatch.setattr(native, "BLOCK", 64)  # 1000 keys in 16 blocks
    out, lse = native.attend(q, K, V, 960)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,D", [(1, 64), (3, 64), (4, 128), (2, 32)])
def test_native_verification_rows_equal_decodes_bit_for_bit(G, D, dtype):
    """T query rows at once (a verification: the tiled scores from 8 rows on) give each row
    exactly the bits of that token's decode (one row, the keys up to it): the identity
    speculative decoding needs, also across block boundaries (BLOCK keys)."""
    if not native.enabled():
        pytest.skip(native.reason() or "native kernel off")
    g = torch.Generator().manual_seed(G * D)
    n = native.BLOCK * 2 - 5  # the verified tokens straddle a block boundary
    for T in (1, 2, 3, 6, 9, 12):
        K = torch.randn(1, 2, n + T, D, generator=g).to(dtype)
        V = torch.randn(1, 2, n + T, D, generator=g).to(dtype)
        q = torch.randn(1, 2 * G, T, D, generator=g)
        out, lse = native.attend(q, K, V, n)
        for t in range(T):
            o1, l1 = native.attend(q[:, :, t:t + 1], K[:, :, :n + t + 1], V[:, :, :n + t + 1], n + t)
            assert torch.equal(out[:, :, t:t + 1], o1) and torch.equal(lse[:, :, t:t + 1], l1), (T, t)


def test_native_row_that_sees_nothing():
    K = torch.randn(1, 2, 32, 16)
    q = torch.randn(1, 2, 2, 16)
    out, lse = native.attend(q, K, K, q_pos0=3, k_pos0=4)  # row 0 at position 3 precedes every key
    assert torch.isinf(lse[0, :, 0]).all() and (out[0, :, 0] == 0).all()
    assert torch.isfinite(lse[0, :, 1]).all()


def test_native_refuses_cleanly(monkeypatch):
    monkeypatch.setenv("TRIFORCE_OFFLOAD_NATIVE", "1")
    q = torch.randn(1, 2, 1, 12)
    assert not native.supports(q, torch.randn(1, 2, 5, 12))  # head_dim not a multiple of 16
    assert not native.supports(q[..., :8].half(), torch.randn(1, 2, 5, 8).half())  # fp16
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setenv("TRIFORCE_OFFLOAD_NATIVE", "0")
    assert not native.available() and "TRIFORCE_OFFLOAD_NATIVE" in native.reason()
    q = torch.randn(1, 6, 3, 64)
    K = torch.randn(1, 2, 50, 64)
    ref, _ = A.attention_lse(q, K, K, 47)
    torch.testing.assert_close(A.attention(q, K, K, 47), ref, rtol=1e-5, atol=1e-5)  # torch path


def test_native_dispatch_follows_the_vector_width(monkeypatch):
    """Built is not used: by default attention takes the kernel only on 512-bit builds;
    TRIFORCE_OFFLOAD_NATIVE=1 forces it (=0 is test_native_refuses_cleanly), and `status`
    says which."""
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.reason()}")  # covered by test_native_kernel_builds_here
    assert native.vector_bits() in (128, 256, 512)
    q, K = torch.randn(1, 6, 1, 64), torch.randn(1, 2, 50, 64)
    for bits, env, used in [(512, None, True), (256, None, False), (256, "auto", False), (256, "1", True)]:
        monkeypatch.setattr(native, "vector_bits", lambda b=bits: b)
        if env is None:
            monkeypatch.delenv("TRIFORCE_OFFLOAD_NATIVE", raising=False)
        else:
            monkeypatch.setenv("TRIFORCE_OFFLOAD_NATIVE", env)
        assert native.supports(q, K) is used and native.status().startswith("native" if used else "torch")
        calls = []
        real = native.attend
        monkeypatch.setattr(native, "attend", lambda *a, **k: calls.append(1) or real(*a, **k))
        A.attention(q, K, K, 49)
        monkeypatch.setattr(native, "attend", real)
        assert bool(calls) is used
    monkeypatch.setenv("TRIFORCE_OFFLOAD_NATIVE", "auto")  # 256-bit build, not forced: says how to force
    assert "TRIFORCE_OFFLOAD_NATIVE=1" in native.status()


def test_native_build_failure_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("TRIFORCE_OFFLOAD_CACHE", str(tmp_path))
    bad = tmp_path / "bad.c"
    bad.write_text("int f( {")
    monkeypatch.setattr(native, "SOURCE", bad)
    with pytest.raises(RuntimeError, match="failed"):
        native.build()
    # a flag the compiler rejects is dropped on retry (as -march=native is where unsupported)
    monkeypatch.setattr(native, "SOURCE", native.Path(__file__).parents[1] / "kernels" / "cpu_attention.c")
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + ["-fno-such-flag-xyz"])
    monkeypatch.setattr(native, "FALLBACK_DROPS", [(), ("-fno-such-flag-xyz",)])
    assert native.build().exists()
    monkeypatch.setattr(native, "compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C compiler"):
        native.build()


def test_greedy_modes_on_the_native_kernel(monkeypatch):
    """head_dim 16: every cache's attention runs in the native kernel; speculative output
    equals autoregressive output, and both equal the torch-kernel run."""
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.reason()}")  # covered by test_native_kernel_builds_here
    monkeypatch.setenv("TRIFORCE_OFFLOAD_NATIVE", "1")  # dispatch to it on any vector width
    L = tiny(scale=3.0, seed=1, dim=64, heads=4, kv=2)
    prompt = repetitive_prompt(300, L.cfg.vocab_size, seed=3)
    calls = []
    for name in ("attend", "rope_attend"):  # the separate steps, or RoPE, write and attention in one call
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    ref, _ = run(L, prompt, "autoregressive", 24)
    assert "rope_attend" in calls and "attend" in calls  # steps in one call; the 300-token prefill not
    for mode, extra in [("triforce", {"budget": 64}), ("draft", {"draft": "self", "draft_window": 16}),
                        ("triforce", {"budget": 64, "offload": "on", "transfer_chunk": 48})]:
        out, _ = run(L, prompt, mode, 24, **extra)
        assert out == ref, mode
    monkeypatch.setattr(A.native, "supports", lambda q, k: False)
    torch_ref, _ = run(L, prompt, "autoregressive", 24)
    assert torch_ref == ref


def test_rope_attend_is_the_separate_steps(monkeypatch):
    """native.rope_attend (RoPE, the K/V write and the attention in one call) against the
    separate steps the model takes without it (transformer.rotate, the cache's write,
    native.attend): the output, the cache's written rows, the rotated queries, bit for bit;
    float32 and bfloat16 caches, 1-64 tokens, keys from the first slot or after others, a
    first key at a later position (a retrieval cache), soft-capped scores. And the model's
    once-per-process check agrees on this machine."""
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.reason()}")  # covered by test_native_kernel_builds_here
    from triforce_offload.runtime.model import transformer as tr
    monkeypatch.setenv("TRIFORCE_OFFLOAD_NATIVE", "1")
    # torch's addcmul is a fused multiply-add on this CPU (x86-64 with FMA), at every head size
    assert all(tr.one_call_ok(d) for d in (32, 64, 80, 128, 240, 256))
    g = torch.Generator().manual_seed(7)
    Hq, H, D = 6, 2, 64
    for dtype in (torch.float32, torch.bfloat16):
        for T, slot, k_pos0, cap in [(1, 0, 0, None), (1, 300, 0, None), (2, 5, 0, 30.0), (7, 513, 0, None),
                                     (7, 40, 1000, None), (16, 255, 0, 5.0), (64, 17, 64, None)]:
            qkv = torch.randn(1, T, Hq + 2 * H, D, generator=g) * 2
            f = torch.randn(T, 1, D // 2, generator=g) * 5
            cos, sin = torch.cat([f.cos(), f.cos()], -1), torch.cat([-f.sin(), f.sin()], -1)
            K, V = (torch.randn(1, H, slot + T + 9, D, generator=g).to(dtype) for _ in range(2))
            K1, V1 = K.clone(), V.clone()
            got = native.rope_attend(qkv, cos, sin, K1, V1, slot, k_pos0 + slot, k_pos0, Hq, softcap=cap)
            assert got is not None
            o, qf = separate_steps(qkv, cos, sin, K, V, slot, k_pos0, Hq, cap)
            case = (dtype, T, slot, k_pos0, cap)
            assert torch.equal(got[0], o), case
            assert torch.equal(K1, K) and torch.equal(V1, V), case  # the rows written, nothing else
            assert torch.equal(got[1], qf), case
    # what it declines, the caller computes with the separate steps
    qkv = torch.randn(1, 2, Hq + 2 * H, D)
    cos = sin = torch.ones(2, 1, D)
    K = torch.zeros(1, H, 8, D)
    assert native.rope_attend(qkv, cos, sin, K, K.clone(), 7, 7, 0, Hq) is None  # past the cache's end
    long = torch.randn(1, 65, Hq + 2 * H, D)  # a prefill chunk: torch's ops on every thread
    assert native.rope_attend(long, torch.ones(65, 1, D), torch.ones(65, 1, D), torch.zeros(1, H, 80, D),
                              torch.zeros(1, H, 80, D), 0, 0, 0, Hq) is None
    assert native.rope_attend(qkv.double(), cos, sin, K, K.clone(), 0, 0, 0, Hq) is None
    assert native.rope_attend(qkv, cos, sin, K.half(), K.half(), 0, 0, 0, Hq) is None
    monkeypatch.setattr(native, "supports", lambda q, k: False)  # attention on torch's kernels: so this
    assert native.rope_attend(qkv, cos, sin, K, K.clone(), 0, 0, 0, Hq) is None


def test_rope_attend_seqs_is_each_sequences_separate_steps():
    """native.rope_attend_seqs (a ragged forward's RoPE, K/V writes and attention of several
    sequences in one call) against each sequence's separate steps alone: outputs, rotated
    queries and written rows bit for bit; float32 and bf16 caches, mixed token counts,
    slots and first key positions, soft-capping. Buffers that do not match the plan (a
    stride, too few slots) are refused before the kernel writes anything."""
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.reason()}")  # covered by test_native_kernel_builds_here
    from triforce_offload.runtime.model.transformer import one_call_ok
    from native_sweep import seqs_separately
    assert one_call_ok(64) and one_call_ok(32)
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        for D, G, H, steps, cap in [(64, 3, 3, [(1, 300, 0), (7, 41, 0), (1, 12, 0), (3, 700, 0)], None),
                                    (64, 3, 1, [(5, 513, 0), (1, 0, 0)], 30.0),
                                    (32, 2, 2, [(1, 90, 1000), (64, 255, 0), (2, 17, 64)], None),
                                    (128, 1, 2, [(9, 5, 3)], None)]:
            assert seqs_separately(g, dtype, D, G, H, steps, cap), (dtype, D, G, H, steps, cap)
    qkv, cos = torch.randn(1, 3, 4 * 3, 32), torch.ones(3, 1, 32)
    K = torch.zeros(1, 2, 10, 32)
    plan = native.SeqSteps([(0, 1, 5, 0, 5, K.stride(1), K.stride(2)), (1, 2, 8, 0, 8, K.stride(1), K.stride(2))], 4)
    with pytest.raises(ValueError, match="rope_attend_seqs"):  # 8 + 2 slots fit; 9 + 2 do not
        native.rope_attend_seqs(qkv, cos, cos, plan, [(K, K.clone()), (K[:, :, :9], K[:, :, :9].clone())], 8)
    with pytest.raises(ValueError, match="rope_attend_seqs"):  # another layout than planned
        native.rope_attend_seqs(qkv, cos, cos, plan, [(K, K.clone()), (K.transpose(1, 2), K.transpose(1, 2))], 8)
    with pytest.raises(ValueError, match="rope_attend_seqs"):  # a sin table of another shape or dtype
        native.rope_attend_seqs(qkv, cos, cos[:1], plan, [(K, K.clone()), (K, K.clone())], 8)
    with pytest.raises(ValueError, match="rope_attend_seqs"):
        native.rope_attend_seqs(qkv, cos, cos.double(), plan, [(K, K.clone()), (K, K.clone())], 8)
    for bad in [(-1, 1, 5, 0, 5), (0, -1, 5, 0, 5), (0, 1, 5, 0, -4)]:  # a row, a count, a slot below 0
        with pytest.raises(ValueError, match="SeqSteps"):
            native.SeqSteps([(*bad, K.stride(1), K.stride(2))], 4)
    with pytest.raises(ValueError, match="rope_attend_seqs"):  # rows 0..2 planned, 2 given
        native.rope_attend_seqs(qkv[:, :2], cos[:2], cos[:2], plan, [(K, K.clone()), (K, K.clone())], 8)
    assert torch.count_nonzero(K) == 0


# ---- attention logit soft-capping (Gemma 2): every path against the float64 reference ----

CAPS = [2.0, 50.0]  # one that caps most scores of these inputs (q scaled up), one that caps few


def _capped_inputs(seed, Hkv, G, T, S, D, dtype=torch.float32, q_scale=6.0):
    g = torch.Generator().manual_seed(seed)
    K = torch.randn(1, Hkv, S + 5, D, generator=g).to(dtype)[:, :, :S]  # views of a larger cache
    V = torch.randn(1, Hkv, S + 5, D, generator=g).to(dtype)[:, :, :S]
    q = (torch.randn(1, Hkv * G, T, D, generator=g) * q_scale).to(dtype)  # scores up to ~100
    return q, K, V


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("D,S,T,k_pos0,G", [(64, 1000, 1, 0, 3), (64, 513, 7, 0, 3), (128, 300, 5, 40, 2),
                                            (16, 5, 2, 0, 3), (80, 40, 9, 0, 1)])
def test_native_softcap_matches_reference(cap, dtype, tol, D, S, T, k_pos0, G):
    q, K, V = _capped_inputs(S * T + D, 3, G, T, S, D, dtype)
    q_pos0 = k_pos0 + S - T
    ref, ref_lse = reference(q, K, V, q_pos0, k_pos0, softcap=cap)
    out, lse = native.attend(q, K, V, q_pos0, k_pos0, out_dtype=torch.float32, softcap=cap)
    lse_tol = 1e-5 if dtype == torch.float32 else 4e-3  # bf16: probabilities rounded to bf16 too
    torch.testing.assert_close(lse, ref_lse, rtol=lse_tol, atol=lse_tol)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    if cap == 2.0:  # the cap changed the result
        plain, _ = native.attend(q, K, V, q_pos0, k_pos0, out_dtype=torch.float32)
        assert (plain - out).abs().max() > 10 * tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_softcap_verification_rows_equal_decodes_bit_for_bit(dtype):
    """Soft-capping is element by element after the dot products, so a verification's rows
    keep the bits of their decodes."""
    if not native.enabled():
        pytest.skip(native.reason() or "native kernel off")
    n = native.BLOCK * 2 - 5
    for T in (1, 3, 9, 12):
        q, K, V = _capped_inputs(T, 2, 3, T, n + T, 64, dtype)
        out, lse = native.attend(q.float(), K, V, n, softcap=2.0)
        for t in range(T):
            o1, l1 = native.attend(q[:, :, t:t + 1].float(), K[:, :, :n + t + 1], V[:, :, :n + t + 1], n + t,
                                   softcap=2.0)
            assert torch.equal(out[:, :, t:t + 1], o1) and torch.equal(lse[:, :, t:t + 1], l1), (T, t)


def test_native_without_softcap_is_the_plain_kernel():
    """softcap None and 0 both take the plain scaling loop: the same bits."""
    q, K, V = _capped_inputs(3, 2, 3, 9, 700, 64)
    a = native.attend(q, K, V, 691)
    for off in (None, 0.0):
        b = native.attend(q, K, V, 691, softcap=off)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("cap", CAPS)
def test_torch_paths_softcap_match_reference(monkeypatch, cap):
    """With the native kernel off: `attention` (explicit fp32 scores in row slices, where
    SDPA or the CPU split-K would run), `attention_lse`, the streamed blocks of an offloaded
    layer merged by log-sum-exp, the fixed-shape length-masked path and a window band."""
    from triforce_offload.kernels.chunked import StreamedAttention
    from triforce_offload.runtime.cache.kv import static_window_attention, window_attention
    monkeypatch.setattr(A.native, "supports", lambda q, k: False)
    q, K, V = _capped_inputs(7, 2, 3, 6, 2100, 64)
    q_pos0 = 2100 - 6
    ref, ref_lse = reference(q, K, V, q_pos0, softcap=cap)
    tol = dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(A.attention(q, K, V, q_pos0, softcap=cap), ref, **tol)
    monkeypatch.setattr(A, "SCORE_BYTES", 3 * 2100 * 4 * 2)  # 3-row slices
    torch.testing.assert_close(A.attention(q, K, V, q_pos0, softcap=cap), ref, **tol)
    out, lse = A.attention_lse(q, K, V, q_pos0, softcap=cap)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    s = StreamedAttention(q, 2, softcap=cap, group=3)  # staged chunks, then the forward's own tokens
    for a in range(0, q_pos0, 512):
        s.add(K[:, :, a:min(a + 512, q_pos0)], V[:, :, a:min(a + 512, q_pos0)])
    s.add_causal(K[:, :, q_pos0:], V[:, :, q_pos0:], q_pos0, q_pos0)
    torch.testing.assert_close(s.result(), ref, **tol)
    cap_K = torch.cat([K, torch.zeros(1, 2, 50, 64)], 2)  # a fixed-capacity buffer past the length
    cap_V = torch.cat([V, torch.zeros(1, 2, 50, 64)], 2)
    length = torch.tensor([2100])
    torch.testing.assert_close(A.static_attention(q, cap_K, cap_V, length, softcap=cap), ref, **tol)
    W = 300  # a sliding layer: each query sees its last W keys
    band, _ = reference(q, K[:, :, q_pos0 + 6 - W - 5:], V[:, :, q_pos0 + 6 - W - 5:], q_pos0,
                        q_pos0 + 6 - W - 5, softcap=cap)
    first = torch.arange(6) + q_pos0 - W + 1  # first key of each query's band
    for t in range(6):  # the reference per query over its own band
        band[:, :, t] = reference(q[:, :, t:t + 1], K[:, :, first[t]:q_pos0 + t + 1],
                                  V[:, :, first[t]:q_pos0 + t + 1], q_pos0 + t, int(first[t]), softcap=cap)[0][:, :, 0]
    torch.testing.assert_close(window_attention(q, K, V, q_pos0, 0, W, softcap=cap), band, **tol)
    torch.testing.assert_close(static_window_attention(q, cap_K, cap_V, length, W, softcap=cap), band, **tol)


TRITON_SOFTCAP = r"""
import torch
from triforce_offload.kernels import triton_attention as ta
from native_sweep import reference  # tests/ is on PYTHONPATH (the caller sets it)
assert ta.available(), ta.reason()
g = torch.Generator().manual_seed(0)
for cap in (2.0, 50.0):
    for dtype, T, G, D in ((torch.float32, 1, 3, 64), (torch.float32, 7, 4, 80), (torch.bfloat16, 5, 2, 64)):
        q = (torch.randn(1, 2 * G, T, D, generator=g) * 6).to(dtype)
        k = torch.randn(1, 2, 256, D, generator=g).to(dtype)
        v = torch.randn(1, 2, 256, D, generator=g).to(dtype)
        k[:, :, 200:] = float("nan")  # past the length: never read
        out, lse = ta.decode_attention_lse(q, k, v, torch.tensor([200]), softcap=cap, block_n=32, splits=3)
        ref, ref_lse = reference(q, k[:, :, :200], v[:, :, :200], 200 - T, softcap=cap)
        tol = 3e-2 if dtype == torch.bfloat16 else 2e-5
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-3 if dtype == torch.bfloat16 else 2e-5)
        if cap == 2.0:
            plain = ta.decode_attention(q, k, v, torch.tensor([200]), block_n=32, splits=3)
            assert (plain.float() - out.float()).abs().max() > 10 * tol, "the cap changed nothing"
print("ok")
"""


def test_triton_softcap_matches_reference():
    """The Triton split-K kernel with a softcap, on CPU tensors under TRITON_INTERPRET=1 (in
    a child process: the variable counts only before triton's first import)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    from triforce_offload.kernels import triton_attention as ta
    if ta.triton is None:
        pytest.skip(ta.reason())
    r = subprocess.run([sys.executable, "-c", TRITON_SOFTCAP], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1",
                            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                        os.environ.get("PYTHONPATH")]))})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
