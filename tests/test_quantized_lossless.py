"""Losslessness at int8 and int4 weights: the target is the model at the precision it runs,
and every speculative mode's greedy output equals its autoregressive output token for token
(resident and offloaded, Llama and Qwen2); plus the level bypass's decisions."""
import copy

import pytest
import torch

from triforce_offload.kernels.qlinear import QEmbedding, QLinear
from triforce_offload.runtime.spec.engine import Bypass
from triforce_offload.runtime.model.quantized import quantize_model, set_activations, weights_name

from helpers_spec import repetitive_prompt, run, tiny


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def quantized_tiny(arch: str, kind: str):
    """kind: int8 | int4 weights, or int4:int8 (int4 weights, activations quantized per row
    and a bfloat16 KV: what --activations/--kv-dtype auto give on a CPU with VNNI)."""
    weights, _, act = kind.partition(":")
    # int8 activations run where K is a multiple of 64: llama then gets dim 64 (every
    # projection), qwen2 keeps 96 (down_proj only, the rest on float x: the mix)
    L = tiny(scale=3.0, seed=1, dim=64 if act else 32) if arch == "llama" else \
        tiny(scale=3.0, seed=2, heads=6, kv=2, layers=3, dim=96, arch="qwen2")
    L = copy.copy(L)
    L.model = quantize_model(copy.deepcopy(L.model), weights)
    L.weights = weights_name(L.model)
    L.activations = set_activations(L.model, act or "fp32", "cpu")
    if act:
        L.kv_dtype = torch.bfloat16
    return L


MODES = [
    ("draft", {}),
    ("retrieval", {"budget": 64}),
    ("triforce", {"budget": 64}),
    ("triforce", {"budget": 32, "retrieval_chunk": 4, "draft": "self", "draft_window": 8, "gamma2": "auto"}),
    ("triforce", {"budget": 64, "offload": "on", "transfer_chunk": 48}),
    ("triforce", {"budget": 64, "no_bypass": True}),
]


@pytest.mark.parametrize("kind", ["int8", "int4", "int4:int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mode,extra", MODES)
def test_greedy_equals_autoregressive_at_the_precision_it_runs(arch, kind, mode, extra):
    L = quantized_tiny(arch, kind)
    assert L.weights.startswith("int") and isinstance(L.model.model.embed_tokens, QEmbedding)
    assert isinstance(L.model.model.layers[0].mlp.down_proj, QLinear)
    prompt = repetitive_prompt(300, L.cfg.vocab_size, seed=3)
    extra = dict(extra)
    if extra.pop("no_bypass", False):
        extra["bypass"] = False
    ref, _ = run(L, prompt, "autoregressive", 48)
    out, st = run(L, prompt, mode, 48, **extra)
    assert out == ref
    assert st.extra["weights"] == L.weights



def test_quantized_logits_stay_close_to_dense():
    L = tiny(scale=3.0, seed=1)
    ids = torch.tensor([repetitive_prompt(40, L.cfg.vocab_size)])
    from triforce_offload.runtime.cache.kv import FullCache
    with torch.inference_mode():
        dense = L.model(ids, 0, FullCache(L.cfg, 64))
        for kind, tol in (("int8", 0.05), ("int4", 0.5)):
            q = quantize_model(copy.deepcopy(L.model), kind)(ids, 0, FullCache(L.cfg, 64))
            err = (q - dense).abs().max().item() / dense.abs().max().item()
            assert 0 < err < tol, (kind, err)


def _drive(b: Bypass, cost: dict, rounds: int, tokens: int = 4) -> list:
    """Run the controller against fixed seconds per token per configuration."""
    seen = []
    for _ in range(rounds):
        c = b.choose()
        b.record(c, cost[c] * tokens, tokens)
        seen.append(c)
    return seen


def test_bypass_leaves_a_level_that_does_not_pay_and_takes_it_back_when_it_does():
    b = Bypass([0, 1])
    none, ngram, ret, both = b.configs  # {}, {0}, {1}, {0, 1}
    slow_mid = {none: 0.030, ngram: 0.040, ret: 0.012, both: 0.020}  # the retrieval level costs
    seen = _drive(b, slow_mid, 60)
    assert b.current == ret and seen[-10:].count(ret) >= 8
    assert b.skipped[1] > b.skipped[0]
    pays_again = {none: 0.006, ngram: 0.040, ret: 0.012, both: 0.020}  # repetitive text
    _drive(b, pays_again, 200)
    assert b.current == none
    f = b.figures(["ngram", "retrieval", "full"])
    assert f["bypass_switches"] >= 2 and f["bypassed_tokens"]["retrieval"] > 0


def test_bypass_keeps_every_level_when_all_pay():
    b = Bypass([0, 1])
    none, ngram, ret, both = b.configs
    cost = {none: 0.005, ngram: 0.010, ret: 0.009, both: 0.020}
    seen = _drive(b, cost, 200)
    assert b.current == none and b.switches == 0
    assert seen.count(none) > 0.8 * len(seen)  # probes back off: most rounds run the choice


def _decode(b: Bypass, cost: dict, toks: dict, n: int) -> float:
    """Seconds per token over n tokens, rounds of toks[c] tokens at cost[c] seconds per token."""
    t = made = 0
    while made < n:
        c = b.choose()
        b.record(c, cost[c] * toks[c], toks[c])
        t, made = t + cost[c] * toks[c], made + toks[c]
    return t / made


def test_bypass_explores_cheaply_when_no_level_pays():
    """Plain decoding is best (every speculative configuration is slower): exploring costs
    little within 64 tokens, and a hopeless configuration sits out later probe cycles."""
    b = Bypass([0, 1])
    none, ngram, ret, plain = b.configs
    cost = {none: 0.040, ngram: 0.050, ret: 0.030, plain: 0.0244}
    toks = {none: 3, ngram: 3, ret: 1, plain: 1}
    assert _decode(b, cost, toks, 64) < 1.2 * cost[plain] and b.current == plain
    assert _decode(b, cost, toks, 512) < 1.05 * cost[plain]  # rests double: rarer probes
    assert b.rest[ngram][1] > 4 * b.base and b.rest[none][1] >= 4 * b.base


def test_bypass_skips_a_probe_whose_best_case_cannot_compete():
    b = Bypass([0, 1], bound=lambda c: 0.035 if c == frozenset({0}) else None)
    none, ngram, ret, plain = b.configs
    cost = {none: 0.040, ngram: 0.050, ret: 0.030, plain: 0.0244}
    toks = {none: 3, ngram: 3, ret: 1, plain: 1}
    _decode(b, cost, toks, 64)
    assert b.seen[ngram] == 0 and b.rest[ngram][0] > 0  # never run: 0.035 > 1.2 x plain's


def test_kv_dtype_auto_follows_the_activations(monkeypatch):
    """--kv-dtype auto: bf16 caches on a CPU where quantized linears take int8 activations,
    the compute dtype otherwise; every cache a run builds stores it."""
    from triforce_offload.runtime.api import kv_dtype
    from triforce_offload.runtime.cache.offloaded import make_full_cache
    from triforce_offload.runtime.options import RunOptions
    cpu = torch.device("cpu")
    assert kv_dtype("auto", cpu, torch.float32, "int8") == torch.bfloat16
    assert kv_dtype("auto", cpu, torch.float32, "fp32") == torch.float32
    assert kv_dtype("auto", cpu, torch.float32, "") == torch.float32  # a dense model stays exact
    assert kv_dtype("auto", torch.device("cuda"), torch.bfloat16, "fp32") == torch.bfloat16
    assert kv_dtype("fp16", cpu, torch.float32, "int8") == torch.float16
    L = quantized_tiny("llama", "int4:int8")
    for offload in ("off", "on"):
        cache = make_full_cache(L, 128, RunOptions.of(offload=offload))
        k = cache.keys(0)[0]  # (K, V)
        assert k.dtype == torch.bfloat16, offload
        cache.close()


def test_kept_and_saved_kv_serve_only_runs_with_the_same_activations(tmp_path):
    """--offload on keeps float activations (auto), a resident run int8 ones: the KV each
    writes differs, so a prefix one saved (in memory or --kv-dir) never serves the other;
    the same activations again reuse it, and every output equals its cold run."""
    import dataclasses
    from triforce_offload.runtime.cache.disk import KVDir
    from triforce_offload.runtime.cache.prefix import PrefixCache
    L = dataclasses.replace(quantized_tiny("llama", "int4:int8"), activations_asked="auto")
    prompt = repetitive_prompt(120, L.cfg.vocab_size, seed=4)
    cold = {o: run(L, prompt, "autoregressive", 12, offload=o)[0] for o in ("on", "off")}
    # kept in memory, or on disk only: saved at once, or later, after the run (the server's way:
    # the entry records the activations of the run that wrote it, not of the moment it is saved)
    for memory, later in ((1 << 30, False), (0, False), (0, True)):
        store = PrefixCache(memory, KVDir(tmp_path / f"{memory}-{later}", 1 << 30, L, lambda _: None), later)
        Lp = dataclasses.replace(L, prefix=store)
        got = []
        for o in ("on", "off", "off", "on"):
            toks, st = run(Lp, prompt, "autoregressive", 12, offload=o)
            assert toks == cold[o], (memory, later, o)
            got.append((st.extra.get("activations"), st.extra.get("reused_tokens", 0)))
        assert [a for a, _ in got] == ["fp32", "int8", "int8", "fp32"]
        assert got[0][1] == 0 and got[1][1] == 0  # the other activations' KV: not reused
        assert got[2][1] > 0 and got[3][1] > 0  # the same activations': reused
