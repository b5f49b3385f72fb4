"""What a batch's caches take, priced before any sequence starts.

Each sequence's full cache (its capacity: prompt, new tokens and the look-ahead slack; window
layers in rings), its retrieval cache where its mode builds one, and a self-drafter's
streaming cache, at the loaded KV dtype: the bytes `offloaded.check_resident` and
`retrieval_slots` count for one run, summed. Where the caches live: on the device (a GPU's
free memory; on a CPU, host memory); an offloaded sequence's full KV in pinned host memory.
A batch over the budget is refused in one line that gives the numbers, before anything is
allocated.
"""
from __future__ import annotations

import psutil

from ...offload.store import _elem, device_available
from ..spec.engine import rollback_depth
from ..errors import TriforceError
from ..generate import capacity
from ..cache.retrieval import RetrievalCache

HEADROOM = 0.9  # of the free memory a batch may plan to take (activations, allocator slack)


def sequence_bytes(loaded, prompt: list[int], opts) -> tuple[int, int]:
    """(device bytes, host bytes) one sequence's caches take: its full cache (on the host
    when offloaded), its retrieval cache, a self-drafter's streaming cache."""
    from ..spec.modes import retrieval_slots  # spec.modes imports generate, which the batch imports
    cfg, elem = loaded.cfg, _elem(loaded.kv_dtype)
    ring = rollback_depth(opts.generation)
    cap, _ = capacity(loaded, len(prompt), opts)
    full = cfg.kv_bytes(cap, elem, ring)
    slots = retrieval_slots(opts.mode, loaded, len(prompt), opts)
    dev = RetrievalCache.bytes_for(cfg, slots, loaded.kv_dtype, ring_depth=ring) if slots else 0
    g = opts.generation
    if opts.mode in ("triforce", "draft") and g.draft == "self":
        dev += cfg.kv_bytes(g.draft_sink + g.draft_window + max(64, g.gamma1 + 16), elem, ring)
    if opts.offload.offload == "on":
        return dev, full
    return dev + full, 0


def check_batch(loaded, prompts: list[list[int]], opts: list, budget: int | None = None) -> int:
    """Refuse a batch whose caches do not fit: on the device (`budget` bytes if given, else
    HEADROOM of its free memory; the host's on a CPU) and, for offloaded sequences, in host
    memory. Returns the device bytes it prices."""
    dev = host = 0
    for p, o in zip(prompts, opts):
        d, h = sequence_bytes(loaded, p, o)
        dev, host = dev + d, host + h
    free_dev = device_available(loaded.device)
    free_host = psutil.virtual_memory().available
    on_host = free_dev is None  # a CPU: the caches are host memory
    limit = budget if budget is not None else int(HEADROOM * (free_host if on_host else free_dev))
    need = dev + (host if on_host else 0)
    where = "host memory" if on_host else f"{loaded.device} memory"
    if need > limit:
        raise TriforceError(f"a batch of {len(prompts)} sequences needs {need / 2**30:.2f} GB of KV caches but "
                            f"{limit / 2**30:.2f} GB of {where} is {'given' if budget is not None else 'free'}; "
                            "run fewer sequences at once, shorten the prompts or --max-new-tokens, or offload")
    if not on_host and host > HEADROOM * free_host:
        raise TriforceError(f"a batch's offloaded KV needs {host / 2**30:.2f} GB of host memory but "
                            f"{free_host / 2**30:.2f} GB is free; run fewer sequences at once")
    return need
