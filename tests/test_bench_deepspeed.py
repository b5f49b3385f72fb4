"""`bench --baseline deepspeed`: the real DeepSpeed ZeRO-Inference row, skipped with its reason
where CUDA or deepspeed is missing (every machine here), never faked."""
import json
import subprocess
import sys
import types

import pytest
import torch

from triforce_offload.bench import peers, runner
from triforce_offload.runtime.errors import TriforceError

NO_CUDA = not torch.cuda.is_available()


def cli(*args):
    cmd = [sys.executable, "-m", "triforce_offload.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not NO_CUDA, reason="the skip path needs a machine without CUDA")
def test_bench_baseline_deepspeed_is_skipped_with_the_reason(tiny_model_dir, tmp_path):
    r = cli("bench", "--model", tiny_model_dir, "--baseline", "deepspeed", "--modes",
            "autoregressive", "--contexts", "256", "--new-tokens", "4", "--no-plots",
            "--dtype", "fp32", "--device", "cpu", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    reason = "deepspeed ZeRO-Inference needs CUDA; this machine has none"
    assert f"deepspeed: skipped ({reason})" in r.stderr.splitlines()
    assert "skipped" in r.stdout and "needs CUDA" in r.stdout  # the table's row and caption
    rows = [json.loads(ln) for ln in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [x["mode"] for x in rows] == ["autoregressive", "deepspeed"]
    ds = rows[1]
    assert ds["skipped"] == reason
    timing = {"ms_per_token", "tokens_per_s", "prefill_s", "tokens", "peak_gb", "context"}
    assert not timing & set(ds)
    assert rows[0]["ms_per_token"] > 0


def test_bench_unknown_baseline_is_one_line_exit_2():
    r = cli("bench", "--baseline", "deepspeed,vllm", "--contexts", "256")
    assert r.returncode == 2, r.stdout
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "--baseline vllm" in r.stderr and "deepspeed" in r.stderr


def test_deepspeed_is_opt_in_and_checked():
    assert "deepspeed" in runner.CONTENDERS and "deepspeed" not in runner.DEFAULT_MODES
    assert runner.BenchOptions().modes == runner.DEFAULT_MODES
    assert runner.check_baselines(["deepspeed"]) == ["deepspeed"]
    with pytest.raises(TriforceError, match="--baseline magic: allowed are deepspeed"):
        runner.check_baselines(["magic"])


def test_deepspeed_missing_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))  # as if installed
    note = peers.deepspeed_missing()
    assert note == "deepspeed ZeRO-Inference needs CUDA; this machine has none"
    assert runner.Bench(loaded=None, o=runner.BenchOptions()).skip_note("deepspeed") == note


def test_deepspeed_missing_when_not_importable(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    note = peers.deepspeed_missing()
    assert note.startswith("deepspeed not importable") and "triforce-offload[deepspeed]" in note


def test_deepspeed_present_with_cuda_can_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    assert peers.deepspeed_missing() is None


def test_zero_inference_config_offloads_params_to_pinned_cpu():
    cfg = peers.zero_inference_config(torch.float16, hidden=64)
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert cfg["fp16"]["enabled"] and not cfg["bf16"]["enabled"]
    assert not peers.zero_inference_config(torch.float32, 64)["fp16"]["enabled"]
