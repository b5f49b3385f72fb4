"""Shared fixtures: a tiny random Llama that speaks SmolLM2's tokenizer (fast CLI tests)."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from triforce_offload.runtime.model.loader import load_tokenizer, resolve


@pytest.fixture(scope="session")
def smol_dir():
    """The dequantized bundled SmolLM2 directory (converted once, then cached)."""
    return resolve(None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_dir):
    """A 2-layer random Llama with SmolLM2's vocabulary and tokenizer, saved as an HF dir."""
    torch.manual_seed(0)
    tok = load_tokenizer(smol_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    d = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture
def one_thread():
    """torch on one thread for the test (bit-identity checks; fewer threads to share)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
