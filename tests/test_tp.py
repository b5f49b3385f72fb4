"""Tensor parallelism with gloo on the CPU: sharded ranks reproduce the unsharded model,
greedy output is identical, sampling stays in lockstep, faults end in bounded time."""
import json
import subprocess
import sys
import time

import pytest
import torch

import helpers_tp as H
from triforce_offload.runtime.model import distributed, tp
from triforce_offload.runtime.errors import TriforceError

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]


@pytest.fixture(scope="module")
def tp2():
    """One 2-rank launch running every tiny config (spawning ranks costs seconds)."""
    return distributed.launch(H.run_all, 2, (PROMPT, 12), threads=1, timeout=120)


@pytest.mark.parametrize("name", list(H.CONFIGS))
def test_tp2_logits_match_tp1(tp2, name):
    ref = H.run_model(name, PROMPT, 12)
    for r in range(2):
        got = torch.tensor(tp2[r][name]["logits"])
        torch.testing.assert_close(got, torch.tensor(ref["logits"]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(H.CONFIGS))
def test_tp2_greedy_identical(tp2, name):
    ref = H.run_model(name, PROMPT, 12)
    assert tp2[0][name]["tokens"] == tp2[1][name]["tokens"] == ref["tokens"]


def test_tp2_logits_bitwise_equal_across_ranks(tp2):
    """Replicated LM head on the same all-reduced state: no rank can decide differently."""
    for name in H.CONFIGS:
        assert tp2[0][name]["logits"] == tp2[1][name]["logits"]


def test_each_rank_caches_only_its_kv_heads(tp2):
    assert tp2[0]["llama-gqa"]["cache_kv_heads"] == 1  # 2 KV heads split over 2 ranks
    assert tp2[0]["llama-mha"]["cache_kv_heads"] == 2
    assert tp2[1]["llama-kv1"]["cache_kv_heads"] == 1  # 1 KV head replicated


def test_sampling_in_lockstep():
    """No seed given: rank 0 draws one and broadcasts it, so both ranks sample alike."""
    a, b = distributed.launch(H.sampled, 2, (None, 10), threads=1, timeout=120)
    assert a == b and len(a) == 10


def test_dead_rank_ends_run_naming_it():
    t0 = time.monotonic()
    with pytest.raises(TriforceError, match=r"rank 1 died \(killed by SIGKILL\)"):
        distributed.launch(H.die_mid_run, 2, (1,), threads=1, timeout=120)
    assert time.monotonic() - t0 < 60


def test_stuck_rank_times_out_instead_of_hanging(monkeypatch):
    monkeypatch.setenv("TRIFORCE_TP_TIMEOUT", "3")  # collective timeout, inherited by the ranks
    t0 = time.monotonic()
    with pytest.raises(TriforceError, match=r"rank 0 waited over 3 s for another rank"):
        distributed.launch(H.stall, 2, (1,), threads=1, timeout=120)
    assert time.monotonic() - t0 < 60


def test_rank_error_is_reported_with_its_message():
    with pytest.raises(TriforceError, match=r"rank 0 failed: bad value 7; allowed: 1-3"):
        distributed.launch(H.raise_user_error, 2, threads=1, timeout=60)


def test_tp_must_divide_heads():
    cfg = H.tiny("llama-gqa")  # 4 heads, 2 KV heads
    with pytest.raises(TriforceError, match=r"--tp 3 does not divide the model's 4 attention heads; allowed: 1, 2, 4"):
        tp.check(cfg, 3)
    with pytest.raises(TriforceError, match="must be >= 1"):
        tp.check(cfg, 0)


def test_rank_config_and_kv_heads():
    cfg = H.tiny("llama-gqa")
    rc = tp.rank_config(cfg, 2)
    assert (rc.n_heads, rc.n_kv_heads, rc.head_dim, rc.intermediate_size) == (2, 1, 16, 64)
    assert list(tp.kv_heads(cfg, 1, 2)) == [1]
    kv1 = H.tiny("llama-kv1")
    assert [list(tp.kv_heads(kv1, r, 4)) for r in range(4)] == [[0]] * 4
    assert tp.rank_config(cfg, 1) is cfg


def test_world_size_one_is_a_no_op():
    m = H.build("llama-gqa")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    assert tp.shard_model(m, m.config, 0, 1) is m.config
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert distributed.setup(1) == 0


# ---- the CLI path: `triforce-offload run --tp N` starts its own ranks ----

def cli(*args, stdin=None):
    cmd = [sys.executable, "-m", "triforce_offload.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, input=stdin, timeout=600)


def cli_json(*args, stdin=None) -> dict:
    r = cli("run", *args, "--json", stdin=stdin)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tp_model_dir(tiny_model_dir):
    """conftest's 2-layer random Llama (4 heads, 2 KV heads: splits over 2 ranks)."""
    return tiny_model_dir


def test_cli_tp2_equals_tp1_on_tiny_model(tp_model_dir):
    args = ("--model", tp_model_dir, "--mode", "autoregressive", "--max-new-tokens", "8",
            "--dtype", "fp32", "--prompt", "-")
    one = cli_json(*args, "--tp", "1", stdin="Tell me a story")
    two = cli_json(*args, "--tp", "2", stdin="Tell me a story")  # stdin read before the ranks start
    assert two["text"] == one["text"] and two["new_tokens"] == one["new_tokens"] == 8
    assert two["tp"] == 2


@pytest.mark.parametrize("flags, needle", [
    (("--tp", "0"), "--tp 0: must be >= 1"),
    (("--tp", "2", "--device", "cuda"), "--tp 2: needs 2 CUDA devices"),
])
def test_cli_bad_tp_fails_before_start(flags, needle):
    r = cli("run", "--prompt", "x", *flags)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert needle in r.stderr


@pytest.mark.slow
def test_cli_bundled_model_tp2_rejected_tp3_equals_tp1():
    """SmolLM2 has 9 heads: --tp 2 is refused up front; --tp 3 (3 ranks on 2 cores) matches."""
    r = cli("run", "--tp", "2", "--prompt", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--tp 2 does not divide the model's 9 attention heads; allowed: 1, 3" in r.stderr
    # tensor parallelism shards dense weights: both runs at the GGUF's blocks dequantized
    args = ("--mode", "autoregressive", "--max-new-tokens", "8", "--weights", "fp32", "--prompt",
            "What is the capital of France?")
    one, three = cli_json(*args, "--tp", "1"), cli_json(*args, "--tp", "3")
    assert three["text"] == one["text"] and three["new_tokens"] == one["new_tokens"]


LONG = [(i * 37 + 11) % 250 + 3 for i in range(48)] + PROMPT * 3  # repeats: the n-gram drafter hits


def test_tp2_greedy_identical_in_every_mode():
    """triforce (n-gram and self drafters, gamma2 auto), retrieval and autoregressive, with
    and without --offload on: 2 ranks produce exactly the single-process tokens."""
    two = distributed.launch(H.run_modes, 2, (LONG, 16), threads=1, timeout=300)
    one = H.run_modes(LONG, 16)
    for case, a, b, ref in zip(H.MODE_CASES, two[0], two[1], one):
        assert a["tokens"] == b["tokens"] == ref["tokens"], case
        assert len(ref["tokens"]) == 16
        assert a["offloaded"] == (case[2].get("offload") == "on")


def test_tp2_sized_drafts_are_rank_0s():
    """The n-gram drafter sizes drafts by timings, which differ between ranks: rank 1 alone
    would draft nothing where rank 0 drafts; both take rank 0's sizes (else their
    verifications would differ in width and the collectives would not match)."""
    two = distributed.launch(H.run_sized_by_rank, 2, (LONG, 16), threads=1, timeout=300)
    one = H.run_modes(LONG, 16)[0]  # autoregressive, single process
    assert two[0]["tokens"] == two[1]["tokens"] == one["tokens"]
    assert two[0]["drafted"] == two[1]["drafted"] > 0


def test_load_shards_on_the_host_before_the_move(tiny_model_dir, monkeypatch):
    """`api.load(shard=)`: the weights load on the host, the rank's slice is cut there, and
    only the slice moves to the device (a GPU never holds the whole model)."""
    from triforce_offload.runtime import api
    monkeypatch.setattr(api, "resolve_device", lambda name: torch.device("meta"))  # stands in for a GPU
    seen = {}

    def shard(model, cfg):
        seen["device"] = next(model.parameters()).device
        return tp.shard_model(model, cfg, 1, 2)

    loaded = api.load(str(tiny_model_dir), "float32", "cuda:1", shard=shard)
    assert seen["device"] == torch.device("cpu")
    assert next(loaded.model.parameters()).device == torch.device("meta")
    from triforce_offload.runtime.model.loader import read_config, resolve
    full = read_config(resolve(str(tiny_model_dir)))
    assert loaded.cfg.n_heads == loaded.model.model.layers[0].self_attn.n_heads == full.n_heads // 2
    assert loaded.model.tp == (1, 2)


@pytest.mark.parametrize("world", [2, 4])
def test_stacked_projections_shard_per_part(world):
    """qkv_proj and gate_up_proj are stacked: rank r keeps its q rows, its KV heads' k rows
    and v rows (biases too), and its slice of gate and of up, each taken from its own part,
    not a contiguous slice of the stack. (4 ranks: 2 KV heads replicated.)"""
    full = H.build("qwen2-bias")
    cfg, D = full.config, full.config.head_dim
    a0, m0 = full.model.layers[0].self_attn.qkv_proj, full.model.layers[0].mlp.gate_up_proj
    q, k, v = a0.weight.split([cfg.n_heads * D, cfg.n_kv_heads * D, cfg.n_kv_heads * D])
    qb, kb, vb = a0.bias.split([cfg.n_heads * D, cfg.n_kv_heads * D, cfg.n_kv_heads * D])
    gate, up = m0.weight.chunk(2)
    hq, w = cfg.n_heads // world, cfg.intermediate_size // world
    for r in range(world):
        m = H.build("qwen2-bias")
        tp.shard_model(m, m.config, r, world)  # no forward: the all-reduce hooks never run
        kv = tp.kv_heads(cfg, r, world)
        qs, ks = slice(r * hq * D, (r + 1) * hq * D), slice(kv.start * D, kv.stop * D)
        attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
        assert torch.equal(attn.qkv_proj.weight, torch.cat([q[qs], k[ks], v[ks]]))
        assert torch.equal(attn.qkv_proj.bias, torch.cat([qb[qs], kb[ks], vb[ks]]))
        assert (attn.n_heads, attn.n_kv_heads) == (hq, len(kv))
        assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate[r * w:(r + 1) * w], up[r * w:(r + 1) * w]]))


def test_tp_steps_run_without_graphs_and_say_why():
    """all_reduce hooks inside a captured CUDA graph would not replay as collectives: under
    --tp > 1 a step over a static cache runs without graphs, said once on the stats line."""
    two = distributed.launch(H.step_figures, 2, (), threads=1, timeout=120)
    for r in two:
        [note] = r["figures"].get("notes", [None])
        assert r["graphed"] is False and r["figures"]["graphs"] is False
        assert note and "tensor parallelism" in note and "all_reduce" in note
    assert two[0]["tokens"] == two[1]["tokens"] and len(two[0]["tokens"]) == 4
