"""benchmarks/gpu_session.py: the commands a lent GPU runs, checked on the CPU (shrunk)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_session.py"


def session(*args, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_dry_run_lists_the_measurements_and_writes_nothing(tmp_path):
    a = session("a", "--dry-run", "--out", tmp_path / "o")
    b = session("b", "--dry-run", "--out", tmp_path / "o", "--model", tmp_path / "missing.gguf")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert "-m cuda" in a.stdout and "--geometry llama2-7b" in a.stdout and "--geometry smollm2" in a.stdout
    assert "offload_pipeline.py" in b.stdout and "--contexts 131072 --no-compare --prefill" in b.stdout
    assert "-m pytest -q -rs -m cuda" in a.stdout
    assert "triforce+offload" in b.stdout and "--device cuda" in b.stdout
    c = session("c", "--dry-run", "--out", tmp_path / "o")
    assert c.returncode == 0 and "--modes graphed compiled" in c.stdout, c.stderr
    assert not (tmp_path / "o").exists()


def test_missing_model_is_one_line(tmp_path):
    r = session("b", "--out", tmp_path, "--model", tmp_path / "missing.gguf")
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr


def test_out_of_budget_commands_are_skipped_and_listed(tmp_path):
    r = session("a", "--smoke", "--out", tmp_path, "--budget-s", "0")
    assert r.returncode == 1
    log = (tmp_path / "a.log").read_text()
    assert log.count("skipped") == 3 and "gpu_decode.py" in log


@pytest.mark.slow
def test_smoke_stages_run_every_command(tmp_path):
    """Both stages shrunk to the CPU: every command exits 0 and leaves its rows."""
    a = session("a", "--smoke", "--out", tmp_path)
    b = session("b", "--smoke", "--out", tmp_path, "--model", "bundled")
    assert a.returncode == 0, (tmp_path / "a.log").read_text()[-3000:]
    assert b.returncode == 0, (tmp_path / "b.log").read_text()[-3000:]
    modes = {json.loads(x)["mode"] for x in (tmp_path / "a.jsonl").read_text().splitlines()}
    assert {"autoregressive eager", "autoregressive graphed", "triforce"} <= modes
    rows = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert any("link_gbps" in r for r in rows) and any(r.get("mode") == "triforce" for r in rows)
    bench = [json.loads(x) for x in (tmp_path / "bench" / "bench.jsonl").read_text().splitlines()]
    assert {"autoregressive+offload", "triforce+offload"} <= {r["mode"] for r in bench}


@pytest.mark.slow
def test_smoke_compile_stage_compiles_the_fixed_shape_step(tmp_path, monkeypatch):
    """Stage c on the CPU with the fixed-shape forward (TRIFORCE_OFFLOAD_STATIC=1): the
    compiled row is compiled (inductor's C++ backend here), the graphed one is not."""
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    c = session("c", "--smoke", "--out", tmp_path)
    assert c.returncode == 0, (tmp_path / "c.log").read_text()[-3000:]
    rows = {r["mode"]: r for r in map(json.loads, (tmp_path / "c.jsonl").read_text().splitlines())}
    assert rows["autoregressive compiled"]["compiled"] is True
    assert rows["autoregressive graphed"]["compiled"] is False
    assert rows["autoregressive compiled"]["same_tokens_as"] == {"autoregressive graphed": True}
