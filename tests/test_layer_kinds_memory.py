"""The memory arithmetic counts layer kinds (issue 28): a window layer is a ring of window +
rollback depth tokens on the device, a global layer holds the capacity (offloaded: in host
memory, streamed). The predicted bytes (ModelConfig.kv_bytes, RetrievalCache.bytes_for,
the cost model's parts) equal what the real caches allocate on the CPU; the memory checks
accept a windowed model where the same model all global would not fit (device memory
faked, `store.device_available`); the cost model and `plan` scale with the global layers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from triforce_offload.offload import costmodel as cm
from triforce_offload.offload import plan as pl
from triforce_offload.offload import store as S
from triforce_offload.offload.errors import OffloadError
from triforce_offload.runtime.cache import offloaded as off_mod
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.model.config import BAND_BLOCK, ModelConfig
from triforce_offload.runtime.spec.engine import rollback_depth
from triforce_offload.runtime.cache.offloaded import (OffloadedCache, check_resident, make_full_cache,
                                                prefill_device_bytes, use_offload)
from triforce_offload.runtime.options import GenerationOptions, RunOptions
from triforce_offload.runtime.cache.retrieval import RetrievalCache

WINDOW, DEPTH = 8, 6
KINDS = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # globals: 2 and 5


def windowed(window=WINDOW, kinds=KINDS) -> ModelConfig:
    """A Gemma-3-like geometry: 6 layers, 1 global in 3, 2 KV heads of 16."""
    return ModelConfig(arch="gemma3", vocab_size=64, hidden_size=64, intermediate_size=128,
                       n_layers=len(kinds), n_heads=4, n_kv_heads=2, head_dim=16,
                       max_position_embeddings=8192, layer_types=list(kinds), sliding_window=window)


def all_global() -> ModelConfig:
    return windowed(None, ["full_attention"] * len(KINDS))


PER_LAYER = 2 * 2 * 16  # K+V elements of one token in one layer


def spec_of(cfg: ModelConfig, elem: int) -> cm.ModelSpec:
    """The cost model's view of a runtime config (as `run --plan auto` builds it)."""
    return cm.ModelSpec("tiny", cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_size,
                        cfg.intermediate_size, cfg.vocab_size, head_dim=cfg.head_dim, dtype_bytes=elem,
                        window=cfg.sliding_window or 0, layer_types=tuple(cfg.layer_types))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_predicted_bytes_equal_the_caches_allocations(dtype):
    cfg, elem, cap = windowed(), torch.empty(0, dtype=dtype).element_size(), 200
    full = FullCache(cfg, cap, dtype=dtype, ring_depth=DEPTH)
    want = (2 * cap + 4 * (WINDOW + DEPTH + BAND_BLOCK - 1)) * PER_LAYER * elem  # 2 global layers, 4 rings
    assert full.nbytes() == cfg.kv_bytes(cap, elem, DEPTH) == want
    assert FullCache(cfg, cap, dtype=dtype).nbytes() == cfg.kv_bytes(cap, elem) == 6 * cap * PER_LAYER * elem
    for depth in (DEPTH, None):  # the retrieval cache: selected slots on global layers, rings elsewhere
        r = RetrievalCache(cfg, 64, 8, 24, dtype=dtype, ring_depth=depth)
        assert r.nbytes() == RetrievalCache.bytes_for(cfg, r.slots, dtype, ring_depth=depth)
    assert RetrievalCache.bytes_for(cfg, 0, dtype, ring_depth=DEPTH) == 0  # no retrieval cache
    assert RetrievalCache.bytes_for(cfg, 512, dtype, ring_depth=DEPTH) < RetrievalCache.bytes_for(cfg, 512, dtype)


def test_cost_model_parts_equal_the_offloaded_caches_allocations():
    """memory_use's on-chip KV, rings, staging and host bytes are the real OffloadedCache's;
    its retrieval part is RetrievalCache.bytes_for at the budget; its ring depth is the
    engine's rollback depth of the run it plans."""
    cfg, cap, tc, on_chip = windowed(), 256, 32, 4  # on chip: global layer 2; 5 offloaded
    s = cm.Settings(context=cap, budget=64, transfer_chunk=tc, on_chip=on_chip, gamma1=1, gamma2=3)
    assert s.ring_depth == rollback_depth(GenerationOptions(gamma1=1, gamma2="3")) == DEPTH
    no_draft = replace(s, draft=None, gamma1=0)
    assert no_draft.ring_depth == rollback_depth(GenerationOptions(gamma2="3"))  # run's default γ1
    cache = OffloadedCache(cfg, cap, transfer_chunk=tc, on_chip=on_chip, ring_depth=DEPTH)
    mem = cm.memory_use(cm.RTX4090, spec_of(cfg, 4), s, "triforce")
    parts = {k: round(v * cm.GIB) for k, v in mem.parts.items()}
    assert parts["on_chip_kv"] == cache.chip.nbytes() == cap * PER_LAYER * 4
    # the plan is a GPU's: a CPU's rings hold BAND_BLOCK - 1 slots more (cache.kv.band_lo)
    cpu = 4 * (BAND_BLOCK - 1) * PER_LAYER * 4
    assert parts["rings"] == cache.ring.nbytes() - cpu == 4 * (WINDOW + DEPTH) * PER_LAYER * 4
    assert parts["staging"] == cache.sched.nbytes()
    assert round(mem.host_gb * cm.GIB) == cache.store.nbytes() == cap * PER_LAYER * 4  # layer 5 only
    assert parts["retrieval"] == RetrievalCache.bytes_for(cfg, 64, torch.float32, ring_depth=DEPTH) - cpu
    cache.close()


def fake_device(monkeypatch, free: float):
    """Every device reports `free` bytes (so a CPU run is checked as a card would be)."""
    monkeypatch.setattr(S, "device_available", lambda d: int(free))


def test_resident_check_accepts_a_windowed_model_an_all_global_one_would_not_fit(monkeypatch):
    cap, chunk, dt = 16384, 512, torch.float32
    pre = prefill_device_bytes(windowed(), chunk, chunk, 1, 4, False)
    win = (2 * cap + 4 * (WINDOW + DEPTH + BAND_BLOCK - 1)) * PER_LAYER * 4 + pre
    glob = 6 * cap * PER_LAYER * 4 + pre
    assert win < glob / 2
    fake_device(monkeypatch, (win + glob) / 2 / 0.9)  # the check keeps 10% in reserve
    check_resident(windowed(), cap, dt, "cuda", chunk, ring_depth=DEPTH)
    with pytest.raises(OffloadError, match=r"the KV cache \(0\.0 GB\) and the prefill need"):
        check_resident(windowed(), cap, dt, "cuda", chunk)  # the same model without rings
    with pytest.raises(OffloadError):
        check_resident(all_global(), cap, dt, "cuda", chunk, ring_depth=DEPTH)
    fake_device(monkeypatch, (win - 1) / 0.9)  # one byte short of the windowed need
    with pytest.raises(OffloadError):
        check_resident(windowed(), cap, dt, "cuda", chunk, ring_depth=DEPTH)
    fake_device(monkeypatch, win / 0.9 + 1)
    check_resident(windowed(), cap, dt, "cuda", chunk, ring_depth=DEPTH)


def test_auto_offload_counts_rings(monkeypatch):
    """`--offload auto` keeps a windowed KV resident where the all-global one would not fit,
    and `make_full_cache` builds it so: the resident cache is what was counted."""
    cap, o = 4096, RunOptions.of().offload
    ring = rollback_depth(RunOptions.of().generation)
    win, glob = windowed().kv_bytes(cap, 4, ring), all_global().kv_bytes(cap, 4)
    fake_device(monkeypatch, (win + glob) / 2 / 0.8)  # auto keeps 20% free
    assert not use_offload(o, windowed(), cap, torch.float32, "cpu", ring_depth=ring)
    assert use_offload(o, windowed(), cap, torch.float32, "cpu")  # every layer whole: too big
    assert use_offload(o, all_global(), cap, torch.float32, "cpu", ring_depth=ring)
    loaded = lambda cfg: SimpleNamespace(cfg=cfg, kv_dtype=torch.float32, device="cpu",  # noqa: E731
                                         model=None, prefix=None)
    resident = make_full_cache(loaded(windowed()), cap, RunOptions.of())
    assert isinstance(resident, FullCache) and resident.nbytes() == win
    monkeypatch.setattr(off_mod, "OffloadedCache", lambda cfg, c, **kw: ("offloaded", c, kw["ring_depth"]))
    assert make_full_cache(loaded(all_global()), cap, RunOptions.of()) == ("offloaded", cap, ring)


def test_offloaded_check_counts_the_retrieval_cache_as_allocated(monkeypatch):
    """The device need of an offloaded cache grows by the retrieval cache it is told of, by
    exactly what that cache allocates (its rings on window layers, not the budget)."""
    seen = []
    monkeypatch.setattr(off_mod, "check_memory", lambda host, dev, *a: seen.append((host, dev)))
    cfg, cap, slots = windowed(), 2048, 512
    for n in (0, slots):
        OffloadedCache(cfg, cap, transfer_chunk=64, ring_depth=DEPTH, retrieval_slots=n).close()
    (host0, dev0), (host1, dev1) = seen
    real = RetrievalCache(cfg, 64, 8, 0, slots=slots, ring_depth=DEPTH)
    assert host0 == host1 == 2 * cap * PER_LAYER * 4  # the two global layers in the store
    assert dev1 - dev0 == real.nbytes() < slots * 6 * PER_LAYER * 4


def test_prefill_counts_the_chunks_only_offloaded_layers_keep():
    cfg = windowed()
    every = prefill_device_bytes(cfg, 1024, 256, 1, 4)
    two = prefill_device_bytes(cfg, 1024, 256, 1, 4, fresh_layers=2)
    q, kv = 4 * 16, 2 * 16
    assert every - two == 4 * 256 * (2 * q + 3 * kv) * 4  # the 4 layers that keep no chunk


# ---- the cost model and plan ----

G27 = cm.GEMMA3_27B
G27_GLOBAL = replace(G27, window=0, layer_types=())  # the same geometry, every layer global


def test_presets_match_published_configs():
    """Gemma 3 technical report, Table 1 (embedding / non-embedding parameters), the Qwen3-8B
    and Mistral-7B model cards; layer kinds as the configs' sliding_window_pattern gives."""
    for m, emb, rest in ((cm.GEMMA3_270M, 170e6, 100e6), (cm.GEMMA3_1B, 302e6, 698e6),
                         (cm.GEMMA3_4B, 675e6, 3209e6), (cm.GEMMA3_12B, 1012e6, 10759e6),
                         (G27, 1416e6, 25600e6)):
        assert m.vocab * m.hidden == pytest.approx(emb, rel=0.015)
        assert m.params - m.vocab * m.hidden == pytest.approx(rest, rel=0.01)
    assert cm.QWEN3_8B.params == pytest.approx(8.2e9, rel=0.01) and cm.QWEN3_8B.n_window == 0
    assert cm.MISTRAL_7B.params == pytest.approx(7.24e9, rel=0.01) and cm.MISTRAL_7B.n_global == 0
    assert cm.GEMMA3_4B.kinds == "34 layers: 29 window (1024), 5 global"
    assert G27.global_layers == tuple(range(5, 62, 6)) and G27.n_window == 52
    with pytest.raises(ValueError, match="need a window"):
        replace(G27, window=0)
    with pytest.raises(ValueError, match="layer_types"):
        replace(G27, layer_types=("full_attention",) * 3)


def test_windowed_kv_is_the_global_layers_share():
    """Gemma 3 27B at 128K on one card, nothing on chip: host KV and streamed bytes are 10/62
    of the all-global model's; the device holds 52 rings of window + depth instead."""
    q = lambda m: replace(m, weights="int4")  # noqa: E731  (bf16 weights do not fit a 4090)
    s = cm.Settings(context=131072, on_chip=0, draft=None, gamma1=0)
    win, glob = (cm.memory_use(cm.RTX4090, q(m), s) for m in (G27, G27_GLOBAL))
    assert win.host_gb == pytest.approx(glob.host_gb * 10 / 62) and glob.host_gb == 62.0
    assert win.parts["rings"] * cm.GIB == 52 * (1024 + s.ring_depth) * G27.kv_layer_bytes
    assert "rings" not in glob.parts
    ring = 1024 + s.ring_depth  # the retrieval cache: the budget on global layers, its own rings
    assert win.parts["retrieval"] * cm.GIB == (10 * s.budget + 52 * ring) * G27.kv_layer_bytes
    assert glob.parts["retrieval"] * cm.GIB == 62 * s.budget * G27.kv_layer_bytes
    ar = [cm.predict(cm.RTX4090, q(m), s, "autoregressive") for m in (G27, G27_GLOBAL)]
    assert ar[0].transfer_ms == pytest.approx(ar[1].transfer_ms * 10 / 62, rel=1e-6)
    assert ar[0].ms_per_token < ar[1].ms_per_token / 3
    tf = [cm.predict(cm.RTX4090, q(m), s, "triforce") for m in (G27, G27_GLOBAL)]
    assert tf[0].ms_per_token < tf[1].ms_per_token


def test_on_chip_counts_global_layers():
    """--on-chip N keeps the global layers among the first N: the plan offers the smallest
    N for a count, all layers when every global layer fits."""
    assert [G27.on_chip_for(k) for k in (0, 1, 3, 10)] == [0, 6, 18, 62]
    assert [G27.chip_globals(n) for n in (0, 5, 6, 17, 18, 62)] == [0, 0, 1, 2, 3, 10]
    s = cm.Settings(context=131072, draft=None, gamma1=0)
    for n, host in ((0, 10.0), (18, 7.0), (62, 0.0)):
        assert cm.memory_use(cm.RTX4090, G27, replace(s, on_chip=n)).host_gb == pytest.approx(host)


def test_plan_for_gemma3_27b_at_128k_on_a_4090():
    p = pl.search_plan(cm.RTX4090, replace(G27, weights="int4"), 131072, draft=None)
    on = G27.chip_globals(p.settings.on_chip)
    assert p.settings.on_chip == G27.on_chip_for(on)  # at a global layer's boundary
    assert p.host_gb == pytest.approx((10 - on) * 131072 * G27.kv_layer_bytes / cm.GIB)
    assert 0 < on < 10 and p.host_gb < 10  # the global layers' 10 GiB, partly on chip
    assert p.gpu_parts["rings"] < 0.5 and p.gpu_gb * cm.GIB <= cm.gpu_capacity(cm.RTX4090)
    assert p.ms_per_token < p.baseline_ms
    # all global: 62 GiB of KV, nearly all of it in host memory and streamed
    g = pl.search_plan(cm.RTX4090, replace(G27_GLOBAL, weights="int4"), 131072, draft=None)
    assert g.host_gb > 55 and g.ms_per_token > 2 * p.ms_per_token


def test_an_all_window_model_keeps_everything_on_the_device():
    p = pl.search_plan(cm.RTX4090, replace(cm.MISTRAL_7B, weights="int4"), 32768, draft=None)
    assert p.host_gb == 0 and p.settings.on_chip == 32 and "staging" not in p.gpu_parts
    assert p.gpu_parts["rings"] * cm.GIB == 32 * (4096 + p.settings.ring_depth) * cm.MISTRAL_7B.kv_layer_bytes


def test_plan_reads_layer_kinds_from_config_json(tmp_path):
    from triforce_offload.cli.plan import parse_model
    hf = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 12, "num_attention_heads": 4,
          "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 640, "intermediate_size": 2048,
          "vocab_size": 262144, "sliding_window": 512}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    m = parse_model(str(tmp_path))
    assert m.window == 512 and m.global_layers == (5, 11) and m.n_window == 10
    assert m.tied  # Gemma ties its embeddings unless the config says not
    mistral = {**hf, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    (tmp_path / "config.json").write_text(json.dumps(mistral))
    assert parse_model(str(tmp_path)).n_global == 0
    llama = {**hf, "architectures": ["LlamaForCausalLM"]}  # a Llama ignores sliding_window
    (tmp_path / "config.json").write_text(json.dumps(llama))
    assert parse_model(str(tmp_path)).n_window == 0 and not parse_model(str(tmp_path)).tied


def test_plan_command_shows_layer_kinds():
    env = {**os.environ, "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "triforce_offload.cli", "plan", "--gpus", "4090", "--model",
           "gemma-3-27b", "--context", "128k", "--weights", "int4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "62 layers: 52 window (1024), 10 global" in r.stdout
    assert "window rings (1024 + " in r.stdout and "global layers' KV" in r.stdout
    r = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=120, env=env)
    d = json.loads(r.stdout)
    assert (d["layers"], d["window_layers"], d["global_layers"], d["window"]) == (62, 52, 10, 1024)
    assert d["ring_depth"] == 4 + d["gamma2"] + 2  # --mode retrieval: run's γ1 default
    assert f"--on-chip {d['on_chip']}" in d["command"] and d["host_gb"] < 10


@pytest.mark.parametrize("depth", [DEPTH, None])
def test_a_prefill_keeps_chunks_of_the_offloaded_layers_only(depth, tmp_path):
    """What `fresh_layers` counts: after a layer-major prefill of a windowed Qwen2 (layer 0
    global, 1-2 window), the offloaded cache keeps a chunk of each layer in its store and of
    no other (rings attend in place)."""
    from test_windows import ours, tiny_qwen2
    from triforce_offload.runtime.cache.offloaded import prefill_layer_major
    model, cfg = ours(tiny_qwen2(), tmp_path)
    cache = OffloadedCache(cfg, 64, transfer_chunk=8, ring_depth=depth)
    with torch.no_grad():
        prefill_layer_major(model, cache, torch.randint(0, 97, (1, 40)), 0, 16)
    assert sorted(cache.fresh) == list(cache.store.spec.layers) == ([0] if depth else [0, 1, 2])
    cache.close()


def test_the_docs_layer_kinds_table_is_the_plans():
    """docs/offload.md's Gemma 3 rows (4090, 128K, int4) are what `plan` predicts now."""
    import re
    from pathlib import Path
    doc = (Path(__file__).resolve().parent.parent / "docs" / "offload.md").read_text()
    models = {"gemma-3-27b": G27, "gemma-3-12b": cm.GEMMA3_12B}
    rows = re.findall(r"^\| (gemma-3-\d+b)(, all global)? \|(.*)$", doc, re.M)
    assert len(rows) == 4
    for name, every, cells in rows:
        m = replace(models[name], weights="int4")
        m = replace(m, window=0, layer_types=()) if every else m
        p = pl.search_plan(cm.RTX4090, m, 131072, draft=None)
        layers = (m.n_window, m.window, m.n_global) if m.n_window else (m.n_global,)
        want = [*layers, m.kv_bytes(131072, p.settings.ring_depth) / cm.GIB, p.settings.on_chip,
                m.chip_globals(p.settings.on_chip), m.n_global, p.gpu_parts.get("rings", 0.0), p.host_gb,
                p.ms_per_token, p.baseline_ms]
        got = re.findall(r"\d+(?:\.\d+)?", cells)
        assert len(got) == len(want), (name, cells)
        for d, v in zip(got, want):
            places = len(d.partition(".")[2])
            assert float(d) == pytest.approx(round(v, places)), (name, d, v)
