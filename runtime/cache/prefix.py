"""Full caches that outlive their runs: KV reuse across requests (`serve`).

After a run its full cache (FullCache, or OffloadedCache with its KV in host memory) is
kept with the token ids whose KV it holds (prompt + generated tokens). A later prompt that
shares a prefix with a kept entry starts from that KV and prefills only the rest; always
at least its last token, whose forward gives the first logits and the queries the
retrieval level is built from. The levels above the full cache (retrieval cache, drafters)
are rebuilt from it as after any prefill, so the output is the cold start's.

An entry is taken over when the prompt reuses most of it (this run's entry supersedes it)
and it has room; otherwise the shared prefix is copied into a new cache and the entry
stays for other prompts. Entries are evicted least recently used first to stay within
`max_bytes`. With a KVDir (`--kv-dir`) every kept cache is also saved to disk, and a
prefix that is longer on disk than in memory is loaded from there. Models with window
layers keep their rings: an entry serves a prompt sharing n of its tokens only when its
rings hold the band a forward at n reads (`cache.band_held`, the rule of --kv-dir entries
too), and a prompt that leaves the kept tokens earlier prefills cold; with a KVDir the
rings' positions at the end of the prompt are copied out (`WindowRing.mark`) for the
saved entry, which then serves that prompt again too. A kept cache was
closed after its run (finish_stats): an offloaded one's copier thread starts again on
its next use.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ...kernels import native
from .kv import copy_prefix, exact_bands, held_from
from .disk import KVDir, covers, longest_prefix
from .shared import seed
from ..options import parse_size

ROOM = 1024  # kept caches' capacity is a multiple of this many tokens


def prefix_store(o, loaded, memory: bool, note=print, save_later: bool = False):
    """The PrefixCache for ReuseOptions `o`: host memory up to --kv-cache-mem (`memory`:
    serve) and --kv-dir; None when neither is asked for."""
    disk = None
    if o.kv_dir:
        disk = KVDir(o.kv_dir, parse_size(o.kv_dir_limit), loaded, note)
    mem = parse_size(o.kv_cache_mem) if memory else 0
    return PrefixCache(mem, disk, save_later) if mem or disk else None


@dataclass(eq=False)  # compared by identity (numpy ids have no truth value)
class Entry:
    ids: np.ndarray  # token ids whose KV the cache holds, [n] int64
    cache: object  # a full cache committed to len(ids)
    held: list  # the spans [lo, hi) its window layers hold: [[cache.held_from, len(ids)]]
    act: str = ""  # the activations the KV was computed with (quantized.activations_set)


class PrefixCache:
    def __init__(self, max_bytes: int, disk=None, save_later: bool = False):
        self.max_bytes = max_bytes  # kept caches' bytes at most (cache.nbytes())
        self.disk = disk  # a cache.disk.KVDir (--kv-dir): runs' KV saved there, prefixes loaded
        self.save_later = save_later  # keep() queues the disk save for save() (the server)
        self.entries: list[Entry] = []  # least recently used first
        self.unsaved: list[tuple] = []  # (cache, ids, activations) to write to disk
        self.lock = threading.Lock()  # /metrics reads nbytes from another thread
        # take / keep / save one at a time: the runs of a batch (runtime/batch) lease from
        # the store from their own threads
        self.busy = threading.RLock()

    def nbytes(self) -> int:
        with self.lock:
            return sum(e.cache.nbytes() for e in self.entries)

    def match(self, prompt: list[int], act: str = "") -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `prompt` and that length, at most
        len(prompt) - 1 (the last prompt token is always prefilled), of those whose window
        layers' rings hold that prefix's band (`resumable`) and whose KV was computed with the
        run's activations `act` (int8 or float activations write other values)."""
        return longest_prefix(((e, e.ids) for e in self.entries if e.act == act), prompt,
                              lambda e, n: e.cache.resumable(n))

    def take(self, prompt: list[int], capacity: int, make, act: str = "") -> tuple[object, int, str | None]:
        """(a full cache of at least `capacity` tokens holding the KV of prompt[:n], n, where
        the KV came from: "memory", "disk" or None); `make(capacity)` builds a new cache,
        with room to spare (a follow-up's longer prompt then fits without a copy)."""
        self.save()
        new = lambda: make(-(-capacity // ROOM) * ROOM)
        with self.lock:
            e, n = self.match(prompt, act)
        name, n_disk = self.disk.match(prompt, act) if self.disk else (None, 0)
        if n_disk > n:
            cache = new()
            if self.disk.load(name, cache, n_disk):
                return cache, n_disk, "disk"
            if e is None:
                return cache, 0, None  # a failed load committed nothing
        if e is None:
            return new(), 0, None
        with self.lock:
            self.entries.remove(e)
            superseded = 2 * n >= len(e.ids)  # this run's entry will hold most of it
            if not superseded:
                self.entries.append(e)  # most recently used
        if superseded and e.cache.capacity >= capacity:
            e.cache.rollback(n)  # to the shared prefix
            return e.cache, n, "memory"
        cache = new()
        copy_prefix(e.cache, cache, n)
        if superseded:
            e.cache.close()
        return cache, n, "memory"

    def keep(self, cache, ids: list[int], act: str = ""):
        """Keep `cache` holding the KV of ids[:cache.length] (and save it to disk); drops
        entries it covers (`disk.covers`) and evicts the least recently used ones beyond
        max_bytes."""
        cache.hold(None)  # a layer-major prefill may have been cancelled
        n = min(cache.length, len(ids))
        if self.disk is not None and n:
            self.unsaved.append((cache, ids[:n], act))  # saved later (the server): act travels with it
            if not self.save_later:
                self.save()
        if n == 0 or cache.nbytes() > self.max_bytes:
            return cache.close()
        new = Entry(np.asarray(ids[:n], dtype=np.int64), cache, [[held_from(cache, n), n]], act)
        with self.lock:
            gone = [e for e in self.entries if covers(new.ids, new.held, e.ids, e.held) and e.act == act]
            self.entries = [e for e in self.entries if e not in gone] + [new]
            while sum(e.cache.nbytes() for e in self.entries) > self.max_bytes:
                gone.append(self.entries.pop(0))
        for e in gone:
            e.cache.close()

    def save(self):
        """Write the queued KV to disk (before the cache can be taken again)."""
        with self.busy:
            self._save()

    def _save(self):
        while self.unsaved:
            cache, ids, act = self.unsaved.pop(0)
            self.disk.save(cache, ids, act)
            if cache.ring is not None:
                cache.ring.mark(None)  # the prompt's copy of the rings is on disk now

    def clear(self):
        with self.lock:
            gone, self.entries = self.entries, []
        for e in gone:
            e.cache.close()


class Lease:
    """One run's full cache: `cache` holds the KV of prompt[:start] (from `source`, taking
    `take_s` seconds); the run sets `ids` to the tokens its cache holds at the end (prompt
    + generated) to keep them."""

    def __init__(self, cache, start: int, ids: list[int], source=None, take_s: float = 0.0):
        self.cache, self.start, self.ids, self.source, self.take_s = cache, start, ids, source, take_s
        self.kept = False  # from a PrefixCache: report() adds the reuse figures

    def report(self, st):
        """Add the reuse to the run's Stats: its time to the prefill, what it reused."""
        if self.kept:
            st.prefill_s += self.take_s
            st.extra.update(reused_tokens=self.start, reused_from=self.source)


def numerics(loaded) -> str:
    """What the KV a run writes was computed with, beyond the model and its KV dtype: the
    activations (quantized.activations_set) with the int8 kernel's arithmetic and, on a CPU, whether attention rounds queries
    and probabilities to bfloat16 (native.bf16_dot) and how window layers attend. Kept prefixes and --kv-dir entries
    serve runs of the same numerics only: other numerics, other values."""
    act = getattr(loaded.model, "activations_now", "")
    if act:  # the int8 kernel's arithmetic since 4dd32b3: one rounding per unit of inputs
        act += "+linear:unit"
    if loaded.device.type == "cpu" and native.bf16_dot(loaded.kv_dtype, loaded.cfg.head_dim):
        act += "+attention:bf16"
    if any(w is not None for w in loaded.cfg.windows) and exact_bands(loaded.cfg, loaded.device):
        act += "+window:bands"  # window layers' rows by the native kernel's bands (cache.kv._cpu_bands)
    return act


@contextmanager
def lease(loaded, prompt: list[int], capacity: int, make):
    """A Lease from `loaded.prefix` (a PrefixCache; None: a new cache from position 0),
    handed back on exit, also after an error or a cancel (then with what it holds of the
    prompt: the committed length bounds what is kept)."""
    store = getattr(loaded, "prefix", None)
    shared = getattr(loaded, "shared", None)
    act = numerics(loaded) if store is not None or shared is not None else ""
    seg = shared.take(prompt, act) if shared is not None else None
    if seg is None and shared is not None and shared.seed_bytes and store is not None:
        seg = seed(loaded, store, shared, prompt, act)  # from a kept prefix (serve)
    if seg is not None:  # a shared prefix: held once, read by every sequence it starts
        cache = make(capacity)
        if cache.share(seg.cache):
            out = Lease(cache, seg.length, prompt, "shared")
            out.kept = True
            try:
                yield out
            finally:  # not kept: its bytes past the segment are a follow-up's to prefill
                shared.release(seg)
                cache.close()
            return
        shared.release(seg, shared=False)
        cache.close()
    if store is None:
        yield Lease(make(capacity), 0, prompt)
        return
    t0 = time.perf_counter()
    with store.busy:
        cache, start, source = store.take(prompt, capacity, make, act)
    if cache.ring is not None:  # the entry saved to disk then serves this prompt again too
        cache.ring.mark(len(prompt) if store.disk is not None else None)
    out = Lease(cache, start, prompt, source, time.perf_counter() - t0)
    out.kept = True
    try:
        yield out
    finally:
        with store.busy:
            store.keep(out.cache, out.ids, act)
