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


class Budget:
    """Bytes the caches of the sequences running at once may take: on the device (a GPU; on a
    CPU the host, where everything lives) and, for offloaded sequences, in host memory. A
    server takes a request's price when it starts and gives it back when it ends."""

    def __init__(self, loaded, device_bytes: int | None = None, host_reserve: int = 0):
        """`device_bytes`: the device budget (default HEADROOM of what is free now);
        `host_reserve`: host bytes kept for something else (a server's kept prefixes)."""
        free_dev = device_available(loaded.device)
        free_host = max(int(HEADROOM * psutil.virtual_memory().available) - host_reserve, 0)
        self.loaded, self.on_host, self.given = loaded, free_dev is None, device_bytes is not None
        self.where = "host memory" if self.on_host else f"{loaded.device} memory"
        self.device = device_bytes if device_bytes is not None else (
            free_host if self.on_host else int(HEADROOM * free_dev))
        self.host = free_host  # offloaded KV (a GPU's runs): pinned host memory
        self.used = (0, 0)

    def price(self, prompt: list[int], opts) -> tuple[int, int]:
        """(device, host) bytes of one sequence's caches, as this budget counts them."""
        d, h = sequence_bytes(self.loaded, prompt, opts)
        return (d + h, 0) if self.on_host else (d, h)

    def refusal(self, need: tuple[int, int], what: str = "this request") -> str | None:
        """Why `need` can never fit, however few others run (None: it can)."""
        if need[0] > self.device:
            return (f"{what} needs {need[0] / 2**30:.2f} GB of KV caches but {self.device / 2**30:.2f} GB "
                    f"of {self.where} is {'given' if self.given else 'free'} for them")
        if need[1] > self.host:
            return (f"{what}'s offloaded KV needs {need[1] / 2**30:.2f} GB of host memory but "
                    f"{self.host / 2**30:.2f} GB is free")
        return None

    def fits(self, need: tuple[int, int]) -> bool:
        return self.used[0] + need[0] <= self.device and self.used[1] + need[1] <= self.host

    def take(self, need: tuple[int, int]):
        self.used = (self.used[0] + need[0], self.used[1] + need[1])

    def give(self, need: tuple[int, int]):
        self.used = (max(self.used[0] - need[0], 0), max(self.used[1] - need[1], 0))


def check_batch(loaded, prompts: list[list[int]], opts: list, budget: int | None = None,
                prefixes: list[tuple] = ()) -> int:
    """Refuse a batch whose caches do not fit: on the device (`budget` bytes if given, else
    HEADROOM of its free memory; the host's on a CPU) and, for offloaded sequences, in host
    memory. `prefixes`: shared prefixes (cache.shared) held once, each sequence starting with
    one holding only its own positions after it. Returns the device bytes it prices."""
    b = Budget(loaded, budget)
    need = [0, 0]
    cfg, elem = loaded.cfg, _elem(loaded.kv_dtype)
    for p, o in zip(prompts, opts):
        d, h = b.price(p, o)
        need = [need[0] + d, need[1] + h]
    for ids in prefixes:
        ring = rollback_depth(opts[0].generation)
        held = cfg.kv_bytes(len(ids), elem, ring) - cfg.kv_bytes(0, elem, ring)  # its global layers' KV
        users = sum(tuple(p[:len(ids)]) == ids for p in prompts)
        need[0] += cfg.kv_bytes(len(ids), elem, ring) - users * held
    why = b.refusal(tuple(need), f"a batch of {len(prompts)} sequences")
    if why:
        raise TriforceError(f"{why}; run fewer sequences at once, shorten the prompts or "
                            "--max-new-tokens, or offload")
    return need[0]
