"""The batched engine: each sequence of a batch equals its solo run token for token, in
every mode, at fp32 and at quantized precision (int8 activations, bf16 KV), with mixed
prompt lengths, sequences ending at different times and joining between rounds; the
rows of a shared forward equal their solo forwards bit for bit; and the forwards really
are shared (weights read once per round for the whole batch)."""
from __future__ import annotations

import copy

import pytest
import torch

from triforce_offload.kernels.linear import EXACT_ROWS, exact_rows, linear
from triforce_offload.kernels.qlinear import load as native_linear, rows_exact
from triforce_offload.runtime.api import Loaded, RunOptions, generate
from triforce_offload.runtime.batch.rows import Rows, forward
from triforce_offload.runtime.batch.runner import Batch, generate_batch
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.model.config import ModelConfig
from triforce_offload.runtime.errors import TriforceError
from triforce_offload.runtime.model.transformer import Transformer
from triforce_offload.runtime.model.quantized import quantize_model, set_activations, weights_name
from triforce_offload.runtime.sampling import SamplingParams

from helpers_spec import repetitive_prompt, tiny

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(native_linear() is None, reason="needs the native linear kernel (a C compiler)")]


def quantized(L: Loaded, weights: str = "int4") -> Loaded:
    """L at int4 weights, int8 activations per row and a bfloat16 KV (the GGUF precision's
    defaults on a CPU with VNNI; without VNNI the int8 kernel is the portable one)."""
    L = copy.copy(L)
    L.model = quantize_model(copy.deepcopy(L.model), weights)
    L.weights = weights_name(L.model)
    L.activations = set_activations(L.model, "int8", "cpu")
    L.kv_dtype = torch.bfloat16
    return L


def windowed(seed: int = 3) -> Loaded:
    """A tiny model with a sliding-window layer (window 12) before a global one."""
    torch.manual_seed(seed)
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=128, n_layers=2,
                      n_heads=4, n_kv_heads=2, max_position_embeddings=4096,
                      layer_types=["sliding_attention", "full_attention"], sliding_window=12)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return Loaded(model, cfg, tiny().tokenizer, torch.device("cpu"), torch.float32)


MODELS = {
    "fp32": lambda: tiny(scale=3.0, seed=1, dim=64),
    "int4:int8": lambda: quantized(tiny(scale=3.0, seed=1, dim=64)),
    "qwen2-int8": lambda: quantized(tiny(scale=3.0, seed=2, heads=6, kv=2, layers=3, dim=96, arch="qwen2"), "int8"),
    "window": windowed,
}

MODES = [
    ("autoregressive", {}),
    ("draft", {}),
    ("retrieval", {"budget": 32}),
    ("triforce", {"budget": 32}),
    ("triforce", {"budget": 32, "bypass": False, "gamma2": "auto"}),
    ("triforce", {"budget": 16, "retrieval_chunk": 4, "draft": "self", "draft_window": 8}),
    # offloaded: streamed attention merges a verification's rows in another order than their
    # decodes (docs/offload.md), so its tokens follow the speculative path taken; a fixed
    # path (no bypass, no draft sizing: both timing-driven) makes the batch equal solo exactly
    ("triforce", {"budget": 32, "offload": "on", "transfer_chunk": 24, "bypass": False}),
    ("autoregressive", {"offload": "on", "transfer_chunk": 24}),
]

LENGTHS, NEW = [40, 97, 150, 61], [20, 33, 12, 25]  # mixed prompts, ending at different times


def prompts(vocab: int) -> list[list[int]]:
    return [repetitive_prompt(n, vocab, seed=i) for i, n in enumerate(LENGTHS)]


def shared(stats) -> float:
    return stats.extra["batch_seqs_per_forward"]


def batch_equals_solo(L: Loaded, mode: str, extra: dict) -> list:
    """The mixed prompts (LENGTHS, each its own NEW tokens) in one batch under `mode`: each
    sequence equal to its solo run and run to its own length; the batch's results."""
    ps = prompts(L.cfg.vocab_size)
    opts = [RunOptions.of(mode=mode, max_new_tokens=n, **extra) for n in NEW]
    solo = [generate(L, p, o)[0] for p, o in zip(ps, opts)]
    got = generate_batch(L, ps, opts)
    assert [t for t, _ in got] == solo
    assert [len(t) for t in solo] == NEW  # every sequence ran to its own length
    return got


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("mode,extra", MODES)
def test_each_sequence_equals_its_solo_run(model, mode, extra):
    got = batch_equals_solo(MODELS[model](), mode, extra)
    if "offload" not in extra:  # an offloaded cache's rows share forwards as well, but not always
        assert shared(got[0][1]) > 1.5, got[0][1].extra  # rows of several sequences in one forward


def sampled(modes: list[str], seeds: list[int], n: int) -> list:
    """One RunOptions per sequence: its mode, nucleus sampling with its seed."""
    return [RunOptions.of(mode=m, max_new_tokens=n, budget=32,
                          sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=s))
            for m, s in zip(modes, seeds)]


def test_sampled_sequences_follow_their_own_seeds():
    L = MODELS["int4:int8"]()
    ps = prompts(L.cfg.vocab_size)
    opts = sampled(["triforce", "autoregressive", "draft", "triforce"], [1, 2, 3, 1], 24)
    solo = [generate(L, p, o)[0] for p, o in zip(ps, opts)]
    assert [t for t, _ in generate_batch(L, ps, opts)] == solo
    assert solo[0] != solo[3]  # the same seed on other prompts: other text (no shared generator)


def test_sequences_join_between_rounds_and_stop_early():
    """A sequence joins after another's 5th token, one stops itself after 7 tokens (a stop
    string or a hang-up), another at an end-of-sequence id: each equals its solo run."""
    L = MODELS["fp32"]()
    ps = prompts(L.cfg.vocab_size)
    opts = RunOptions.of(mode="triforce", max_new_tokens=30, budget=32)
    eos_run = copy.copy(L)
    solo = [generate(L, p, opts)[0] for p in ps]
    eos = solo[2][9]  # sequence 2's 10th token as its end-of-sequence (every run ends at it)
    eos_run.cfg = copy.copy(L.cfg)
    eos_run.cfg.eos_token_ids = [eos]
    want2 = generate(eos_run, ps[2], opts)[0]
    assert want2 == solo[2][:solo[2].index(eos) + 1]

    b = Batch(L)
    joined = []

    def on0(t, seen=[]):
        seen.append(t)
        if len(seen) == 5:
            joined.append(b.add(ps[3], opts))
        return False

    def on1(t, seen=[]):
        seen.append(t)
        return len(seen) == 7  # stop after 7 tokens

    m0 = b.add(ps[0], opts, on0)
    m1 = b.add(ps[1], opts, on1)
    b2 = Batch(eos_run)  # another model config: its own batch (sequences of a batch share a Loaded)
    m2 = b2.add(ps[2], opts)
    b.drain()
    b2.drain()
    assert m0.result()[0] == solo[0]
    assert m1.result()[0] == solo[1][:7]
    assert joined and joined[0].result()[0] == solo[3] and joined[0].joined_round > 0
    assert m2.result()[0] == want2


def test_one_sequence_failing_leaves_the_others_running():
    L = MODELS["fp32"]()
    ps = prompts(L.cfg.vocab_size)
    too_long = list(range(60)) * 80  # 4800 tokens: past the model's 4096
    opts = RunOptions.of(mode="triforce", max_new_tokens=16, budget=32)
    b = Batch(L)
    ms = [b.add(p, opts) for p in (ps[0], too_long, ps[1])]
    b.drain()
    with pytest.raises(TriforceError, match="does not fit"):
        ms[1].result()
    assert ms[0].result()[0] == generate(L, ps[0], opts)[0]
    assert ms[2].result()[0] == generate(L, ps[1], opts)[0]
    with pytest.raises(TriforceError, match="does not fit"):
        generate_batch(L, [ps[0], too_long], opts)


def test_a_batch_that_does_not_fit_is_refused_before_anything_is_allocated(monkeypatch):
    from triforce_offload.runtime.batch import memory
    L = MODELS["fp32"]()
    ps = prompts(L.cfg.vocab_size) * 2  # 8 sequences
    opts = RunOptions.of(mode="triforce", max_new_tokens=32, budget=32)
    one = sum(memory.sequence_bytes(L, p, opts)[0] for p in ps)
    assert one > 0
    started = []
    monkeypatch.setattr(Batch, "add", lambda *a, **k: started.append(a))
    with pytest.raises(TriforceError, match=r"a batch of 8 sequences needs .* GB of KV caches but .* given"):
        generate_batch(L, ps, opts, memory=one - 1)
    assert started == []  # refused before any sequence started (nothing allocated)
    # offloaded sequences price their full KV on the host, not the device budget
    off = RunOptions.of(mode="autoregressive", max_new_tokens=32, offload="on")
    assert memory.sequence_bytes(L, ps[0], off)[0] == 0 < memory.sequence_bytes(L, ps[0], off)[1]


def test_ragged_forward_rows_equal_solo_forwards_bit_for_bit():
    """Decode, verification and prefill-chunk rows of four sequences at different positions,
    in one forward: each sequence's logits and the KV written equal its forward alone."""
    for L in (MODELS["fp32"](), MODELS["int4:int8"](), MODELS["window"]()):
        assert rows_exact(L.model)
        g = torch.Generator().manual_seed(0)
        lens, widths = [30, 75, 12, 50], [1, 7, 1, 20]

        def made():
            cs = []
            for n in lens:
                c = FullCache(L.cfg, 256, dtype=L.kv_dtype, ring_depth=8)
                with torch.inference_mode():
                    L.model(torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n)), 0, c)
                c.commit(n)
                cs.append(c)
            return cs
        ids = [torch.randint(0, 64, (1, w), generator=g) for w in widths]
        alone, together = made(), made()
        with torch.inference_mode():
            want = [L.model(i, n, c, last_only=w == 20) for i, n, c, w in zip(ids, lens, alone, widths)]
        got = forward(L.model, [Rows(i, n, c, w == 20) for i, n, c, w in zip(ids, lens, together, widths)])
        for w, o in zip(want, got):
            assert torch.equal(w, o)
        for a, t, n, w in zip(alone, together, lens, widths):
            for layer in a.full_layers:
                assert torch.equal(a.k[layer][:, :, : n + w], t.k[layer][:, :, : n + w])


def test_a_ragged_forward_takes_each_layer_in_one_call_where_every_step_would(monkeypatch):
    """Decodes and verifications of full caches, a recording full cache (the retrieval level
    scores with its queries) and a retrieval cache in one ragged forward: each layer in one
    native call for all of them (`native.rope_attend_seqs`), each sequence's logits, KV and
    recorded queries the bits of its solo forward. A prefill chunk of more than
    ONE_CALL_TOKENS rows in the forward sends every layer back to the separate steps. With
    int8 activations every layer goes in one call too (model/program.py,
    `triforce_forward_layers_seqs`): the same bits again."""
    from triforce_offload.kernels import native
    from triforce_offload.runtime.batch import rows
    from triforce_offload.runtime.cache.retrieval import Recorder, RetrievalCache
    from triforce_offload.runtime.model.program import Program
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.reason()}")
    monkeypatch.setenv("TRIFORCE_OFFLOAD_NATIVE", "1")
    calls, real = [], native.rope_attend_seqs
    monkeypatch.setattr(rows.native, "rope_attend_seqs", lambda *a, **kw: calls.append(a[3].n) or real(*a, **kw))
    layers, run_rows = [], Program.run_rows
    monkeypatch.setattr(Program, "run_rows", lambda self, *a: (layers.append(run_rows(self, *a)) or layers[-1])
                        if layers != [None] else False)
    for L, whole in ((MODELS["fp32"](), False), (MODELS["int4:int8"](), False), (MODELS["int4:int8"](), True),
                     (quantized(tiny(scale=3.0, seed=1, dim=128)), False)):  # bf16 path: D 32
        layers[:] = [] if whole else [None]  # the layers in one call, or layer by layer
        def made(kind, n):
            c = FullCache(L.cfg, 512, dtype=L.kv_dtype)
            c = Recorder(c) if kind != "full" else c
            with torch.inference_mode():
                L.model(torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n)), 0, c)
            c.commit(n)
            if kind != "retrieval":
                return c
            r = RetrievalCache(L.cfg, 32, 8, 16, dtype=L.kv_dtype)
            r.build(c, c.q, n)
            return r

        for lens, widths, kinds, one in [([30, 75, 12, 150], [1, 7, 1, 3], ["full", "rec", "full", "retrieval"], True),
                                         ([30, 75], [1, 65], ["full", "rec"], False)]:
            if not rows.exact(L.model, sum(widths)):
                continue  # float32 projections of a prefill chunk's rows: a batch runs them alone
            ids = [torch.randint(0, 64, (1, w), generator=torch.Generator().manual_seed(w)) for w in widths]
            alone = [made(k, n) for k, n in zip(kinds, lens)]
            together = [made(k, n) for k, n in zip(kinds, lens)]
            with torch.inference_mode():
                want = [L.model(i, n, c) for i, n, c in zip(ids, lens, alone)]
            calls.clear()
            if whole:
                layers.clear()
            got = forward(L.model, [Rows(i, n, c) for i, n, c in zip(ids, lens, together)])
            if whole:  # the program: one call for the forward where each layer would take one
                assert calls == [] and layers == [one], (lens, widths)
            else:
                assert calls == ([len(lens)] * L.cfg.n_layers if one else []), (lens, widths)
            for w, o in zip(want, got):
                assert torch.equal(w, o)
            for a, t, n, w in zip(alone, together, lens, widths):  # the slots written so far
                a, t = rows.direct_cache(a), rows.direct_cache(t)
                for layer in range(L.cfg.n_layers):
                    for x, y in zip(a.own(layer), t.own(layer)):
                        assert torch.equal(x[:, :, : n + w - a.first_position], y[:, :, : n + w - t.first_position])
            for a, t in zip(alone, together):
                if isinstance(a, Recorder):
                    assert a.q.keys() == t.q.keys() and all(torch.equal(a.q[i], t.q[i]) for i in a.q)
            if one:  # RoPE tables the kernel does not read row by row (a layer kind's slice): declined
                qkv = torch.randn(1, sum(widths), L.cfg.n_heads + 2 * L.cfg.n_kv_heads, L.cfg.head_dim)
                wide = torch.ones(sum(widths), 1, 2 * L.cfg.head_dim)[..., : L.cfg.head_dim]
                ragged = rows.Ragged([Rows(i, n + w, c) for i, n, w, c in zip(ids, lens, widths, together)])
                assert ragged.rope_attend(0, qkv, wide, wide, None, L.cfg.n_heads) is None
                assert ragged.rope_attend(0, qkv, wide.contiguous(), wide.contiguous(), None, L.cfg.n_heads) is not None


def test_float32_linear_rows_do_not_depend_on_the_call():
    torch.manual_seed(0)
    for N, K in [(576, 576), (100, 48), (1536, 64), (7, 32)]:
        w, b, x = torch.randn(N, K), torch.randn(N), torch.randn(EXACT_ROWS + 9, K)
        with torch.inference_mode():
            one = torch.cat([linear(x[i: i + 1], w, b) for i in range(len(x))])
            for M in (2, 7, EXACT_ROWS):
                assert torch.equal(linear(x[:M], w, b), one[:M])
            with exact_rows():
                assert torch.equal(linear(x, w, b), one)
            torch.testing.assert_close(one, torch.nn.functional.linear(x.double(), w.double(), b.double()).float(),
                                       rtol=1e-4, atol=1e-4)


def test_models_without_row_exact_kernels_run_each_forward_alone():
    """bf16 dense weights on the CPU (torch's GEMM sums a row by the call's shape): the
    batch runs each sequence's forward by itself, still equal to its solo run."""
    L = tiny(scale=3.0, seed=1, dim=64)
    L = copy.copy(L)
    L.model = copy.deepcopy(L.model).to(torch.bfloat16)
    L.dtype = L.kv_dtype = torch.bfloat16
    assert not rows_exact(L.model)
    ps = prompts(L.cfg.vocab_size)[:3]
    opts = RunOptions.of(mode="triforce", max_new_tokens=12, budget=32)
    got = generate_batch(L, ps, opts)
    assert [t for t, _ in got] == [generate(L, p, opts)[0] for p in ps]
    assert got[0][1].extra["batch_forwards_shared"] == 0


@pytest.mark.slow
def test_bundled_model_batch_at_its_gguf_precision(one_thread):
    from triforce_offload.runtime import api
    from triforce_offload.runtime.data import long_prompt
    L = api.load()  # int4/int8 weights, int8 activations, bf16 KV (with VNNI)
    base = long_prompt(L.tokenizer, 1200)
    ps = [base[:1100 - 97 * i] for i in range(4)]
    for mode in ("autoregressive", "triforce"):
        opts = RunOptions.of(mode=mode, max_new_tokens=24, budget=256)
        got = generate_batch(L, ps, opts)
        assert [t for t, _ in got] == [generate(L, p, opts)[0] for p in ps], mode
        assert shared(got[0][1]) > 1.5


def test_a_failed_shared_forward_reaches_its_sequences_and_the_batch_goes_on(monkeypatch):
    from triforce_offload.runtime.batch import runner
    L = MODELS["int4:int8"]()
    ps = prompts(L.cfg.vocab_size)[:3]
    opts = RunOptions.of(mode="autoregressive", max_new_tokens=8)
    real, calls = runner.forward, []

    def flaky(model, sets):
        calls.append(len(sets))
        if len(calls) == 3:
            raise RuntimeError("injected: the shared forward failed")
        return real(model, sets)
    monkeypatch.setattr(runner, "forward", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        generate_batch(L, ps, opts)
    assert [t for t, _ in generate_batch(L, ps, opts)] == [generate(L, p, opts)[0] for p in ps]


def test_the_driving_thread_computes_with_the_batchs_thread_count():
    """Members run torch on one thread; that must not become the forwards' count."""
    import threading
    from triforce_offload.runtime.batch import runner
    L = MODELS["int4:int8"]()
    seen = []
    real = runner.forward

    def spy(model, sets):
        seen.append(torch.get_num_threads())
        return real(model, sets)
    n = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        b = Batch(L)
        b.batcher.threads = 3
        runner.forward = spy
        t = threading.Thread(target=lambda: (torch.set_num_threads(1), b.add(prompts(64)[0], RunOptions.of(
            max_new_tokens=4, mode="autoregressive")), b.add(prompts(64)[1], RunOptions.of(
                max_new_tokens=4, mode="autoregressive")), b.drain()))
        t.start()
        t.join()
    finally:
        runner.forward = real
        torch.set_num_threads(n)
    assert seen and set(seen) == {3}


@pytest.mark.parametrize("threads", [3, 5])
def test_rows_stay_exact_at_odd_thread_counts(threads):
    """torch splits a large elementwise op between threads and computes the elements past a
    split's last whole vector on its scalar path: at 3 or 5 threads a shared forward of
    many rows would move those splits. Prefill chunks and decodes of float-activation
    models (SiLU and GELU in torch) in one forward still equal their forwards alone."""
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for L in (MODELS["fp32"](), tiny_gelu()):
            caches = [FullCache(L.cfg, 512, dtype=L.kv_dtype) for _ in range(4)]
            alone = [FullCache(L.cfg, 512, dtype=L.kv_dtype) for _ in range(4)]
            widths = [1, 37, 64, 3]
            ids = [torch.randint(0, 64, (1, w), generator=torch.Generator().manual_seed(w)) for w in widths]
            with torch.inference_mode():
                want = [L.model(i, 0, c) for i, c in zip(ids, alone)]
            got = forward(L.model, [Rows(i, 0, c) for i, c in zip(ids, caches)])
            for w, o in zip(want, got):
                assert torch.equal(w, o)
    finally:
        torch.set_num_threads(n)


def tiny_gelu() -> Loaded:
    """A tiny model with Gemma's GELU-tanh MLP and (1 + w) norms, float activations."""
    torch.manual_seed(4)
    cfg = ModelConfig(arch="gemma3", vocab_size=64, hidden_size=64, intermediate_size=400, n_layers=2,
                      n_heads=4, n_kv_heads=2, max_position_embeddings=4096, hidden_act="gelu_pytorch_tanh",
                      norm_plus_one=True)
    return Loaded(Transformer(cfg).eval(), cfg, tiny().tokenizer, torch.device("cpu"), torch.float32)


def test_fixed_shape_batch_caches_have_the_solo_runs_capacity(monkeypatch):
    """On the fixed-shape path (CUDA; TRIFORCE_OFFLOAD_STATIC=1 here) a solo run's full cache
    is the model's kept one, its capacity rounded to a class; a batch's sequences keep their
    own caches, of that same capacity: the fixed-shape attention kernels split a buffer's
    keys by its capacity (on an H200 a bf16 batch left its solo runs' tokens before this)."""
    from triforce_offload.runtime.cache import offloaded
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    made = []
    real = offloaded.FullCache

    class Spy(real):
        def __init__(self, cfg, capacity, *a, **k):
            made.append(capacity)
            super().__init__(cfg, capacity, *a, **k)
    monkeypatch.setattr(offloaded, "FullCache", Spy)
    L = MODELS["fp32"]()
    ps = prompts(L.cfg.vocab_size)[:2]
    opts = RunOptions.of(mode="autoregressive", max_new_tokens=8)
    solo = [generate(L, p, opts)[0] for p in ps]
    n_solo = list(made)
    assert [t for t, _ in generate_batch(L, ps, opts)] == solo
    assert set(made[len(n_solo):]) <= set(n_solo) and len(made) > len(n_solo)


@pytest.mark.parametrize("model", ["fp32", "window", "int4:int8"])
@pytest.mark.parametrize("mode,extra", [m for m in MODES if "offload" not in m[1]])
def test_fixed_shape_steps_share_forwards_and_equal_their_solo_runs(model, mode, extra, monkeypatch):
    """The fixed-shape path (CUDA's graphed steps; TRIFORCE_OFFLOAD_STATIC=1 runs it eager on
    the CPU): a batch's decode, verification and draft steps join ragged forwards, each
    cache attending with its start as a device tensor as its solo step does, so every
    sequence still equals its solo run (on the same path) and forwards are shared."""
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    got = batch_equals_solo(MODELS[model](), mode, extra)
    st = got[0][1].extra
    assert shared(got[0][1]) > 1.5 and st["batch_forwards_shared"] > st["batch_forwards_alone"], st


def prefilled_kv(L, prompt, chunks):
    """(logits after the prompt, every layer's K and V) of a prefill in `chunks` tokens each."""
    from triforce_offload.runtime.generate import _prefill_chunks
    cache = FullCache(L.cfg, len(prompt) + 4, dtype=L.kv_dtype)
    sizes = iter(chunks)
    import triforce_offload.runtime.generate as g
    real = g.prefill_tokens
    g.prefill_tokens = lambda model, cache, chunk: next(sizes)
    try:
        with torch.inference_mode():
            logits = _prefill_chunks(L.model, cache, torch.tensor([prompt]), 0, 512, None)
    finally:
        g.prefill_tokens = real
    n = len(prompt)
    return logits, [t.clone() for layer in range(L.cfg.n_layers) for t in cache.keys(layer, n)]


@pytest.mark.parametrize("model", ["int4:int8", "window-int8", "window-int8-fp16kv"])
def test_chunk_invariant_models_prefill_the_same_at_any_chunk_boundaries(model):
    """What `runner.chunk_invariant` promises (and Batcher.chunk_tokens relies on): the
    same logits and KV bit for bit whatever the chunk sizes (a window layer's rows each
    over its block's band start, cache.kv._cpu_bands); dense float32 projections break it."""
    from triforce_offload.runtime.batch.runner import chunk_invariant
    L = MODELS["int4:int8"]() if model == "int4:int8" else quantized(windowed(), "int8")
    if model.endswith("fp16kv"):  # the kernel reads a float16 band widened to float32
        L.kv_dtype = torch.float16
    p = repetitive_prompt(700, L.cfg.vocab_size, seed=5)
    ref = prefilled_kv(L, p, [700] * 8)
    if not model.endswith("fp16kv"):
        assert chunk_invariant(L.model, FullCache(L.cfg, 8, dtype=L.kv_dtype))
    for chunks in ([16] * 44, [100, 17, 64, 519], [1] * 3 + [697], [512, 188], [130, 300, 270]):
        got = prefilled_kv(L, p, chunks + [700] * 8)
        assert torch.equal(got[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(got[1], ref[1])), chunks
    assert not chunk_invariant(MODELS["fp32"]().model, FullCache(L.cfg, 8))  # dense float32 projections


@pytest.mark.parametrize("model", ["int4:int8", "window-int8"])
def test_a_prompt_prefills_in_shorter_chunks_while_others_decode(model):
    """With max_stall, a prompt that arrives while another sequence decodes prefills in
    chunks sized to keep each round within max_stall times a decode round (shorter than
    --prefill-chunk, at least PREFILL_MIN; with window layers too, not multiples of 128);
    both answers equal their solo runs."""
    from triforce_offload.runtime.batch.runner import PREFILL_MIN
    L = MODELS["int4:int8"]() if model == "int4:int8" else quantized(windowed(), "int8")
    short, long = (repetitive_prompt(n, L.cfg.vocab_size, seed=s) for n, s in ((30, 6), (900, 7)))
    opts = RunOptions.of(mode="autoregressive", max_new_tokens=60, ignore_eos=True, prefill_chunk=256)
    solo = [generate(L, p, opts)[0] for p in (short, long)]
    b = Batch(L, prefill_budget=256, max_stall=2.0)
    ends, later = [], []

    def on_token(t, seen=[]):
        seen.append(t)
        if len(seen) == 5:
            later.append(b.add(long, opts, progress=lambda e, T: ends.append(e)))
        return False
    first = b.add(short, opts, on_token)
    b.drain()
    assert first.result()[0] == solo[0] and later[0].result()[0] == solo[1]
    sizes = [e - s for s, e in zip([0] + ends, ends)]
    print("chunks", sizes)
    assert sum(sizes) == len(long) and max(sizes) <= 256
    assert min(sizes[:-1]) >= PREFILL_MIN and len(sizes) > -(-len(long) // 256), sizes  # shorter chunks


def test_a_ragged_forward_charges_each_sequence_its_own_attention():
    """A batch prices each sequence's forwards by what they cost the batch (member.clock):
    Ragged times each sequence's attention (the native kernel times its work per
    sequence), and Batcher._charge splits the rest of the forward by rows; the charges add
    up to the forward's time, and a sequence over a long cache is charged more than one
    over a short cache in the same forward."""
    from triforce_offload.runtime.batch import member
    from triforce_offload.runtime.batch.runner import Ask, Batcher
    L = MODELS["int4:int8"]()
    sets = []
    for n in (8000, 10):
        c = FullCache(L.cfg, n + 8, dtype=L.kv_dtype)
        with torch.inference_mode():
            L.model(torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n)), 0, c)
        c.commit(n)
        sets.append(Rows(torch.tensor([[5]]), n, c))
    forward(L.model, sets)
    long, short = (s.attention_s for s in sets)
    assert long > short > 0
    asks = [Ask(None, s.ids, s.start, False) for s in sets]
    Batcher._charge(asks, sets, long + short + 0.01)
    assert sum(a.charge for a in asks) == pytest.approx(long + short + 0.01)
    assert asks[0].charge - asks[1].charge == pytest.approx(long - short)
    # a member's clock advances by its charge, not by its wait
    t0 = member.clock()
    member.charge(waited=5.0, charged=0.25)
    assert member.clock() - t0 == pytest.approx(-4.75, abs=0.05)
    member.charge(waited=0.25, charged=5.0)  # this thread's clock back as it was


def on_cuda(L: Loaded, dtype: torch.dtype) -> Loaded:
    """A copy of L with its model on the GPU in `dtype` (KV in that dtype too)."""
    import dataclasses
    model = copy.deepcopy(L.model).to("cuda", dtype)
    return dataclasses.replace(L, model=model, device=torch.device("cuda"), dtype=dtype, kv_dtype=dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode,extra", [("autoregressive", {}), ("retrieval", {"budget": 32, "bypass": False}),
                                        ("triforce", {"budget": 32, "bypass": False})])
def test_cuda_batch_shares_forwards_and_each_sequence_equals_its_solo_run(mode, extra, dtype):
    """On a GPU: the steps' projections run the row-exact Triton kernel, so a batch's graphed
    steps join ragged forwards (each cache's fixed-shape attention with a device start) and
    every sequence, in bf16 as in fp32, equals its solo (graphed) run token for token."""
    from triforce_offload.kernels.linear import gpu_exact
    assert gpu_exact("cuda"), "the row-exact Triton projections do not run here"
    got = batch_equals_solo(on_cuda(MODELS["fp32"](), dtype), mode, {**extra, "ignore_eos": True})
    st = got[0][1].extra
    assert shared(got[0][1]) > 1.5 and st["batch_forwards_shared"] > st["batch_forwards_alone"], st


def test_round_graphs_capture_a_class_the_second_time_and_drop_it_with_its_steps(monkeypatch):
    """`rows.Graphs`' bookkeeping (the capture itself needs CUDA: tests/test_cuda_dryrun.py
    runs it on the fake device): a class of round is captured the second time it runs and
    replayed after; a class whose step is gone is dropped, and a new step that reuses a
    dead one's id is a new class; where captures stop paying, no new class is captured."""
    import gc
    from types import SimpleNamespace
    from triforce_offload.runtime.batch.rows import Graphs
    made = []

    class Graph:
        def replay(self):
            self.replays = getattr(self, "replays", 0) + 1

    def fake_capture(self, model, asks, key, fresh):
        made.append(key)
        return ([weakref.ref(a.step) for a in asks], Graph(), torch.zeros(1, len(asks), dtype=torch.long),
                None, [torch.zeros(1, 1, 4) for _ in asks])
    import weakref
    monkeypatch.setattr(Graphs, "_capture", fake_capture)

    class Step:  # what a round's graph reads of a step: its start buffer, its cache
        def __init__(self):
            self.start = torch.zeros(1, dtype=torch.long)
            self.cache = SimpleNamespace(on_replay=lambda: None)
    step = Step

    def asks(*steps):
        return [SimpleNamespace(step=s, ids=torch.tensor([[3]]), start=5, last_only=False) for s in steps]
    g = Graphs()
    a, b = step(), step()
    assert g.run(None, asks(a, b)) is None and not made  # the first time: eager
    outs = g.run(None, asks(a, b))  # the second: captured, then replayed
    assert len(made) == 1 and len(outs) == 2 and a.start.item() == 5
    assert g.run(None, asks(a, b)) is not None and len(made) == 1 and g.replays == 2
    assert g.run(None, asks(b, a)) is None  # another class (order is part of it)
    del a
    gc.collect()
    c = step()
    assert g.run(None, asks(c, b)) is None and not g._g  # b's class with the dead step: dropped
    g.captures, g.replays = Graphs.TRIAL, 1  # captures that did not pay
    assert g.run(None, asks(c, b)) is None and len(made) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_row_ops_do_not_depend_on_the_call(dtype):
    """What a ragged forward on CUDA assumes besides the projections: a row's norm, SwiGLU,
    RoPE rotation, softcap and row-exact projection are the same bits alone (1 row) as at
    any offset of a 40-row call (when the batch identity fails on a GPU, this names the op)."""
    import torch.nn.functional as F
    from triforce_offload.kernels.linear import exact_rows, linear
    from triforce_offload.runtime.model.transformer import rotate
    g = torch.Generator(device="cuda").manual_seed(0)
    H = 576
    x = torch.randn(40, 1, H, device="cuda", generator=g).to(dtype)
    w = torch.randn(H, device="cuda", generator=g).to(dtype)
    W = torch.randn(1536, H, device="cuda", generator=g).to(dtype)
    cos, sin = (torch.randn(40, 1, 64, device="cuda", generator=g).to(dtype) for _ in range(2))
    heads = x.view(40, 9, 64)
    ops = {"rms_norm": (lambda a: F.rms_norm(a, (H,), w, 1e-5), (x,)),
           "swiglu": (lambda a: F.silu(a[..., : H // 2]) * a[..., H // 2:], (x,)),
           "rotate": (lambda a, c, s: rotate(a.unsqueeze(0), c, s)[0], (heads, cos, sin)),  # [1, T, H, D]
           "softcap": (lambda a: torch.tanh(a / 30.0) * 30.0, (x,)),
           "linear": (lambda a: linear(a, W), (x,))}
    with torch.inference_mode(), exact_rows([1] * 40):
        for name, (op, args) in ops.items():
            whole = op(*args)
            for i in (0, 1, 7, 16, 39):
                alone = op(*(t[i: i + 1] for t in args))
                assert torch.equal(alone, whole[i: i + 1]), (name, i)
