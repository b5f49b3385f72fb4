"""The forward of Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 3 and Gemma 2 in plain
PyTorch: one block with the differences as config fields (q/k norms, (1 + w) norms, norms
after attention and the MLP, the activation, the embedding scale, the attention scale, per
layer-kind RoPE). A sliding-window layer's window is the cache's to honour: the model
hands every layer's (q, k, v) to it alike.

The model knows nothing of offloading, retrieval or parallelism: each attention layer
hands rotated (q, k, v) and the first token's position (tokens are contiguous) to the cache
object it is given and gets the attention output back. Module names follow HF, except that
q/k/v and gate/up are stacked into one Linear each (`STACKED`): HF-named checkpoints load
as they are (the loader and `load_state_dict` stack them).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _torch_module

from ...kernels import native
from ...kernels.linear import Linear, by_rows
from ...kernels.qlinear import QLinear
from .config import ModelConfig, rope_frequencies
from .program import Program


# HF checkpoints keep these projections apart; the model stacks each group into one Linear
# (rows in this order): one GEMM instead of three (q, k, v) or two (gate, up) per layer
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def stack_parts(state: dict, prefix: str, into: str) -> None:
    """Replace `prefix`'s separate HF projections in a state dict by the stacked `into`
    (weights, and biases where there are any), once every part is in `state`."""
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{p}.{kind}" for p in STACKED[into]]
        if all(k in state for k in keys):
            state[f"{prefix}{into}.{kind}"] = torch.cat([state.pop(k) for k in keys])


def _loads_hf(module: nn.Module, into: str) -> None:
    """`module.load_state_dict` also takes HF-named (unstacked) weights."""
    module.register_load_state_dict_pre_hook(lambda _m, state, prefix, *_: stack_parts(state, prefix, into))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.eps = eps
        self.plus_one = plus_one  # Gemma: the scale is (1 + w), w as checkpoints store it
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x):
        # one op (one fused kernel on CUDA), normalised in fp32 as HF does; the weight is
        # applied before the cast back (HF casts, then multiplies: in bf16 about a quarter
        # of the outputs differ from HF's by one ulp; in fp32 on the CPU, bitwise equal)
        w = self.weight + 1 if self.plus_one else self.weight
        return F.rms_norm(x, self.weight.shape, w, self.eps)


def norm(cfg: ModelConfig, dim: int | None = None) -> RMSNorm:
    return RMSNorm(dim or cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)


class Rotary(nn.Module):
    """RoPE cos/sin for a forward's absolute positions (scaling kinds as HF computes them),
    computed once per forward and shared by every layer. Where sliding layers have their
    own base (Gemma 3), their cos/sin follow the global layers' in the last dimension
    ([T, 1, 2D]; `Transformer.layer_step` gives each layer its half)."""

    def __init__(self, cfg: ModelConfig, max_len: int | None = None):
        super().__init__()
        inv, self.scale = rope_frequencies(cfg, max_len or cfg.max_position_embeddings)
        if cfg.local_rope:  # the sliding layers' plain RoPE of their own base
            local = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)
            inv_local, _ = rope_frequencies(local, max_len or cfg.max_position_embeddings)
            inv = inv + inv_local
        self.register_buffer("inv_freq", torch.tensor(inv, dtype=torch.float32), persistent=False)
        self.half = len(inv) if not cfg.local_rope else len(inv) // 2  # D/2 frequencies per kind

    def forward(self, pos: torch.Tensor, dtype):
        """pos [T] -> cos, sin [T, 1, D] in `dtype` (broadcast over the heads of [B, T, H, D]),
        [T, 1, 2D] with a sliding layers' RoPE. sin's first half is negated: `rotate` then
        needs no negation of its own."""
        f = pos.float()[:, None] * self.inv_freq[None, :]  # [T, K*D/2]
        c, s = f.cos(), f.sin()
        if self.scale != 1.0:  # yarn's attention factor: the global RoPE's only
            c[:, : self.half], s[:, : self.half] = c[:, : self.half] * self.scale, s[:, : self.half] * self.scale
        parts = [(c[:, i: i + self.half], s[:, i: i + self.half]) for i in range(0, f.shape[1], self.half)]
        cos = torch.cat([torch.cat([a, a], dim=-1) for a, _ in parts], dim=-1)  # [T, K*D]
        sin = torch.cat([torch.cat([-b, b], dim=-1) for _, b in parts], dim=-1)
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def rotate(x, cos, sin):
    """RoPE on x [B, T, H, D] (rotate-half convention: x*cos + cat(-x2, x1)*sin) with cos,
    sin from `Rotary` (sin's first half negated, so cat(-x2, x1)*sin = cat(x2, x1)*sin'):
    three ops, in x's dtype."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # cat(x2, x1)
    return torch.addcmul(x * cos, swapped, sin)


_ONE_CALL: dict = {}  # head_dim -> the check's verdict, once made


def one_call_ok(head_dim: int) -> bool:
    """Whether attention layers of this head size take `native.rope_attend` (RoPE, the K/V
    write and the attention in one call): the kernel enabled, and its numbers the separate
    steps' (`rotate`, a cache's write, `native.attend`) bit for bit on this machine. rotate's
    bits are torch's (its `addcmul` a fused multiply-add, as the kernel's), which the kernel
    cannot know: so the rotated queries and the K, V rows written are compared once per
    process and head size, on random numbers with a float32 and a bfloat16 cache (the
    attention is `triforce_attend`'s own code with `attend`'s arguments, tested bit for bit
    in tests/test_kernels.py). False: the separate steps."""
    if not native.enabled() or head_dim % 16 or head_dim > 256:  # sizes the kernel takes
        return False
    if head_dim not in _ONE_CALL:
        verdict = _one_call_exact(head_dim)
        if verdict is None:  # the call declined these inputs: no verdict yet
            return False
        _ONE_CALL[head_dim] = verdict
    return _ONE_CALL[head_dim]


def _one_call_exact(D: int) -> bool | None:
    g = torch.Generator().manual_seed(0)
    T, Hq, H, s = 3, 4, 2, 5
    with torch.inference_mode():
        qkv = torch.randn(1, T, Hq + 2 * H, D, generator=g)
        f = torch.randn(T, 1, D // 2, generator=g)
        cos, sin = torch.cat([f.cos(), f.cos()], -1), torch.cat([-f.sin(), f.sin()], -1)
        for dtype in (torch.float32, torch.bfloat16):
            k, v = (torch.randn(1, H, 2 * s, D, generator=g).to(dtype) for _ in range(2))
            k1, v1 = k.clone(), v.clone()
            got = native.rope_attend(qkv, cos, sin, k1, v1, s, s, 0, Hq)
            if got is None:
                return None
            qk = rotate(qkv[:, :, : Hq + H], cos, sin)
            k[:, :, s: s + T] = qk[:, :, Hq:].transpose(1, 2)
            v[:, :, s: s + T] = qkv[:, :, Hq + H:].transpose(1, 2)
            # the attention is triforce_attend's own code with attend's arguments: what can
            # differ is the rotated queries and the rows written
            if not (torch.equal(got[1], qk[:, :, :Hq].transpose(1, 2).reshape(H, Hq // H * T, D))
                    and torch.equal(k1, k) and torch.equal(v1, v)):
                return False
    return True


# torch's global module hooks (nn.modules.module.register_module_forward_hook and the like)
_HOOKS = (_torch_module._global_forward_hooks, _torch_module._global_forward_pre_hooks,
          _torch_module._global_forward_hooks_always_called)


def call(module: nn.Module, *args, **kwargs):
    """module(*args, **kwargs), without nn.Module.__call__'s bookkeeping where no hook can run
    (its own or a global one): a decode step calls three modules per layer, ~3 us each."""
    if module._forward_hooks or module._forward_pre_hooks or any(_HOOKS):
        return module(*args, **kwargs)
    return module.forward(*args, **kwargs)


def project(lin, x, norm=None, glu: bool = False, residual=None):
    """lin(norm(x)) (`glu`: lin(silu(gate) * up) of x = [gate | up]), plus `residual`: in
    one native pass where lin has one (QLinear.fused: int8 activations on the CPU), else
    as the separate ops."""
    y = lin.fused(x, norm, glu, residual) if isinstance(lin, QLinear) else None
    if y is not None:
        return y
    if norm is not None:
        x = norm(x)
    if glu:
        gate, up = x.chunk(2, dim=-1)
        x = by_rows(lambda g, u: F.silu(g) * u, gate, up, dims=(-2, -2))  # per sequence where it matters
    y = lin(x)
    return y if residual is None else residual + y


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # rows: q (n_heads * D), k (n_kv_heads * D), v (n_kv_heads * D); Qwen2's biases likewise
        self.qkv_proj = Linear(cfg.hidden_size, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim,
                               bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
            self.q_norm, self.k_norm = norm(cfg, cfg.head_dim), norm(cfg, cfg.head_dim)
        # Gemma scales scores by query_pre_attn_scalar ** -0.5, attention by head_dim ** -0.5:
        # q carries the ratio (1 where they agree, as in Gemma 3 270M)
        qpas = cfg.query_pre_attn_scalar
        self.q_scale = 1.0 if qpas is None or qpas == cfg.head_dim else (cfg.head_dim / qpas) ** 0.5
        # RoPE, the cache's write and the attention in one native call where the cache offers
        # it (`rope_attend`): nothing between the projection and RoPE, no q scale
        self.one_call = not cfg.qk_norm and self.q_scale == 1.0
        _loads_hf(self, "qkv_proj")

    def forward(self, x, cos, sin, start, cache, norm=None, residual=None):
        """`norm`: x's norm, applied here (fused into the projection where it can be);
        `residual`: added to the output likewise."""
        B, T, _ = x.shape
        Hq, Hkv = self.n_heads, self.n_kv_heads
        qkv = project(self.qkv_proj, x, norm).view(B, T, Hq + 2 * Hkv, self.head_dim)  # [B, T, Hq+2Hkv, D]
        if (self.one_call and B == 1 and qkv.is_cpu and (start is None or isinstance(start, int))
                and one_call_ok(self.head_dim)):  # start None: a ragged forward's rows (batch.rows.Ragged)
            done = cache.rope_attend(self.layer, qkv, cos, sin, start, Hq)
            if done is not None:  # CPU decode, verification or draft steps: ~60 us of ops less per layer
                return project(self.o_proj, done[0], residual=residual)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qkv[:, :, :Hq]), self.k_norm(qkv[:, :, Hq: Hq + Hkv])], 2)
        else:
            qk = qkv[:, :, : Hq + Hkv]
        qk = by_rows(rotate, qk, cos, sin, dims=(1, 0, 0))  # q and k heads in one pass
        q, k, v = qk[:, :, :Hq], qk[:, :, Hq:], qkv[:, :, Hq + Hkv:]  # views
        if self.q_scale != 1.0:
            q = q * self.q_scale
        o = cache.attend(self.layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                         start)  # q [B, Hq, T, D], k, v [B, Hkv, T, D] -> o [B, Hq, T, D]
        return project(self.o_proj, o.transpose(1, 2).reshape(B, T, Hq * self.head_dim), residual=residual)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # rows: gate (intermediate_size), then up (intermediate_size)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # Gemma; else SiLU
        _loads_hf(self, "gate_up_proj")

    def forward(self, x, norm=None, residual=None):
        """`norm`, `residual`: as Attention's."""
        h = project(self.gate_up_proj, x, norm)
        if not self.gelu:
            return project(self.down_proj, h, glu=True, residual=residual)
        gate, up = h.chunk(2, dim=-1)
        act = by_rows(lambda g, u: F.gelu(g, approximate="tanh") * u, gate, up, dims=(-2, -2))
        return project(self.down_proj, act, residual=residual)


class Block(nn.Module):
    """Pre-norm block; Gemma's sandwich adds a norm after attention and after the MLP (its
    `post_attention_layernorm` is the one after attention, `pre_feedforward_layernorm` the
    one before the MLP; in Llama `post_attention_layernorm` is the one before the MLP)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = norm(cfg)
        self.post_attention_layernorm = norm(cfg)
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(cfg)
            self.post_feedforward_layernorm = norm(cfg)

    def forward(self, x, cos, sin, start, cache):
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, start, cache))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.self_attn._forward_hooks or self.mlp._forward_hooks:  # tensor parallel: all-reduced outputs
            x = x + self.self_attn(x, cos, sin, start, cache, norm=self.input_layernorm)
            return x + self.mlp(x, norm=self.post_attention_layernorm)
        x = call(self.self_attn, x, cos, sin, start, cache, norm=self.input_layernorm, residual=x)
        return call(self.mlp, x, norm=self.post_attention_layernorm, residual=x)


class Body(nn.Module):
    """HF's `model.` prefix: embedding, blocks, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = norm(cfg)


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
        # every layer in one native call where it applies (an int start: not a fixed-shape step)
        prog = self._program() if isinstance(start, int) and not torch.compiler.is_compiling() else None
        if prog is None or not prog.run(x, cos, sin, start, cache):
            for i in range(len(self.model.layers)):
                x = self.layer_step(i, x, cos, sin, start, cache)
        cache.end_forward()
        return self.head(x, last_only)

    def _program(self):
        """The layers' native program (model/program.py), built on first use and again where
        its projections' native calls changed since (`Program.current`: an activation
        precision set, a move); None where the layers are not what it computes (asked again
        when the projections' activations change)."""
        got = self.__dict__.get("_prog")
        if got is not None:
            prog, lins, acts = got
            if prog is not None and prog.current():
                return prog
            if prog is None and all(m.act == a for m, a in zip(lins, acts)):
                return None
        else:
            lins = [m for m in self.modules() if isinstance(m, QLinear)]
        prog = Program.build(self, one_call_ok(self.config.head_dim), _HOOKS)
        self.__dict__["_prog"] = (prog, lins, None if prog is not None else [m.act for m in lins])
        return prog

    def _apply(self, fn, *args, **kwargs):  # .to(), .cuda(), ...: the program's pointers go
        self.__dict__.pop("_prog", None)
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):  # a copy builds its own program (this one's points at these modules)
        state = super().__getstate__()
        state.pop("_prog", None)
        return state

    def forward_rows(self, ids: torch.Tensor, pos: torch.Tensor, cache, keep: torch.Tensor) -> torch.Tensor:
        """ids [1, N] of tokens at positions pos [N], which need not follow each other
        (rows of several sequences: `cache` tells them apart, runtime/batch/rows.py) ->
        logits [1, len(keep), V] of the rows `keep`. The cache's attend gets start None."""
        x = self.embed(ids)
        cos, sin = by_rows(lambda p: self.rotary(p, x.dtype), pos, dims=(0,))  # [N, 1, D] each
        cache.begin_forward(None, ids.shape[1])
        prog = self._program() if not torch.compiler.is_compiling() else None
        if prog is None or not prog.run_rows(x, cos, sin, cache):  # else every layer in one native call
            for i in range(len(self.model.layers)):
                x = self.layer_step(i, x, cos, sin, None, cache)
        cache.end_forward()
        return self.head(x[:, keep])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> hidden states [B, T, H] (Gemma: times sqrt(H), rounded to
        the dtype first as HF does)."""
        x = self.model.embed_tokens(ids)
        s = self.config.embed_scale
        return x if s == 1.0 else x * torch.tensor(s, dtype=x.dtype)

    def rope(self, start, T: int, dtype, device):
        """cos, sin [T, 1, D] of positions start..start+T-1 (`start` an int or a device tensor [1])."""
        if isinstance(start, torch.Tensor):
            pos = start + torch.arange(T, device=device, dtype=start.dtype)
        else:
            pos = torch.arange(start, start + T, device=device)
        return self.rotary(pos, dtype)

    def layer_step(self, i: int, x, cos, sin, start, cache) -> torch.Tensor:
        """Layer i over hidden states x [B, T, H] of the tokens at positions start.. (cos,
        sin theirs, from `rope`), attending through `cache`."""
        D = self.config.head_dim
        if cos.shape[-1] > D:  # global RoPE, then the sliding layers' own
            k = D if self.config.layer_types[i] == "sliding_attention" else 0
            cos, sin = cos[..., k: k + D], sin[..., k: k + D]
        return call(self.model.layers[i], x, cos, sin, start, cache)

    def head(self, x: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Hidden states [B, T, H] -> logits [B, T, V] (of the last position only: [B, 1, V])."""
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.model.norm(x))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
