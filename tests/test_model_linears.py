"""benchmarks/model_linears.py: every projection of the bundled model at M rows, beside the
copy-bandwidth floor (docs/weights.md quotes it)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_model_linears_prints_each_row_count_and_the_floor():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "model_linears.py"), "--rows", "1", "3",
                        "--passes", "2", "--repeats", "1", "--threads", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    head = re.search(r"(\d+) projections, ([\d.]+) MB of weights, .*copy bandwidth ([\d.]+) GB/s", r.stdout)
    assert head and int(head.group(1)) > 0 and float(head.group(2)) > 0 and float(head.group(3)) > 0, r.stdout
    rows = re.findall(r"rows (\d+): ([\d.]+) ms per pass, ([\d.]+) GB/s", r.stdout)
    assert [m for m, _, _ in rows] == ["1", "3"] and all(float(ms) > 0 for _, ms, _ in rows), r.stdout


@pytest.mark.slow
def test_model_linears_columns_times_packed_against_transposing():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "model_linears.py"), "--rows", "1", "4",
                        "--passes", "1", "--repeats", "3", "--threads", "1", "--columns"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = re.findall(r"rows (\d+): packed columns ([\d.]+) ms per pass, transposing ([\d.]+); paired ratio ([\d.]+)x",
                      r.stdout)
    assert [m for m, *_ in rows] == ["1", "4"], r.stdout
    assert all(float(p) > 0 and float(t) > 0 and float(x) > 0 for _, p, t, x in rows), r.stdout
