"""Cost model against the TriForce paper's offloading table, its monotonicity, the planner."""
from dataclasses import replace

import pytest

from triforce_offload.cli.plan import parse_context, parse_gpus, parse_model
from triforce_offload.offload import costmodel as cm
from triforce_offload.offload import plan as pl


@pytest.mark.parametrize("row", cm.paper_table(), ids=lambda r: f"{r[0]}-{r[1]}")
def test_paper_table_within_25_percent(row):
    setup, mode, predicted, paper = row
    assert abs(predicted / paper - 1) <= 0.25, f"{setup} {mode}: {predicted:.0f} vs {paper}"


def test_paper_table_covers_all_rows():
    modes = {(r[0], r[1]) for r in cm.paper_table()}
    assert len(modes) == 6
    assert {m for _, m in modes} == {"triforce", "autoregressive", "deepspeed"}


def test_architectures_match_published_sizes():
    assert cm.LLAMA2_7B_128K.params == pytest.approx(6.74e9, rel=0.01)
    assert cm.LLAMA2_13B_128K.params == pytest.approx(13.0e9, rel=0.01)
    assert cm.LLAMA31_8B.params == pytest.approx(8.03e9, rel=0.01)
    assert cm.LLAMA_68M.params == pytest.approx(68e6, rel=0.02)
    # Llama2-7B-128K: 64 GiB of KV at 128K tokens (the paper's figure)
    assert cm.LLAMA2_7B_128K.kv_token_bytes * 131072 == 64 * cm.GIB


def test_from_hf_config_llama3():
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256}
    m = cm.ModelSpec.from_hf_config(cfg, name="x")
    assert m.head_dim == 128 and m.kv_layer_bytes == 2 * 8 * 128 * 2
    assert m.params == cm.LLAMA31_8B.params


def test_from_hf_config_missing_key():
    with pytest.raises(ValueError, match="hidden_size"):
        cm.ModelSpec.from_hf_config({"num_attention_heads": 4, "num_hidden_layers": 2})


def _tf(**kw):
    return cm.predict(cm.TWO_4090, cm.LLAMA2_7B_128K, cm.Settings(**kw), "triforce")


def test_higher_acceptance_is_faster():
    assert _tf(alpha1=0.95).ms_per_token < _tf(alpha1=0.9).ms_per_token
    assert _tf(alpha1=0.9).ms_per_token < _tf(alpha1=0.7).ms_per_token
    assert _tf(alpha0=0.8).ms_per_token < _tf(alpha0=0.4).ms_per_token


def test_bigger_context_slower_baseline():
    ms = [cm.predict(cm.TWO_4090, cm.LLAMA2_7B_128K, cm.Settings(context=c),
                     "autoregressive").ms_per_token for c in (32768, 65536, 131072)]
    assert ms[0] < ms[1] < ms[2]


def test_faster_link_faster_baseline():
    s = cm.Settings(on_chip=4)
    slow = replace(cm.RTX4090, pcie_gbps=12.0)
    fast = replace(cm.RTX4090, pcie_gbps=25.0)
    a = cm.predict(slow, cm.LLAMA2_7B_128K, s, "autoregressive").ms_per_token
    b = cm.predict(fast, cm.LLAMA2_7B_128K, s, "autoregressive").ms_per_token
    assert b < a


def test_small_transfer_chunks_waste_link():
    assert cm.link_gbps(cm.RTX4090, 64 * 1024) < cm.link_gbps(cm.RTX4090, 64 << 20)
    assert cm.link_gbps(cm.RTX4090, 1 << 30) == pytest.approx(25.0, rel=0.01)


def test_expected_tokens():
    assert cm.expected_tokens(0.0, 6) == 1.0
    assert cm.expected_tokens(1.0, 6) == 7.0
    assert cm.expected_tokens(0.5, 1) == pytest.approx(1.5)


def test_breakdown_adds_up():
    p = _tf()
    assert sum(p.levels.values()) == pytest.approx(p.ms_per_token)
    assert p.transfer_ms > 0 and p.compute_ms > 0


def test_predict_rejects_bad_mode():
    with pytest.raises(ValueError, match="unknown mode"):
        cm.predict(cm.RTX4090, cm.LLAMA2_7B_128K, cm.Settings(), "magic")


def test_from_profile_uses_best_link():
    hw = cm.Hardware.from_profile({"device": "NVIDIA GeForce RTX 4090",
                                   "link_gbps": {"64": 3.1, "1024": 10.2, "16384": 21.5}})
    assert hw.pcie_gbps == 21.5 and hw.gpu_mem_gb == 24.0
    assert cm.Hardware.from_profile({}).pcie_gbps == cm.RTX4090.pcie_gbps
    cpu = cm.Hardware.from_profile({"device": "cpu", "link_gbps": "n/a", "compute_gbps": 40})
    assert cpu.hbm_gbps == 40 and cpu.hbm_eff == 1.0 and cpu.name == "cpu"


def test_plan_fits_memory_and_beats_baseline():
    hw = parse_gpus("2x4090")
    p = pl.search_plan(hw, cm.LLAMA2_7B_128K, parse_context("128k"))
    assert p.gpu_gb * cm.GIB <= cm.gpu_capacity(hw)
    assert p.host_gb * cm.GIB <= cm.host_capacity(hw)
    assert p.ms_per_token < p.baseline_ms
    assert p.tp == 2 and 0 <= p.settings.on_chip <= 32
    from triforce_offload.cli.plan import run_command
    cmd = run_command(p, "/models/llama 7b", "/models/llama-68m")
    assert cmd.startswith("triforce-offload run --model '/models/llama 7b' --mode triforce")
    for flag in ("--budget", "--retrieval-chunk 8", "--gamma1", "--gamma2", "--on-chip",
                 "--transfer-chunk", "--offload on", "--tp 2"):
        assert flag in cmd
    no_draft = run_command(p, "/models/llama 7b", None)  # no L0 model: the retrieval mode,
    assert "--mode retrieval" in no_draft and "--gamma1" not in no_draft  # never --gamma1 0


def test_plan_respects_memory_overrides():
    hw = parse_gpus("4090")
    big = pl.search_plan(hw, cm.LLAMA2_7B_128K, 131072)
    small = pl.search_plan(hw, cm.LLAMA2_7B_128K, 131072, gpu_mem_gb=20)
    assert small.gpu_gb <= 20 and small.ms_per_token >= big.ms_per_token


def test_plan_refuses_host_overflow_with_numbers():
    # 512K: the prefill's device layer (8 GiB) still fits the card, the host KV does not
    with pytest.raises(ValueError, match=r"needs \d+\.\d GiB host memory.*57\.6 GiB available"):
        pl.search_plan(parse_gpus("4090"), cm.LLAMA2_7B_128K, parse_context("512k"),
                       host_mem_gb=64)


def test_plan_refuses_gpu_overflow_with_numbers():
    # llama2-13b: 24.2 GiB of fp16 weights cannot sit on one 24 GiB card
    with pytest.raises(ValueError, match=r"needs 2\d\.\d GiB per GPU.*\d+\.\d GiB avail"):
        pl.search_plan(parse_gpus("4090"), cm.LLAMA2_13B_128K, parse_context("128k"),
                       host_mem_gb=64)


def test_plan_is_fast():
    import time
    t = time.perf_counter()
    pl.search_plan(parse_gpus("2x4090"), cm.LLAMA2_13B_128K, 131072)
    assert time.perf_counter() - t < 1.0


@pytest.mark.parametrize("text,gpus,name", [
    ("4090", 1, "rtx4090"), ("2x4090", 2, "rtx4090"), ("2X4090", 2, "rtx4090"),
    ("rtx4090", 1, "rtx4090"), ("a100-80g", 1, "a100-80g"), ("1xa100-80g", 1, "a100-80g")])
def test_parse_gpus(text, gpus, name):
    hw = parse_gpus(text)
    assert hw.gpus == gpus
    assert hw.gpu_mem_gb == cm.HARDWARE[name].gpu_mem_gb


@pytest.mark.parametrize("text", ["3090", "0x4090", "x4090", "", "2x"])
def test_parse_gpus_rejects(text):
    with pytest.raises(ValueError, match="GPU"):
        parse_gpus(text)


@pytest.mark.parametrize("text,tokens", [
    ("128k", 131072), ("131072", 131072), ("32K", 32768), ("1M", 1048576), (4096, 4096)])
def test_parse_context(text, tokens):
    assert parse_context(text) == tokens


@pytest.mark.parametrize("text", ["abc", "12q", "-5", "0", "k"])
def test_parse_context_rejects(text):
    with pytest.raises(ValueError, match="context"):
        parse_context(text)


def test_parse_model(tmp_path):
    assert parse_model("llama2-7b-128k") is cm.LLAMA2_7B_128K
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, '
        '"intermediate_size": 128, "vocab_size": 100}')
    assert parse_model(str(tmp_path)).layers == 2
    with pytest.raises(ValueError, match="unknown model"):
        parse_model("gpt-5")


def test_int4_weights_free_memory_for_on_chip_kv():
    """plan --weights int4: 5 bits a weight; the memory freed holds KV layers on the card."""
    m = cm.LLAMA31_8B
    q = replace(m, weights="int4")
    assert q.weight_bytes == round(m.params * 5 / 8) and q.weight_bytes < m.weight_bytes / 3
    assert q.step_read_bytes > m.step_bytes  # today's GPU kernel dequantizes per call
    hw = parse_gpus("4090")
    dense = pl.search_plan(hw, m, 131072, draft=None)
    int4 = pl.search_plan(hw, q, 131072, draft=None)
    assert int4.settings.on_chip > dense.settings.on_chip
    assert int4.host_gb < dense.host_gb and int4.ms_per_token < dense.ms_per_token
    with pytest.raises(ValueError, match="weights 'int3'"):
        replace(m, weights="int3")


def test_plan_drafts_only_with_the_targets_tokenizer():
    from triforce_offload.cli.plan import draft_for
    d, note = draft_for(cm.LLAMA31_8B, True)
    assert d is None and "llama3 tokenizer" in note
    assert draft_for(cm.LLAMA2_7B_128K, True) == (cm.LLAMA_68M, "")
    d, note = draft_for(replace(cm.LLAMA2_7B_128K, tokenizer=""), True)  # a model folder
    assert d is None and "cannot check" in note
    assert draft_for(cm.LLAMA2_7B_128K, False) == (None, "")


def test_plan_command_line_weights_and_draft(tmp_path):
    import json
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "triforce_offload.cli", "plan", "--gpus", "4090",
                        "--model", "llama-3.1-8b", "--context", "128k", "--weights", "int4", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["weights"] == "int4" and d["draft"] is None and "llama3" in d["draft_note"]
    assert "--weights int4" in d["command"] and "--mode retrieval" in d["command"]
    assert d["on_chip"] == 32 and d["host_gb"] == 0


def test_batch_shares_weights_and_multiplies_each_sequences_kv():
    """Assumption 12: at batch B a step reads the weights once and each sequence's KV; KV,
    rings, retrieval caches and the offloaded KV scale with B; batch 1 is the old model."""
    hw, m = cm.A100_80G, cm.GEMMA3_1B
    s1 = cm.Settings(context=8192, on_chip=m.layers, budget=1024, tp=1)
    s8 = replace(s1, batch=8)
    for mode in ("autoregressive", "triforce", "deepspeed"):
        p1, p8 = cm.predict(hw, m, s1, mode), cm.predict(hw, m, s8, mode)
        assert p1.batch == 1 and p8.batch == 8
        # a step costs more at batch 8 but less than 8 steps: throughput rises
        assert p1.ms_per_token < p8.ms_per_token < 8 * p1.ms_per_token, mode
        assert p8.tokens_per_s > p1.tokens_per_s
    g1, g8 = cm.memory_use(hw, m, s1).parts, cm.memory_use(hw, m, s8).parts
    assert g8["weights"] == g1["weights"]
    for k in ("on_chip_kv", "rings", "retrieval"):
        assert g8[k] == pytest.approx(8 * g1[k]), k
    off1 = replace(s1, on_chip=0)
    assert cm.memory_use(hw, m, replace(off1, batch=8)).host_gb == pytest.approx(
        8 * cm.memory_use(hw, m, off1).host_gb)
    # offloaded, each sequence's KV crosses the link: the transfer scales with the batch
    t1 = cm.predict(hw, m, off1, "autoregressive").transfer_ms
    assert cm.predict(hw, m, replace(off1, batch=8), "autoregressive").transfer_ms == pytest.approx(8 * t1, rel=0.01)
    with pytest.raises(ValueError, match="batch"):
        cm.predict(hw, m, replace(s1, batch=0))


def test_plan_batch_fits_every_sequence_or_refuses_in_one_line():
    hw = parse_gpus("a100-80g")
    one = pl.search_plan(hw, cm.LLAMA31_8B, 32768, draft=None)
    many = pl.search_plan(hw, cm.LLAMA31_8B, 32768, draft=None, batch=8)
    assert many.batch == 8 and many.gpu_gb * cm.GIB <= cm.gpu_capacity(hw)
    assert many.host_gb * cm.GIB <= cm.host_capacity(hw)
    # eight sequences' KV leaves less of it on the card than one sequence's
    assert many.settings.on_chip <= one.settings.on_chip
    with pytest.raises(ValueError, match=r"needs \d+\.\d GiB per GPU for 512 sequences"):
        pl.search_plan(parse_gpus("4090"), cm.LLAMA2_7B_128K, 131072, batch=512)


def test_plan_cli_batch_prints_the_serve_command_and_aggregate_rate():
    import json
    import subprocess
    import sys
    base = [sys.executable, "-m", "triforce_offload.cli", "plan", "--gpus", "a100-80g", "--model",
            "gemma-3-1b", "--context", "16k", "--json"]
    r = subprocess.run(base + ["--batch", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["batch"] == 4 and d["tokens_per_s"] == pytest.approx(4e3 / d["ms_per_token"])
    assert d["command"].startswith("triforce-offload serve ") and d["command"].endswith("--max-batch 4")
    assert "--tp" not in d["command"]
    r = subprocess.run(base + ["--batch", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--batch 0" in r.stderr
