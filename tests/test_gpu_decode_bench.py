"""benchmarks/gpu_decode.py on the CPU: a shrunk geometry, and a tiny checkpoint with transformers."""
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_decode.py"
OURS = ["autoregressive eager", "autoregressive graphed", "triforce"]
HF = "transformers generate"


def bench(out, *args):
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--contexts", "256", "--new-tokens", "4",
           "--copy-mib", "64", "--threads", "1", "--out", str(out), *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, [json.loads(line) for line in out.read_text().splitlines()]


def check_timed(row):
    assert row["context"] == 256 and row["prompt_tokens"] == 252 and row["new_tokens"] == 4
    assert row["ms_per_token"] > 0 and row["bytes_per_token"] > row["kv_bytes"] > 0
    assert row["gb_per_s"] > 0 and row["copy_gb_per_s"] > 0
    assert row["floor_ms"] > 0 and row["floor_ratio"] > 0
    assert abs(row["floor_ratio"] - row["ms_per_token"] / row["floor_ms"]) < 1e-6 * row["floor_ratio"]


def test_geometry_rows_and_table(tmp_path):
    out = tmp_path / "gd.jsonl"
    stdout, rows = bench(out, "--geometry", "smollm2", "--layers", "2")
    by = {r["mode"]: r for r in rows}
    assert set(by) == set(OURS) | {HF}
    for m in OURS:
        check_timed(by[m])
    # SmolLM2 geometry, 2 layers, fp32: tied embedding read once (49152x576) + 2 blocks + norm
    blk = (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536 + 2 * 576) * 4  # q,o k,v mlp norms
    assert by[OURS[0]]["weights_bytes"] == 49152 * 576 * 4 + 2 * blk + 576 * 4
    assert by[OURS[0]]["kv_bytes"] == 2 * 2 * 3 * 64 * 4 * 256
    assert by["autoregressive eager"]["graphs"] is False  # no CUDA: nothing replays
    assert by["autoregressive graphed"]["graphs"] is False
    assert "acceptance" in by["triforce"] and "mean_accepted" in by["triforce"]
    assert "random-weight" in by[HF]["skipped"]
    assert "| context | mode | ms/token |" in stdout
    for m in OURS + [HF]:
        assert f"| 256 | {m} |" in stdout
    assert "triforce vs graphed autoregressive at 256:" in stdout
    ops = by[OURS[0]]["ops_per_layer"]  # one decode step under runtime/opcount.py's counter
    assert 0 < ops["eager"] <= 20 and 0 < ops["fixed"] <= 20 and ops["fixed_syncs"] == 0
    assert f"work ops per layer per decode step: eager {ops['eager']} " in stdout
    assert by["triforce"]["host_reads"]["full"] <= 1  # one read per top verification
    assert "host reads per verification at 256 (triforce): ngram 0, full 1\n" in stdout


def test_checkpoint_with_transformers_and_essays(tmp_path, tiny_model_dir):
    out = tmp_path / "gd.jsonl"
    stdout, rows = bench(out, "--model", tiny_model_dir, "--prompt-text", "essays")
    by = {r["mode"]: r for r in rows}
    assert set(by) == set(OURS) | {HF}
    for m in OURS + [HF]:
        check_timed(by[m])
    assert f"| 256 | {HF} |" in stdout


def test_oversized_context_is_skipped_with_the_reason(tmp_path):
    out = tmp_path / "gd.jsonl"
    # 100M tokens of one SmolLM2 layer's fp32 KV (150 GB) fit no test machine's memory
    stdout, rows = bench(out, "--geometry", "smollm2", "--layers", "1", "--contexts", "256",
                         "100000000", "--modes", "eager")
    skipped = [r for r in rows if r.get("skipped")]
    assert [r["context"] for r in skipped] == [100000000]
    assert "90%" in skipped[0]["skipped"] and "skipped" in stdout
    assert [r["mode"] for r in rows if not r.get("skipped")] == ["autoregressive eager"]


class _FakeGraph:
    """A 'captured graph' that records the forward and replays it eagerly (the CPU has no
    CUDA graphs), so that a Step takes its capture path and counts its captures."""

    def __init__(self, run):
        self.run = run
        self.out = run()

    def replay(self):
        self.out.copy_(self.run())


def test_timed_decode_contains_no_capture(monkeypatch):
    """The graphed row's timed decode replays what its untimed warm-up captured: the step's
    capture count does not move inside the timed region, the capture seconds are reported
    apart, and the tokens are the eager row's."""
    import importlib.util
    from triforce_offload.runtime import graphs
    spec = importlib.util.spec_from_file_location("gpu_decode", SCRIPT)
    gd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gd)
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")  # the fixed-shape path on the CPU
    init = graphs.Step.__init__

    def on_a_card(self, model, cache, graphs_on=True, compile=False):
        init(self, model, cache, graphs_on, compile)
        self.graphed = self.static = bool(graphs_on and cache.static)
    monkeypatch.setattr(graphs.Step, "__init__", on_a_card)
    monkeypatch.setattr(graphs.Step, "_capture_on", lambda self, dev, ids, run: graphs._Graph(
        g := _FakeGraph(run), ids, g.out))
    a = gd.args_(["--geometry", "smollm2", "--layers", "1", "--device", "cpu", "--contexts", "64",
                  "--new-tokens", "6"])
    L, _ = gd.load(a, torch.device("cpu"), "fp32")
    prompt = list(range(3, 61))
    eager = gd.run_ours(L, "eager", prompt, a, 6)
    row = gd.run_ours(L, "graphed", prompt, a, 6)
    assert row["timed_captures"] == 0 and row["graphs"] is True  # replays only, timed
    assert row["capture_s"] > 0 and row["warm_up_s"] >= row["capture_s"]
    assert row["tokens"] == eager["tokens"] and len(row["tokens"]) == 6
