"""`bench`, `plan`, `run --plan auto` and needle-in-a-haystack on tiny models."""
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from triforce_offload.bench import peers, runner
from triforce_offload.runtime import api
from triforce_offload.runtime.errors import TriforceError

OURS = ["autoregressive", "autoregressive+offload", "zero-inference", "draft", "retrieval",
        "triforce", "draft+offload", "retrieval+offload", "triforce+offload"]
ROOT = Path(__file__).resolve().parent.parent


def cli(*args):
    cmd = [sys.executable, "-m", "triforce_offload.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def bench_cli(model, out, contexts, temperatures, *more):
    return cli("bench", "--model", model, "--contexts", contexts, "--new-tokens", "12",
               "--temperatures", temperatures, "--budget", "32", "--gamma2", "3", "--dtype", "fp32",
               "--device", "cpu", "--out", out, "--json", *more)


@pytest.fixture(scope="module")
def bench_run(tiny_model_dir, tmp_path_factory):
    """A small `bench` then one over every contender, both into one results folder."""
    out = tmp_path_factory.mktemp("bench")
    first = bench_cli(tiny_model_dir, out, "160", "0", "--modes", "autoregressive,triforce", "--fresh-prefill")
    assert first.returncode == 0, first.stderr
    r = bench_cli(tiny_model_dir, out, "160,256", "0,0.8")
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout.strip().splitlines()[-1]), first


def test_bench_rows_for_every_mode(bench_run):
    _, d, _ = bench_run
    rows = [s for s in d["summary"] if "skipped" not in s]
    for mode in OURS + ["hf", "hf-lookup"]:
        cells = {(s["context"], s["temperature"]) for s in rows if s["mode"] == mode}
        assert cells == {(160, 0.0), (160, 0.8), (256, 0.0), (256, 0.8)}, mode
    for s in rows:
        assert s["ms_per_token"] > 0 and s["tokens_per_s"] > 0 and s["peak_gb"] >= 0
    # the physical floor beside each row: weights + the context's KV over the measured bandwidth
    assert d["meta"]["copy_gbps"] > 0
    f = {s["context"]: s["floor_ms"] for s in rows}
    assert 0 < f[160] < f[256] and all(s["floor_ms"] == f[s["context"]] for s in rows)


def test_bench_greedy_modes_are_lossless(bench_run):
    _, d, _ = bench_run
    greedy = [s for s in d["summary"] if s.get("temperature") == 0 and s["mode"] in OURS]
    assert len(greedy) == 2 * len(OURS)
    assert all(s["lossless"] is True for s in greedy), [s["mode"] for s in greedy if not s["lossless"]]
    assert all(s["lossless"] is None for s in d["summary"] if s.get("temperature", 0) > 0)


def test_bench_speedup_and_acceptance(bench_run):
    _, d, _ = bench_run
    by = {(s["mode"], s["context"], s["temperature"]): s for s in d["summary"] if "skipped" not in s}
    assert by[("autoregressive", 256, 0.0)]["speedup"] == pytest.approx(1.0)
    tf = by[("triforce", 256, 0.0)]
    assert set(tf["acceptance"]) == {"ngram", "retrieval"} and tf["mean_accepted"] >= 1
    assert "acceptance" not in by[("autoregressive", 256, 0.0)]
    # the offloaded contenders against autoregressive+offload, the comparison offloading is about
    ar_off = by[("autoregressive+offload", 256, 0.0)]
    assert ar_off["offload_speedup"] == pytest.approx(1.0)
    for m in ("draft+offload", "retrieval+offload", "triforce+offload"):
        s = by[(m, 256, 0.0)]
        assert s["offload_speedup"] == pytest.approx(ar_off["ms_per_token"] / s["ms_per_token"])
        assert s["mean_accepted"] >= 1
    assert "offload_speedup" not in by[("triforce", 256, 0.0)]


def test_bench_skips_llama_cpp_without_gguf_with_a_note(bench_run):
    _, d, _ = bench_run
    skipped = {s["mode"]: s["skipped"] for s in d["summary"] if "skipped" in s}
    assert set(skipped) == {"llama.cpp", "llama.cpp-lookup"}
    assert "GGUF" in skipped["llama.cpp"]


def test_bench_appends_jsonl_and_writes_plots(bench_run):
    out, d, first = bench_run
    lines = (out / "bench.jsonl").read_text().splitlines()
    n_first = 2  # 2 modes x 1 context x 1 temperature
    n_second = (len(OURS) + 2) * 2 * 2 + 2  # + one skip row per llama.cpp contender
    assert len(lines) == n_first + n_second
    row = json.loads(lines[-3])
    assert {"mode", "context", "temperature", "ms_per_token", "tokens", "model"} <= set(row)
    for name in ("bench_speed.png", "bench_acceptance.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert sorted(d["plots"]) == sorted(str(out / n) for n in ("bench_speed.png", "bench_acceptance.png"))


def test_bench_prefills_once_per_context(bench_run):
    """Our in-memory runs decode from the kept prompt KV (the last prompt token prefilled
    again) where an in-memory run of ours at that context kept it; a run of ours with its
    own KV (offloaded, zero-inference) drops it, as does a new context; --fresh-prefill
    runs prefill all. The tokens are the same either way."""
    out, _, _ = bench_run
    rows = [json.loads(x) for x in (out / "bench.jsonl").read_text().splitlines()]
    fresh, shared = rows[:2], [r for r in rows[2:] if "skipped" not in r]
    assert all("reused_tokens" not in r and r["reuse_prefill"] is False for r in fresh)
    kept, ctx, reused = False, None, 0
    for r in shared:
        kind, _, extra = runner.CONTENDERS[r["mode"]]
        kept = kept and r["context"] == ctx
        ctx = r["context"]
        if kind == "ours" and extra.get("offload") == "off":
            assert r.get("reused_tokens", 0) == (r["prompt_tokens"] - 1 if kept else 0), r["mode"]
            reused += kept
            kept = True
        elif kind == "ours":
            assert "reused_tokens" not in r, r["mode"]
            kept = False
    assert reused >= 8  # retrieval and triforce after draft, per context and temperature
    ref = {r["mode"]: r["tokens"] for r in shared if r["context"] == 160 and r["temperature"] == 0}
    assert all(r["tokens"] == ref[r["mode"]] for r in fresh)


def test_llama_cpp_keeps_its_context_only_when_reusing():
    class Llm:
        resets = 0

        def reset(self):
            self.resets += 1

        def set_seed(self, seed):
            pass

        def generate(self, prompt, **kw):
            yield from [5, 6, 7, 8]
    llm = Llm()
    assert peers.llama_cpp_generate(llm, [1, 2], 3, 0.0, 0, reuse=True).tokens == [5, 6, 7]
    assert llm.resets == 0
    peers.llama_cpp_generate(llm, [1, 2], 3, 0.0, 0)
    assert llm.resets == 1


def test_llama_cpp_missing_gives_a_note(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    note = peers.llama_cpp_missing()
    assert note and "llama-cpp-python not installed" in note
    b = runner.Bench(loaded=None, o=runner.BenchOptions(gguf="/x/model.gguf"))
    assert b.skip_note("llama.cpp") == note and b.skip_note("hf") is None


def test_runs_alternate_their_order_between_repeats():
    o = runner.BenchOptions(contexts=[256], repeats=3, modes=["triforce", "llama.cpp", "autoregressive"])
    runs = [(r, m) for _, _, r, m in runner.plan_runs(o)]
    assert runs == [(0, "autoregressive"), (0, "triforce"), (0, "llama.cpp"),
                    (1, "llama.cpp"), (1, "triforce"), (1, "autoregressive"),
                    (2, "autoregressive"), (2, "triforce"), (2, "llama.cpp")]


def test_bench_options_refuse_bad_values():
    with pytest.raises(TriforceError, match="--modes magic"):
        runner.BenchOptions(modes=["magic"]).check()
    with pytest.raises(TriforceError, match="--contexts 50"):
        runner.BenchOptions(contexts=[50], new_tokens=8).check()


def test_summarize_flags_a_lossy_mode_and_speedup():
    row = lambda m, ms, toks: {"mode": m, "context": 100, "temperature": 0.0, "ms_per_token": ms,
                               "tokens": toks, "peak_gb": 0.1}
    s = runner.summarize([row("autoregressive", 10.0, [1, 2]), row("triforce", 5.0, [1, 3]),
                          row("draft", 4.0, [1, 2])])
    by = {x["mode"]: x for x in s}
    assert by["triforce"]["lossless"] is False and by["draft"]["lossless"] is True
    assert by["triforce"]["speedup"] == pytest.approx(2.0)


def test_speedup_is_the_median_of_each_repeats_ratio():
    """A drifting machine: each repeat's runs see the same speed, repeats differ. The ratio
    of medians would say 20/18; each repeat's ratio says the mode is ~10% slower."""
    row = lambda m, r, ms: {"mode": m, "context": 100, "temperature": 0.0, "ms_per_token": ms,
                            "tokens": [1], "peak_gb": 0.1, "repeat": r}
    rows = [row("autoregressive", r, ms) for r, ms in enumerate([10.0, 20.0, 30.0])]
    rows += [row("triforce", r, ms) for r, ms in enumerate([11.0, 18.0, 40.0])]
    by = {x["mode"]: x for x in runner.summarize(rows)}
    assert by["triforce"]["speedup"] == pytest.approx(10 / 11)
    assert by["triforce"]["ms_per_token"] == 18.0  # the median, as printed
    # repeats that do not pair up (a run missing): the ratio of medians
    assert runner.paired_ratio(rows[:3], rows[3:5]) == pytest.approx(20 / 14.5)
    # beside llama.cpp, our rows say how they compare with it, paired the same way
    rows += [row("llama.cpp", r, ms) for r, ms in enumerate([12.0, 30.0, 30.0])]
    by = {x["mode"]: x for x in runner.summarize(rows)}
    assert by["triforce"]["vs_llama_cpp"] == pytest.approx(12 / 11)  # of 12/11, 30/18, 30/40
    assert by["autoregressive"]["vs_llama_cpp"] == pytest.approx(1.2) and "vs_llama_cpp" not in by["llama.cpp"]


def test_bench_cli_refuses_bad_list():
    r = cli("bench", "--contexts", "2k,4k")
    assert r.returncode == 2 and "--contexts" in r.stderr and "Traceback" not in r.stderr


def test_plan_prints_table_and_command():
    r = cli("plan", "--gpus", "2x4090", "--model", "llama2-7b-128k", "--context", "128k")
    assert r.returncode == 0, r.stderr
    assert "predicted TriForce" in r.stdout
    cmd = [ln for ln in r.stdout.splitlines() if ln.startswith("triforce-offload run")]
    assert len(cmd) == 1
    for flag in ("--mode triforce", "--budget", "--gamma2", "--on-chip", "--transfer-chunk",
                 "--offload on", "--tp 2", "--max-context 131072"):
        assert flag in cmd[0]


def test_plan_json_without_draft_model_uses_retrieval():
    r = cli("plan", "--gpus", "a100-80g", "--model", "llama-3.1-8b", "--context", "64k",
            "--no-draft-model", "--json")
    d = json.loads(r.stdout)
    assert d["gpu_gb"] <= 80 and d["ms_per_token"] < d["baseline_ms"]
    assert "--mode retrieval" in d["command"] and "--gamma1" not in d["command"]


@pytest.mark.parametrize("args,needle", [
    (("--gpus", "4090", "--context", "512k", "--rope-scaling", "linear:4", "--host-mem", "64"),
     "host memory"),
    (("--gpus", "3090"), "unknown GPU"),
    (("--context", "lots"), "bad context"),
    (("--alpha1", "1.5"), "--alpha1"),
])
def test_plan_refuses_impossible_or_bad_input(args, needle):
    r = cli("plan", *args)
    assert r.returncode == 2, r.stdout
    assert "Traceback" not in r.stderr and needle in r.stderr


def test_run_plan_auto_on_cpu_keeps_defaults(tiny_model_dir):
    r = cli("run", "--model", tiny_model_dir, "--mode", "autoregressive", "--prompt", "Hi",
            "--max-new-tokens", "3", "--device", "cpu", "--plan", "auto", "--json")
    assert r.returncode == 0, r.stderr
    assert "planner targets GPUs" in r.stderr
    r = cli("run", "--model", tiny_model_dir, "--prompt", "Hi", "--plan", "fast")
    assert r.returncode == 2 and "--plan 'fast'" in r.stderr


def load_niah():
    spec = importlib.util.spec_from_file_location("niah", ROOT / "benchmarks" / "niah.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_needle_is_placed_at_depth(smol_dir):
    niah = load_niah()
    from triforce_offload.runtime.model.loader import load_tokenizer
    tok = load_tokenizer(smol_dir)
    assert niah.haystack(tok, 400, 0).startswith(niah.NEEDLE)
    assert niah.haystack(tok, 400, 100).endswith(niah.NEEDLE)
    mid = niah.haystack(tok, 400, 50)
    assert 0.3 < mid.index(niah.NEEDLE) / len(mid) < 0.7


def test_niah_grid_on_tiny_model(tiny_model_dir, tmp_path):
    niah = load_niah()
    o = niah.parse(["--model", str(tiny_model_dir), "--lengths", "200", "300", "--depths", "0",
                    "100", "--new-tokens", "6", "--budget", "32", "--out", str(tmp_path)])
    loaded = api.load(o.model, "float32", "cpu")
    grid = niah.run_grid(loaded, o)
    assert {(c["length"], c["depth"]) for c in grid} == {(200, 0), (200, 100), (300, 0), (300, 100)}
    assert all(c["identical"] for c in grid)  # greedy triforce == greedy autoregressive
    pngs = niah.save(grid, o)
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)
    assert len((tmp_path / "niah.jsonl").read_text().splitlines()) == 4
    assert "| 300 | 100% |" in niah.table(grid)


def test_auto_plan_on_a_gpu_uses_the_planner(monkeypatch):
    """The GPU branch of `run --plan auto`, with the CUDA queries faked."""
    from types import SimpleNamespace

    import torch

    from triforce_offload.cli.plan import auto_plan
    from triforce_offload.runtime.model.config import ModelConfig
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA GeForce RTX 4090")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(total_memory=24 * 2**30))
    monkeypatch.setattr("triforce_offload.offload.tune.load_profile",
                        lambda d: {"rows": [{"chunk": 4096, "link_gbps": 20.0}]})
    cfg = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, n_layers=32,
                      n_heads=32)
    extra, note = auto_plan(cfg, 65536, torch.device("cuda"))
    assert extra["offload"] == "on" and extra["budget"] >= 1024 and int(extra["gamma2"]) >= 1
    assert 0 <= extra["on_chip"] <= 32 and "RTX 4090" in note and "ms/token" in note


def test_bench_batch_rows_and_refusals(tiny_model_dir, tmp_path):
    """`bench --batch`: per batch size and mode, S_TG, the ratio to batch 1 and the identity
    to solo runs; llama.cpp without its binary is a skipped row; a bad mode is one line."""
    r = cli("bench", "--model", tiny_model_dir, "--batch", "1,3", "--contexts", "200", "--new-tokens", "6",
            "--modes", "autoregressive,triforce,llama.cpp", "--budget", "32", "--dtype", "fp32",
            "--llama-batched-bench", str(tmp_path / "none"), "--gguf", str(tmp_path / "x.gguf"),
            "--out", tmp_path, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)["summary"]
    rows = {(s["mode"], s.get("batch")): s for s in summary}
    assert "llama-batched-bench" in rows[("llama.cpp", None)]["skipped"]
    for mode in ("autoregressive", "triforce"):
        one, three = rows[(mode, 1)], rows[(mode, 3)]
        assert one["same_as_solo"] and three["same_as_solo"], (one, three)
        assert three["speed_tg"] > 0 and three["vs_batch1"] == pytest.approx(three["speed_tg"] / one["speed_tg"])
    assert rows[("autoregressive", 3)]["seqs_per_forward"] > 1.5
    r = cli("bench", "--model", tiny_model_dir, "--batch", "2", "--modes", "hf", "--out", tmp_path)
    assert r.returncode == 2 and "with --batch allowed are" in r.stderr and "Traceback" not in r.stderr


def test_bench_batch_shared_prefix_runs_each_mode_both_ways(tiny_model_dir, tmp_path):
    """`bench --batch --shared-prefix`: each mode with the document held per sequence and
    once for all, both equal to the solo runs, with the ratios; an impossible length is one line."""
    r = cli("bench", "--model", tiny_model_dir, "--batch", "3", "--contexts", "700", "--new-tokens", "6",
            "--modes", "autoregressive", "--shared-prefix", "600", "--dtype", "fp32", "--out", tmp_path, "--json")
    assert r.returncode == 0, r.stderr
    rows = {s["mode"]: s for s in json.loads(r.stdout)["summary"]}
    own, shared = rows["autoregressive own"], rows["autoregressive shared"]
    assert own["same_as_solo"] and shared["same_as_solo"]
    assert own["shared_tokens"] == 0 and shared["shared_tokens"] == 512  # fp32: a multiple of the prefill chunk
    assert shared["vs_own"] == pytest.approx(shared["speed_tg"] / own["speed_tg"]) and shared["vs_own_total"] > 0
    r = cli("bench", "--model", tiny_model_dir, "--batch", "2", "--contexts", "700", "--new-tokens", "6",
            "--modes", "autoregressive", "--shared-prefix", "690", "--out", tmp_path)
    assert r.returncode == 2 and "--shared-prefix 690" in r.stderr and "Traceback" not in r.stderr


def test_bench_batch_repeats_pair_ratios_and_keep_prefills(tiny_model_dir, tmp_path):
    """`bench --batch --repeats 2`: each (mode, batch size) once per repeat, the summary the
    medians and the median of each repeat's ratio to batched autoregressive; the prompts'
    KV is prefilled once and taken by later runs (`kept_prefill`), their tokens unchanged,
    and `--fresh-prefill` prefills every run."""
    args = ("bench", "--model", tiny_model_dir, "--batch", "1,2", "--contexts", "200", "--new-tokens", "6",
            "--modes", "autoregressive,triforce", "--budget", "32", "--dtype", "fp32", "--repeats", "2")
    r = cli(*args, "--out", tmp_path / "a", "--json")
    assert r.returncode == 0, r.stderr
    summary = {(s["mode"], s["batch"]): s for s in json.loads(r.stdout)["summary"]}
    rows = [json.loads(x) for x in (tmp_path / "a" / "bench.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2 and {x["repeat"] for x in rows} == {0, 1}
    by = {(x["mode"], x["batch"], x["repeat"]): x for x in rows}
    assert not by[("autoregressive", 1, 0)]["kept_prefill"]  # the first run prefills
    assert all(by[(m, b, 1)]["kept_prefill"] for m in ("autoregressive", "triforce") for b in (1, 2))
    assert by[("triforce", 1, 0)]["kept_prefill"]
    for b in (1, 2):
        tri = summary[("triforce", b)]
        assert tri["repeats"] == 2 and tri["same_as_solo"], tri
        want = statistics.median(by[("triforce", b, k)]["speed_tg"] / by[("autoregressive", b, k)]["speed_tg"]
                                 for k in (0, 1))
        assert tri["vs_autoregressive"] == pytest.approx(want)
        assert tri["speed_tg"] == pytest.approx(statistics.median(by[("triforce", b, k)]["speed_tg"] for k in (0, 1)))
        assert "vs_autoregressive" not in summary[("autoregressive", b)]
    assert not summary[("autoregressive", 1)]["kept_prefill"]  # one of its two runs prefilled
    assert summary[("triforce", 1)]["kept_prefill"]
    # the kept KV changes nothing: the same tokens as the runs that prefilled
    r = cli(*args[:-2], "--fresh-prefill", "--out", tmp_path / "b", "--json")
    assert r.returncode == 0, r.stderr
    fresh = [json.loads(x) for x in (tmp_path / "b" / "bench.jsonl").read_text().splitlines()]
    assert fresh and not any(x["kept_prefill"] for x in fresh)
    assert all(x["same_as_solo"] for x in fresh)
    r = cli(*args[:-1], "0", "--out", tmp_path / "c")
    assert r.returncode == 2 and "--repeats 0" in r.stderr and "Traceback" not in r.stderr


def test_summarize_batch_pairs_repeats():
    """The ratios are medians of each repeat's ratio (not ratios of medians), llama.cpp's
    compared by its single run."""
    from triforce_offload.bench.batch import summarize_batch
    row = lambda m, b, rep, v: {"mode": m, "batch": b, "repeat": rep, "speed_tg": v, "t_pp": 1.0, "t_tg": 1.0}
    rows = [row("autoregressive", 4, 0, 10.0), row("triforce", 4, 0, 30.0),
            row("autoregressive", 4, 1, 20.0), row("triforce", 4, 1, 22.0),
            row("autoregressive", 4, 2, 30.0), row("triforce", 4, 2, 36.0),
            {"mode": "llama.cpp", "batch": 4, "repeat": 0, "speed_tg": 11.0, "t_pp": 1.0, "t_tg": 1.0}]
    s = {(x["mode"], x["batch"]): x for x in summarize_batch(rows)}
    tri = s[("triforce", 4)]
    assert tri["speed_tg"] == 30.0 and tri["repeats"] == 3
    assert tri["vs_autoregressive"] == pytest.approx(1.2)  # median of 3.0, 1.1, 1.2 (medians' ratio: 1.5)
    assert tri["vs_llama_cpp"] == pytest.approx(30.0 / 11.0)  # unpaired: the medians' ratio
    assert "vs_autoregressive" not in s[("llama.cpp", 4)]
