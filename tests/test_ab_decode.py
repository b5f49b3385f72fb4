"""benchmarks/ab_decode.py: two revisions in one process, interleaved steps, one table."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("fp32", [False, True])
def test_head_against_itself(tmp_path, smol_dir, fp32):
    """Both ways of loading: as `run` does (the default) and dense float32 (`--fp32`)."""
    out = tmp_path / "ab.jsonl"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_decode.py"), "--base", "HEAD",
                        "--contexts", "64", "--tokens", "3", "--threads", "1", "--out", str(out)]
                       + ["--fp32"] * fp32,
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(out.read_text())
    assert row["context"] == 64 and row["steps"] == 2 and row["same_tokens"] is True
    assert row["base_ms_per_token"] > 0 and row["this_ms_per_token"] > 0
    assert "| 64 |" in r.stdout and "base/this" in r.stdout
    assert row["fp32"] is fp32 and ("SmolLM2 fp32" if fp32 else "at the runtime's defaults") in r.stdout
