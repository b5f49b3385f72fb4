"""Tiny random models and a stand-in for `api.Loaded`, for the speculative-decoding tests."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from triforce_offload.runtime.api import Loaded, RunOptions, generate
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.model.config import ModelConfig
from triforce_offload.runtime.model.transformer import Transformer
from triforce_offload.runtime.sampling import SamplingParams


def tiny(vocab=64, layers=2, heads=4, kv=2, dim=32, seed=0, scale=1.0, arch="llama") -> Loaded:
    """A random Llama-family model; `scale` sharpens the logits (more peaked distributions)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(arch=arch, attention_bias=arch == "qwen2", vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, n_layers=layers,
                      n_heads=heads, n_kv_heads=kv, max_position_embeddings=4096)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    tok = SimpleNamespace(eos_token_id=None)
    return Loaded(model, cfg, tok, torch.device("cpu"), torch.float32)


def prefilled(L, n: int, static: bool = True, capacity: int = 256):
    """A FullCache of `capacity` tokens (the model's dtype) holding n random tokens' KV,
    committed; `static`: the fixed-shape (CUDA graph) path's cache."""
    cache = FullCache(L.cfg, capacity, dtype=next(L.model.parameters()).dtype, static=static)
    ids = torch.randint(0, L.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        L.model(ids, 0, cache)
    cache.commit(n)
    return cache


def repetitive_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    """A prompt with repeated spans, so the n-gram drafter finds matches."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (max(n // 4, 8),), generator=g).tolist()
    return (base * 5)[:n]


def run(loaded, prompt, mode, n=32, temperature=0.0, seed=0, **extra):
    opts = RunOptions.of(mode=mode, max_new_tokens=n, **extra,
                      sampling=SamplingParams(temperature=temperature, seed=seed))
    return generate(loaded, prompt, opts)
