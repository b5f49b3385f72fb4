"""Qwen3 and Gemma 3 (issue 28): tiny random models made with transformers, from HF folders
and from GGUF files written with `gguf`, against transformers' forward and greedy output,
and every speculative mode against autoregressive decoding, prompts longer than the window."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen3Config, Qwen3ForCausalLM

from triforce_offload.runtime.cache import FullCache

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


def tiny_gemma2(seed=0):
    """Gemma 2 is Gemma 3's machinery without q/k norms and with one RoPE base; attention
    soft-capping is refused, so this one has none (final logit soft-capping it does have)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(seed)
    conf = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                        attn_logit_softcapping=None, final_logit_softcapping=5.0, query_pre_attn_scalar=32,
                        max_position_embeddings=512)
    return _sharpen(Gemma2ForCausalLM(conf).eval())


MAKERS = {"qwen3": tiny_qwen3, "gemma2": tiny_gemma2, "qwen3-window": lambda: tiny_qwen3(window=True),
          "gemma3": tiny_gemma3, "gemma3-scalar": lambda: tiny_gemma3(qpas=32, softcap=5.0)}


@pytest.mark.parametrize("make", list(MAKERS))
def test_forward_equals_transformers(make, tmp_path):
    hf = MAKERS[make]()
    model, cfg = ours(hf, tmp_path)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        for static in (False, True):
            cache, outs, pos = FullCache(cfg, 48, static=static), [], 0
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


@pytest.fixture(scope="module", params=["qwen3-window", "gemma3"])
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

def _byte_tokens():
    """GPT-2's byte-to-unicode table: a byte-level BPE vocabulary with no merges."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    rest = [b for b in range(256) if b not in bs]
    return [chr(b) for b in bs] + [chr(256 + i) for i in range(len(rest))]


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "input_layernorm": "attn_norm"}


def write_gguf(hf, path):
    """The HF model as llama.cpp's converter writes it (fp32 tensors; Gemma's norms with
    the 1 added), with a byte-level tokenizer."""
    import gguf
    c = hf.config
    arch = "gemma3" if c.model_type == "gemma3_text" else c.model_type
    gemma = arch == "gemma3"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(1e6 if gemma else c.rope_parameters["rope_theta"])
    if gemma:
        w.add_sliding_window(c.sliding_window)
    tokens = _byte_tokens() + ["<|endoftext|>"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3])
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(256)
    names = dict(GGUF_NAMES)
    if gemma:
        names.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    else:
        names["post_attention_layernorm"] = "ffn_norm"
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if gemma and name.endswith("norm.weight"):
            a = a + 1
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            out = "output.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            mod = rest.rsplit(".", 1)[0]
            out = f"blk.{i}.{names[mod]}.weight"
        w.add_tensor(out, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("make", ["qwen3", "gemma3"])
def test_gguf_equals_the_hf_folder(make, tmp_path, monkeypatch):
    """The same weights from a GGUF: dequantized (fp32) through transformers, and read as
    blocks (--weights int8) by our own reader; greedy output equal to transformers' for
    the first, every mode equal to autoregressive for the second."""
    from triforce_offload.runtime.api import load
    from helpers_spec import repetitive_prompt, run
    monkeypatch.setenv("TRIFORCE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    hf = tiny_gemma3(gguf=True) if make == "gemma3" else MAKERS[make]()
    path = tmp_path / f"{make}.gguf"
    write_gguf(hf, path)
    prompt = repetitive_prompt(40, 256, seed=2)
    ref = hf_greedy(hf, prompt, 12)
    dense = load(str(path), "fp32", "cpu", weights="fp32")
    dense.cfg.eos_token_ids = []
    assert run(dense, prompt, "autoregressive", 12, ignore_eos=True)[0] == ref
    q = load(str(path), "fp32", "cpu", weights="int8")
    q.cfg.eos_token_ids = []
    auto, _ = run(q, prompt, "autoregressive", 12, ignore_eos=True)
    for mode, extra in MODES[1:5]:
        assert run(q, prompt, mode, 12, ignore_eos=True, **extra)[0] == auto, mode
