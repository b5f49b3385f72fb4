"""Rank bodies for tests/test_tp.py: spawned ranks import these by name.

Results go back to the parent as plain lists (not tensors) so no shared-memory handle
outlives the rank that made it.
"""
from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from triforce_offload.runtime.model import tp
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.model.config import ModelConfig
from triforce_offload.runtime.generate import decode, prefill
from triforce_offload.runtime.model.transformer import Transformer
from triforce_offload.runtime.sampling import SamplingParams

# tiny configs: plain GQA, KV heads fewer than ranks (replicated), MHA, Qwen2 with q/k/v bias
CONFIGS = {
    "llama-gqa": dict(n_heads=4, n_kv_heads=2),
    "llama-kv1": dict(n_heads=4, n_kv_heads=1),
    "llama-mha": dict(n_heads=4, n_kv_heads=4),
    "qwen2-bias": dict(arch="qwen2", n_heads=4, n_kv_heads=2, attention_bias=True),
}


def tiny(name: str) -> ModelConfig:
    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, n_layers=3,
                       head_dim=16, max_position_embeddings=256, **CONFIGS[name])


def build(name: str, seed: int = 0) -> Transformer:
    """The same random model on every rank (same seed)."""
    torch.manual_seed(seed)
    m = Transformer(tiny(name)).eval().requires_grad_(False)
    if m.config.attention_bias:  # random biases, so that sharding them is really tested
        for b in m.model.layers:
            b.self_attn.qkv_proj.bias.normal_(0, 0.5)  # q, k and v rows
    return m


def run_model(name: str, prompt: list[int], n_new: int) -> dict:
    """Shard (if in a group), prefill, greedy-decode: logits, tokens and cache head counts."""
    m = build(name)
    cfg = m.config
    if dist.is_initialized():
        cfg = tp.shard_model(m, cfg, dist.get_rank(), dist.get_world_size())
    cache = FullCache(cfg, 128)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        full = m(ids, 0, cache)[0]  # [T, V]
        cache.commit(len(prompt))
        toks = decode(m, cache, full[-1:], len(prompt), SamplingParams(), n_new, set())
    return {"logits": full.tolist(), "tokens": toks, "cache_kv_heads": cache.k[0].shape[1]}


def run_all(prompt: list[int], n_new: int) -> dict:
    return {name: run_model(name, prompt, n_new) for name in CONFIGS}


def sampled(seed, n_new: int) -> list[int]:
    """Temperature sampling with a run seed from sync_sampling (None: rank 0 draws one)."""
    m = build("llama-gqa")
    cfg = tp.shard_model(m, m.config, dist.get_rank(), dist.get_world_size())
    sp = tp.sync_sampling(SamplingParams(temperature=1.0, seed=seed))
    cache = FullCache(cfg, 128)
    with torch.inference_mode():
        logits = prefill(m, cache, torch.tensor([[1, 2, 3]]))
        return decode(m, cache, logits, 3, sp, n_new, set())


def die_mid_run(victim: int, steps: int = 1000):
    """Forward passes in a loop; rank `victim` kills itself (SIGKILL) after 3 of them."""
    m = build("llama-gqa")
    cfg = tp.shard_model(m, m.config, dist.get_rank(), dist.get_world_size())
    with torch.inference_mode():
        for i in range(steps):
            if i == 3 and dist.get_rank() == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            m(torch.tensor([[1, 2]]), 0, FullCache(cfg, 8))
    return "finished"


def raise_user_error():
    from triforce_offload.runtime.errors import TriforceError
    raise TriforceError("bad value 7; allowed: 1-3")


class _NoTokenizer:
    eos_token_id = None


# (model, mode, extra): every mode through api.generate, greedy
MODE_CASES = [
    ("llama-gqa", "autoregressive", {}),
    ("llama-gqa", "triforce", dict(budget=16, retrieval_chunk=4, gamma1=2, gamma2="3")),
    ("qwen2-bias", "triforce", dict(budget=16, retrieval_chunk=4, draft="self", gamma2="auto")),
    ("llama-kv1", "retrieval", dict(budget=16, retrieval_chunk=4, offload="on", on_chip=1, transfer_chunk=8)),
    ("llama-gqa", "triforce", dict(budget=16, retrieval_chunk=4, offload="on", transfer_chunk=8)),
    ("llama-mha", "autoregressive", dict(offload="on", on_chip=1, transfer_chunk=8)),
]


def run_modes(prompt: list[int], n_new: int) -> list[dict]:
    """api.generate for every MODE_CASES entry on the (sharded, if in a group) tiny model."""
    from triforce_offload.runtime import api
    out = []
    for name, mode, extra in MODE_CASES:
        m = build(name)
        loaded = tp.shard(api.Loaded(m, m.config, _NoTokenizer(), torch.device("cpu"), torch.float32))
        opts = api.RunOptions.of(mode=mode, max_new_tokens=n_new, **dict(extra), ignore_eos=True)
        toks, st = api.generate(loaded, prompt, opts)
        out.append({"tokens": toks, "kv_heads": loaded.cfg.n_kv_heads,
                    "offloaded": bool(st.extra.get("offload"))})
    return out


def run_sized_by_rank(prompt: list[int], n_new: int) -> dict:
    """draft mode where each rank prices verification widths differently (rank 0: rows
    nearly free, the others: each row a whole forward), as local timings would: the n-gram
    drafter's sizes must still be rank 0's on every rank."""
    from triforce_offload.runtime import api
    from triforce_offload.runtime.spec import engine
    rank = dist.get_rank() if dist.is_initialized() else 0
    engine.Engine.relative = lambda self, i: (lambda w: 1.0 + 0.01 * (w - 1)) if rank == 0 else float
    m = build("llama-gqa")
    loaded = tp.shard(api.Loaded(m, m.config, _NoTokenizer(), torch.device("cpu"), torch.float32))
    opts = api.RunOptions.of(mode="draft", max_new_tokens=n_new, gamma1=4, ignore_eos=True)
    toks, st = api.generate(loaded, prompt, opts)
    return {"tokens": toks, "drafted": st.extra["drafts"]["ngram"]["drafted"]}


def stall(victim: int):
    """Rank `victim` stops responding (alive, no collective); the others wait in one."""
    import time
    if dist.get_rank() == victim:
        time.sleep(600)
    dist.all_reduce(torch.ones(4))
    return "finished"


def step_figures() -> dict:
    """A graphs-on Step over a static (fixed-shape) cache in a tensor-parallel group: its
    figures for the stats line, and the greedy tokens it decoded."""
    from triforce_offload.runtime.graphs import Step
    m = build("llama-gqa")
    cfg = tp.shard_model(m, m.config, dist.get_rank(), dist.get_world_size())
    cache = FullCache(cfg, 64, static=True)
    step = Step(m, cache, graphs=True)
    with torch.inference_mode():
        logits = prefill(m, cache, torch.tensor([[1, 2, 3]]))
        toks = decode(m, cache, logits, 3, SamplingParams(), 4, set(), step=step)
    return {"figures": step.figures(), "graphed": step.graphed, "tokens": toks}
