"""Shared prefixes: sequences whose prompts start with the same tokens hold that prefix's
KV once, and a batch's round computes attention over it once for all of them.

A `Segment` is the KV of one prefix (a FullCache committed to its length, never written
again), prefilled once. A sequence whose prompt starts with it leases a full cache that
`share`s it (`cache.kv.FullCache.share`): the cache holds only the positions after the
prefix (window layers copy its band into their rings) and starts its prefill there. Its
attention over the prefix runs on the native kernel's per-block results
(`kernels.native.attend_parts`): in a batch's round the query rows of every sequence
sharing a segment go through one call over the prefix's keys, read once
(`batch.rows.Ragged`); each sequence then finishes over its own keys
(`native.attend(..., pre=...)`), merging every block in key order as one call over all its
keys in one buffer would. So an answer equals its solo answer bit for bit, as long as the
prefix's KV is what the solo prefill writes: its length is a multiple of the kernel's
key block (native.BLOCK), and of the prefill chunk where a prefill's KV depends on where
its chunks end (`batch.rows.chunk_invariant`).

`Shared` holds a loaded model's segments (`api.Loaded.shared`); `cache.prefix.lease`
hands a sequence the longest one its prompt starts with, of the run's numerics
(`prefix.numerics`). `api.generate_batch` makes them for prompts that start alike; `serve`
makes them from its kept prefixes (`seed`): a request whose prompt shares a long prefix
with a kept conversation (several questions over one document, asked one after another or
while the first still runs) holds that prefix once with every later one. Memory: each sharing sequence saves the segment's bytes. Only caches
on the CPU share (a GPU's fixed-shape and offloaded caches hold their own); sequences
that cannot share prefill their whole prompt, as alone.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from ...kernels import native

MIN_SHARED = native.BLOCK  # fewer shared tokens than this: not worth a segment


@dataclass(eq=False)
class Segment:
    ids: tuple  # the prefix's token ids
    cache: object  # a FullCache committed to len(ids): its KV, read only
    act: str = ""  # the numerics it was computed with (prefix.numerics)
    seeded: bool = False  # made from a kept prefix (`seed`): evicted when unused (Shared.evict)
    users: int = 0  # runs whose caches share it now
    used: float = 0.0  # when a run last leased it (least recently used first out)

    @property
    def length(self) -> int:
        return len(self.ids)

    def nbytes(self) -> int:
        return self.cache.nbytes()


class Shared:
    """A loaded model's shared prefixes. `seed_bytes` > 0 (`serve`): a run whose prompt
    shares MIN_SHARED or more tokens with a kept prefix (cache.prefix.PrefixCache) makes a
    segment of them (`seed`), which that run and every later one starting with it share;
    seeded segments no run uses are evicted past that many bytes, least recently used first."""

    def __init__(self, seed_bytes: int = 0):
        self.segments: list[Segment] = []
        self.lock = threading.Lock()  # the runs of a batch lease from their own threads
        self.leases = 0  # caches that shared a segment
        self.seed_bytes = seed_bytes

    def take(self, prompt: list[int], act: str = "") -> Segment | None:
        """`match`, and the run that asked uses it from now on (`release` when it ends): no
        eviction between the two."""
        with self.lock:
            seg = self._match(prompt, act)
            if seg is not None:
                seg.users += 1
                seg.used = time.monotonic()
                self.leases += 1
            return seg

    def release(self, seg: Segment, shared: bool = True):
        """A run that took `seg` ended (`shared` False: its cache could not share it, which
        then counts no lease); seeded segments past `seed_bytes` that no run uses go."""
        with self.lock:
            seg.users -= 1
            if not shared:
                self.leases -= 1
                if seg.seeded and seg.users == 0 and seg in self.segments:
                    self.segments.remove(seg)
            seeded = sorted((s for s in self.segments if s.seeded), key=lambda s: s.used)
            total = sum(s.nbytes() for s in seeded)
            for s in seeded:
                if total <= self.seed_bytes:
                    break
                if s.users == 0:
                    self.segments.remove(s)
                    total -= s.nbytes()

    def add(self, seg: Segment):
        with self.lock:
            self.segments.append(seg)

    def remove(self, seg: Segment):
        with self.lock:
            self.segments = [s for s in self.segments if s is not seg]

    def match(self, prompt: list[int], act: str = "") -> Segment | None:
        """The longest segment `prompt` starts with and goes past (its last token is
        prefilled by the run: its logits start the generation), of numerics `act`."""
        with self.lock:
            return self._match(prompt, act)

    def _match(self, prompt: list[int], act: str) -> Segment | None:
        best = None
        for s in self.segments:
            n = s.length
            if (s.act == act and n < len(prompt) and (best is None or n > best.length)
                    and tuple(prompt[:n]) == s.ids):
                best = s
        return best

    def nbytes(self) -> int:
        with self.lock:
            return sum(s.nbytes() for s in self.segments)


def seed(loaded, store, shared: Shared, prompt: list[int], act: str) -> Segment | None:
    """A segment made from the kept prefix (`store`, a PrefixCache) that shares the most
    tokens with `prompt`, where the prompt goes on with other tokens than the kept ones, at
    least MIN_SHARED, cut to a multiple of native.BLOCK, copied once
    out of the kept cache (which stays in the store) and held in `shared`; None where there
    is none, or the kept cache cannot share (offloaded, fixed-shape, a prefill whose KV
    depends on its chunks' ends, rings that no longer hold the band)."""
    from ..batch.rows import chunk_invariant  # runtime.batch imports this package
    from .kv import FullCache, copy_prefix, depth_of
    with store.busy:
        with store.lock:
            e, n = store.match(prompt, act)
        # where the prompt leaves the kept tokens before both ends (another question over the
        # same text); a follow-up extending them, or the same prompt again, takes the kept
        # cache over instead (prefix.PrefixCache.take: no copy)
        if (e is None or n >= len(e.ids) or n >= len(prompt) - 1 or type(e.cache) is not FullCache
                or e.cache.static or not e.cache.full_layers):  # all window layers: nothing to share
            return None
        P = n // native.BLOCK * native.BLOCK
        if (P < MIN_SHARED or not e.cache.resumable(P) or not chunk_invariant(loaded.model, e.cache)
                or e.cache.length < P):
            return None
        have = shared.take(prompt, act)  # another run seeded it meanwhile
        if have is not None:
            return have
        dtype = e.cache.k[e.cache.full_layers[0]].dtype
        cache = FullCache(loaded.cfg, P, dtype=dtype, device=loaded.device, ring_depth=depth_of(e.cache))
        copy_prefix(e.cache, cache, P)
        seg = Segment(tuple(prompt[:P]), cache, act, seeded=True)
        shared.add(seg)
        return shared.take(prompt, act)


def common_prefixes(prompts: list[list[int]], align: int, least: int = MIN_SHARED) -> list[tuple]:
    """The prefixes worth holding once for `prompts`: for each group of two or more prompts
    starting with the same `least` or more tokens, the tokens they all share, cut to a
    multiple of `align` and short of every member's last token. Sorted, so a group is a run
    of neighbours (their common prefix is that of its first and last)."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    out, i = [], 0
    while i < len(order):
        j, lcp = i, None
        while j + 1 < len(order):
            n = _lcp(prompts[order[i]], prompts[order[j + 1]])
            n = n if lcp is None else min(lcp, n)
            if n < least:
                break
            j, lcp = j + 1, n
        if j > i:
            members = [prompts[order[m]] for m in range(i, j + 1)]
            n = min(lcp, min(len(p) for p in members) - 1) // align * align
            if n >= least:
                out.append(tuple(members[0][:n]))
        i = j + 1
    return out


def alignment(invariant: bool, prefill_chunk: int) -> int:
    """A shared prefix's length is a multiple of this: the kernel's key block, and the
    prefill chunk too where a prefill's KV depends on where its chunks end (`invariant`
    False)."""
    b = native.BLOCK
    return b if invariant else b * prefill_chunk // math.gcd(b, prefill_chunk)


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
