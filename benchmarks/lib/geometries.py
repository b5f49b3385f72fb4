"""Model geometries with random weights: decode and transfer speed do not depend on weight
values, so the benchmark scripts time a Llama-2-7B-shaped model without its checkpoint.
`gpu_decode.py` and `offload_pipeline.py` both build theirs here."""
from __future__ import annotations

import math

import torch

from ..runtime.model.config import ModelConfig, apply_rope_override
from ..runtime.model.transformer import Rotary, Transformer

# name -> (ModelConfig fields, RoPE stretch kind); max_position_embeddings is the pre-stretch length
GEOMETRIES = {
    "llama2-7b": (dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, n_layers=32,
                       n_heads=32, n_kv_heads=32, max_position_embeddings=4096,
                       rope_theta=10000.0, rms_norm_eps=1e-5), "linear"),
    "llama3-8b": (dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, n_layers=32,
                       n_heads=32, n_kv_heads=8, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5), "llama3"),
    "smollm2": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, n_layers=30,
                     n_heads=9, n_kv_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=True), "linear"),
}
STRETCH_TO = 131072  # geometries support this many positions (more if a context asks)


def geometry_config(name: str, layers: int, max_context: int):
    """ModelConfig of a geometry, RoPE stretched to cover max(128K, max_context) positions."""
    fields, kind = GEOMETRIES[name]
    cfg = ModelConfig(arch="llama", **fields)
    if layers:
        cfg.n_layers = layers
    factor = math.ceil(max(STRETCH_TO, max_context) / cfg.max_position_embeddings)
    return apply_rope_override(cfg, f"{kind}:{factor}") if factor > 1 else cfg


def random_model(cfg, dtype: torch.dtype, device: torch.device, seed: int):
    """Transformer(cfg) with small random weights, allocated on `device` directly (built on
    the meta device, then `to_empty`: nothing is materialised on the CPU first)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype).to_empty(device=device)
    with torch.device(device):
        model.rotary = Rotary(cfg)  # computed buffer: to_empty left it uninitialised
    model.tie_weights()  # after to_empty, which unties
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights come once
            if name.endswith("norm.weight"):  # RMSNorm scales: ones, as a checkpoint starts
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval().requires_grad_(False)


def p_bytes(cfg, dtype: torch.dtype):
    """Parameter bytes of Transformer(cfg) in `dtype` (for the fit check before building)."""
    with torch.device("meta"):
        m = Transformer(cfg)
    m.tie_weights()
    return [p.numel() * torch.empty(0, dtype=dtype).element_size() for p in m.parameters()]
