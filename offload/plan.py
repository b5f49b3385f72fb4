"""Memory planning: choose TriForce run settings for a machine, model and context.

A grid search in the spirit of FlexGen's policy search (Sheng et al. 2023), over the
cost model in `costmodel`: retrieval budget, gamma1, gamma2, transfer chunk; for each
point the on-chip layers are the most that fit (more on-chip KV never costs time).
Every candidate must fit GPU memory (weights shard + L1 retrieval cache + draft +
staging buffers + on-chip KV + window layers' rings, after a reserve) and host memory
(offloaded KV). Only global layers count as on-chip or offloaded KV: a window layer is a
ring of window + γ1 + γ2 + 2 tokens on the device (costmodel assumption 11).

Acceptance depends on the budget, which the search varies, so the L1->L2 acceptance is
given at a reference budget and scaled by a heuristic (`alpha_at_budget`): the miss
rate falls as 1/sqrt(budget). This is an assumption loosely following the TriForce
paper's observation that acceptance rises with budget with diminishing returns; pass
measured rates when you have them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .costmodel import (GIB, LLAMA_68M, Hardware, ModelSpec, Settings, gpu_capacity,
                        host_capacity, max_on_chip, memory_use, predict)

BUDGETS = tuple(2 ** i for i in range(10, 15))  # 1024 .. 16384 tokens
GAMMA1S = (1, 2, 3, 4)  # L0 drafts per L1 verification
GAMMA2S = tuple(range(1, 13))  # L1 tokens per L2 verification
TRANSFER_CHUNKS = tuple(2 ** i for i in range(6, 15))  # 64 .. 16384 tokens
REF_BUDGET = 4096  # budget at which alpha1 is given


@dataclass(frozen=True)
class Plan:
    """Chosen settings with their predicted speed and memory."""

    hardware: Hardware
    model: ModelSpec
    settings: Settings  # on_chip resolved to a number
    ms_per_token: float  # predicted TriForce ms/token
    baseline_ms: float  # predicted autoregressive offloading ms/token, same machine
    gpu_gb: float  # GiB per GPU
    host_gb: float  # GiB of host memory for the offloaded KV
    tp: int  # tensor-parallel degree
    gpu_parts: dict = field(default_factory=dict)  # GiB per GPU by item (costmodel.Memory.parts)

    @property
    def batch(self) -> int:
        return self.settings.batch

    @property
    def tokens_per_s(self) -> float:
        """Predicted aggregate TriForce tokens/s over the batch."""
        return self.batch * 1e3 / self.ms_per_token


def alpha_at_budget(alpha_ref: float, budget: int, ref: int = REF_BUDGET) -> float:
    """L1 acceptance at `budget` from a rate measured at `ref` (heuristic, see above)."""
    miss = (1.0 - alpha_ref) * math.sqrt(ref / budget)
    return min(max(1.0 - miss, 0.0), 1.0)


def _budgets(context: int, retrieval_chunk: int) -> list[int]:
    """Candidate budgets: powers of two below the context, multiples of the retrieval chunk."""
    c = retrieval_chunk
    out = [b for b in BUDGETS if b < context and b % c == 0]
    return out or [max(c, context // 2 // c * c)]


def search_plan(hw: Hardware, model: ModelSpec, context: int,
                gpu_mem_gb: float | None = None, host_mem_gb: float | None = None,
                alpha0: float = 0.6, alpha1: float = 0.9, retrieval_chunk: int = 8,
                draft: ModelSpec | None = LLAMA_68M, tp: int = 0, batch: int = 1) -> Plan:
    """Lowest predicted ms/token TriForce settings that fit; ValueError if none fit.

    gpu_mem_gb / host_mem_gb override the hardware's memory (GiB per GPU / in total);
    alpha1 is the L1 acceptance at REF_BUDGET tokens; `batch` sequences of `context` tokens
    each decode together (costmodel assumption 12).
    """
    if context <= 0:
        raise ValueError(f"context must be positive, got {context}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    hw = replace(hw, gpu_mem_gb=gpu_mem_gb or hw.gpu_mem_gb,
                 host_mem_gb=host_mem_gb or hw.host_mem_gb)
    base = Settings(context=context, retrieval_chunk=retrieval_chunk, alpha0=alpha0,
                    draft=draft, tp=tp or hw.gpus, batch=batch)
    _check_fits(hw, model, base)
    best = None
    for s in _candidates(hw, model, base, alpha1):
        ms = predict(hw, model, s, "triforce").ms_per_token
        if best is None or ms < best[0]:
            best = (ms, s)
    if best is None:  # nothing passed the host check with any budget
        _check_fits(hw, model, base, strict=True)
    return _plan(hw, model, *best)


def _candidates(hw, model, base, alpha1):
    """Fitting settings over the grid, on_chip maximal for each (memory counted at the
    deepest window rings the gammas give: shallower ones fit too)."""
    g1s = GAMMA1S if base.draft is not None else (0,)
    for b in _budgets(base.context, base.retrieval_chunk):
        a1 = alpha_at_budget(alpha1, b)
        for tc in TRANSFER_CHUNKS:
            s = replace(base, budget=b, transfer_chunk=tc, alpha1=a1, gamma1=g1s[-1], gamma2=GAMMA2S[-1])
            if not _gpu_fits(hw, model, s, 0):
                continue
            s = replace(s, on_chip=max_on_chip(hw, model, s, "triforce"))
            if memory_use(hw, model, s).host_gb * GIB > host_capacity(hw):
                continue
            for g1 in g1s:
                for g2 in GAMMA2S:
                    yield replace(s, gamma1=g1, gamma2=g2)


def _gpu_fits(hw, model, s, on_chip) -> bool:
    m = memory_use(hw, model, replace(s, on_chip=on_chip))
    return m.gpu_gb * GIB <= gpu_capacity(hw)


def _check_fits(hw, model, base, strict=False) -> None:
    """Raise a one-line ValueError when even the smallest configuration cannot fit."""
    small = replace(base, budget=_budgets(base.context, base.retrieval_chunk)[0],
                    transfer_chunk=TRANSFER_CHUNKS[0], gamma1=GAMMA1S[0], gamma2=GAMMA2S[0])
    need = memory_use(hw, model, replace(small, on_chip=0)).gpu_gb
    have = gpu_capacity(hw) / GIB
    seqs = f" for {base.batch} sequences" if base.batch > 1 else ""
    if need > have:
        raise ValueError(f"{model.name} on {hw.name}: needs {need:.1f} GiB per GPU{seqs} "
                         f"(weights shard, retrieval cache, draft, staging"
                         f"{', window rings' if model.n_window else ''}), "
                         f"{have:.1f} GiB available")
    on = max_on_chip(hw, model, small, "triforce")
    host = memory_use(hw, model, replace(small, on_chip=on)).host_gb
    hhave = host_capacity(hw) / GIB
    if host > hhave or strict:
        raise ValueError(f"{model.name} at {base.context} tokens on {hw.name}: needs "
                         f"{host:.1f} GiB host memory for the offloaded KV cache{seqs}, "
                         f"{hhave:.1f} GiB available")


def _plan(hw, model, ms, s) -> Plan:
    if model.chip_globals(s.on_chip) == model.n_global:  # nothing streams: the chunk is moot
        s = replace(s, transfer_chunk=Settings.transfer_chunk)
    mem = memory_use(hw, model, s)
    ar = replace(s, on_chip=None)  # the baseline fills the GPU with KV instead
    base_ms = predict(hw, model, ar, "autoregressive").ms_per_token
    return Plan(hw, model, s, ms, base_ms, mem.gpu_gb, mem.host_gb, s.tp or hw.gpus, mem.parts)

