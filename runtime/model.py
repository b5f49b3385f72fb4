"""The Llama-family forward (Llama 2/3, SmolLM2, Mistral-style, Qwen2) in plain PyTorch.

The model knows nothing of offloading, retrieval or parallelism: each attention layer
hands rotated (q, k, v) and the first token's position (tokens are contiguous) to the cache object it is given and gets
the attention output back. Module names follow HF so checkpoints load without renaming.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.linear import Linear
from .config import ModelConfig, rope_frequencies


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32 as HF does, then cast back before the weight
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    """RoPE cos/sin for arbitrary absolute positions (scaling kinds as HF computes them)."""

    def __init__(self, cfg: ModelConfig, max_len: int | None = None):
        super().__init__()
        inv, self.scale = rope_frequencies(cfg, max_len or cfg.max_position_embeddings)
        self.register_buffer("inv_freq", torch.tensor(inv, dtype=torch.float32), persistent=False)

    def forward(self, pos: torch.Tensor, dtype):
        f = pos.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat([f, f], dim=-1)  # [T, D]
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def rotate(x, cos, sin):
    """Apply RoPE to x [B, H, T, D] with cos/sin [T, D] (rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        b = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, cfg.n_heads * cfg.head_dim, bias=b)
        self.k_proj = Linear(cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim, bias=b)
        self.v_proj = Linear(cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim, bias=b)
        self.o_proj = Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, start, cache):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = cache.attend(self.layer, q, k, v, start)  # [B, Hq, T, D]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, start, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """HF's `model.` prefix: embedding, blocks, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Body(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg)

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor, start, cache, last_only: bool = False):
        """ids [B, T] at positions start..start+T-1 -> logits [B, T, V] (or [B, 1, V]).

        `start` is an int, or an int64 device tensor [1] (a fixed-shape step for a CUDA
        graph: nothing then depends on its value on the host; the cache gets the tensor).
        The cache hears when the forward begins and ends (`begin_forward`/`end_forward`)."""
        x = self.embed(ids)
        cos, sin = self.rope(start, ids.shape[1], x.dtype, ids.device)
        cache.begin_forward(start, ids.shape[1])
        for i in range(len(self.model.layers)):
            x = self.layer_step(i, x, cos, sin, start, cache)
        cache.end_forward()
        return self.head(x, last_only)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> hidden states [B, T, H]."""
        return self.model.embed_tokens(ids)

    def rope(self, start, T: int, dtype, device):
        """cos, sin [T, D] of positions start..start+T-1 (`start` an int or a device tensor [1])."""
        if isinstance(start, torch.Tensor):
            pos = start + torch.arange(T, device=device, dtype=start.dtype)
        else:
            pos = torch.arange(start, start + T, device=device)
        return self.rotary(pos, dtype)

    def layer_step(self, i: int, x, cos, sin, start, cache) -> torch.Tensor:
        """Layer i over hidden states x [B, T, H] of the tokens at positions start.. (cos,
        sin theirs), attending through `cache`."""
        return self.model.layers[i](x, cos, sin, start, cache)

    def head(self, x: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Hidden states [B, T, H] -> logits [B, T, V] (of the last position only: [B, 1, V])."""
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x))
