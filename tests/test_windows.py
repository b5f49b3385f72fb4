"""Sliding windows honoured and what is not implemented refused (issue 28): a tiny random
windowed Mistral and Qwen2 made with transformers against transformers' own forward and
greedy output, on every cache path and in every mode, with prompts longer than the window."""
from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.model.config import ModelConfig
from triforce_offload.runtime.errors import TriforceError
from triforce_offload.runtime.cache.retrieval import RetrievalCache
from triforce_offload.runtime.cache.streaming import StreamingCache

WINDOW = 12


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_mistral(window=WINDOW, seed=0, layers=2):
    torch.manual_seed(seed)
    conf = MistralConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         sliding_window=window, rms_norm_eps=1e-6)
    m = MistralForCausalLM(conf).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(4.0)  # peaked logits: greedy ties are far apart
    return m


def tiny_qwen2(seed=0):
    torch.manual_seed(seed)
    conf = Qwen2Config(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, rms_norm_eps=1e-6)
    return Qwen2ForCausalLM(conf).eval()


def ours(hf, path):
    from triforce_offload.runtime.model.loader import load_model
    hf.save_pretrained(path)
    model, cfg, _ = load_model(path) if (path / "tokenizer.json").exists() else _load(path)
    return model, cfg


def _load(path):
    from triforce_offload.runtime.model.loader import Rotary, Transformer, load_weights, read_config
    cfg = read_config(path)
    model = Transformer(cfg)
    model.rotary = Rotary(cfg)
    load_weights(model, path, torch.float32, "cpu")
    return model.eval(), cfg, None


def test_window_kinds_as_transformers_reads_them(tmp_path):
    m = tiny_mistral()
    m.save_pretrained(tmp_path / "m")
    from triforce_offload.runtime.model.loader import read_config
    assert read_config(tmp_path / "m").windows == [WINDOW, WINDOW]
    q = tiny_qwen2()
    q.save_pretrained(tmp_path / "q")
    assert read_config(tmp_path / "q").windows == [None, WINDOW, WINDOW]  # from max_window_layers on
    hf = q.config.to_dict()
    hf.update(use_sliding_window=False, layer_types=None)
    assert ModelConfig.from_hf(hf).windows == [None] * 3  # a window only with use_sliding_window


@pytest.mark.parametrize("key,value,named", [
    ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "longrope"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("num_local_experts", 8, "mixture of experts"),
    ("mlp_bias", True, "mlp_bias"),
    ("hidden_act", "gelu", "activation 'gelu'"),
    ("layer_types", ["chunked_attention", "full_attention"], "chunked_attention"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor"),
])
def test_what_is_not_implemented_is_refused_in_one_line(key, value, named):
    hf = tiny_mistral().config.to_dict()
    hf.pop("rope_parameters", None)
    hf[key] = value
    with pytest.raises(TriforceError) as e:
        ModelConfig.from_hf(hf)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_unexpected_weights_are_refused(tmp_path):
    """A checkpoint tensor the model has no place for (attention sinks, an o_proj bias) is
    never dropped silently."""
    from safetensors.torch import load_file, save_file
    m = tiny_mistral()
    m.save_pretrained(tmp_path)
    f = next(tmp_path.glob("*.safetensors"))
    state = load_file(f)
    state["model.layers.0.self_attn.sinks"] = torch.zeros(4)
    save_file(state, f)
    with pytest.raises(TriforceError, match="self_attn.sinks"):
        _load(tmp_path)


def paths(cfg, n):
    """Every cache the target's attention runs through, sized for n tokens."""
    return {"full": FullCache(cfg, n), "static": FullCache(cfg, n, static=True)}


@pytest.mark.parametrize("make", ["mistral", "qwen2"])
@pytest.mark.parametrize("path", ["full", "static", "offloaded", "retrieval-window"])
def test_forward_equals_transformers_past_the_window(make, path, tmp_path):
    """Chunked prefill, multi-token verifications and decode steps, 3-4 windows long."""
    hf = tiny_mistral() if make == "mistral" else tiny_qwen2()
    model, cfg = ours(hf, tmp_path)
    ids = torch.randint(0, 97, (1, 46), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids).logits
        if path == "offloaded":
            from triforce_offload.runtime.cache.offloaded import OffloadedCache
            cache = OffloadedCache(cfg, 64, transfer_chunk=5)
        elif path == "retrieval-window":  # a retrieval cache whose budget covers the window
            full = FullCache(cfg, 64)
            model(ids[:, :20], 0, full)
            full.commit(20)
            cache = RetrievalCache(cfg, 16, 4, 40)
            cache.build(full, {i: torch.randn(1, 4, cfg.head_dim) for i in range(cfg.n_layers)}, 20)
            outs = [model(ids[:, 20:26], 20, cache)]
            cache.commit(26)
            outs += [model(ids[:, i:i + 1], i, cache) for i in range(26, 30)]
            got = torch.cat(outs, 1)
            windowed = [w is not None for w in cfg.windows]
            if all(windowed):
                torch.testing.assert_close(got, ref[:, 20:30], rtol=1e-4, atol=1e-4)
            return
        else:
            cache = paths(cfg, 64)[path]
        outs, pos = [], 0
        for n in (9, 7, 1, 1, 5, 1, 13, 3, 1, 5):  # prefill chunks, decode steps, verifications
            start = torch.tensor([pos]) if cache.static else pos
            if cache.static and n > 1 and pos == 0:
                start = pos  # the static path's first chunk runs eagerly (a prefill)
            outs.append(model(ids[:, pos:pos + n], start, cache))
            pos += n
            cache.commit(pos)
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-4, atol=1e-4)


def test_streaming_and_retrieval_caches_take_the_window(tmp_path):
    """Draft caches: a window layer's band in the streaming cache; the retrieval cache keeps
    a window layer's most recent tokens rather than scored chunks."""
    hf = tiny_mistral()
    model, cfg = ours(hf, tmp_path)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
        s = StreamingCache(cfg, sink=0, window=WINDOW + 4, pending=16)
        outs = []
        for i in range(40):
            outs.append(model(ids[:, i:i + 1], i, s))
            s.commit(i + 1)
    # with no sink and the streaming window past the model's, the drafter is exact
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-4, atol=1e-4)


LOSSLESS_MODES = [
    ("autoregressive", {}),
    ("draft", {}),
    ("draft", {"draft": "self", "draft_sink": 4, "draft_window": 16}),
    ("retrieval", {"budget": 16, "retrieval_chunk": 4}),
    ("triforce", {"budget": 16, "retrieval_chunk": 4}),
    ("triforce", {"budget": 8, "retrieval_chunk": 4, "draft": "self", "draft_window": 8, "gamma2": "auto"}),
    ("triforce", {"budget": 16, "retrieval_chunk": 4, "offload": "on", "transfer_chunk": 8}),
    ("triforce", {"budget": 16, "retrieval_chunk": 4, "offload": "on", "on_chip": 1, "transfer_chunk": 8}),
]


def loaded_from(hf, path):
    from types import SimpleNamespace
    from triforce_offload.runtime.api import Loaded
    model, cfg = ours(hf, path)
    cfg.eos_token_ids = []
    return Loaded(model, cfg, SimpleNamespace(eos_token_id=None), torch.device("cpu"), torch.float32)


def hf_greedy(hf, prompt, n):
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def mistral_run(tmp_path_factory):
    from helpers_spec import repetitive_prompt
    hf = tiny_mistral(seed=3)
    L = loaded_from(hf, tmp_path_factory.mktemp("mistral"))
    prompt = repetitive_prompt(70, 97, seed=4)  # almost 6 windows
    return hf, L, prompt, hf_greedy(hf, prompt, 24)


@pytest.mark.parametrize("mode,extra", LOSSLESS_MODES)
def test_greedy_of_every_mode_equals_transformers(mistral_run, mode, extra):
    from helpers_spec import run
    hf, L, prompt, ref = mistral_run
    out, st = run(L, prompt, mode, 24, **extra)
    assert out == ref


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_window_verification_rows_equal_their_decodes_bit_for_bit(kv_dtype):
    """A window layer's verification (T queries whose bands differ) gives each row the bits
    of the decode at its position: at int8 activations any other summation order turns into
    other tokens between speculative modes and autoregressive decoding (found on Gemma 3)."""
    from triforce_offload.runtime.cache.kv import window_attention
    g = torch.Generator().manual_seed(0)
    W, T, start, k0 = 32, 6, 70, 30  # keys from position 30 on; queries at 70..75
    q = torch.randn(1, 4, T, 64, generator=g)
    k = torch.randn(1, 2, start + T - k0, 64, generator=g).to(kv_dtype)
    v = torch.randn(1, 2, start + T - k0, 64, generator=g).to(kv_dtype)
    rows = window_attention(q, k, v, start, k0, W)
    for t in range(T):
        end = start + t + 1 - k0  # what a decode at start + t holds: keys up to its own
        one = window_attention(q[:, :, t: t + 1], k[:, :, :end], v[:, :, :end], start + t, k0, W)
        assert torch.equal(rows[:, :, t: t + 1], one), t
    full = torch.nn.functional.scaled_dot_product_attention  # and the band is the right one
    kp = torch.arange(k0, start + T)
    mask = (kp[None] <= torch.arange(start, start + T)[:, None]) & (kp[None] > torch.arange(start, start + T)[:, None] - W)
    ref = full(q, k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1), attn_mask=mask)
    tol = 1e-4 if kv_dtype == torch.float32 else 1e-2  # bf16 KV: queries and probabilities rounded to bf16
    torch.testing.assert_close(rows, ref, rtol=tol, atol=tol)
