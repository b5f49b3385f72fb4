"""The native CPU attention kernel built with memory checks, run over tests/native_sweep.py.

An out-of-bounds write in the kernel (issue 12: a negative memset size) passed the plain
tests by luck and segfaulted a user's run. Here the kernel is compiled once with
AddressSanitizer + UndefinedBehaviorSanitizer and once with -O2 -D_FORTIFY_SOURCE=3 (the
default of several distributions' compilers), each in a fresh kernel cache, and the sweep
runs in a subprocess; any bad access aborts it and fails the test.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SWEEP = Path(__file__).with_name("native_sweep.py")
QLINEAR_SWEEP = Path(__file__).with_name("qlinear_sweep.py")  # the quantized linear kernel


def _gcc_runtime(name: str) -> str:
    """Path of a gcc runtime library (libasan.so, ...); '' when gcc has none."""
    if not shutil.which("gcc"):
        return ""
    out = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else ""


def _run_sweep(tmp_path, cflags: str, extra_env: dict, sweep: Path = SWEEP) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRIFORCE_OFFLOAD_CACHE=str(tmp_path), TRIFORCE_OFFLOAD_NATIVE="1",
               TRIFORCE_OFFLOAD_NATIVE_CFLAGS=cflags, CC="gcc", **extra_env)
    return subprocess.run([sys.executable, str(sweep)], env=env, capture_output=True, text=True,
                          timeout=900)


def _assert_clean(r: subprocess.CompletedProcess, says: str = "match float64 attention"):
    tail = "\n".join((r.stdout + r.stderr).splitlines()[-25:])
    assert r.returncode == 0, tail
    assert says in r.stdout, tail
    assert "runtime error" not in r.stderr and "ERROR: AddressSanitizer" not in r.stderr, tail


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc (the native kernel's compiler)")
def test_native_kernel_under_fortify_source(tmp_path):
    r = _run_sweep(tmp_path, "-O2 -D_FORTIFY_SOURCE=3", {})
    _assert_clean(r)


def test_native_kernel_under_address_sanitizer(tmp_path):
    asan, ubsan = _gcc_runtime("libasan.so"), _gcc_runtime("libubsan.so")
    if not (asan and ubsan):  # Debian's gcc ships both; fortify above still runs
        pytest.skip("gcc without libasan/libubsan")
    r = _run_sweep(tmp_path, "-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer",
                   {"LD_PRELOAD": f"{asan} {ubsan}", "ASAN_OPTIONS": "detect_leaks=0",
                    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"})
    _assert_clean(r)


# the quantized linear's int8-activation dot has a VNNI path and a portable one: both checked
# ("-mno-avx512vnni" builds the portable one on a CPU that has VNNI)
PORTABLE = "-mno-avx512vnni"


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc (the native kernel's compiler)")
@pytest.mark.parametrize("extra", ["", PORTABLE])
def test_quantized_linear_kernel_under_fortify_source(tmp_path, extra):
    r = _run_sweep(tmp_path, f"-O2 -D_FORTIFY_SOURCE=3 {extra}", {}, QLINEAR_SWEEP)
    _assert_clean(r, "match float64 linear")
    if extra:
        assert "portable C" in r.stdout


@pytest.mark.parametrize("extra", ["", PORTABLE])
def test_quantized_linear_kernel_under_address_sanitizer(tmp_path, extra):
    asan, ubsan = _gcc_runtime("libasan.so"), _gcc_runtime("libubsan.so")
    if not (asan and ubsan):
        pytest.skip("gcc without libasan/libubsan")
    r = _run_sweep(tmp_path, f"-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer {extra}",
                   {"LD_PRELOAD": f"{asan} {ubsan}", "ASAN_OPTIONS": "detect_leaks=0",
                    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}, QLINEAR_SWEEP)
    _assert_clean(r, "match float64 linear")
