"""Our forward against transformers' own implementation of the same weights."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.model.loader import load_model

ROPES = [None,
         {"rope_type": "linear", "factor": 2.0},
         {"rope_type": "dynamic", "factor": 2.0},
         {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
         {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}]


def tiny_hf(arch: str, rope=None, tie=False, heads=4, kv=2, seed=0):
    torch.manual_seed(seed)
    kw = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
              tie_word_embeddings=tie, rms_norm_eps=1e-6)
    if rope:
        kw["rope_scaling"] = rope
    cls, conf = ((LlamaForCausalLM, LlamaConfig) if arch == "llama" else (Qwen2ForCausalLM, Qwen2Config))
    m = cls(conf(**kw)).eval()
    if arch == "qwen2":  # HF initialises biases to zero: make them matter
        for layer in m.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(p.bias, std=0.5)
    return m



def load_ours(hf, tmp_path):
    from triforce_offload.runtime.model.loader import Rotary, Transformer, load_weights, read_config
    hf.save_pretrained(tmp_path)
    cfg = read_config(tmp_path)
    model = Transformer(cfg)
    model.rotary = Rotary(cfg)
    load_weights(model, tmp_path, torch.float32, "cpu")
    return model.eval(), cfg


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rope", ROPES, ids=lambda r: (r or {}).get("rope_type", "default"))
def test_prefill_and_decode_match_transformers(arch, rope, tmp_path):
    hf = tiny_hf(arch, rope, tie=(arch == "llama"))
    ours, cfg = load_ours(hf, tmp_path)
    ids = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        ref = hf(ids).logits
        cache = FullCache(cfg, 64)
        pre = ours(ids[:, :30], 0, cache)
        cache.commit(30)
        steps = []
        for i in range(30, 40):  # incremental decode, one token at a time
            steps.append(ours(ids[:, i:i + 1], i, cache))
            cache.commit(i + 1)
    torch.testing.assert_close(pre, ref[:, :30], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(steps, 1), ref[:, 30:], rtol=1e-4, atol=1e-4)


def test_chunked_prefill_and_multi_token_verify(tmp_path):
    hf = tiny_hf("llama", heads=6, kv=2)
    ours, cfg = load_ours(hf, tmp_path)
    ids = torch.randint(0, 97, (1, 50))
    with torch.no_grad():
        ref = hf(ids).logits
        cache = FullCache(cfg, 64)
        outs = []
        for s in range(0, 50, 7):  # chunks that do not divide the length
            outs.append(ours(ids[:, s:s + 7], s, cache))
            cache.commit(min(s + 7, 50))
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-4, atol=1e-4)


def test_rollback_leaves_no_trace(tmp_path):
    hf = tiny_hf("qwen2")
    ours, cfg = load_ours(hf, tmp_path)
    ids = torch.randint(0, 97, (1, 20))
    junk = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        cache = FullCache(cfg, 64)
        ours(ids[:, :15], 0, cache)
        cache.commit(15)
        ours(junk, 15, cache)  # a rejected draft
        cache.commit(15)
        got = ours(ids[:, 15:], 15, cache)
        ref = hf(ids).logits[:, 15:]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_batch_dimension(tmp_path):
    hf = tiny_hf("llama")
    ours, cfg = load_ours(hf, tmp_path)
    ids = torch.randint(0, 97, (3, 12))
    with torch.no_grad():
        got = ours(ids, 0, FullCache(cfg, 16, batch=3))
        ref = hf(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_dtype_conversion_while_reading_matches_torch(tmp_path):
    from triforce_offload.runtime.model.loader import read_safetensors, _read_tensor
    hf = tiny_hf("qwen2")
    hf.save_pretrained(tmp_path)
    f = next(tmp_path.glob("*.safetensors"))
    want = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    got = dict(read_safetensors(f, torch.bfloat16))
    assert set(got) >= {k for k in want if k != "lm_head.weight"}
    for k, t in got.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, want[k]), k
    x = torch.randn(5, 7)  # several small blocks, the last one partial
    (tmp_path / "raw").write_bytes(x.numpy().tobytes())
    with open(tmp_path / "raw", "rb") as fh:
        y = _read_tensor(fh, [5, 7], torch.float32, torch.float16, block=4)
    assert torch.equal(y, x.half())


def test_hf_state_dict_loads_into_the_stacked_projections(tmp_path):
    """q/k/v (with Qwen2's biases) and gate/up are one Linear each here; an HF-named state
    dict loads as is, through the loader and through load_state_dict, with equal logits."""
    from triforce_offload.runtime.model.transformer import Transformer
    hf = tiny_hf("qwen2")
    ours, cfg = load_ours(hf, tmp_path)
    attn = ours.model.layers[0].self_attn
    assert not hasattr(attn, "q_proj") and attn.qkv_proj.bias is not None
    direct = Transformer(cfg).eval()
    direct.load_state_dict(hf.state_dict(), strict=False)
    assert not any(k.endswith((".q_proj.weight", ".up_proj.weight")) for k in direct.state_dict())
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        ref = hf(ids).logits
        for m in (ours, direct):
            torch.testing.assert_close(m(ids, 0, FullCache(cfg, 16)), ref, rtol=1e-4, atol=1e-4)
