"""Qwen3, Gemma 3 and Gemma 2 (issue 28): tiny random models made with transformers, from HF
folders and from GGUF files written with `gguf`, against transformers' forward and greedy
output, and every speculative mode against autoregressive decoding, prompts longer than the
window. Gemma 2 with attention logit soft-capping too, on every attention path."""
from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen3Config, Qwen3ForCausalLM

from triforce_offload.kernels import native
from triforce_offload.runtime.cache.kv import FullCache

from helpers_gguf import write_hf_gguf
from test_windows import hf_greedy, loaded_from, ours

VOCAB = 257  # byte-level tokenizer of the GGUF files: 256 bytes + one end token
WINDOW = 10


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _sharpen(m):
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):  # norms away from their init (Gemma's: 0, i.e. scale 1)
                p.add_(torch.randn_like(p) * 0.3)
        m.lm_head.weight.mul_(3.0) if not m.config.tie_word_embeddings else None
    return m


def tiny_qwen3(seed=0, window=False):
    torch.manual_seed(seed)
    conf = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=24,  # head_dim not hidden/heads
                       max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       use_sliding_window=window, sliding_window=WINDOW, max_window_layers=1)
    return _sharpen(Qwen3ForCausalLM(conf).eval())


def tiny_gemma3(seed=0, qpas=16, softcap=None, gguf=False):
    """`gguf`: only what a GGUF file states (llama.cpp's pattern of 5 sliding layers and one
    global, transformers' default query_pre_attn_scalar of 256)."""
    torch.manual_seed(seed)
    kinds = None if gguf else ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    conf = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6 if gguf else 4,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                            max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=WINDOW,
                            layer_types=kinds, query_pre_attn_scalar=256 if gguf else qpas,
                            final_logit_softcapping=softcap,
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    return _sharpen(Gemma3ForCausalLM(conf).eval())


SOFTCAP = 5.0  # Gemma 2's is 50: scores of the tiny model (q and k scaled up) reach past this one


def tiny_gemma2(seed=0, softcap=None, gguf=False):
    """Gemma 2 is Gemma 3's machinery without q/k norms and with one RoPE base, plus
    attention logit soft-capping (`softcap`: q and k projections scaled up so that scores
    reach the cap, the embedding so that logits are apart; transformers' eager attention,
    which soft-caps). `gguf`: transformers' default query_pre_attn_scalar of 256, what a
    GGUF file implies."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(seed)
    conf = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                        attn_logit_softcapping=softcap, final_logit_softcapping=30.0 if softcap else 5.0,
                        query_pre_attn_scalar=256 if gguf else 32, max_position_embeddings=512,
                        attn_implementation="eager")
    m = _sharpen(Gemma2ForCausalLM(conf).eval())
    if softcap:
        with torch.no_grad():
            m.model.embed_tokens.weight.mul_(3.0)
            for layer in m.model.layers:
                layer.self_attn.q_proj.weight.mul_(24.0 if gguf else 12.0)
                layer.self_attn.k_proj.weight.mul_(12.0)
    return m


MAKERS = {"qwen3": tiny_qwen3, "gemma2": tiny_gemma2, "qwen3-window": lambda: tiny_qwen3(window=True),
          "gemma3": tiny_gemma3, "gemma3-scalar": lambda: tiny_gemma3(qpas=32, softcap=5.0),
          "gemma2-softcap": lambda: tiny_gemma2(softcap=SOFTCAP)}


@pytest.mark.parametrize("make", list(MAKERS) + ["gemma2-softcap-torch"])
def test_forward_equals_transformers(make, tmp_path, monkeypatch):
    """Prefill chunks, decodes and verifications, on the dynamic and the fixed-shape path
    (band masks, the length-masked reference), window layers kept whole and in rings;
    "-torch": the native kernel off, so the
    soft-capped scores run explicitly where SDPA would."""
    if make.endswith("-torch"):
        make = make.removesuffix("-torch")
        monkeypatch.setattr(native, "supports", lambda q, k: False)
    hf = MAKERS[make]()
    model, cfg = ours(hf, tmp_path)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        for static, ring in ((False, None), (True, None), (False, 16), (True, 16)):  # window layers in rings too
            cache, outs, pos = FullCache(cfg, 48, static=static, ring_depth=ring), [], 0
            for n in (13, 1, 1, 6, 1, 11, 7):  # prefill chunks, decode steps, verifications
                start = torch.tensor([pos]) if static and pos else pos
                outs.append(model(ids[:, pos:pos + n], start, cache))
                pos += n
                cache.commit(pos)
            torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-4, atol=1e-4)


MODES = [
    ("autoregressive", {}),
    ("draft", {}),
    ("draft", {"draft": "self", "draft_sink": 4, "draft_window": 16}),
    ("retrieval", {"budget": 16, "retrieval_chunk": 4}),
    ("triforce", {"budget": 16, "retrieval_chunk": 4}),
    ("triforce", {"budget": 16, "retrieval_chunk": 4, "offload": "on", "on_chip": 1, "transfer_chunk": 8}),
]


def test_attention_softcap_is_read_and_matters(tmp_path):
    """The config carries the cap, and dropping it changes the logits well beyond float
    rounding (so the tests above could fail)."""
    hf = MAKERS["gemma2-softcap"]()
    model, cfg = ours(hf, tmp_path)
    assert cfg.attn_logit_softcapping == SOFTCAP and cfg.final_logit_softcapping == 30.0
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        capped = model(ids, 0, FullCache(cfg, 48))
        cfg.attn_logit_softcapping = None
        plain = model(ids, 0, FullCache(cfg, 48))
    assert (capped - plain).abs().max() > 0.05


@pytest.fixture(scope="module", params=["qwen3-window", "gemma3", "gemma2-softcap"])
def arch_run(request, tmp_path_factory):
    from helpers_spec import repetitive_prompt
    hf = MAKERS[request.param]()
    L = loaded_from(hf, tmp_path_factory.mktemp(request.param))
    prompt = repetitive_prompt(64, VOCAB, seed=4)  # six windows
    return hf, L, prompt, hf_greedy(hf, prompt, 20)


@pytest.mark.parametrize("mode,extra", MODES)
def test_greedy_of_every_mode_equals_transformers(arch_run, mode, extra):
    from helpers_spec import run
    hf, L, prompt, ref = arch_run
    out, _ = run(L, prompt, mode, 20, **extra)
    assert out == ref


# ---- GGUF -----------------------------------------------------------------------------------

GGUF_MAKERS = {"qwen3": tiny_qwen3, "gemma3": lambda: tiny_gemma3(gguf=True),
               "gemma2-softcap": lambda: tiny_gemma2(softcap=SOFTCAP, gguf=True)}


@pytest.mark.parametrize("make", list(GGUF_MAKERS))
def test_gguf_equals_the_hf_folder(make, tmp_path, monkeypatch):
    """The same weights from a GGUF: dequantized (fp32) through transformers, and read as
    blocks (--weights int8) by our own reader; greedy output equal to transformers' for
    the first, every mode equal to autoregressive for the second. Gemma 2's soft-caps come
    from the file's metadata (not transformers' defaults of 50 and 30)."""
    from triforce_offload.runtime.api import load
    from helpers_spec import repetitive_prompt, run
    monkeypatch.setenv("TRIFORCE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    hf = GGUF_MAKERS[make]()
    path = tmp_path / f"{make}.gguf"
    write_hf_gguf(hf, path)
    prompt = repetitive_prompt(40, 256, seed=2)
    ref = hf_greedy(hf, prompt, 12)
    dense = load(str(path), "fp32", "cpu", weights="fp32")
    assert dense.cfg.attn_logit_softcapping == hf.config.to_dict().get("attn_logit_softcapping")
    dense.cfg.eos_token_ids = []
    assert run(dense, prompt, "autoregressive", 12, ignore_eos=True)[0] == ref
    q = load(str(path), "fp32", "cpu", weights="int8")
    q.cfg.eos_token_ids = []
    auto, _ = run(q, prompt, "autoregressive", 12, ignore_eos=True)
    for mode, extra in MODES[1:5]:
        assert run(q, prompt, mode, 12, ignore_eos=True, **extra)[0] == auto, mode
