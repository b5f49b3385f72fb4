"""The runtime's interfaces as `typing.Protocol`s: what the model, `generate` and the
engine call on caches, host stores and engine levels.

A capability with a natural no-op (prefetching, the forward hooks, holding a layer on the
device, timing figures, closing) is a method every cache has, with that no-op on the base
class `cache.KVCache`; callers just call it. A capability without one is a protocol
below, and callers tell the kinds apart with `isinstance` (every protocol is
`runtime_checkable`): the engine absorbs verified KV into, and rebuilds, a cache that is
a `RetrievalKV`; a `FullKV` is what retrieval and streaming caches are filled from.

The protocols list what a kind offers; runtime_checkable only checks that the names
exist (on Python 3.11 by `hasattr`, which evaluates properties: keep side effects out of
the members of a protocol that is checked in the decode path).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Cache(Protocol):
    """Every cache. The model brackets one forward's `attend` calls (every layer, in
    order) with `begin_forward`/`end_forward`; `generate` and the engine alone move the
    length, forward with `commit` and back with `rollback`; neither does I/O, which
    happens in the forward hooks, `prefetch` and `hold`."""

    static: bool  # `start` may be an int64 device tensor [1] (fixed shapes: CUDA graphs)
    layer_major: bool  # prefill runs layer by layer (`hold`), never chunk-major forwards
    capacity: int | None  # tokens the cache can hold; None: no fixed capacity

    @property
    def length(self) -> int: ...  # committed tokens

    def begin_forward(self, start, n_tokens: int) -> None: ...
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start) -> torch.Tensor: ...
    # attend in one native call from the qkv projection's output (RoPE and the write inside):
    # (output, rotated queries), or None where the cache does not (the model then calls attend)
    def rope_attend(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    start, heads: int) -> tuple | None: ...
    # (direct cache, slot, recorder) where every layer's rope_attend would be the native call
    # over that cache's own buffers at one slot (model/program.py), or None
    def one_call_layers(self, start, n_tokens: int) -> tuple | None: ...
    # the same for a batch's ragged forward (batch.rows.Ragged; None elsewhere)
    def one_call_rows(self, heads: int, D: int) -> tuple | None: ...
    def end_forward(self) -> None: ...
    def commit(self, n: int) -> None: ...
    def rollback(self, n: int) -> None: ...
    def check_end(self, end: int) -> int: ...
    def prefetch(self) -> None: ...
    def hold(self, layer: int | None, end: int = 0) -> None: ...
    def on_replay(self) -> None: ...
    def nbytes(self) -> int: ...
    def stats(self) -> dict: ...
    def close(self) -> None: ...


@runtime_checkable
class FullKV(Cache, Protocol):
    """A cache holding every token's exact KV (FullCache, OffloadedCache, a Recorder over
    either): what a retrieval cache is built and absorbs from, a streaming cache loaded from.
    A window layer it keeps in a ring (cache.WindowRing) has only its latest positions:
    `recent` reads them, `keys` refuses."""

    capacity: int

    def keys(self, layer: int, end: int | None = None) -> tuple: ...  # K, V [B, Hkv, S, D]
    def device_keys(self, layer: int, end: int | None = None) -> tuple: ...  # the same, on the device
    def recent(self, layer: int, lo: int, hi: int) -> tuple: ...  # positions lo..hi-1 on the device


@runtime_checkable
class RecordingKV(FullKV, Protocol):
    """A full cache that keeps the last query row of each layer's latest forward
    (retrieval.Recorder): the verifier's cache, whose queries score a retrieval rebuild."""

    q: dict  # layer -> [B, Hq, D]


@runtime_checkable
class StreamingKV(Cache, Protocol):
    """StreamingLLM: `sink` first tokens + the `window` most recent ones (draft levels)."""

    sink: int
    window: int

    def load_from(self, full: FullKV, length: int) -> None: ...


@runtime_checkable
class RetrievalKV(Cache, Protocol):
    """Selected chunks of a full cache + appended tokens (the middle level)."""

    base: int  # absolute position of the first appended token
    n_retrieved: int  # slots holding selected tokens (all before `base`)
    ring: object | None  # cache.WindowRing of the window layers; None: every layer selected

    def build(self, full: FullKV, qs: dict, length: int) -> None: ...
    def absorb(self, full: FullKV, lo: int, hi: int) -> None: ...
    def room(self) -> int: ...


@runtime_checkable
class DirectKV(Cache, Protocol):
    """A CPU cache whose attention a ragged forward can compute in one native call with
    other sequences' (batch.rows.Ragged; FullCache, RetrievalCache): its K, V buffers
    (`own`) hold consecutive positions from `first_position`, after a shared `prefix`
    cache's (or none); `direct` says whether an attend of q at start would be the native
    kernel over them, `settle` hands it the output computed with the others'; `one_call_slot`
    where a step's RoPE, K/V write and attention would go in one call (Ragged.rope_attend)."""

    prefix: object | None  # the shared prefix's FullCache, or None
    first_position: int  # the position `own`'s index 0 stands for

    def plain(self, layer: int) -> bool: ...
    def direct(self, layer: int, q, start) -> bool: ...
    def own(self, layer: int) -> tuple: ...  # K, V buffers [B, Hkv, slots, D]
    def settle(self, layer: int, out) -> None: ...
    def one_call_slot(self, layer: int, start, n_tokens: int) -> int | None: ...  # rope_attend's slot


@runtime_checkable
class HostStore(Protocol):
    """Host-backed KV of the offloaded layers (offload/store.py HostKVStore): per layer
    K and V tensors `k[layer]`, `v[layer]` ([S, B, Hkv, D] token-major, views into one
    interleaved [S, 2, B, Hkv, D]; else [B, Hkv, S, D]); `chunk` is what one copy of a
    range of positions moves, `pack` lays fresh device K, V out the same way."""

    spec: object  # offload.store.StoreSpec: layers, heads, capacity, dtype, layout
    pinned: bool  # page-locked (CUDA present): copies to the device can be asynchronous
    k: dict
    v: dict

    @property
    def capacity(self) -> int: ...
    def view(self, layer: int, end: int) -> tuple: ...  # K, V [B, Hkv, S, D] of [0, end)
    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def chunk(self, layer: int, c0: int, c1: int) -> tuple: ...
    def pack(self, k: torch.Tensor, v: torch.Tensor) -> tuple: ...
    def nbytes(self) -> int: ...


@runtime_checkable
class OffloadedKV(FullKV, Protocol):
    """A full cache whose layers >= `on_chip` live in a host store and stream to the
    device (runtime/cache/offloaded.py). `forwards` and `trace` (properties) resolve pending
    timings: an isinstance check evaluates them, so the decode path never makes one."""

    on_chip: int
    transfer_chunk: int
    store: HostStore

    @property
    def forwards(self) -> list: ...
    @property
    def trace(self) -> dict | None: ...


@runtime_checkable
class Level(Protocol):
    """A level of the speculative engine (runtime/spec/drafters.py). `levels[0]` only drafts."""

    name: str
    time: float  # seconds spent in this level's work
    cache: Cache | None  # None: a model-free drafter
    step: object | None  # graphs.Step of its forwards; None: a model-free drafter

    def draft(self, seq: list, g: int, sp, gen) -> torch.Tensor: ...
    def rollback(self, n: int) -> None: ...


@runtime_checkable
class VerifyingLevel(Level, Protocol):
    """A level that verifies the drafts of the level below (`levels[1:]`): a model over a cache."""

    held: int  # leading positions of seq its cache holds, committed or pending

    def forward(self, seq: list, rows: int) -> torch.Tensor: ...
    def commit(self, n: int) -> None: ...


@runtime_checkable
class SizingDrafter(Level, Protocol):
    """A drafter that sizes each draft by what it is expected to pay (drafters.NgramDrafter):
    the engine sets `price` (a forward of w tokens of the level it drafts for, in forwards
    of one) before it drafts and `agree` once, and shows it the verified text after each
    top-level verification (`judge`: seq[:n] is verified)."""

    price: object
    agree: object  # rank 0's value on every tensor-parallel rank (the size depends on timings)

    def judge(self, seq: list, n: int) -> None: ...
    def figures(self) -> dict: ...  # for the stats: matches found, tokens drafted, acceptance
