"""benchmarks/gpu_session.py: the commands a lent GPU runs, checked on the CPU (shrunk)."""
import importlib.util
import json
import re
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


def test_stage_b_without_the_model_runs_the_geometry_commands(tmp_path):
    """No joined GGUF (the machine went cold between the two calls): the geometry-only
    commands run, the real-model ones are skipped with a note, and the stage succeeds."""
    r = session("b", "--smoke", "--out", tmp_path, "--model", tmp_path / "missing.gguf")
    log = (tmp_path / "b.log").read_text()
    assert r.returncode == 0, log[-3000:]
    assert "not found" in r.stderr and "Traceback" not in r.stderr
    assert "== offload smollm2: exit 0" in log
    for name in ("decode real", "bench offload"):
        assert f"== {name}: skipped, model {tmp_path / 'missing.gguf'} not found" in log
    assert "1/3 commands succeeded, 2 skipped without the model" in r.stdout
    rows = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert rows and all("link_gbps" in x for x in rows) and not (tmp_path / "bench").exists()
    dry = session("b", "--dry-run", "--model", tmp_path / "missing.gguf")
    assert dry.stdout.count("; skipped: model") == 2


@pytest.mark.parametrize("stage", ["a", "b", "c", "d"])
def test_default_budget_leaves_room_for_the_set_up(stage):
    """A GPU command runs 600 s at most: a stage's default budget plus env.sh's set-up stays
    under 540 s, and its commands' limits fit the budget (the last is not starved)."""
    spec = importlib.util.spec_from_file_location("gpu_session", SCRIPT)
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    r = session(stage, "--dry-run")
    budget, total = (int(x) for x in re.match(r"# budget (\d+) s; the commands' limits add up to (\d+) s",
                                               r.stdout).groups())
    assert budget + gs.SETUP_S <= 540 and total <= budget


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


def test_smoke_batch_stage_decodes_batches_each_first_sequence_its_batch1_run(tmp_path):
    """Stage d shrunk to the CPU: a row per batch size and mode, aggregate tokens/s, the
    floor, and the first sequence's tokens equal at every batch size."""
    d = session("d", "--smoke", "--out", tmp_path)
    assert d.returncode == 0, (tmp_path / "d.log").read_text()[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert {(r["batch"], r["mode"]) for r in rows} == {(b, m) for b in (1, 2)
                                                       for m in ("autoregressive graphed", "triforce")}
    assert all(r["speed_tg"] > 0 and r["floor_tok_per_s"] > 0 and r["same_as_batch1"] for r in rows)
    assert all(r["seqs_per_forward"] > 1.5 for r in rows if r["batch"] == 2)


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


def test_docs_give_each_calls_command_and_carry():
    """docs/gpu.md, "Measuring on a GPU": python3 (the GPU image may have no `python`), and
    per call the command and the git-ignored .gpu/ paths it must carry."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    section = text[text.index("## Measuring on a GPU"):]
    assert not re.search(r"(?<![\w/])python (benchmarks|\.gpu|-m)", text)
    calls = re.findall(r"^\s*\| (\d)[^|]*\| `(.+?)` \| (.+?) \|$", section, re.M)
    assert [(n, cmd) for n, cmd, _ in calls] == [
        (str(i), f". .gpu/bin/env.sh && python3 benchmarks/gpu_session.py {s}") for i, s in enumerate("adbc", 1)]
    carry = [set(re.findall(r"`(\.gpu/\w+)`", c)) for _, _, c in calls]
    assert carry[0] == {".gpu/whl", ".gpu/bin", ".gpu/a"} and ".gpu/b" in carry[2]
    assert "git-ignored" in section
