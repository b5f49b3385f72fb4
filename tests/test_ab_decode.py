"""benchmarks/ab_decode.py: two revisions in one process, interleaved steps, one table."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_head_against_itself(tmp_path, smol_dir):
    out = tmp_path / "ab.jsonl"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_decode.py"), "--base", "HEAD",
                        "--contexts", "64", "--tokens", "3", "--threads", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(out.read_text())
    assert row["context"] == 64 and row["steps"] == 2 and row["same_tokens"] is True
    assert row["base_ms_per_token"] > 0 and row["this_ms_per_token"] > 0
    assert "| 64 |" in r.stdout and "base/this" in r.stdout
