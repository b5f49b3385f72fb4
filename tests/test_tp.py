"""Tensor parallelism with gloo on the CPU: sharded ranks reproduce the unsharded model,
greedy output is identical, sampling stays in lockstep, faults end in bounded time."""
import time

import pytest
import torch

import helpers_tp as H
from triforce_offload.runtime import distributed, tp
from triforce_offload.runtime.errors import TriforceError

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]


@pytest.fixture(scope="module")
def tp2():
    """One 2-rank launch running every tiny config (spawning ranks costs seconds)."""
    return distributed.launch(H.run_all, 2, PROMPT, 12, threads=1, timeout=120)


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
    a, b = distributed.launch(H.sampled, 2, None, 10, threads=1, timeout=120)
    assert a == b and len(a) == 10


def test_dead_rank_ends_run_naming_it():
    t0 = time.monotonic()
    with pytest.raises(TriforceError, match=r"rank 1 died \(killed by SIGKILL\)"):
        distributed.launch(H.die_mid_run, 2, 1, threads=1, timeout=120)
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
