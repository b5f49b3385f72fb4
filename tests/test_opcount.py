"""A decode step is lean by construction: at most 20 work ops per layer on the eager and
the fixed-shape (CUDA graph) path, the same ops at every position, no host sync.

Work ops are counted by runtime/opcount.py (views, metadata and no-op conversions are not
work). Before q/k/v and gate/up were stacked, RMSNorm fused and RoPE done in one pass,
a decode step dispatched 36 (eager) and 45 (fixed-shape) work ops per layer in fp32,
40 and 49 in bf16.
"""
import pytest
import torch

from helpers_spec import prefilled, tiny
from triforce_offload.runtime import opcount
from triforce_offload.runtime.graphs import Step

LIMIT = 20  # work ops per layer of a one-token decode step


def test_counter_skips_views_and_no_ops_and_flags_host_syncs():
    x = torch.randn(2, 3, 4)
    with torch.inference_mode(), opcount.OpCount() as c:
        x.view(6, 4).t()[1:].unsqueeze(0)  # views
        x.reshape(6, 4)  # a view: contiguous
        x.float()  # already float32: returns x
        x.transpose(0, 1).reshape(6, 4)  # must copy: work
        x.to(torch.bfloat16)  # a conversion: work
        x.sum().item()  # sum, and a host sync (`item`: _local_scalar_dense inside)
    assert [o.name for o in c.ops] == ["reshape", "to", "sum", "item"]
    assert [o.name for o in c.syncs] == ["item"]
    assert c.ops[0].shapes == (((3, 2, 4), "float32"),)
    with torch.inference_mode(), opcount.OpCount(kernels=True) as k:
        bool(x.sum() > 0)
    assert [o.name for o in k.syncs] == ["_local_scalar_dense"]


def test_kernels_mode_expands_composites_this_device_has_no_kernel_for():
    x, w = torch.randn(1, 1, 8), torch.ones(8)
    run = lambda: torch.nn.functional.rms_norm(x, (8,), w, 1e-5)  # noqa: E731
    m = torch.nn.Module()
    m.model = torch.nn.Module()
    m.model.layers = []
    assert [o.name for o in opcount.count(m, run).ops] == ["rms_norm"]
    names = [o.name for o in opcount.count(m, run, kernels=True).ops]
    assert "rms_norm" not in names and {"pow", "mean", "rsqrt"} <= set(names)  # on the CPU


MODELS = [dict(arch="llama", heads=4, kv=2), dict(arch="qwen2", heads=6, kv=2, dim=48)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kw", MODELS, ids=["llama", "qwen2-bias"])
def test_decode_step_work_ops_per_layer(kw, dtype, monkeypatch):
    """Every layer of a one-token step: <= 20 work ops eagerly and through graphs.Step on
    the fixed-shape path (TRIFORCE_OFFLOAD_STATIC=1 runs it on the CPU), and no dtype
    conversion inside a layer (no round trips)."""
    L = tiny(layers=3, **kw)
    L.model.to(dtype)
    eager = prefilled(L, 20, static=False, capacity=64)
    eager_ops = opcount.count(L.model, lambda: L.model(torch.tensor([[3]]), 20, eager))
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    step = Step(L.model, prefilled(L, 20, static=True, capacity=64))
    assert step.static and not step.graphed
    fixed_ops = opcount.count(L.model, lambda: step(torch.tensor([[3]]), 20))
    for c in (eager_ops, fixed_ops):
        assert len(c.per_layer()) == 3 and max(c.per_layer()) <= LIMIT, c.per_layer()
        assert not [o for o in c.ops if o.layer is not None and o.name in ("to", "_to_copy")]
        assert c.outside <= 2 * LIMIT  # embedding, cos/sin, final norm, LM head
    names = [o.name for o in eager_ops.ops if o.layer == 0]
    assert names.count("rms_norm") == 2 and names.count("flip") == 1  # one RoPE pass for q and k


def test_fixed_shape_steps_replay_alike_without_host_syncs(monkeypatch):
    """Two consecutive decode steps through Step on the fixed-shape path dispatch the same
    ops with the same shapes (a CUDA graph captured at one replays the other), and neither
    reads a device value on the host."""
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    L = tiny(arch="qwen2", heads=6, kv=2, dim=48)
    step = Step(L.model, prefilled(L, 20, static=True, capacity=64))
    runs = [opcount.count(L.model, lambda p=p: step(torch.tensor([[p]]), p)) for p in (20, 21)]
    step.cache.commit(22)
    assert runs[0].signature() == runs[1].signature() and len(runs[0].ops) > 2 * LIMIT
    assert not runs[0].syncs and not runs[1].syncs


def test_benchmark_figures_for_a_checkpoint_shaped_model():
    """decode_step_ops (what benchmarks/gpu_decode.py prints) on a model with SmolLM2's head
    size (64: the native CPU kernel's shapes where it is enabled)."""
    L = tiny(layers=2, heads=3, kv=1, dim=192)
    ops = opcount.decode_step_ops(L.model, L.cfg)
    assert 0 < ops["eager"] <= LIMIT and 0 < ops["fixed"] <= LIMIT and ops["fixed_syncs"] == 0
    assert ops["eager_kernels"] >= ops["eager"]  # on the CPU rms_norm runs as six kernels


@pytest.mark.slow
def test_bundled_model_decode_step(smol_dir):
    from triforce_offload.runtime.model.loader import load_model
    model, cfg, _ = load_model(smol_dir)
    ops = opcount.decode_step_ops(model, cfg)
    assert ops["eager"] <= LIMIT and ops["fixed"] <= LIMIT and ops["fixed_syncs"] == 0, ops


def test_fixed_verification_shares_its_slots_across_layers(monkeypatch):
    """A fixed-shape verification (T=5) over the full and the retrieval cache: the new
    tokens' slots and the length are computed once per forward (the cache's begin_forward)
    and the attention mask by the first layer only, not in every layer."""
    from triforce_offload.runtime.cache.retrieval import RetrievalCache
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    L = tiny(layers=3)
    for cache in (prefilled(L, 20, static=True, capacity=64), RetrievalCache(L.cfg, 16, 4, 24)):
        step = Step(L.model, cache)
        c = opcount.count(L.model, lambda: step(torch.randint(0, 64, (1, 5)), 20))
        layers = [[o.name for o in c.ops if o.layer == i] for i in range(3)]
        assert "arange" in layers[0]  # the mask, made once
        assert layers[1] == layers[2] and "arange" not in layers[1] and len(layers[1]) <= LIMIT
        assert layers[1].count("add") == 2  # the two residual adds: no position arithmetic
