"""benchmarks/attention_cycles.py builds its harness against the kernel's source and prints
a cycle count for every phase (the harness calls the kernel's static functions: a change of
their signatures must keep it building)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from triforce_offload.kernels import native

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not native.available() or not native.load().triforce_bf16_path(),
                    reason="the harness measures the bf16 path (AVX512_BF16)")
def test_attention_cycles_prints_every_phase():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_cycles.py"), "--rows", "7",
                        "--keys", "1024", "--layers", "1", "--threads", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = dict(re.findall(r"^\| ([a-z][^|]*?) \| ([0-9.]+) \|$", r.stdout, re.M))
    for phase in ("block hot", "block memory", "scores", "transposes", "softmax", "pv"):
        assert float(rows[phase]) > 0, (phase, r.stdout)
    whole = [v for k, v in rows.items() if k.startswith("whole call")]
    assert whole and float(whole[0]) > 0
    assert re.search(r"clock [0-9.]+ GHz", r.stdout)
