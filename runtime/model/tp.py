"""Tensor parallelism: a sharding pass applied after load (gpt-fast's tp.py is the model).

Per layer, rank r of W keeps:
- of the stacked qkv_proj, the q rows of its n_heads/W query heads, then the k rows and
  the v rows of the KV heads those queries read (biases too, for Qwen2), stacked again in
  that order: column-parallel, no communication;
- o_proj columns of its query heads: row-parallel, so its output is a partial sum;
- of the stacked gate_up_proj, its 1/W of the gate rows, then the same 1/W of the up rows;
  down_proj columns of that 1/W of the MLP width.
A forward hook all-reduces the attention output and the MLP output: exactly two
collectives per layer, the minimum for Megatron-style sharding (consumer GPUs without
peer-to-peer route each all-reduce through host memory, so the count matters).

Grouped-query models with fewer KV heads than ranks replicate KV heads: each rank keeps
the one KV head its query heads share. The head counts are fixed on the modules and in a
per-rank `ModelConfig` before any cache is built, so every cache and host store sized
from that config holds only this rank's KV heads.

Kept replicated on every rank: the embedding, the norms and the LM head. Sharding the
vocabulary would add a third collective per forward (an all-gather of logits, which
sampling needs whole) for a matrix that is about 2% of Llama2-7B; replicated,
every rank computes bitwise-identical logits from the identical all-reduced hidden
state. A draft model (TriForce L0) is likewise left unsharded: it is small, runs with no
collectives at all, and every rank drafts the same tokens from it.

Sampling in lockstep: every rank holds identical logits, so one seed per run, chosen
by rank 0 and broadcast (`sync_sampling`), makes every accept/reject decision agree.
"""
from __future__ import annotations

import dataclasses
import random

import torch
import torch.distributed as dist
import torch.nn as nn

from .config import ModelConfig
from ..errors import TriforceError
from ..hostread import to_host


def check(cfg: ModelConfig, world: int, what: str = "--tp"):
    """Raise a clear error unless `world` ranks can split this model."""
    if world < 1:
        raise TriforceError(f"{what} {world}: must be >= 1")
    if cfg.n_heads % world:
        ok = [w for w in range(1, cfg.n_heads + 1) if _fits(cfg, w)]
        raise TriforceError(f"{what} {world} does not divide the model's {cfg.n_heads} attention "
                            f"heads; allowed: {', '.join(map(str, ok))}")
    if not _kv_fits(cfg, world):
        raise TriforceError(f"{what} {world}: the {cfg.n_kv_heads} KV heads can be neither split "
                            f"nor replicated over {world} ranks (need one to divide the other)")
    if cfg.intermediate_size % world:
        raise TriforceError(f"{what} {world} does not divide the MLP width {cfg.intermediate_size}")


def _kv_fits(cfg, world) -> bool:
    return cfg.n_kv_heads % world == 0 or world % cfg.n_kv_heads == 0


def _fits(cfg, world) -> bool:
    return (cfg.n_heads % world == 0 and _kv_fits(cfg, world)
            and cfg.intermediate_size % world == 0)


def rank_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The per-rank config: this rank's query/KV heads and MLP width."""
    if world == 1:
        return cfg
    return dataclasses.replace(cfg, n_heads=cfg.n_heads // world,
                               n_kv_heads=max(cfg.n_kv_heads // world, 1),
                               head_dim=cfg.head_dim,
                               intermediate_size=cfg.intermediate_size // world)


def kv_heads(cfg: ModelConfig, r: int, world: int) -> range:
    """Indices of the KV heads rank r keeps (one shared head when KV heads < ranks)."""
    hq = cfg.n_heads // world
    first = r * hq // cfg.group  # the KV head of this rank's first query head
    return range(first, first + max(cfg.n_kv_heads // world, 1))


def _rows(t: torch.Tensor, idx: range, width: int) -> torch.Tensor:
    """Rows idx*width .. of a [out, in] weight or [out] bias, as a fresh tensor."""
    return t[idx.start * width: idx.stop * width].clone()


def _pick(t: torch.Tensor, sizes: list[int], picks: list[range], width: int) -> torch.Tensor:
    """Of a stacked weight or bias (parts of `sizes` rows, e.g. q, k, v), the rows `picks[i]`
    (in blocks of `width`) of each part i, stacked again in the same order."""
    return torch.cat([_rows(p, idx, width) for p, idx in zip(t.split(sizes), picks)])


def _set(lin: nn.Linear, w: torch.Tensor, b: torch.Tensor | None = None):
    lin.weight = nn.Parameter(w, requires_grad=False)
    if b is not None:
        lin.bias = nn.Parameter(b, requires_grad=False)
    lin.out_features, lin.in_features = w.shape


def _shard_attention(attn, cfg: ModelConfig, r: int, world: int):
    D, hq = cfg.head_dim, cfg.n_heads // world
    q_idx, kv_idx = range(r * hq, (r + 1) * hq), kv_heads(cfg, r, world)
    sizes = [cfg.n_heads * D, cfg.n_kv_heads * D, cfg.n_kv_heads * D]  # q, k, v rows
    picks = [q_idx, kv_idx, kv_idx]
    qkv = attn.qkv_proj
    b = None if qkv.bias is None else _pick(qkv.bias, sizes, picks, D)
    _set(qkv, _pick(qkv.weight, sizes, picks, D), b)
    # o_proj [hidden, Hq*D]: keep this rank's input columns; output is a partial sum
    _set(attn.o_proj, _rows(attn.o_proj.weight.t(), q_idx, D).t().contiguous())
    attn.n_heads, attn.n_kv_heads = hq, len(kv_idx)


def _shard_mlp(mlp, cfg: ModelConfig, r: int, world: int):
    w = cfg.intermediate_size // world
    idx = range(r, r + 1)
    _set(mlp.gate_up_proj, _pick(mlp.gate_up_proj.weight, [cfg.intermediate_size] * 2, [idx, idx], w))
    _set(mlp.down_proj, _rows(mlp.down_proj.weight.t(), idx, w).t().contiguous())


def _all_reduce_hook(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(out)  # partial sums of the row-parallel projection -> the full output
    return out


def shard_model(model: nn.Module, cfg: ModelConfig, r: int, world: int) -> ModelConfig:
    """Shard `model` (built from the full `cfg`) in place for rank r of `world`.

    Returns the per-rank config (also set as `model.config`); a no-op at world size 1.
    """
    if world == 1:
        return cfg
    check(cfg, world)
    for block in model.model.layers:
        _shard_attention(block.self_attn, cfg, r, world)
        _shard_mlp(block.mlp, cfg, r, world)
        block.self_attn.register_forward_hook(_all_reduce_hook)
        block.mlp.register_forward_hook(_all_reduce_hook)
    model.config = rank_config(cfg, world)
    model.tp = (r, world)  # (rank, world size), for engines and stats
    return model.config


def shard_fn():
    """`shard(model, cfg) -> cfg` for this process's rank (what `api.load(shard=)` takes),
    or None outside a process group of several ranks."""
    if not _multi():
        return None
    r, world = dist.get_rank(), dist.get_world_size()
    return lambda model, cfg: shard_model(model, cfg, r, world)


def shard(loaded):
    """Shard a loaded model (runtime.api.Loaded) for this process's rank; returns it.

    Uses the joined process group; a no-op outside one or at world size 1.
    """
    if not _multi():
        return loaded
    loaded.cfg = shard_model(loaded.model, loaded.cfg, dist.get_rank(), dist.get_world_size())
    return loaded


def _multi() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree(x: int) -> int:
    """Rank 0's value, on every rank: for decisions made from local measurements (timings,
    e.g. --gamma2 auto), which would otherwise send ranks down different paths."""
    if not _multi():
        return x
    t = torch.tensor([x], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.broadcast(t, src=0)
    return to_host(t)[0]


def sync_sampling(sp):
    """Same seed on every rank: rank 0's seed (drawn if none) broadcast to all.

    Also seeds torch's global generator with it, so any sampling that does not pass a
    generator stays in lockstep as well. Returns SamplingParams with the seed set.
    """
    if not _multi():
        return sp
    seed = agree(sp.seed if sp.seed is not None else random.SystemRandom().randrange(2**62))
    torch.manual_seed(seed)
    return dataclasses.replace(sp, seed=seed)

