"""The Triton decode kernels compiled for real GPUs, on a machine without one.

Triton compiles ahead of time for a named target (`GPUTarget`) with its bundled LLVM and
ptxas, no device needed. The kernels compiled here are exactly the ones the runtime
launches: `triton_attention.plan` builds the two launches from cache-shaped tensors, and
Triton's own launcher code (the binder `JITFunction.run` uses) turns their arguments into
the specialization, so the constexprs and the `tt.divisibility` attributes are those of
16-byte-aligned pointers and strides divisible by 16 (a compile without them pipelines
nothing and needs a fraction of the shared memory: bf16 at head_dim 256 took 141 KB at
first launch on sm_89, which has 99 KB). For sm_80 (A100, RTX 30xx pro cards), sm_86
(RTX 30xx), sm_89 (RTX 40xx, the paper's 4090) and sm_90 (H100), at head_dim 64, 128 and
256, in fp16, bf16 and fp32, for decode and verification shapes of real models: the split
kernel must fit the target's shared memory per block (and `smem_bytes`, the bound
`launch_config` picks tiles with, must cover it), and ptxas must report no register spill
(`-v`): a spill turns a bandwidth-bound decode kernel into a local-memory-bound one.
"""
import re
import subprocess

import pytest
import torch

from triforce_offload.kernels import triton_attention as ta

triton = pytest.importorskip("triton")  # in the `test` extra: present wherever the suite runs
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

CAPS = {80: 108, 86: 84, 89: 128, 90: 132}  # sm -> SM count (A100, RTX 3090, RTX 4090, H100)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEADS = [(32, 8, 1), (32, 8, 7), (32, 32, 1), (9, 3, 5), (32, 4, 16)]  # (Hq, Hkv, T)


def compile_launch(kernel, args, kwargs, cap: int):
    """Compile one launch for sm_`cap` as `JITFunction.run` would: its binder specializes
    the arguments (divisibility by 16, ints equal to 1), `_pack_args` makes the signature,
    constexprs and attributes."""
    target = GPUTarget("cuda", cap, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, opts)
    key = (cap, str(signature), str(sorted(constexprs.items(), key=str)), str(sorted(attrs.items())),
           str(options))
    return key, lambda: triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                       target=target, options=options.__dict__)


def launches(dtype, D: int, Hq: int, Hkv: int, T: int, cap: int, monkeypatch, s_cap: int = 4096):
    """The runtime's two launches for a cache [1, Hkv, s_cap, D] and a step of T tokens:
    q as the model makes it ([B, T, Hq, D] transposed), an int64 device length."""
    monkeypatch.setattr(ta, "_sm_count", lambda device: CAPS[cap])
    q = torch.empty(1, T, Hq, D, dtype=dtype).transpose(1, 2)
    k = torch.empty(1, Hkv, s_cap, D, dtype=dtype)
    (split, merge), _, _ = ta.plan(q, k, torch.empty_like(k), torch.tensor([s_cap // 2]),
                                   capability=cap)
    return split, merge


def ptxas_report(ptx: str, cap: int, tmp_path) -> tuple[int, int]:
    """(registers per thread, spill store bytes) from ptxas -v on the kernel's PTX."""
    f = tmp_path / f"k{cap}.ptx"
    f.write_text(ptx)
    r = subprocess.run([get_ptxas(cap).path, "-v", f"--gpu-name={sm_arch_from_capability(cap)}",
                        str(f), "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", r.stderr).group(1))
    return regs, spills


def check_split(dtype, D, heads, cap, monkeypatch, tmp_path, seen: set):
    (kernel, _, args, kwargs), _ = launches(dtype, D, *heads, cap, monkeypatch)
    key, build = compile_launch(kernel, args, kwargs, cap)
    if key in seen:
        return
    seen.add(key)
    k = build()
    cfg = ta.launch_config(dtype, D, heads[0] // heads[1] * heads[2], False, cap)
    what = f"sm_{cap} {dtype} D={D} heads={heads} {cfg}"
    assert k.metadata.shared <= ta.smem_limit(cap), f"{what}: {k.metadata.shared} B of shared memory"
    assert k.metadata.shared <= ta.smem_bytes(cfg, dtype, cap), f"{what}: smem_bytes under-counts"
    regs, spills = ptxas_report(k.asm["ptx"], cap, tmp_path)
    assert spills == 0, f"{what}: {spills} bytes spilled with {regs} registers"


def test_the_launch_is_specialized_as_the_runtime_launches_it(monkeypatch):
    """Pointers 16-byte aligned and strides divisible by 16 carry tt.divisibility 16, ints
    equal to 1 become constants: what Triton's launcher infers at the first launch."""
    (kernel, _, args, kwargs), _ = launches(torch.bfloat16, 128, 32, 8, 1, 89, monkeypatch)
    _, build = compile_launch(kernel, args, kwargs, 89)
    backend = make_backend(GPUTarget("cuda", 89, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    _, spec, _ = binder(*args, **kwargs)
    names = [p.name for p in kernel.params]
    by = dict(zip(names, spec))
    assert all(by[p][1] == "D" for p in ("Q", "K", "V", "Acc", "skn", "skh", "sqh"))  # divisible by 16
    assert by["T"] == ("constexpr", 1)


@pytest.mark.parametrize("cap", [89, 86])
def test_head_dim_256_fits_a_99_kb_card(cap, monkeypatch, tmp_path):
    """The defect: the real bf16 kernel at head_dim 256 needed 141 KB of shared memory on
    sm_89 (99 KB per block). The launch config now picks tiles per target."""
    check_split(torch.bfloat16, 256, (32, 8, 1), cap, monkeypatch, tmp_path, set())


@pytest.mark.slow
@pytest.mark.parametrize("cap", list(CAPS))
@pytest.mark.parametrize("D", [64, 128, 256])
def test_split_kernel_fits_every_target_without_spills(cap, D, monkeypatch, tmp_path):
    seen = set()
    for dtype in DTYPES:
        for heads in HEADS:
            check_split(dtype, D, heads, cap, monkeypatch, tmp_path, seen)


def test_launch_config_rows_and_tiles():
    for cap in CAPS:
        for dtype in DTYPES:
            for D in (64, 80, 128, 256):
                for R in (1, 3, 16, 17, 64, 200):
                    c = ta.launch_config(dtype, D, R, False, cap)
                    assert c.block_d >= D and c.block_m >= 16 and c.block_n >= 16
                    assert c.block_m <= ta.MAX_ROWS and (c.block_m >= R or c.block_m * c.block_d >= 4096)
                    assert c.dot_f32 == (dtype == torch.float32)
                    assert ta.smem_bytes(c, dtype, cap) <= ta.smem_limit(cap)
    assert ta.launch_config(torch.bfloat16, 64, 1, interpret=True).dot_f32  # the interpreter's bf16 dot
    assert ta.launch_config(torch.bfloat16, 256, 1, False, 89).num_stages == 2  # 3 stages: 141 KB
    assert ta.launch_config(torch.bfloat16, 256, 1, False, 90).num_stages == 3


def test_nothing_fits_names_the_fallback(monkeypatch):
    """A card whose shared memory holds no tile: `fits` says why; `info` names the fallback."""
    from triforce_offload.kernels import attention as A
    monkeypatch.setattr(ta, "device_capability", lambda device: 75)
    monkeypatch.setattr(ta, "SMEM", {75: 8 << 10})
    why = ta.fits(torch.bfloat16, 128, 4, torch.device("cuda"))
    assert "sm_75" in why and "8 KB" in why and "head_dim 128" in why
    assert "length-masked SDPA there" in A._triton_gaps(torch.device("cuda"))


def test_static_attention_falls_back_when_nothing_fits_and_says_so(monkeypatch):
    """The Triton path with no fitting tile runs the masked SDPA (same result) and the stats
    line (the steps' figures) names the fallback and why, once."""
    from triforce_offload.kernels import attention as A
    from triforce_offload.runtime.graphs import combined
    monkeypatch.setenv("TRIFORCE_OFFLOAD_ATTENTION", "triton")
    monkeypatch.setattr(ta, "device_capability", lambda device: 75)
    monkeypatch.setattr(ta, "SMEM", {75: 8 << 10})
    monkeypatch.setattr(A, "FALLBACKS", {})
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 2, 64, generator=g)
    k, v = torch.randn(2, 1, 2, 32, 64, generator=g)
    length = torch.tensor([20])
    for _ in range(2):
        out = A.static_attention(q, k, v, length)
    torch.testing.assert_close(out, A._masked_attention(q, k, v, length))
    [note] = combined([])["notes"]
    assert "sm_75" in note and "length-masked SDPA instead" in note


@pytest.mark.parametrize("D", [64, 128, 256])
def test_merge_kernel_compiles(D, monkeypatch, tmp_path):
    for cap in (80, 90):
        _, (kernel, _, args, kwargs) = launches(torch.bfloat16, D, 32, 8, 1, cap, monkeypatch)
        _, build = compile_launch(kernel, args, kwargs, cap)
        assert ptxas_report(build().asm["ptx"], cap, tmp_path)[1] == 0


# ---- the row-exact projection (kernels/triton_linear.py)

LINEARS = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096),  # Llama-2-7B
           (960, 576), (49152, 576)]  # SmolLM2's qkv and tied head


def check_linear(dtype, N, K, cap, monkeypatch, tmp_path, seen: set, rows: int = 1):
    """One projection's launch as the runtime makes it, compiled for sm_`cap`: within the
    target's shared memory (and `smem_bytes`' bound), no register spill."""
    from triforce_offload.kernels import triton_linear as tl_
    monkeypatch.setattr(ta, "_sm_count", lambda device: CAPS[cap])
    (kernel, _, args, kwargs), _ = tl_.plan(torch.empty(rows, K, dtype=dtype), torch.empty(N, K, dtype=dtype),
                                            capability=cap)
    key, build = compile_launch(kernel, args, kwargs, cap)
    if key in seen:
        return
    seen.add(key)
    k = build()
    t = tl_.tiles(N, K, dtype, CAPS[cap], cap)
    what = f"sm_{cap} {dtype} {N}x{K} {t}"
    assert k.metadata.shared <= ta.smem_limit(cap), f"{what}: {k.metadata.shared} B of shared memory"
    assert k.metadata.shared <= tl_.smem_bytes(t, dtype), f"{what}: smem_bytes under-counts"
    regs, spills = ptxas_report(k.asm["ptx"], cap, tmp_path)
    assert spills == 0, f"{what}: {spills} bytes spilled with {regs} registers"


def test_linear_launch_does_not_specialize_on_rows(monkeypatch):
    """A decode's 1 row and a verification's 7 bind to the same compiled kernel: Triton
    would make M == 1 a constant, and another kernel could sum rows in another order."""
    from triforce_offload.kernels import triton_linear as tl_
    monkeypatch.setattr(ta, "_sm_count", lambda device: 128)
    keys = set()
    for rows in (1, 7, 16, 33):
        (kernel, _, args, kwargs), _ = tl_.plan(torch.empty(rows, 4096, dtype=torch.bfloat16),
                                                torch.empty(4096, 4096, dtype=torch.bfloat16), capability=89)
        keys.add(compile_launch(kernel, args, kwargs, 89)[0])
    assert len(keys) == 1


def test_linear_fits_a_99_kb_card(monkeypatch, tmp_path):
    check_linear(torch.bfloat16, 32000, 4096, 89, monkeypatch, tmp_path, set())


@pytest.mark.slow
@pytest.mark.parametrize("cap", list(CAPS))
def test_linear_fits_every_target_without_spills(cap, monkeypatch, tmp_path):
    seen = set()
    for dtype in DTYPES:
        for N, K in LINEARS:
            check_linear(dtype, N, K, cap, monkeypatch, tmp_path, seen)
