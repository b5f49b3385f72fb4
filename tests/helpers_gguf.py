"""GGUF files for tests, written with `gguf`: the byte-level tokenizer every test GGUF
carries (`add_byte_tokenizer`), and a tiny HF model as llama.cpp's converter writes it
(`write_hf_gguf`: Llama-style names, Qwen3, Gemma 2 and Gemma 3)."""
from __future__ import annotations

import numpy as np


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode table: a byte-level BPE vocabulary with no merges (256
    tokens, unlike SmolLM2's)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    rest = [b for b in range(256) if b not in bs]
    return [chr(b) for b in bs] + [chr(256 + i) for i in range(len(rest))]


def add_byte_tokenizer(w) -> list[str]:
    """The byte-level tokenizer (256 bytes + `<|endoftext|>`, id 256, as bos and eos) into
    the GGUFWriter `w`; returns its tokens."""
    tokens = byte_tokens() + ["<|endoftext|>"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3])
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(256)
    return tokens


NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "input_layernorm": "attn_norm"}
# Gemma's sandwich: the norms around attention and the MLP
GEMMA_NAMES = {**NAMES, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def write_hf_gguf(hf, path):
    """The HF model as llama.cpp's converter writes it (fp32 tensors; Gemma's norms with
    the 1 added; Gemma 2's soft-caps as metadata), with the byte-level tokenizer."""
    import gguf
    c = hf.config
    arch = "gemma3" if c.model_type == "gemma3_text" else c.model_type
    gemma = arch in ("gemma2", "gemma3")
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
    w.add_rope_freq_base(1e6 if arch == "gemma3" else c.rope_parameters["rope_theta"])
    if gemma:
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    add_byte_tokenizer(w)
    names = dict(GEMMA_NAMES if gemma else NAMES, **({} if gemma else {"post_attention_layernorm": "ffn_norm"}))
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
            out = f"blk.{i}.{names[rest.rsplit('.', 1)[0]]}.weight"
        w.add_tensor(out, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
