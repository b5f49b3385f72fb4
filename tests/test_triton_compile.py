"""The Triton decode kernels compiled for real GPUs, on a machine without one.

Triton compiles ahead of time for a named target (`GPUTarget`) with its bundled LLVM and
ptxas, no device needed. For every launch configuration `launch_config` hands out (16-bit
and fp32, head sizes 64-256, 1-128 rows per KV head) and for sm_80 (A100, RTX 30xx),
sm_89 (RTX 40xx, the paper's 4090) and sm_90 (H100), the split kernel must compile and
ptxas must report no register spill (`-v`): a spill turns a bandwidth-bound decode kernel
into a local-memory-bound one, which the interpreter tests cannot see. The merge kernel
compiles for every split count bucket.
"""
import re
import subprocess

import pytest
import torch

from triforce_offload.kernels import triton_attention as ta

triton = pytest.importorskip("triton")  # in the `test` extra: present wherever the suite runs
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

CAPS = (80, 89, 90)
PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
SCALARS = {"qk_scale": "fp32"}


def configs():
    """Every distinct (dtype, launch) the runtime uses for these head sizes and rows."""
    seen = {}
    for dtype in PTR:
        for D in (64, 80, 128, 256):
            for R in (1, 7, 21, 28, 49, 64, 128):  # G*T: decode and verification of real models
                cfg = ta.launch_config(dtype, D, R)
                seen.setdefault((dtype, cfg), (D, R))
    return sorted(seen, key=str)


def compile_for(fn, pointers: dict, const: dict, cap: int, **options):
    """Compile jitted `fn` for sm_`cap`: integer arguments i32, `pointers` typed, `const` baked in."""
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(pointers)
    sig.update({k: "constexpr" for k in const})
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", cap, 32), options=options)


def compile_split(dtype, cfg: ta.Launch, cap: int):
    split, _ = ta._kernels()
    pointers = dict(Q=PTR[dtype], K=PTR[dtype], V=PTR[dtype], Lens="*i64", QPos="*i64",
                    Acc="*fp32", Mx="*fp32", Sm="*fp32", **SCALARS)
    return compile_for(split, pointers, dict(QPOS_MODE=0, CAUSAL=True, **cfg.constexprs()), cap,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)


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


def test_launch_config_rows_and_tiles():
    for dtype in PTR:
        for D in (64, 80, 128, 256):
            for R in (1, 3, 16, 17, 64, 200):
                c = ta.launch_config(dtype, D, R)
                assert c.block_d >= D and c.block_m >= 16 and c.block_n >= 16
                assert c.block_m <= ta.MAX_ROWS and (c.block_m >= R or c.block_m * c.block_d >= 4096)  # capped only for big tiles
                assert c.dot_f32 == (dtype == torch.float32)
    assert ta.launch_config(torch.bfloat16, 64, 1, interpret=True).dot_f32  # the interpreter's bf16 dot


@pytest.mark.slow
@pytest.mark.parametrize("dtype,cfg", configs(), ids=lambda x: str(x).replace("torch.", ""))
def test_split_kernel_compiles_without_spills(dtype, cfg, tmp_path):
    for cap in CAPS:
        k = compile_split(dtype, cfg, cap)
        regs, spills = ptxas_report(k.asm["ptx"], cap, tmp_path)
        assert spills == 0, f"sm_{cap}: {spills} bytes spilled with {regs} registers ({cfg})"
        assert k.metadata.shared <= 99 * 1024  # fits sm_89's shared memory per block


@pytest.mark.parametrize("D", [64, 128, 256])
def test_merge_kernel_compiles(D, tmp_path):
    _, merge = ta._kernels()
    for splits in (1, 8, 64):
        k = compile_for(merge, dict(Acc="*fp32", Mx="*fp32", Sm="*fp32", Out="*bf16", Lse="*fp32"),
                        dict(SPLITS=triton.next_power_of_2(splits), BLOCK_D=D), 90,
                        num_warps=ta.MERGE_WARPS)
        assert ptxas_report(k.asm["ptx"], 90, tmp_path)[1] == 0
