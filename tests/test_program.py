"""A CPU step's layers in one native call (runtime/model/program.py): the logits, the KV
written and the queries recorded are the layer loop's bit for bit, for full, recording and
retrieval caches, bf16 and float32 KV, decode, verification and short prefill steps; it
runs where it applies and steps aside (the layer loop runs) where it does not."""
from __future__ import annotations

import pytest
import torch

from triforce_offload.kernels import native
from triforce_offload.kernels.qlinear import load as native_linear
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.cache.retrieval import Recorder, RetrievalCache
from triforce_offload.runtime.model import program as P

from helpers_spec import tiny
from test_batch import quantized

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(native_linear() is None or not native.available(),
                                 reason="needs the native kernels (a C compiler)")]


@pytest.fixture
def ran(monkeypatch):
    """The steps the program took ([T, ...]) and a switch that turns it off (`ran.off`)."""
    class Took(list):
        def off(self, on: bool = True):
            state["off"] = on

    took, real = Took(), P.Program.run
    state = {"off": False}

    def run(self, x, cos, sin, start, cache):
        if state["off"]:
            return False
        done = real(self, x, cos, sin, start, cache)
        if done:
            took.append(x.shape[1])
        return done

    monkeypatch.setattr(P.Program, "run", run)
    monkeypatch.setenv("TRIFORCE_OFFLOAD_NATIVE", "1")
    return took


def made(L, kind: str, n: int, kv_dtype):
    """A cache of `kind` (full, rec: a full cache recording queries, retrieval) after an
    n-token prefill through the layer loop."""
    c = FullCache(L.cfg, 512, dtype=kv_dtype)
    c = Recorder(c) if kind != "full" else c
    with torch.inference_mode():
        L.model(torch.randint(0, L.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)), 0, c)
    c.commit(n)
    if kind != "retrieval":
        return c
    r = RetrievalCache(L.cfg, 32, 8, 16, dtype=kv_dtype)
    r.build(c, c.q, n)
    return r


def direct(c):
    return c.inner if isinstance(c, Recorder) else c


MODELS = {  # int8 activations (the program's): head sizes 16 and 32, GQA groups 2 and 3
    "int4 D16": lambda: quantized(tiny(scale=3.0, seed=1, dim=64)),
    "int8 D32 G3": lambda: quantized(tiny(scale=3.0, seed=4, dim=192, heads=6, kv=2, layers=3), "int8"),
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_the_program_is_the_layer_loop_bit_for_bit(model, kv_dtype, ran):
    L = MODELS[model]()
    for kind, n in (("full", 40), ("rec", 75), ("retrieval", 150)):
        for T in (1, 3, 7, 16 if kind == "retrieval" else 64):  # the retrieval cache's room: 16
            ids = torch.randint(0, L.cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
            ran.off()
            loop = made(L, kind, n, kv_dtype)
            with torch.inference_mode():
                want = L.model(ids, n, loop)
            ran.off(False)
            prog = made(L, kind, n, kv_dtype)  # a prefill of 64 tokens or fewer through it too
            ran.clear()
            with torch.inference_mode():
                got = L.model(ids, n, prog)
            assert ran == [T], (kind, T)
            assert torch.equal(want, got), (kind, T)
            a, b = direct(loop), direct(prog)
            for layer in range(L.cfg.n_layers):
                for x, y in zip(a.own(layer), b.own(layer)):  # the slots written so far
                    end = n + T - a.first_position
                    assert torch.equal(x[:, :, :end], y[:, :, :end]), (kind, T, layer)
            if isinstance(loop, Recorder):
                assert loop.q.keys() == prog.q.keys() and all(torch.equal(loop.q[i], prog.q[i]) for i in loop.q)


def test_greedy_generation_is_the_same_with_and_without_it(ran):
    from helpers_spec import run
    L = MODELS["int4 D16"]()
    L.kv_dtype = torch.bfloat16
    prompt = torch.randint(0, 64, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    for mode in ("autoregressive", "retrieval"):
        ran.off()
        want, ws = run(L, prompt, mode, n=24, gamma2="3", budget=32, retrieval_chunk=8, bypass=False)
        ran.off(False)
        ran.clear()
        got, gs = run(L, prompt, mode, n=24, gamma2="3", budget=32, retrieval_chunk=8, bypass=False)
        assert ran, mode
        assert got == want, mode
        assert gs.extra.get("drafts") == ws.extra.get("drafts"), mode  # the retrieval level's drafts too


def test_it_steps_aside_where_it_does_not_apply(ran, monkeypatch):
    L = MODELS["int4 D16"]()
    cache = made(L, "full", 40, torch.bfloat16)
    ids = torch.randint(0, 64, (1, 1))
    with torch.inference_mode():
        ran.clear()
        L.model(torch.randint(0, 64, (1, 65)), 40, cache)  # a prefill chunk past ONE_CALL_TOKENS
        assert ran == []
        h = L.model.model.layers[0].mlp.register_forward_hook(lambda *a: None)  # a hook sees its module's call
        L.model(ids, 105, cache)
        assert ran == []
        h.remove()
        L.model(ids, 106, cache)
        assert ran == [1]
    # models whose layers it does not describe: no program
    from triforce_offload.runtime.model.transformer import _HOOKS
    assert P.Program.build(tiny(scale=3.0, seed=1, dim=64).model, True, _HOOKS) is None  # float32 activations
    assert P.Program.build(L.model, False, _HOOKS) is None  # the attention's one call not exact here
    monkeypatch.setenv("TRIFORCE_OFFLOAD_PROGRAM", "0")
    assert P.Program.build(L.model, True, _HOOKS) is None
    monkeypatch.delenv("TRIFORCE_OFFLOAD_PROGRAM")
    assert P.Program.build(L.model, True, _HOOKS) is not None


def test_it_follows_the_projections_and_the_cache_buffers(ran):
    """A projection whose native calls were dropped (an `act` change), or a cache whose
    buffers are other tensors now, is not run from the stale pointers."""
    L = MODELS["int4 D16"]()
    cache = made(L, "full", 40, torch.bfloat16)
    prog = L.model._program()
    with torch.inference_mode():
        L.model(torch.randint(0, 64, (1, 1)), 40, cache)
        assert prog.current()
        lin = L.model.model.layers[1].mlp.down_proj
        lin.act = lin.act  # drops its native calls
        assert not prog.current()
        ran.clear()
        L.model(torch.randint(0, 64, (1, 1)), 41, cache)
        assert ran == [1] and L.model._program() is not prog  # built again from the new calls
        prog = L.model._program()
        before = prog.buffers(cache, 50)[0].clone()
        k, v = cache.own(0)
        cache.k[0], cache.v[0] = k.clone(), v.clone()
        assert not torch.equal(L.model._program().buffers(cache, 50)[0], before)
        L.model(torch.randint(0, 64, (1, 1)), 42, cache)
        assert ran == [1, 1]


def test_the_bundled_model_at_its_gguf_precision(ran):
    """SmolLM2's GGUF (int4 and int8 parts, head size 64, 3 query heads per KV head), int8
    activations and a bf16 KV: the program's steps are the layer loop's bit for bit."""
    from triforce_offload.runtime import api
    from triforce_offload.runtime.options import ModelOptions
    L = api.load(ModelOptions())
    if L.model._program() is None:
        pytest.skip("the bundled model's projections do not take the int8 kernel here")
    prompt = torch.randint(0, 4000, (1, 300), generator=torch.Generator().manual_seed(0))
    for T in (1, 7):
        ids = torch.randint(0, 4000, (1, T), generator=torch.Generator().manual_seed(T))
        outs = []
        for off in (True, False):
            ran.off(off)
            c = Recorder(FullCache(L.cfg, 512, dtype=L.kv_dtype))
            with torch.inference_mode():
                L.model(prompt, 0, c)
                c.commit(300)
                ran.clear()
                outs.append((L.model(ids, 300, c), c))
            assert ran == ([] if off else [T])
        (want, a), (got, b) = outs
        assert torch.equal(want, got)
        for layer in range(L.cfg.n_layers):
            for x, y in zip(a.inner.own(layer), b.inner.own(layer)):
                assert torch.equal(x[:, :, :300 + T], y[:, :, :300 + T])
            assert torch.equal(a.q[layer], b.q[layer])


def test_copies_swapped_modules_and_other_kv_dtypes(ran, monkeypatch):
    """A deep copy builds its own program (none copied: it would run the original's
    modules); a module swapped for another is seen (built again); a float16 KV, which the
    kernels do not take, keeps the layer loop, solo and in a batch."""
    import copy
    from triforce_offload.runtime.batch.rows import Rows, forward
    L = MODELS["int4 D16"]()
    ids = torch.randint(0, 64, (1, 3), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = L.model(ids, 40, made(L, "full", 40, torch.bfloat16))
        twin = copy.deepcopy(L.model)
        assert "_prog" not in twin.__dict__ and "_prog" in L.model.__dict__
        ran.clear()
        assert torch.equal(twin(ids, 40, made(L, "full", 40, torch.bfloat16)), want) and ran[-1:] == [3]
        prog = L.model._program()
        attn = L.model.model.layers[1].self_attn
        attn.o_proj = copy.deepcopy(attn.o_proj)  # the same numbers in another module
        assert not prog.current()
        ran.clear()
        assert torch.equal(L.model(ids, 40, made(L, "full", 40, torch.bfloat16)), want)
        assert ran[-1:] == [3] and L.model._program() is not prog
        ran.clear()
        half = made(L, "full", 40, torch.float16)
        assert ran == []  # the prefill too
        alone = L.model(ids, 40, made(L, "full", 40, torch.float16))
        rows, real = [], P.Program.run_rows
        monkeypatch.setattr(P.Program, "run_rows", lambda self, *a: rows.append(real(self, *a)) or rows[-1])
        got = forward(L.model, [Rows(ids, 40, half), Rows(ids[:, :1], 40, made(L, "full", 40, torch.float16))])
        assert ran == [] and rows == [False] and torch.equal(got[0], alone)
        got = forward(L.model, [Rows(ids, 40, made(L, "full", 40, torch.bfloat16)),
                                Rows(ids[:, :1], 40, made(L, "full", 40, torch.bfloat16))])
        assert rows == [False, True] and torch.equal(got[0], want)
