"""KV caches. A cache owns its tensors and its length; only the engine (and `generate`)
moves the length. The full interface is `protocols.Cache`; this is what each call means.

- `begin_forward(start, n_tokens)` / `end_forward()`: `Transformer.forward` brackets the
  layer loop of one forward of n_tokens tokens at positions start.. with them (and the
  layer-major prefill its whole pass). No-ops here; a static cache computes what every
  layer of a fixed-shape forward shares (`PerForward`); an offloaded cache times the forward.
- `attend(layer, q, k, v, start)`: q [B, Hq, T, D] and k, v [B, Hkv, T, D] are the rotated
  projections of T new tokens at absolute positions start .. start+T-1. The cache stores
  k, v as *pending* entries and returns the attention output [B, Hq, T, D], causal by
  position. Several forwards may add pending tokens one after another (drafting).
- `commit(n)`: the sequence is now n >= length tokens long: pending tokens below n become
  part of the cache; everything written at positions >= n leaves no trace.
- `rollback(n)`: forget positions >= n (n <= length), committed or pending.
- `length`: committed tokens.
  Neither commit nor rollback does I/O or starts any: the caller asks for it
  (`prefetch()`: a forward over this cache comes next, so an offloaded cache starts
  streaming its first layers; `hold(layer, end)`: a layer-major prefill pass).
- `stats()`, `close()`: figures for Stats.extra, release of threads and buffers.

Sliding-window layers (`cfg.window(layer)`, Mistral, Qwen2/3, Gemma): a query at position
p sees only the keys at positions p - window < pos <= p, in every cache and on every path
(`window_attention`, `write_and_attend`): each query its own band, also in a multi-token
verification and a prefill chunk. Built with a `ring_depth` (the factories do: the engine's
`rollback_depth`), a cache keeps such a layer's KV in a `WindowRing` of window + depth slots
on the device and only the global layers' whole; without one, every token of every layer.

Caches with `static = True` also take `start` as an int64 device tensor [1]: they then
write and attend with shapes that do not depend on its value and never read it on the
host, so the forward can be captured and replayed as a CUDA graph (runtime/graphs.py).
Python runs only at capture, so their forward hooks must stay free of host work (the
no-ops here); state a replay updates behind Python's back is refreshed in `on_replay()`.
"""
from __future__ import annotations


import torch

from ...kernels import native
from ...kernels.attention import attention, sdpa, static_attention
from ..model.config import BAND_BLOCK, ModelConfig  # BAND_BLOCK: window_attention's rows in blocks of positions
from ..errors import TriforceError
from ...settings import env


class KVCache:
    """Base class: shapes, the length bookkeeping and the no-op capabilities of every cache."""

    static = False  # takes a device-tensor `start` (fixed shapes, CUDA graphs)
    layer_major = False  # prefill layer by layer through `hold` (an offloaded cache)
    capacity: int | None = None  # preallocated tokens; None: no fixed capacity

    def __init__(self, cfg: ModelConfig, batch: int = 1, ring: "WindowRing | None" = None, layers=None):
        self.n_layers, self.n_kv_heads, self.head_dim = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        self.windows = cfg.windows  # per layer: keys a query sees (None: all before it)
        self.softcap = cfg.attn_logit_softcapping  # scores soft-capped (Gemma 2); None: not
        self.batch = batch
        self.length = 0
        self.ring = ring  # the window layers' rings (None: every layer kept whole)
        # the layers this cache keeps every token of: `layers` (default all) but the ring's
        self.full_layers = [i for i in (range(cfg.n_layers) if layers is None else layers)
                            if ring is None or i not in ring]

    def attend(self, layer, q, k, v, start):  # pragma: no cover - interface
        raise NotImplementedError

    def rope_attend(self, layer, qkv, cos, sin, start, heads: int):
        """`attend` of tokens given as their qkv projection before RoPE, in one native call
        (FullCache.rope_attend); None: not here, the model rotates and calls `attend`."""
        return None

    def one_call_layers(self, start, n_tokens: int):
        """(direct cache, slot, recorder) where every layer's step of n_tokens tokens at
        `start` would be `native.rope_attend` over that cache's own buffers at one slot
        (`rope_attend` of each layer, recording its queries into `recorder` or None): what
        lets a forward take all its layers in one native call (model/program.py); None here.
        A subclass that changes `rope_attend` or `attend` changes this too."""
        return None

    def one_call_rows(self, heads: int, D: int):
        """A batch's ragged forward's `one_call_layers` (batch.rows.Ragged); None here."""
        return None

    def begin_forward(self, start, n_tokens: int):
        """A forward of n_tokens tokens at positions start.. begins (`start` a device
        tensor on the static path: never read it on the host there)."""

    def end_forward(self):
        """The forward that `begin_forward` announced has issued its last layer."""

    def commit(self, n: int):
        """Keep the pending tokens below n: the length moves forward to n (no I/O)."""
        if n < self.length:
            raise ValueError(f"commit({n}) below the committed length {self.length}: "
                             "use rollback() to shorten a cache")
        self._settle_rings(n)
        self.length = n

    def rollback(self, n: int):
        """Forget positions >= n: the length moves back to n (no I/O)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"rollback({n}) outside the committed length 0..{self.length}: "
                             "use commit() to keep pending tokens")
        self._settle_rings(n)
        self.length = n

    def _settle_rings(self, n: int):
        # not `_settle`: OffloadedCache has its own (pending forwards' timings)
        if self.ring is not None:
            self.ring.settle(n)

    def whole(self, layer: int):
        """Refuse to read all of a layer this cache keeps only a ring of."""
        if layer not in self.full_layers:
            raise TriforceError(f"layer {layer} keeps only its last window of tokens (a ring): "
                                "read it with recent()")

    def share(self, base) -> bool:
        """Start from a shared prefix's cache instead of holding its KV (FullCache.share);
        False: this kind of cache holds its own."""
        return False

    def resumable(self, n: int) -> bool:
        """Whether a forward at position n <= length could run on this cache: what its
        window layers' rings still hold (a cache without rings holds every position)."""
        return self.ring is None or self.ring.holds(n)

    def end_of(self, q, start: int) -> int:
        """Position after the new tokens; refuses to write past a preallocated capacity."""
        return self.check_end(start + q.shape[2])

    def check_end(self, end: int) -> int:
        """`end` if the cache has room for tokens up to it, else a TriforceError."""
        if self.capacity is not None and end > self.capacity:
            raise TriforceError(f"context of {end} tokens exceeds the cache capacity "
                                f"{self.capacity}; raise --max-context")
        if self.ring is not None:
            self.ring.reach(end)  # a fixed-shape forward writes its rings up to `end`
        return end

    def prefetch(self):
        """Hint from the engine or `generate`: a forward over this cache at its committed
        length comes next (an offloaded cache starts streaming its first layers)."""

    def hold(self, layer: int | None, end: int = 0):
        """Keep `layer`'s KV of [0, end) on the device for a layer-major prefill pass
        (None: release it). Resident caches have it there already."""

    def on_replay(self):
        """A CUDA graph replay of a forward over this cache ran (no Python did)."""

    def nbytes(self) -> int:
        return 0

    def stats(self) -> dict:
        """The cache's own figures for Stats.extra (an offloaded cache: overlap, bytes)."""
        return {}

    def close(self):
        """Release threads and buffers that outlive the cache's use."""


def static_slots(slot: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """What a fixed-shape forward of T tokens from slot `slot` (int64 device tensor [1])
    needs in every layer: the slots it writes ([1], or [T]), the valid length after it
    ([1]), and a dict for what attention derives from that length (`static_attention`'s
    `shared`). Device tensors only, no host read."""
    pos = slot if T == 1 else slot + torch.arange(T, device=slot.device, dtype=slot.dtype)
    return pos, slot + T, {}


def write_and_attend(K, V, q, k, v, slots: tuple, window: int | None = None,
                     softcap: float | None = None):
    """The fixed-shape step of a preallocated cache: write k, v [B, Hkv, T, D] into the
    buffers K, V [B, Hkv, cap, D] at `slots` (from `static_slots`) and attend causally over
    the whole buffers up to its length (a sliding layer: over the last `window` slots of
    each query, slots being consecutive positions); `softcap`: soft-capped scores."""
    pos, length, shared = slots
    K.index_copy_(2, pos, k.to(K.dtype))  # the KV dtype (--kv-dtype), whatever the compute dtype
    V.index_copy_(2, pos, v.to(V.dtype))
    if window is not None:
        return static_window_attention(q, K, V, length, window, shared, softcap)
    return static_attention(q, K, V, length, shared, softcap)


def _folded(q, n_kv: int):
    """[B, Hq, T, D] -> [B, Hkv, G*T, D] (the G query heads of a KV head side by side)."""
    B, Hq, T, D = q.shape
    return q.reshape(B, n_kv, (Hq // n_kv) * T, D)


# a forward of up to this many tokens on a CPU (a verification) computes each row's attention
# as its decode does: window layers (`_cpu_blocks`), an offloaded cache (`_attend_rows`)
ROWWISE_MAX = 64


def window_attention(q, k, v, q_pos0: int, k_pos0: int, window: int | None,
                     softcap: float | None = None):
    """`attention` of q [B, Hq, T, D] (positions q_pos0..) over k, v [B, Hkv, S, D]
    (positions k_pos0..) where a query at p sees only keys at p - window < pos <= p (None:
    every key up to p). On a GPU: keys before the first query's band cut off, plain
    attention where every query's band still holds the first key, else SDPA with a band
    mask (`band_sdpa`). On a CPU, by blocks of BAND_BLOCK absolute positions
    (`_cpu_bands`): a row's computation depends on its position alone, not on the forward
    it came in (a decode, a verification, a prefill chunk of any size) nor on the rows
    beside it. `softcap`: soft-capped scores (Gemma 2), on every path (kernels/attention.py)."""
    if window is None:
        return attention(q, k, v, q_pos0, k_pos0, softcap=softcap)
    if q.device.type == "cpu":
        return _cpu_bands(q, k, v, q_pos0, k_pos0, window, softcap)
    return _banded(q, k, v, q_pos0, k_pos0, window, softcap, band_sdpa)


def band_lo(p: int, window: int, blocks: bool = True) -> int:
    """The first key position the CPU's window attention reads for a query at position p:
    the band of the first position of p's block of BAND_BLOCK (`_cpu_bands`), so that every
    row of a block shares its keys' layout. What a window ring must hold for a forward at
    p (`WindowRing.first`, `band_held`). `blocks` False: a GPU's, p - window + 1."""
    if not blocks:  # a GPU's window attention: the query's own band
        return max(p + 1 - window, 0)
    return max(p // BAND_BLOCK * BAND_BLOCK + 1 - window, 0)


def exact_bands(cfg, device) -> bool:
    """Whether window layers' attention computes each row independently of the forward it
    comes in (the native kernel on a CPU, `_cpu_bands`): prefill chunks may then end
    anywhere (`prefill_end`)."""
    return torch.device(device).type == "cpu" and native.enabled() and cfg.head_dim % 16 == 0 and cfg.head_dim <= 256


def _banded(q, k, v, q_pos0: int, k_pos0: int, window: int, softcap, differ):
    """Keys before the first query's band cut off; plain attention where the last query's
    band still holds the first key (every row sees every key up to its own); else
    `differ(q, k, v, q_pos0, k_pos0, window, softcap)`."""
    lo = max(q_pos0 + 1 - window - k_pos0, 0)
    k, v, k_pos0 = k[:, :, lo:], v[:, :, lo:], k_pos0 + lo
    if k_pos0 > q_pos0 + q.shape[2] - 1 - window:
        return attention(q, k, v, q_pos0, k_pos0, softcap=softcap)
    return differ(q, k, v, q_pos0, k_pos0, window, softcap)


def _cpu_bands(q, k, v, q_pos0: int, k_pos0: int, window: int, softcap):
    """The rows of each block of BAND_BLOCK absolute positions this forward holds, in one
    native call over the keys from the block's band start (`band_lo`) to its last row,
    each row masked to its own band (`native.attend(window=)`): the kernel's key blocks
    start at the same position for every row of a block, and its rows do not see each
    other, so a row is the same bits in a decode, a verification and a prefill chunk of
    any size (int8 activations would turn another summation order into other tokens
    between modes). Where the keys given do not reach back to the band start (a drafter's
    cache) or the kernel does not run: `_cpu_rows`."""
    parts, T = [], q.shape[2]
    a = q_pos0
    while a < q_pos0 + T:
        blk = a // BAND_BLOCK * BAND_BLOCK
        b = min(blk + BAND_BLOCK, q_pos0 + T)
        qb = q[:, :, a - q_pos0: b - q_pos0]
        lo = band_lo(a, window)
        kb, vb = k[:, :, max(lo - k_pos0, 0): b - k_pos0], v[:, :, max(lo - k_pos0, 0): b - k_pos0]
        if kb.dtype == torch.float16:  # the kernel reads float32 or bfloat16: widened exactly
            kb, vb = kb.float(), vb.float()
        if lo >= k_pos0 and b - k_pos0 <= k.shape[2] and native.supports(qb, kb):
            parts.append(native.attend(qb, kb, vb, a, lo, softcap=softcap, window=window)[0])
        else:
            parts.append(_banded(qb, k, v, a, k_pos0, window, softcap, _cpu_rows))
        a = b
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


def _cpu_rows(q, k, v, q_pos0: int, k_pos0: int, window: int, softcap):
    """Rows of one block whose bands differ, without the native band kernel: up to
    ROWWISE_MAX of them each as its decode computes it; more (a prefill chunk's) in one
    SDPA call with a band mask."""
    if q.shape[2] <= ROWWISE_MAX:
        return torch.cat([_banded(q[:, :, t: t + 1], k, v, q_pos0 + t, k_pos0, window, softcap, band_sdpa)
                          for t in range(q.shape[2])], 2)
    return band_sdpa(q, k, v, q_pos0, k_pos0, window, softcap)


def prefill_end(start: int, tokens: int, end: int, windows: bool = True) -> int:
    """Where a prefill forward from position `start` that takes about `tokens` tokens
    ends, at most `end`. With window layers whose rows depend on the forward they come in
    (`windows`: not `exact_bands`), on a multiple of BAND_BLOCK (start + tokens rounded
    down, or the next multiple), so that their blocks are never cut between two forwards
    (`_cpu_rows`): a prompt's rows are then computed in the same blocks at any chunk size.
    Else start + tokens."""
    if not windows:
        return min(start + tokens, end)
    e = (start + tokens) // BAND_BLOCK * BAND_BLOCK
    if e <= start:
        e = (start // BAND_BLOCK + 1) * BAND_BLOCK
    return min(e, end)


def band_sdpa(q, k, v, q_pos0: int, k_pos0: int, window: int, softcap: float | None = None):
    """SDPA of q [B, Hq, T, D] over the keys its band reaches, with a band mask."""
    lo = max(q_pos0 + 1 - window - k_pos0, 0)
    hi = min(q_pos0 + q.shape[2] - k_pos0, k.shape[2])  # past the last query: never seen
    k, v, k_pos0 = k[:, :, lo:hi], v[:, :, lo:hi], k_pos0 + lo
    B, Hq, T, D = q.shape
    qp = torch.arange(q_pos0, q_pos0 + T, device=q.device)[:, None]
    kp = torch.arange(k_pos0, k_pos0 + k.shape[2], device=q.device)[None, :]
    mask = ((kp <= qp) & (kp > qp - window)).repeat(Hq // k.shape[1], 1)  # [G*T, S]
    o = sdpa(_folded(q, k.shape[1]), k, v, attn_mask=mask, softcap=softcap)
    return o.reshape(B, Hq, T, D)


def static_window_attention(q, K, V, length: torch.Tensor, window: int, shared: dict | None = None,
                            softcap: float | None = None):
    """`static_attention` of a sliding layer: the folded query row of position
    length - T + t sees the slots in [length - T + t + 1 - window, length - T + t]; SDPA over
    the whole buffers with a band mask built on the device (once per forward in `shared`)."""
    B, Hq, T, D = q.shape
    n_kv, cap = K.shape[1], K.shape[2]
    key = ("band", T, Hq // n_kv, window)

    def make():
        t = torch.arange(1 - T, 1, device=length.device).repeat(Hq // n_kv)  # [G*T]
        limit = length.view(-1, 1, 1, 1) + t[:, None]  # [B, 1, G*T, 1]: slots < limit
        slot = torch.arange(cap, device=length.device)
        return (slot < limit) & (slot >= limit - window)  # [B, 1, G*T, cap]
    if shared is None:
        mask = make()
    else:
        mask = shared[key] = shared[key] if key in shared else make()
    return sdpa(_folded(q, n_kv), K, V, attn_mask=mask, softcap=softcap).reshape(B, Hq, T, D)


class PerForward:
    """What every layer of one fixed-shape forward shares, computed once in `begin_forward`
    (inside a captured graph: device ops only) and dropped in `end_forward`. A layer whose
    (start, T) is not the announced forward's (attend called outside a model forward)
    computes its own."""

    def __init__(self, make):
        self.make = make  # (start, T) -> the shared value
        self.key, self.value = None, None

    def begin(self, start, T: int):
        if isinstance(start, torch.Tensor):
            self.key, self.value = (start, T), self.make(start, T)

    def end(self):
        self.key, self.value = None, None

    def get(self, start: torch.Tensor, T: int):
        if self.key is not None and self.key[0] is start and self.key[1] == T:
            return self.value
        return self.make(start, T)


class Settles:
    """What a cache holding its layers in buffers self.k, self.v (None where a ring keeps the
    layer) and a `PerForward` self._slots offers a ragged forward that attends many
    sequences in one native call per layer (batch.rows.Ragged, protocols.DirectKV; FullCache,
    RetrievalCache): the buffers, which layers they hold whole, and `settle`. The class
    using it sets self._done = {} and defines `direct`, `prefix` and `first_position`;
    its `attend` writes K, V, then returns `settled(layer)` where there is one."""

    def plain(self, layer: int) -> bool:
        """`layer` is held whole in this cache's own buffers (no window, no ring)."""
        return layer in self.full_layers and self.windows[layer] is None and (self.ring is None or layer not in self.ring)

    def own(self, layer: int):
        """This cache's own K, V buffers of `layer` [B, Hkv, slots, D] (position
        first_position + i at index i)."""
        return self.k[layer], self.v[layer]

    def one_call_layers(self, start, n_tokens: int):
        """KVCache.one_call_layers: this cache at `one_call_slot`'s slot, which is the same for
        every layer where each is held whole in its buffers (plain)."""
        plain = self.__dict__.get("_all_plain")
        if plain is None:  # windows, the ring and the layers kept are fixed at construction
            plain = self.__dict__["_all_plain"] = all(self.plain(i) for i in range(self.n_layers))
        slot = self.one_call_slot(0, start, n_tokens) if plain else None
        return None if slot is None else (self, slot, None)

    def settle(self, layer: int, out):
        """The next `attend` of `layer` writes its K, V and returns `out`, which the caller
        fills afterwards with the output computed in one call with other sequences' rows
        (batch.rows.Ragged)."""
        self._done[layer] = out

    def settled(self, layer: int):
        """The output `settle` handed this forward's attend of `layer` (once), or None."""
        return self._done.pop(layer, None)

    def begin_forward(self, start, n_tokens: int):
        self._slots.begin(start, n_tokens)
        self._done.clear()  # what a forward settles belongs to it (Ragged._direct)

    def end_forward(self):
        self._slots.end()
        self._done.clear()


class FullCache(Settles, KVCache):
    """Every token's K and V, preallocated to `capacity` tokens (no growth by copying)."""

    def __init__(self, cfg: ModelConfig, capacity: int, batch: int = 1,
                 dtype=torch.float32, device="cpu", static: bool | None = None,
                 ring_depth: int | None = None, layers=None):
        # `ring_depth`: window layers in a WindowRing (None: kept whole); `layers`: the
        # layers it holds (None: all; an offloaded cache's on-chip ones)
        super().__init__(cfg, batch, WindowRing.of(cfg, ring_depth, batch, dtype, device), layers)
        self.capacity = capacity
        # the static path (default on CUDA; TRIFORCE_OFFLOAD_STATIC=1 anywhere) reads whole
        # buffers through the length-masked reference: slots must then hold finite values
        if static is None:
            static = torch.device(device).type == "cuda" or env("static")
        self.static = static
        alloc = torch.zeros if self.static else torch.empty
        shape = (batch, cfg.n_kv_heads, capacity, cfg.head_dim)  # [B, Hkv, S, D]
        self.k = [alloc(shape, dtype=dtype, device=device) if i in self.full_layers else None
                  for i in range(cfg.n_layers)]
        self.v = [alloc(shape, dtype=dtype, device=device) if i in self.full_layers else None
                  for i in range(cfg.n_layers)]
        self._slots = PerForward(static_slots)  # slots and length of a fixed-shape forward
        self.leased = False  # handed out to a run that has not closed it (graphs.Kept)
        # a shared prefix (`share`): the KV of positions [0, base.length) of every layer kept
        # whole is `base`'s (a frozen FullCache other sequences read too); self.k, self.v
        # then hold positions from there on, at index position - offset
        self.base: FullCache | None = None
        self.offset = 0
        self._done: dict = {}  # layer -> the next attend's output, computed with other sequences' (`settle`)

    def share(self, base: "FullCache") -> bool:
        """Start from the shared prefix `base` (committed, never written again: a
        cache.shared.Segment's) instead of holding its KV: this empty cache's full layers keep
        only the positions after it, window layers copy its band into their rings, and the
        length becomes base.length. False (nothing changed) where it cannot: a fixed-shape or
        non-CPU cache, another dtype or too little room."""
        P = base.length
        k0 = next((t for t in self.k if t is not None), None)
        if (self.static or base.static or self.length or k0 is None or k0.device.type != "cpu"
                or self.capacity <= P or base.full_layers != self.full_layers
                or next(t for t in base.k if t is not None).dtype != k0.dtype
                or (self.ring is not None) != (base.ring is not None)):
            return False
        B, H, _, D = k0.shape
        for i in self.full_layers:
            self.k[i] = torch.empty((B, H, self.capacity - P, D), dtype=k0.dtype)
            self.v[i] = torch.empty((B, H, self.capacity - P, D), dtype=k0.dtype)
        self.base, self.offset = base, P
        if self.ring is not None:
            lo = base.ring.first(P)
            for layer in self.ring.k:
                self.ring.put(layer, lo, *base.recent(layer, lo, P))
            self.ring.hold_from(lo)
        self.commit(P)
        return True

    def unshare(self):
        """Hold the shared prefix's KV itself again (before a write or rollback below it)."""
        if self.base is None:
            return
        P, base = self.offset, self.base
        for i in self.full_layers:
            for mine, theirs in ((self.k, base.k), (self.v, base.v)):
                t = torch.empty((*mine[i].shape[:2], self.capacity, mine[i].shape[3]), dtype=mine[i].dtype)
                t[:, :, :P].copy_(theirs[i][:, :, :P])
                t[:, :, P:].copy_(mine[i])
                mine[i] = t
        self.base, self.offset, self._done = None, 0, {}

    def direct(self, layer: int, q, start) -> bool:
        """Whether `attend` of q at `start` in `layer` is the native kernel over this cache's
        own keys, from the first or after a shared prefix read as per-block results
        (`shares`): what a ragged forward computes for many sequences in one call
        (batch.rows.Ragged: `settle`, then over `own`), each row the same bits."""
        if not isinstance(start, int) or start < self.offset or not self.plain(layer):
            return False
        return self.shares(layer, q, start) if self.offset else native.supports(q, self.k[layer])

    @property
    def prefix(self) -> "FullCache | None":
        """The shared prefix whose KV precedes `own`'s (None: none; `offset` is then 0)."""
        return self.base

    @property
    def first_position(self) -> int:
        """The position `own`'s index 0 stands for (after a shared prefix: its length)."""
        return self.offset

    def shares(self, layer: int, q, start) -> bool:
        """Whether attention of q at `start` in `layer` reads the shared prefix through the
        native kernel's per-block results (the rest of the keys after them)."""
        return (self.base is not None and isinstance(start, int) and start >= self.offset
                and self.offset % native.BLOCK == 0
                and layer in self.full_layers and self.windows[layer] is None and native.supports(q, self.k[layer]))

    def rollback(self, n: int):
        if n < self.offset:
            self.unshare()
        super().rollback(n)

    def reset(self):
        """Empty, in place: a kept cache starts another run at the addresses its captured
        graphs replay (zeroed: the static path reads whole buffers, slots must be finite)."""
        self.unshare()
        for t in self.k + self.v:
            if t is not None:
                t.zero_()
        if self.ring is not None:
            self.ring.reset()
        self.length = 0

    def close(self):
        self.leased = False  # the run ended (finish_stats) or a prefix store let it go

    def attend(self, layer, q, k, v, start):
        if isinstance(start, torch.Tensor):
            return self._attend_static(layer, q, k, v, start)
        end = self.end_of(q, start)
        if self.ring is not None and layer in self.ring:
            return self.ring.attend(layer, q, k, v, start)
        if start < self.offset:
            self.unshare()
        P = self.offset
        K, V = self.k[layer], self.v[layer]
        K[:, :, start - P:end - P] = k
        V[:, :, start - P:end - P] = v
        done = self.settled(layer)
        if done is not None:
            return done
        if P and self.shares(layer, q, start):
            return native.attend(q, K[:, :, :end - P], V[:, :, :end - P], start, P, softcap=self.softcap,
                                 pre_kv=self.base.keys(layer, P))[0]
        if P:
            K, V = self.keys(layer, end)  # the prefix's and this cache's, in one buffer
        return window_attention(q, K[:, :, :end], V[:, :, :end], start, 0, self.windows[layer], self.softcap)

    def rope_attend(self, layer, qkv, cos, sin, start, heads: int):
        """`attend` of the T tokens whose qkv projection (before RoPE) is qkv [1, T, heads +
        2 Hkv, D], in one native call (`native.rope_attend`: RoPE, the K/V write and the
        attention, the same bits as the separate steps): (o [1, T, heads * D], the rotated
        queries), or None where that call does not apply (a device-tensor start, a window or
        ring layer, a shared prefix, a ragged forward's settled outputs, what the kernel does
        not take): the caller then rotates and calls `attend`."""
        slot = self.one_call_slot(layer, start, qkv.shape[1])
        if slot is None:
            return None
        return native.rope_attend(qkv, cos, sin, self.k[layer], self.v[layer], slot, start, 0, heads, self.softcap)

    def one_call_slot(self, layer: int, start, n_tokens: int) -> int | None:
        """The slot in `own(layer)` where a step of n_tokens tokens at `start` writes its K, V
        when RoPE, the write and the attention run in one native call (`rope_attend`, and a
        ragged forward's `Ragged.rope_attend`), or None where that call does not apply."""
        if not isinstance(start, int) or self.base is not None or self._done or not self.plain(layer):
            return None
        self.check_end(start + n_tokens)
        return start

    def _attend_static(self, layer, q, k, v, start: torch.Tensor):
        """The same with `start` on the device (the caller checked the capacity on the host)."""
        if self.ring is not None and layer in self.ring:
            return self.ring.attend(layer, q, k, v, start, self._slots.get(start, q.shape[2])[2])
        return write_and_attend(self.k[layer], self.v[layer], q, k, v, self._slots.get(start, q.shape[2]),
                                self.windows[layer], self.softcap)

    def put(self, layer: int, start: int, k, v):
        """Write K, V [B, Hkv, T, D] of positions start.. as they are (a kept or saved
        prefix, runtime/cache/prefix.py); the caller commits."""
        end = self.check_end(start + k.shape[2])
        if self.ring is not None and layer in self.ring:
            return self.ring.put(layer, start, k, v)
        if start < self.offset:
            self.unshare()
        P = self.offset
        self.k[layer][:, :, start - P:end - P].copy_(k)
        self.v[layer][:, :, start - P:end - P].copy_(v)

    def keys(self, layer: int, end: int | None = None):
        """Committed (or up to `end`) K and V of a layer: [B, Hkv, S, D] views (a window
        layer in a ring has only its latest positions: `recent`); past a shared prefix a
        copy of its KV and this cache's in one buffer."""
        end = self.length if end is None else end
        self.whole(layer)
        P = self.offset
        if P and end > P:
            K0, V0 = self.base.keys(layer, P)
            return (torch.cat([K0, self.k[layer][:, :, :end - P]], 2),
                    torch.cat([V0, self.v[layer][:, :, :end - P]], 2))
        if P:
            return self.base.keys(layer, end)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def device_keys(self, layer: int, end: int | None = None):
        """`keys`: on the device already."""
        return self.keys(layer, end)

    def recent(self, layer: int, lo: int, hi: int):
        """K, V [B, Hkv, hi-lo, D] of positions lo..hi-1."""
        if self.ring is not None and layer in self.ring:
            return self.ring.recent(layer, lo, hi)
        P = self.offset
        if P and lo >= P:  # this cache's own positions only: no copy of the prefix
            self.whole(layer)
            return self.k[layer][:, :, lo - P:hi - P], self.v[layer][:, :, lo - P:hi - P]
        K, V = self.keys(layer, hi)
        return K[:, :, lo:hi], V[:, :, lo:hi]

    def nbytes(self) -> int:
        """The bytes this cache holds (a shared prefix's are its segment's)."""
        ring = self.ring.nbytes() if self.ring is not None else 0
        return ring + sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


def depth_of(cache) -> int | None:
    """The depth of a cache's window rings (None: it keeps every layer whole, right for any
    depth)."""
    return None if cache.ring is None else cache.ring.depth


def copy_prefix(src, dst, n: int):
    """Copy what a forward at n needs of positions [0, n) from one full cache to another
    (a layer kept whole all of it, a window layer's ring its band) and commit n."""
    for layer in range(src.n_layers):
        lo = 0 if layer in src.full_layers else src.ring.first(n)
        k, v = src.keys(layer, n) if layer in src.full_layers else src.recent(layer, lo, n)
        dst.put(layer, lo, k, v)  # [B, Hkv, n - lo, D]
    if src.ring is not None and dst.ring is not None:
        dst.ring.hold_from(src.ring.first(n))
        if src.ring.marked is not None and src.ring.marked[1] <= n:
            dst.ring.marked = src.ring.marked  # read only: shared
    dst.commit(n)


def held_from(cache, n: int) -> int:
    """The first position of [0, n) whose KV every layer of `cache` (of length >= n) still
    holds: 0 without rings, else where its window layers' rings start (`WindowRing.span`)."""
    return 0 if cache.ring is None else cache.ring.span(n)


def band_held(lo: int, window: int | None, n: int, blocks: bool = True) -> bool:
    """Whether window layers holding the positions from `lo` on (to n) have the band a
    forward at n reads: [band_lo(n), n). The one rule for resuming a ring, reusing a kept
    cache and loading a --kv-dir entry at n."""
    return window is None or band_lo(n, window, blocks) >= lo


class WindowRing:
    """The KV of a model's sliding-window layers (sglang's SWAKVPool: a window pool beside
    the full one): per window layer a ring of `size` = window + depth slots on the device
    (on a CPU BAND_BLOCK - 1 more), position p in slot p % size. A forward at p needs the
    positions from `first(p)` on (p - window + 1; on a CPU band_lo(p), up to BAND_BLOCK - 1
    before);
    `depth` bounds what may be written above the point a cache is later committed or
    rolled back to (the engine's `rollback_depth`), so those stay in the ring. `floor`:
    positions below it may be overwritten; `settle` refuses a length whose band starts
    below it (a deeper rollback than `depth`), so a wrong bound fails instead of reading
    stale keys. Holds no length: slots are found from positions (`slot_mask`)."""

    def __init__(self, cfg: ModelConfig, depth: int, batch: int = 1, dtype=torch.float32, device="cpu"):
        self.window, self.depth = cfg.sliding_window, depth
        self.softcap = cfg.attn_logit_softcapping  # scores soft-capped (Gemma 2); None: not
        # on a CPU a forward at p reads from band_lo(p), up to BAND_BLOCK - 1 positions before
        # its own band (`_cpu_bands`); a GPU's from p - window + 1
        self.blocks = torch.device(device).type == "cpu"
        self.size = self.window + depth + (BAND_BLOCK - 1 if self.blocks else 0)  # slots per layer
        shape = (batch, cfg.n_kv_heads, self.size, cfg.head_dim)  # [B, Hkv, size, D]
        layers = [i for i, w in enumerate(cfg.windows) if w is not None]
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.floor = 0  # positions below it may be overwritten
        self.mark_at: int | None = None  # the length whose held positions `settle` copies out
        self.marked: tuple | None = None  # (lo, hi, {layer: (K, V) [B, Hkv, hi-lo, D]}): that copy

    @classmethod
    def of(cls, cfg: ModelConfig, depth: int | None, batch: int = 1, dtype=torch.float32, device="cpu"):
        """The rings of cfg's window layers (the one place that splits layers by kind);
        None without a `depth` or a window layer: every layer is kept whole."""
        if depth is None or all(w is None for w in cfg.windows):
            return None
        return cls(cfg, depth, batch, dtype, device)

    def __contains__(self, layer: int) -> bool:
        return layer in self.k

    def first(self, end: int) -> int:
        """The first position a query at `end` sees."""
        return band_lo(end, self.window, self.blocks)

    def holds(self, n: int) -> bool:
        """Whether a forward at n still finds its band of earlier positions."""
        return self.first(n) >= self.floor

    def span(self, n: int) -> int:
        """The first position of [0, n) the ring holds, its owner's length being >= n."""
        return max(self.floor, n - self.size, 0)

    def hold_from(self, lo: int):
        """Only positions from `lo` on were written (a prefix's band put into a new ring,
        `copy_prefix`, a --kv-dir entry): the ring holds nothing below."""
        self.floor = max(self.floor, lo)

    def settle(self, n: int):
        """The owning cache's length moves to n: its band must still be here."""
        if not self.holds(n):
            raise TriforceError(f"window ring of {self.size} slots (window {self.window} + depth "
                                f"{self.depth}{' + ' + str(BAND_BLOCK - 1) if self.blocks else ''}) no longer holds positions {self.first(n)}..{n - 1}")
        if n == self.mark_at and self.marked is None:
            lo = self.span(n)
            self.marked = (lo, n, {i: self._read(i, lo, n) for i in self.k})

    def mark(self, n: int | None):
        """Copy out the positions the ring holds when its owner's length first settles at n
        (a prompt's end), for a --kv-dir entry to serve that prompt again after generated
        tokens moved the ring on (None: no copy)."""
        self.mark_at, self.marked = n, None

    def reach(self, end: int, start: int | None = None):
        """Positions start..end-1 are written (start unknown: a fixed-shape forward's): the
        ring forgets those below end - size; a write from the floor down holds from its start."""
        if start is not None and start <= self.floor:
            self.floor = max(start, end - self.size)
        else:
            self.floor = max(self.floor, end - self.size)

    def _slots(self, lo: int, hi: int, device) -> torch.Tensor:
        return torch.arange(lo, hi, device=device) % self.size

    def put(self, layer: int, start: int, k, v):
        """Write K, V [B, Hkv, T, D] of positions start.. (the ring keeps the last `size`)."""
        T = k.shape[2]
        n = min(T, self.size)
        idx = self._slots(start + T - n, start + T, k.device)
        K, V = self.k[layer], self.v[layer]
        K.index_copy_(2, idx.to(K.device), k[:, :, T - n:].to(K.device, K.dtype))
        V.index_copy_(2, idx.to(V.device), v[:, :, T - n:].to(V.device, V.dtype))
        self.reach(start + T, start)

    def recent(self, layer: int, lo: int, hi: int):
        """K, V [B, Hkv, hi-lo, D] of positions lo..hi-1 (still in the ring)."""
        if lo < self.floor or hi - lo > self.size:
            raise TriforceError(f"window ring of {self.size} slots does not hold positions {lo}..{hi - 1}")
        return self._read(layer, lo, hi)

    def _read(self, layer: int, lo: int, hi: int):
        idx = self._slots(lo, hi, self.k[layer].device)
        return self.k[layer].index_select(2, idx), self.v[layer].index_select(2, idx)

    def attend(self, layer: int, q, k, v, start, shared: dict | None = None):
        """Attention of a window layer's q [B, Hq, T, D] (positions start..) with its own k,
        v [B, Hkv, T, D] written into the ring: over the band read out of the ring and the
        new keys (any T: a prefill chunk longer than the ring too); a fixed-shape forward
        (`start` a device tensor, T <= depth + 1) over the whole ring with a band mask."""
        if isinstance(start, torch.Tensor):
            return self._attend_static(layer, q, k, v, start, {} if shared is None else shared)
        lo = self.first(start)
        K0, V0 = self._read(layer, lo, start)  # in the ring: `settle` checked the band
        K = torch.cat([K0, k.to(K0.dtype)], 2)
        V = torch.cat([V0, v.to(V0.dtype)], 2)
        out = window_attention(q, K, V, start, lo, self.window, self.softcap)
        self.put(layer, start, k, v)
        return out

    def _attend_static(self, layer, q, k, v, start: torch.Tensor, shared: dict):
        B, Hq, T, D = q.shape
        K, V = self.k[layer], self.v[layer]
        key = ("ring", T, Hq // K.shape[1])
        if key not in shared:
            shared[key] = self.slot_mask(start, T, Hq // K.shape[1])
        idx, mask = shared[key]
        K.index_copy_(2, idx, k.to(K.dtype))
        V.index_copy_(2, idx, v.to(V.dtype))
        return sdpa(_folded(q, K.shape[1]), K, V, attn_mask=mask, softcap=self.softcap).reshape(B, Hq, T, D)

    def slot_mask(self, start: torch.Tensor, T: int, group: int):
        """The slots T tokens from `start` (int64 device tensor [1]) write [T], and which
        slots each folded query row sees [1, 1, G*T, size]: slot s holds, for a query at p,
        position p - ((p - s) mod size), in its band when that distance is below the window
        and not before position 0. Device ops only (captured in a graph)."""
        pos = start + torch.arange(T, device=start.device)  # [T]
        p = pos.repeat(group)[:, None]  # [G*T, 1]: row g*T + t is position start + t
        d = (p - torch.arange(self.size, device=start.device)) % self.size  # [G*T, size]
        return pos % self.size, ((d < self.window) & (d <= p))[None, None]

    def reset(self):
        for t in list(self.k.values()) + list(self.v.values()):
            t.zero_()
        self.floor = 0
        self.mark(None)

    def nbytes(self) -> int:
        marked = [t for kv in self.marked[2].values() for t in kv] if self.marked else []
        return sum(t.numel() * t.element_size() for t in list(self.k.values()) + list(self.v.values()) + marked)
