"""benchmarks/quality.py on the bundled model: the GGUF's own precision (auto) scores what
its exact fp32 dequantization scores; a requantized precision is measured, not assumed."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quality_rows(tmp_path):
    out = tmp_path / "q.jsonl"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--weights",
                        "fp32,auto,int4,auto:int8", "--tokens", "96", "--window", "48", "--generations", "1",
                        "--prompt-len", "32", "--new", "4", "--threads", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {d["weights"]: d for d in map(json.loads, out.read_text().splitlines())}
    fp32, auto, int4 = rows["fp32"], rows["auto"], rows["int4"]
    assert fp32["scored"] == 94 and fp32["top1_agreement"] == 1.0 and fp32["greedy_identical"] == 1
    assert auto["loaded"] == "int4+int8" and auto["mb"] < fp32["mb"] / 5
    assert auto["perplexity"] == pytest.approx(fp32["perplexity"], rel=1e-3)
    assert auto["top1_agreement"] == 1.0
    assert int4["loaded"] == "int4" and 0 < int4["top1_agreement"] <= 1
    q8 = rows["auto:int8"]  # the same weights, activations quantized per row: close, not equal
    assert q8["loaded"] == "int4+int8" and q8["activations"] == "int8" and auto["activations"] == "fp32"
    assert q8["perplexity"] == pytest.approx(fp32["perplexity"], rel=0.05) and q8["top1_agreement"] > 0.8
    assert "| bundled | auto (int4+int8) |" in r.stdout
