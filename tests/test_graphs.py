"""The fixed-shape (CUDA graph) step, checked on the CPU.

A step over a static cache takes its start position as a device tensor. These tests run
that path on CPU tensors (the length-masked SDPA reference of `static_attention`) and
check what graph capture and replay rely on: the same result as the eager forward, the
same aten ops with the same shapes, strides and dtypes at every position, and no host
synchronisation (`aten::_local_scalar_dense`, what `.item()`/`int()` dispatch) inside a
forward. GPU-only checks (replay against eager, each kernel) are marked `cuda`.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers_spec import prefilled, tiny
from triforce_offload.kernels import attention as A
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.graphs import Step


class OpLog(TorchDispatchMode):
    """Records (op, shapes, strides, dtypes) of every aten op dispatched."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        sig = tuple((tuple(a.shape), a.stride(), a.dtype) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((str(func), sig))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch,heads,kv", [("llama", 4, 2), ("qwen2", 6, 2), ("llama", 3, 3)])
def test_static_step_equals_eager(arch, heads, kv):
    L = tiny(arch=arch, heads=heads, kv=kv, dim=48 if heads in (3, 6) else 32)
    eager, static = prefilled(L, 40, False), prefilled(L, 40, True)
    g = torch.Generator().manual_seed(2)
    pos = 40
    with torch.inference_mode():
        for T in (1, 1, 4, 1, 7):  # decode steps and verifications of several widths
            ids = torch.randint(0, L.cfg.vocab_size, (1, T), generator=g)
            ref = L.model(ids, pos, eager)
            out = L.model(ids, torch.tensor([pos]), static)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            pos += T
            eager.commit(pos)
            static.commit(pos)


def _ops_of_step(L, cache, ids, pos):
    with torch.inference_mode(), OpLog() as log:
        L.model(ids, torch.tensor([pos]), cache)
    return log.ops


@pytest.mark.parametrize("T", [1, 5])
def test_consecutive_steps_dispatch_identical_ops(T):
    """Two decode steps (T=1), two verifications of the same gamma (T=5) at different
    positions: identical op sequences, shapes, strides and dtypes (what graph replay needs;
    the eager path fails this: its key count grows)."""
    L = tiny()
    cache = prefilled(L, 30, True)
    g = torch.Generator().manual_seed(3)
    a = _ops_of_step(L, cache, torch.randint(0, 64, (1, T), generator=g), 30)
    b = _ops_of_step(L, cache, torch.randint(0, 64, (1, T), generator=g), 30 + T + 3)
    assert len(a) > 20 and a == b
    eager = prefilled(L, 30, False)
    with torch.inference_mode(), OpLog() as l1:
        L.model(torch.zeros(1, T, dtype=torch.long), 30, eager)
    with torch.inference_mode(), OpLog() as l2:
        L.model(torch.zeros(1, T, dtype=torch.long), 31, eager)
    assert l1.ops != l2.ops  # the check can fail: the dynamic path's shapes change


def test_no_host_sync_inside_a_forward():
    """No aten::_local_scalar_dense in a forward over the static or the eager full cache."""
    L = tiny()
    for static, start in ((True, torch.tensor([30])), (False, 30)):
        cache = prefilled(L, 30, static)
        with torch.inference_mode(), OpLog() as log:
            L.model(torch.zeros(1, 3, dtype=torch.long), start, cache)
        names = [op for op, _ in log.ops]
        assert names and not any("_local_scalar_dense" in n for n in names), static
    with OpLog() as log:  # and the check sees one when there is one
        torch.ones(2).sum().item()
    assert any("_local_scalar_dense" in op for op, _ in log.ops)


def test_step_is_eager_on_the_cpu_and_checks_capacity():
    L = tiny()
    cache = prefilled(L, 30, True)
    step = Step(L.model, cache, graphs=True)
    assert not step.graphed  # graphs are a CUDA feature: the CPU runs the plain forward
    with torch.inference_mode():
        out = step(torch.zeros(1, 1, dtype=torch.long), 30)
    assert out.shape == (1, 1, 64)


def test_graph_figures_combine_levels_and_reach_the_stats_line():
    """Captures (one per token count a level uses; γ2 auto adds one per length it tries)
    and their seconds are counted over the levels; a failed capture is a note, not a graph."""
    from types import SimpleNamespace
    from triforce_offload.cli.show import stats_line
    from triforce_offload.runtime.graphs import combined
    target = SimpleNamespace(replays=9, graphs={((1, 1), False): object(), ((1, 7), False): object()},
                             captures=2, capture_s=0.25, notes=[], compiled=False)
    middle = SimpleNamespace(replays=0, graphs={((1, 1), False): None}, captures=0, capture_s=0.5, compiled=False,
                             notes=["CUDA graph capture failed for 1 tokens (X); running eager"])
    d = combined([target, middle])
    assert d == {"graphs": True, "graph_captures": 2, "capture_s": 0.75, "notes": middle.notes}
    assert combined([middle]) == {"graphs": False, "notes": middle.notes}
    line = stats_line({"prompt_tokens": 5, "prefill_s": 0.1, "decode_ms_per_token": 2.0,
                       "tokens_per_s": 500.0, "new_tokens": 8, "peak_memory_gb": 1.0, **d})
    assert "2 CUDA graphs (0.75 s to capture)" in line and "running eager" in line
    cpu = Step(tiny().model, prefilled(tiny(), 4, True))
    assert cpu.figures() == {"graphs": False}  # the CPU never captures


def test_static_path_choice_is_reported(monkeypatch):
    assert A.static_path("cpu")[0] == "sdpa"
    monkeypatch.setenv("TRIFORCE_OFFLOAD_ATTENTION", "triton")
    assert A.static_path("cpu") == ("triton", "forced by TRIFORCE_OFFLOAD_ATTENTION")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_equals_eager(dtype):
    L = tiny()
    L.model.to("cuda", dtype)
    eager = FullCache(L.cfg, 256, dtype=dtype, device="cuda", static=False)
    static = FullCache(L.cfg, 256, dtype=dtype, device="cuda")
    ids = torch.randint(0, 64, (1, 40), device="cuda")
    with torch.inference_mode():
        L.model(ids, 0, eager)
        L.model(ids, 0, static)
        step = Step(L.model, static)
        assert step.graphed
        pos = 40
        for T in (1, 1, 1, 5, 5, 1):
            x = torch.randint(0, 64, (1, T), device="cuda")
            ref = L.model(x, pos, eager)
            out = step(x, pos)
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
            pos += T
    assert not step.notes and step.replays == 6 and len(step.graphs) == 2
    f = step.figures()
    assert f["graphs"] and f["graph_captures"] == 2 and f["capture_s"] > 0


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("path", ["sdpa", "triton", "flash-attn"])
def test_cuda_static_attention_paths_match_reference(monkeypatch, path):
    if path == "flash-attn" and A._flash_attn_reason():
        pytest.skip(A._flash_attn_reason())
    monkeypatch.setenv("TRIFORCE_OFFLOAD_ATTENTION", path)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 5, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 512, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, 2, 512, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    length = torch.tensor([300], device="cuda")
    ref = A.attention(q, k[:, :, :300], v[:, :, :300], 295)
    torch.testing.assert_close(A.static_attention(q, k, v, length).float(), ref.float(), rtol=3e-2, atol=3e-2)


def test_retrieval_static_step_equals_eager_across_a_rebuild():
    """The middle level's cache on the fixed-shape path: same logits as its eager path,
    also after a rebuild moves its slots (the device-side offset a graph reads)."""
    from triforce_offload.runtime.cache.retrieval import Recorder, RetrievalCache
    L = tiny()
    full = Recorder(prefilled(L, 120, False))
    with torch.inference_mode():
        L.model(torch.zeros(1, 1, dtype=torch.long), 120, full)  # queries for scoring
    full.commit(120)
    caches = [RetrievalCache(L.cfg, 32, 8, 40) for _ in range(2)]
    g = torch.Generator().manual_seed(4)
    n = 120
    for _ in range(2):  # build, then rebuild later in the sequence
        for c in caches:
            c.build(full, full.q, n)
        pos = n
        with torch.inference_mode():
            for T in (1, 6, 1):
                ids = torch.randint(0, 64, (1, T), generator=g)
                ref = L.model(ids, pos, caches[0])
                out = L.model(ids, torch.tensor([pos]), caches[1])
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
                L.model(ids, pos, full)  # the full cache grows along
                pos += T
                for c in caches + [full]:
                    c.commit(pos)
        n = pos
    assert caches[1].offset.item() == caches[1].n_retrieved - caches[1].base
    with pytest.raises(Exception, match="past its last slot"):
        caches[1].check_end(caches[1].base + caches[1].slots)


def test_retrieval_steps_dispatch_identical_ops():
    from triforce_offload.runtime.cache.retrieval import RetrievalCache
    L = tiny()
    full = prefilled(L, 100, False)
    ret = RetrievalCache(L.cfg, 32, 8, 40)
    ret.build(full, {i: torch.randn(1, 4, 8) for i in range(2)}, 100)
    ops = []
    for pos in (100, 107):
        with torch.inference_mode(), OpLog() as log:
            L.model(torch.zeros(1, 7, dtype=torch.long), torch.tensor([pos]), ret)
        ops.append(log.ops)
    assert len(ops[0]) > 20 and ops[0] == ops[1]
    assert not any("_local_scalar_dense" in op for op, _ in ops[0])


@pytest.mark.parametrize("mode,extra", [
    ("triforce", {"budget": 64}),
    ("triforce", {"budget": 48, "rebuild": "every:7", "gamma2": "auto"}),
    ("retrieval", {"budget": 64}),
    ("draft", {}),
])
def test_greedy_on_the_fixed_shape_path_equals_autoregressive(monkeypatch, mode, extra):
    """Every level's forward through the graph path's code (device-tensor start, whole
    buffers, length masks), without graphs: the target's greedy tokens, token for token."""
    from helpers_spec import repetitive_prompt, run
    L = tiny(scale=3.0, seed=1)
    prompt = repetitive_prompt(300, L.cfg.vocab_size, seed=3)
    ref, _ = run(L, prompt, "autoregressive", 40)
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    calls = []
    real = FullCache._attend_static
    monkeypatch.setattr(FullCache, "_attend_static", lambda *a: calls.append(1) or real(*a))
    out, st = run(L, prompt, mode, 40, **extra)
    assert out == ref and calls  # the fixed-shape path ran
    static_ref, _ = run(L, prompt, "autoregressive", 40)
    assert static_ref == ref


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("mode,extra", [
    ("autoregressive", {}), ("triforce", {"budget": 64}), ("retrieval", {"budget": 64}),
    ("draft", {}), ("triforce", {"budget": 64, "draft": "self", "draft_window": 16}),
])
def test_cuda_greedy_every_mode_fp32(mode, extra):
    """On the GPU, graphed, fp32: every mode gives the autoregressive (eager) tokens."""
    from helpers_spec import repetitive_prompt, run
    from triforce_offload.runtime.api import Loaded, RunOptions, generate
    from triforce_offload.runtime.sampling import SamplingParams
    L = tiny(scale=3.0, seed=1)
    L = Loaded(L.model.to("cuda"), L.cfg, L.tokenizer, torch.device("cuda"), torch.float32)
    prompt = repetitive_prompt(300, L.cfg.vocab_size, seed=3)
    eager = RunOptions.of(mode="autoregressive", max_new_tokens=40, graphs=False, sampling=SamplingParams())
    ref, _ = generate(L, prompt, eager)
    out, st = generate(L, prompt, RunOptions.of(mode=mode, max_new_tokens=40, **dict(extra),
                                             sampling=SamplingParams()))
    assert out == ref and st.extra["graphs"] and st.extra["graph_captures"] >= 1


@pytest.mark.parametrize("T,S,G", [(1, 40, 2), (7, 7, 3), (16, 300, 4), (5, 129, 1)])
def test_prefix_and_causal_equals_masked_attention(T, S, G):
    """CUDA's mask-free path for a chunk's queries (prefix in one fused kernel, own tokens
    causal in another), run here on the CPU kernels: the masked reference's output."""
    g = torch.Generator().manual_seed(T * S)
    q = torch.randn(1, 2 * G, T, 32, generator=g)
    k, v = torch.randn(1, 2, S, 32, generator=g), torch.randn(1, 2, S, 32, generator=g)
    ref, _ = A.attention_lse(q, k, v, S - T)
    torch.testing.assert_close(A._prefix_and_causal(q, k, v, None, "cpu"), ref, rtol=1e-5, atol=1e-5)


def test_flash_attn_only_for_what_it_takes():
    q = torch.zeros(1, 4, 1, 64)
    assert not A.flash_attn_fits(q)  # fp32: flash-attn refuses it
    assert A.flash_attn_fits(q.bfloat16()) and A.flash_attn_fits(q.half())
    assert not A.flash_attn_fits(torch.zeros(1, 4, 1, 12, dtype=torch.bfloat16))  # head_dim % 8
    assert not A.flash_attn_fits(torch.zeros(1, 4, 1, 512, dtype=torch.bfloat16))  # > 256


def test_recorder_queries_follow_graph_replays():
    """After an eager forward re-points the recorded queries, a replay (which runs no
    Python) makes the graph-updated buffers the latest again (Step calls on_replay)."""
    from triforce_offload.runtime.cache.retrieval import Recorder
    L = tiny()
    rec = Recorder(prefilled(L, 30, True))
    with torch.inference_mode():
        L.model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([30]), rec)  # "capture"
        bufs = {l: t for l, t in rec.q.items()}
        L.model(torch.zeros(1, 1, dtype=torch.long), 30, rec)  # eager
    assert all(rec.q[l] is not bufs[l] for l in bufs)
    rec.on_replay()
    assert all(rec.q[l] is bufs[l] for l in bufs)


def test_failed_capture_falls_back_to_the_dynamic_eager_forward(monkeypatch):
    """A capture that fails runs that shape on the cache's int-start (dynamic) forward, not
    the fixed-shape one that may be what broke it; the output equals the eager reference
    and the stats line says so once."""
    L = tiny()
    eager, static = prefilled(L, 40, False), prefilled(L, 40, True)
    step = Step(L.model, static, graphs=True)
    step.graphed = step.static = True  # as on CUDA: capture the first time a shape runs

    def broken(*a):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(step, "_capture_on", broken)
    starts, forward = [], L.model.forward
    monkeypatch.setattr(L.model, "forward", lambda ids, start, *a, **k: (starts.append(start), forward(ids, start, *a, **k))[1])
    g, pos = torch.Generator().manual_seed(4), 40
    with torch.inference_mode():
        for T in (1, 1, 3, 1):
            ids = torch.randint(0, L.cfg.vocab_size, (1, T), generator=g)
            torch.testing.assert_close(step(ids, pos), L.model(ids, pos, eager), rtol=1e-5, atol=1e-5)
            pos += T
            eager.commit(pos)
            static.commit(pos)
    assert all(type(s) is int for s in starts), starts  # never the device-tensor start
    assert step.eager == 4 and step.replays == 0
    notes = step.figures()["notes"]
    assert len(notes) == 2 and all("int start" in n for n in notes)  # once per shape (1 and 3)
