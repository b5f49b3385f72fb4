"""`--compile`: torch.compile of the fixed-shape step (runtime/graphs.py), checked on the CPU.

On CUDA the compiled forward is what the step captures as a graph; here it runs on CPU
tensors through inductor's C++ backend with `TRIFORCE_OFFLOAD_STATIC=1` (the same
fixed-shape forward, uncaptured). What must hold wherever it runs: the forward traces as
one graph (no graph break: a break would split the captured step and put Python between
its pieces), the attention kernels stay opaque custom ops with correct fakes, the KV
buffers are written in place (no copy of a layer's buffer per step), outputs equal the
eager forward's, and greedy decoding through every mode stays identical to autoregressive.
"""
import os
import re
import subprocess
import sys

import pytest
import torch
import torch._dynamo
from torch._inductor.utils import run_and_get_code

from helpers_spec import prefilled, repetitive_prompt, run, tiny
from triforce_offload.kernels import attention as A
from triforce_offload.runtime.graphs import Step, combined, no_recompile, settle
from triforce_offload.runtime.cache.retrieval import Recorder, RetrievalCache


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _retrieval(L, full, n):
    ret = RetrievalCache(L.cfg, 32, 8, 64)
    q = {i: torch.randn(1, L.cfg.n_heads, L.cfg.head_dim) for i in range(L.cfg.n_layers)}
    ret.build(full, q, n)
    return ret


@pytest.mark.parametrize("level", ["full", "retrieval"])
@pytest.mark.parametrize("T,last_only", [(1, True), (5, False)])
def test_fixed_step_traces_as_one_graph(level, T, last_only):
    L = tiny()
    cache = prefilled(L, 40)
    if level == "retrieval":
        cache = _retrieval(L, cache, 40)
    ids = torch.zeros(1, T, dtype=torch.long)
    with torch.inference_mode():
        ex = torch._dynamo.explain(lambda i, s: L.model(i, s, cache, last_only))(ids, torch.tensor([40]))
    assert ex.graph_break_count == 0, [str(b.reason) for b in ex.break_reasons]
    assert ex.graph_count == 1


def test_compile_applies_only_to_fixed_shape_steps(monkeypatch):
    """On the CPU without TRIFORCE_OFFLOAD_STATIC the step is dynamic: --compile is not
    applied and says so once; with it, the step's forward is the compiled module."""
    L = tiny()
    monkeypatch.delenv("TRIFORCE_OFFLOAD_STATIC", raising=False)
    dynamic = Step(L.model, prefilled(L, 8, static=False), graphs=True, compile=True)
    assert not dynamic.compiled and dynamic.forward is L.model and "compiled" not in combined([dynamic])
    assert any("--compile not applied on cpu" in n for n in combined([dynamic, dynamic])["notes"])
    assert len(combined([dynamic, dynamic])["notes"]) == 1
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    fixed = Step(L.model, prefilled(L, 8), graphs=True, compile=True)
    assert fixed.compiled and fixed.forward is not L.model and combined([fixed])["compiled"] is True
    assert not fixed.notes
    plain = Step(L.model, prefilled(L, 8), graphs=True, compile=False)
    assert plain.forward is L.model


def _allocations(code: str) -> list[int]:
    """Element counts of the buffers inductor's generated code allocates."""
    sizes = re.findall(r"empty_strided_\w+\(\(([\d, ]*)\)", code)
    return [torch.Size(int(x) for x in s.split(",") if x.strip()).numel() for s in sizes]


@pytest.mark.slow
def test_compiled_step_equals_eager_and_writes_kv_in_place(monkeypatch):
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    L = tiny(heads=4, kv=2, dim=32)
    cap = 4096
    eager, fixed = prefilled(L, 40, static=False, capacity=cap), prefilled(L, 40, capacity=cap)
    step = Step(L.model, fixed, graphs=False, compile=True)
    g, pos = torch.Generator().manual_seed(2), 40
    with torch.inference_mode():
        for i, T in enumerate((1, 1, 4, 1, 4)):  # decode steps and verifications
            ids = torch.randint(0, L.cfg.vocab_size, (1, T), generator=g)
            ref = L.model(ids, pos, eager)
            if i == 0:  # the first call compiles: read what inductor generated
                out, code = run_and_get_code(step, ids, pos)
                kv_numel = fixed.k[0].numel()
                assert max(_allocations("\n".join(code))) < kv_numel  # no copy of a KV buffer
            else:
                out = step(ids, pos)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            pos += T
            eager.commit(pos)
            fixed.commit(pos)
    for layer in range(L.cfg.n_layers):  # the compiled forward wrote the cache itself
        torch.testing.assert_close(fixed.k[layer][:, :, :pos], eager.k[layer][:, :, :pos])
        torch.testing.assert_close(fixed.v[layer][:, :, :pos], eager.v[layer][:, :, :pos])


@pytest.mark.slow
@pytest.mark.parametrize("mode,extra", [
    ("autoregressive", {}),
    ("triforce", {"budget": 64, "gamma2": "auto"}),
])
def test_compiled_greedy_equals_autoregressive(monkeypatch, mode, extra):
    L = tiny(scale=3.0, seed=1)
    prompt = repetitive_prompt(300, L.cfg.vocab_size, seed=3)
    monkeypatch.delenv("TRIFORCE_OFFLOAD_STATIC", raising=False)
    ref, _ = run(L, prompt, "autoregressive", 24)
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    out, st = run(L, prompt, mode, 24, compile=True, **extra)
    assert out == ref
    assert st.extra.get("compiled") is True


_TRITON_OP = r"""
import torch, torch._dynamo
from helpers_spec import tiny
from triforce_offload.kernels import attention as A
from triforce_offload.runtime.cache.kv import FullCache
assert A.static_path(torch.device("cpu"))[0] == "triton"
g = torch.Generator().manual_seed(0)
for T in (1, 3):
    q = torch.randn(1, 4, T, 16, generator=g)
    k, v = torch.randn(1, 2, 64, 16, generator=g), torch.randn(1, 2, 64, 16, generator=g)
    res = torch.library.opcheck(A.triton_decode, (q, k, v, torch.tensor([20])))
    assert all(r == "SUCCESS" for r in res.values()), res
L = tiny()
cache = FullCache(L.cfg, 128, static=True)
with torch.inference_mode():
    ex = torch._dynamo.explain(lambda i, s: L.model(i, s, cache, True))(
        torch.zeros(1, 1, dtype=torch.long), torch.tensor([3]))
assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
ops = {str(n.target) for gm in ex.graphs for n in gm.graph.nodes}
assert "triforce_offload.triton_decode.default" in ops, ops
print("ok")
"""


def test_triton_attention_is_an_opaque_custom_op():
    """The Triton path (interpreted on CPU tensors) inside a traced step: a custom op whose
    fake matches the kernel (opcheck), and no graph break around it."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", TRIFORCE_OFFLOAD_ATTENTION="triton",
               PYTHONPATH=os.path.dirname(__file__))
    r = subprocess.run([sys.executable, "-c", _TRITON_OP], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.cuda
def test_flash_attn_custom_op_matches_its_fake():
    pytest.importorskip("flash_attn")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 3, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    lens = torch.tensor([100], dtype=torch.int32, device="cuda")
    res = torch.library.opcheck(A.flash_decode, (q, k, v, lens))
    assert all(r == "SUCCESS" for r in res.values()), res


def test_compile_without_triton_on_cuda_is_named(monkeypatch):
    """Inductor needs triton on CUDA: without it --compile says why (info, the stats line)
    rather than failing at the first capture."""
    from triforce_offload.runtime import graphs
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    assert "needs triton" in graphs.compile_gap("cuda")
    assert graphs.compile_status("cuda").startswith("unavailable: inductor needs triton")
    assert graphs.compile_gap("cpu") is None


@pytest.mark.slow
def test_warm_up_settles_what_the_capture_would_recompile(monkeypatch):
    """The verifier's Recorder makes its query buffers in the first forward, which changes
    what the next one guards on: one warm-up run would leave a recompile for the capture
    (a failed capture on CUDA: dynamo reads the RNG state, illegal while capturing).
    `settle` runs until nothing new compiles; the capture's `no_recompile` then holds."""
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    L = tiny()
    start, ids = torch.tensor([40]), torch.zeros(1, 1, dtype=torch.long)
    for warm_ups in ("once", "settle"):
        torch._dynamo.reset()
        rec = Recorder(prefilled(L, 40))
        step = Step(L.model, rec, graphs=False, compile=True)
        run = lambda: step.forward(ids, start, rec, True)  # noqa: E731
        with torch.inference_mode():
            run() if warm_ups == "once" else settle(run, compiled=True)
            if warm_ups == "once":
                with pytest.raises(Exception, match="[Rr]ecompil"), no_recompile(True):
                    run()
            else:
                with no_recompile(True):
                    run()


@pytest.mark.slow
def test_new_capacities_and_widths_reuse_the_compiled_step(monkeypatch):
    """A server sees a new prompt length (cache capacity) per request: after the second,
    the compiled step is symbolic in the capacity and nothing recompiles for a width it
    compiled (the mask is not keyed on the capacity: hashing it would specialize). Each
    verification width compiles once (the step specializes on it)."""
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    L = tiny()
    f = Step(L.model, prefilled(L, 8), graphs=False, compile=True).forward

    def step(cap, T):
        cache = prefilled(L, 40, capacity=cap)
        return f(torch.zeros(1, T, dtype=torch.long), torch.tensor([40]), cache, T == 1)

    with torch.inference_mode():
        for cap, T in ((256, 1), (300, 1), (256, 3), (256, 5)):
            step(cap, T)
        with no_recompile(True):
            for cap, T in ((1000, 1), (777, 1), (999, 3), (4096, 5)):
                step(cap, T)


def test_compile_note_names_why_on_a_card():
    """On CUDA, --compile not applying says the actual reason (the reason alone: a Step
    without its constructor, as nothing can run on a card here)."""
    step = Step.__new__(Step)
    step.device = torch.device("cuda")
    assert "offloaded" in step._where(static=False, tp=False)
    assert "tensor parallelism" in step._where(static=True, tp=True)
    assert "--no-graphs" in step._where(static=True, tp=False)
    step.device = torch.device("cpu")
    assert step._where(static=True, tp=False) == "on cpu"
