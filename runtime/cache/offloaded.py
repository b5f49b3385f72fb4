"""The full cache with the KV in host memory: the offloaded cache.

`OffloadedCache` is a `protocols.OffloadedKV` (the cache protocol of `cache.py`) over
`offload/`: the first `on_chip` layers keep their KV on the device; every other layer's
KV lives in the host store and streams through staging slots in `transfer_chunk`-token
chunks while compute runs. Attention over such a layer runs chunk by chunk as chunks land
and merges the partial results by log-sum-exp, then adds the forward's own tokens, which
are on the device already. New K/V are written back to the host right after each layer's
attention (asynchronously), and several forwards may add pending tokens in a row:
positions at or above the committed length are scratch that the next `commit` keeps or
forgets, and only positions below a forward's start are streamed.

When each transfer starts is the caller's to say, never a side effect of the length:
- a forward streams its own layers (the first chunks may already be in flight);
- `prefetch()` starts streaming the first offloaded layers for a forward at the committed
  length: the engine calls it right after committing a verification and before the draft
  levels run (the link is idle then), `generate` after each commit;
- `commit(n)` / `rollback(n)` only move the length (a pass streaming a prefix that no
  longer matches is abandoned by the next forward);
- `begin_forward` / `end_forward`, which the model calls around its layer loop, time the
  forward (events only: no host synchronisation) instead of guessing its edges from layer
  indices.

Per-chunk spans (copies, waits) are recorded only under `--profile` (`profile=True`):
without it a forward keeps two timing events and, on the CPU, the copier's copy seconds
and the scheduler's wait seconds (`overlap` from those sums); on CUDA `overlap` then
needs `--profile`.

Prefill never re-streams: `prefill_layer_major` runs every prompt chunk through layer l
(the model's own `layer_step`) before layer l+1, and the cache holds that one layer's
prompt KV on the device meanwhile (`hold`), so each chunk attends to its predecessors
there and is written back once. Host->device bytes of a prefill are at most one pass over
the KV committed before it. `layer_major = True` tells `generate.prefill` to take that path.

Window layers (Gemma 3, windowed Mistral/Qwen2), built with a `ring_depth`, keep a ring of
window + depth tokens on the device (`cache.WindowRing`) and are never streamed: the store
holds the global layers only, and a verification streams their share of the bytes.

`make_full_cache(loaded, capacity, opts)` picks the full cache for `--offload`; the
autoregressive mode and the TriForce verifier both build their full cache with it.
"""
from __future__ import annotations

import json
import weakref
from pathlib import Path

import torch

from ...kernels.attention import attention
from ...kernels import chunked
from ...kernels.chunked import StreamedAttention
from ...offload.copier import ChunkCopier
from ...offload.costmodel import STAGE_DEPTH, staging_bytes
from ...offload.pipeline import TransferPipeline
from ...offload import store as S
from ...offload.store import HostKVStore, StoreSpec, _elem, check_memory
from ...offload.timeline import Span, Timeline, device_clock
from ...offload.tune import transfer_chunk_for
from .kv import ROWWISE_MAX, FullCache, KVCache, WindowRing, band_lo, copy_prefix, window_attention
from ..spec.engine import rollback_depth
from ..graphs import graphable, keeps, kept, room_for
from .retrieval import RetrievalCache
from ..errors import TriforceError
from ..protocols import HostStore
from ..model.tp import agree

HOST_HINT = "lower --max-context or --max-new-tokens (or shorten the prompt)"
RESIDENT_HINT = HOST_HINT + ", or keep the KV in host memory with --offload on"
DEVICE_HINT = "lower --on-chip or --transfer-chunk"
PREFILL_HINT = "lower --on-chip, --transfer-chunk or --prefill-chunk, or --max-context"
PREFILL_CHUNK = 512  # GenerationOptions.prefill_chunk's default


def layer_bytes(cfg, tokens: int, dtype, batch: int = 1) -> int:
    """K and V bytes of `tokens` tokens in one layer."""
    return tokens * batch * cfg.kv_bytes_per_token(_elem(dtype)) // cfg.n_layers


def rebuild_device_bytes(cfg, capacity: int, retrieval_slots: int, dtype, offloaded: bool,
                         ring_depth: int | None = None) -> int:
    """Device bytes a retrieval-cache (re)build holds beside the caches, one layer at a
    time: the selected chunks' K and V, gathered then joined to the tail (twice a layer of
    the retrieval cache), and for an offloaded full cache the layer's whole prefix copied
    in one block (`device_keys`). With a `ring_depth` and no global layer, only the rings'
    bands are read (`recent`: one window of a layer)."""
    if not retrieval_slots:
        return 0
    if ring_depth is not None and all(w is not None for w in cfg.windows):
        return layer_bytes(cfg, min(cfg.sliding_window, capacity), dtype)
    block = layer_bytes(cfg, capacity, dtype) if offloaded else 0
    return block + 2 * layer_bytes(cfg, retrieval_slots, dtype)


def prefill_device_bytes(cfg, tokens: int, chunk: int, batch: int, elem: int,
                         layer_major: bool = True, fresh_layers: int | None = None) -> int:
    """Device bytes a layer-major prefill of `tokens` holds besides the held layer's KV:
    the prompt's hidden states [B, T, H] and cos, sin [T, D] for the whole prefill; every
    layer's latest chunk of K, V (`fresh`, kept for `recent`: views that keep the chunk's
    stacked qkv and rotated q|k buffers alive); and the peak of one chunk's `layer_step`,
    the larger half of it: attention (the norm, the residual, qkv, the rotation and its
    temporaries, write-back copies of k, v, the fp32 prefix and causal partial outputs) or
    the MLP (the norm, gate|up, silu(gate) and the product). `fresh_layers`: the layers that
    keep their chunk (the offloaded ones: on-chip and ring layers attend in place; None:
    every layer). `layer_major=False`: a resident prefill, chunk by chunk through every
    layer (no `fresh`)."""
    H, D, inner = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.n_heads * D, cfg.n_kv_heads * D
    c = min(chunk, tokens)
    whole = tokens * (batch * H + 2 * D) * elem
    n_fresh = cfg.n_layers if fresh_layers is None else fresh_layers
    fresh = n_fresh * c * batch * (2 * q + 3 * kv) * elem if layer_major else 0
    attn = (3 * H + 4 * q + 7 * kv) * elem + (2 * H + 2 * q) * 4
    mlp = (3 * H + 4 * inner) * elem + 2 * H * 4
    return whole + fresh + c * batch * max(attn, mlp)


class OffloadedCache(KVCache):
    """Full cache whose layers >= on_chip live in the host store, streamed per verification
    (`protocols.OffloadedKV`)."""

    layer_major = True  # prefill through `hold`, never re-streaming

    def __init__(self, cfg, capacity: int, batch: int = 1, dtype=torch.float32, device="cpu",
                 on_chip: int = 0, transfer_chunk: int | None = None, depth: int = STAGE_DEPTH,
                 overlap: bool = True, copier_cls=ChunkCopier, log_order: bool = False,
                 prefill_chunk: int = PREFILL_CHUNK, profile: bool = False, retrieval_slots: int = 0,
                 ring_depth: int | None = None):
        # `ring_depth`: window layers in a WindowRing on the device (None: stored and streamed too)
        super().__init__(cfg, batch, WindowRing.of(cfg, ring_depth, batch, dtype, device))
        if not 0 <= on_chip <= cfg.n_layers:
            raise TriforceError(f"--on-chip {on_chip}: must be between 0 and {cfg.n_layers} layers")
        chip = [i for i in self.full_layers if i < on_chip]  # global layers kept on the device
        spec = StoreSpec([i for i in self.full_layers if i >= on_chip], cfg.n_kv_heads, cfg.head_dim,
                         capacity, batch, dtype)
        transfer_chunk = min(transfer_chunk_for(device, spec.bytes_per_token(), transfer_chunk), capacity)
        self.capacity, self.on_chip, self.device = capacity, on_chip, device
        self.transfer_chunk = transfer_chunk  # tokens per host-to-device copy
        self._check(cfg, spec, depth, prefill_chunk, retrieval_slots, len(chip))
        self.timeline = Timeline(log_order, device_clock(device))  # forwards' edges, always
        self.spans = self.timeline if profile or log_order else None  # per-chunk spans: --profile
        self.store: HostStore = HostKVStore(spec)
        self.copier = copier_cls(device, self.spans)
        weakref.finalize(self, self.copier.close)  # stop the copier thread with the cache
        self.sched = TransferPipeline(self.store, self.copier, transfer_chunk, device, depth,
                                       overlap, self.spans) if spec.layers else None
        self.chip = FullCache(cfg, capacity, batch, dtype, device, layers=chip) if chip else None
        self.write_backs = {}  # layer -> Signal of its latest write-back
        self._forwards = []  # per-forward timing summaries (`forwards`)
        self._pending = []  # forwards whose timing events are not resolved yet
        self._trace_spans = None  # resolved spans of the last multi-layer forward (`trace`)
        self.held = None  # (layer, K, V [B, Hkv, S, D]) on the device during a layer-major prefill
        self.fresh = {}  # layer -> (start, k, v [B, Hkv, T, D]): the latest forward's device KV
        self._t0 = None  # timing event of the running forward's start (`begin_forward`)
        self._sums0 = None  # copy and wait sums at its start (`_sums`)
        self._tokens = 0  # its tokens

    def _check(self, cfg, spec: StoreSpec, depth: int, prefill_chunk: int, retrieval_slots: int = 0,
               n_chip: int = 0):
        """On-chip layers (`n_chip` global ones, and the window layers' rings), the staging
        ring, the retrieval cache (`retrieval_slots`: the middle level's, 0 for none; its
        rings as deep as this cache's) and the larger of the prefill (the layer it holds,
        and its activations over a prompt as long as the capacity) and a rebuild (a layer's
        prefix in one block, the selection) must fit."""
        per_layer = spec.bytes_per_token() * spec.capacity
        dev = n_chip * per_layer + (self.ring.nbytes() if self.ring is not None else 0)
        ring = self.ring.depth if self.ring is not None else None  # the retrieval cache's rings too
        ret = RetrievalCache.bytes_for(cfg, retrieval_slots, spec.dtype, spec.batch, ring)
        rebuild = rebuild_device_bytes(cfg, spec.capacity, retrieval_slots, spec.dtype, bool(spec.layers), ring)
        what = f" and the retrieval cache ({ret / 2 ** 30:.1f} GB)" if ret else ""
        if spec.layers:
            stage = staging_bytes(self.transfer_chunk, spec.bytes_per_token(), depth)
            pre = prefill_device_bytes(cfg, spec.capacity, prefill_chunk, spec.batch, _elem(spec.dtype),
                                       fresh_layers=len(spec.layers))
            dev += stage + ret + max(per_layer + pre, rebuild)
            what = f"on-device KV, staging, the prefill ({(per_layer + pre) / 2 ** 30:.1f} GB){what}"
            return check_memory(spec.nbytes(), dev, self.device, HOST_HINT, PREFILL_HINT, what)
        check_memory(spec.nbytes(), dev + ret + rebuild, self.device, HOST_HINT, DEVICE_HINT,
                     f"on-device KV{what}")

    def begin_forward(self, start: int, n_tokens: int):
        """Time the forward from here (an event on the compute stream on CUDA: no host sync)."""
        if start < self.length:
            raise RuntimeError(f"a forward at {start} below the committed length {self.length}: "
                               "rollback() first")
        self._t0 = self.timeline.event()
        self._tokens = n_tokens
        self._sums0 = self._sums()

    def _sums(self) -> dict | None:
        """Copy and wait seconds so far, without spans (the CPU, no --profile); else None."""
        if self.spans is not None or self.sched is None or self.copier.cuda:
            return None
        return {"copy_s": self.copier.busy, "wait_s": self.sched.waited}

    def attend(self, layer, q, k, v, start):
        self.end_of(q, start)
        if self.ring is not None and layer in self.ring:
            return self.ring.attend(layer, q, k, v, start)
        if layer < self.on_chip:
            return self.chip.attend(layer, q, k, v, start)
        return self._attend_offloaded(layer, q, k, v, start)

    def end_forward(self):
        """The forward's timing spans become one pending summary (resolved later)."""
        self._forward_done(self._tokens)

    def _attend_offloaded(self, layer, q, k, v, start):
        if self.held is not None and self.held[0] == layer:
            return self._attend_held(layer, q, k, v, start)
        if self.windows[layer] is not None:
            return self._attend_window(layer, q, k, v, start)
        if 1 < q.shape[2] <= ROWWISE_MAX and chunked.default_path(q.device) != "cuda":  # rows as decodes
            return self._attend_rows(layer, q, k, v, start)
        acc = StreamedAttention(q, k.shape[1], softcap=self.softcap)
        with Span(self.spans, "compute", f"attention L{layer}", tokens=q.shape[2]):
            for _, kc, vc in self.sched.stream(layer, start):
                acc.add(kc, vc)  # all keys < start: no mask
            acc.add_causal(k, v, start, start)  # the forward's own tokens
            out = acc.result(q.dtype)
        self._write_back(layer, k, v, start)
        return out

    def _attend_rows(self, layer, q, k, v, start):
        """A forward of several tokens on the CPU path (a verification), each row computed
        exactly as its one-token decode: over the same key blocks, merged in the same order.
        A decode at p streams the grid chunks [cC, min((c+1)C, p)) out of the store (the keys
        at the KV dtype) and adds its own key last; so row i (position start + i) gets the
        whole chunks below start's cell, then its cell's keys up to start + i in grid chunks,
        the stored ones and the forward's earlier ones at the KV dtype (what the store will
        hold), then its own key. The chunks stream once, but each row's accumulator attends
        to each of them on its own (the CPU flash kernel is not row-exact across query rows):
        T attention calls per chunk, about twice the shared path's decode time at T ~ 7."""
        T, C = q.shape[2], self.sched.transfer_chunk
        accs = [StreamedAttention(q[:, :, i:i + 1], k.shape[1], softcap=self.softcap) for i in range(T)]
        cell = start // C * C  # the grid chunk start falls in: its stored part is [cell, start)
        tail = None
        with Span(self.spans, "compute", f"attention L{layer}", tokens=T):
            for c0, kc, vc in self.sched.stream(layer, start):
                if c0 < cell:
                    for a in accs:
                        a.add(kc, vc)
                else:  # the stored part of start's cell: a staging slot, reused after the loop
                    tail = (kc.clone(), vc.clone())
            kn, vn = k.to(self.store.spec.dtype), v.to(self.store.spec.dtype)
            for i, a in enumerate(accs):
                p, lo = start + i, cell
                while lo < p:  # the grid chunks of [cell, p), as the decode at p streams them
                    hi = min(lo + C, p)
                    ks, vs = [], []
                    if lo < start:
                        ks.append(tail[0][:, :, lo - cell:min(hi, start) - cell])
                        vs.append(tail[1][:, :, lo - cell:min(hi, start) - cell])
                    if hi > start:
                        ks.append(kn[:, :, max(lo, start) - start:hi - start])
                        vs.append(vn[:, :, max(lo, start) - start:hi - start])
                    a.add(torch.cat(ks, 2) if len(ks) > 1 else ks[0], torch.cat(vs, 2) if len(vs) > 1 else vs[0])
                    lo = hi
                a.add_causal(k[:, :, i:i + 1], v[:, :, i:i + 1], p, p)  # its own key, last
            out = torch.cat([a.result(q.dtype) for a in accs], 2)
        self._write_back(layer, k, v, start)
        return out

    def _attend_window(self, layer, q, k, v, start):
        """A sliding-window layer: the streamed chunks' keys from the first query's band on
        (copied out of their staging slots), then the forward's own, each query attending
        to its own band (the whole prefix still streams)."""
        lo = band_lo(start, self.windows[layer])  # where the CPU's window attention reads from
        ks, vs = [], []
        with Span(self.spans, "compute", f"attention L{layer}", tokens=q.shape[2]):
            for c0, kc, vc in self.sched.stream(layer, start):
                a = max(lo - c0, 0)
                if a < kc.shape[2]:
                    ks.append(kc[:, :, a:].clone())
                    vs.append(vc[:, :, a:].clone())
            K, V = torch.cat(ks + [k], 2), torch.cat(vs + [v], 2)
            out = window_attention(q, K, V, start, lo, self.windows[layer], self.softcap)
        self._write_back(layer, k, v, start)
        return out

    def _attend_held(self, layer, q, k, v, start):
        """Prefill: the layer's earlier KV is on the device already (`hold`), nothing streams."""
        _, K, V = self.held
        end = start + q.shape[2]
        if end > K.shape[2]:
            raise RuntimeError(f"attend up to {end} past the held prefill end {K.shape[2]}")
        K[:, :, start:end] = k
        V[:, :, start:end] = v
        with Span(self.spans, "compute", f"attention L{layer}", tokens=q.shape[2]):
            out = window_attention(q, K[:, :, :end], V[:, :, :end], start, 0, self.windows[layer], self.softcap)
        self._write_back(layer, k, v, start)
        return out

    def _write_back(self, layer, k, v, start):
        """Copy the forward's new K, V [B, Hkv, T, D] to the store asynchronously (and keep
        them for `recent`)."""
        self.fresh[layer] = (start, k, v)
        src = self.store.pack(k, v)  # [T, 2, B, Hkv, D], the store's layout: one copy
        dst = self.store.chunk(layer, start, start + k.shape[2])
        self.write_backs[layer] = self.copier.write_back(dst, src, (layer, start, "wb"))

    def hold(self, layer: int | None, end: int = 0):
        """Keep offloaded `layer`'s KV of positions [0, end) on the device until the next
        `hold` (None releases it): a layer-major prefill runs all its chunks through that
        layer. The committed prefix [0, length) is streamed in once; new KV is written
        into the held buffer and back to the host as usual. A no-op for on-chip layers."""
        if layer is None or layer < self.on_chip or (self.ring is not None and layer in self.ring):
            self.held = None
            return
        _, K, V = self.held or (None, None, None)
        if K is None or K.shape[2] < end:
            shape = (self.batch, self.n_kv_heads, end, self.head_dim)  # [B, Hkv, S, D]
            dtype = self.store.spec.dtype
            K, V = (torch.empty(shape, dtype=dtype, device=self.device) for _ in range(2))
        if self.length:  # a continued prefill: the committed prefix streams in once
            for c0, kc, vc in self.sched.stream(layer, self.length):
                K[:, :, c0: c0 + kc.shape[2]] = kc
                V[:, :, c0: c0 + vc.shape[2]] = vc
        self.held = (layer, K, V)

    PENDING = 4  # forwards left unresolved at most (their events are long done by then)

    def _forward_done(self, tokens: int):
        if self._t0 is None or self.sched is None:
            return
        t1 = self.timeline.event()
        # the spans since the last forward: its copies, waits, compute, and the prefetch
        # that ran before it (while the draft levels ran); resolved later, never waited for
        sums, s0 = self._sums(), self._sums0
        counts = None if sums is None else {k: sums[k] - s0[k] for k in sums}
        self._pending.append(self.timeline.take(self._t0, t1, tokens, counts))
        self._settle(keep=self.PENDING)

    def _settle(self, keep: int = 0):
        """Resolve pending forwards in order: those whose events have all landed (queried,
        not waited for), and past `keep` pending the oldest anyway (forwards ago: landed).
        keep=0 when a summary or the trace is read."""
        while self._pending and (len(self._pending) > keep or self._pending[0].done()):
            s, spans = self.timeline.settle(self._pending.pop(0))
            self._forwards.append(s)
            self._trace_spans = spans

    @property
    def forwards(self) -> list[dict]:
        """Per-forward timing summaries (wall, copy, compute, wait seconds, overlap, tokens)."""
        self._settle()
        return self._forwards

    @property
    def trace(self) -> dict | None:
        """Chrome trace of the last multi-layer forward, with the prefetch copies that ran
        before it on their own `prefetch` thread."""
        self._settle()
        if self._trace_spans is None:
            return None
        return self.timeline.chrome_trace(spans=self._trace_spans)

    def commit(self, n: int):
        super().commit(n)
        if self.chip is not None:
            self.chip.commit(n)

    def rollback(self, n: int):
        super().rollback(n)
        if self.chip is not None:
            self.chip.rollback(n)

    def prefetch(self):
        """Start streaming the first offloaded layers for a forward at the committed length
        (the engine: before the draft levels run; `generate`: after a commit)."""
        if self.sched is not None and self.sched.overlap:
            self.sched.start(self.length)

    def put(self, layer: int, start: int, k, v):
        """Write K, V [B, Hkv, T, D] of positions start.. straight into the store (or the
        on-chip layer, or its ring); the caller commits. Nothing may be in flight for those positions."""
        if self.ring is not None and layer in self.ring:
            return self.ring.put(layer, start, k, v)
        if layer < self.on_chip:
            return self.chip.put(layer, start, k, v)
        self.check_end(start + k.shape[2])
        self.store.write(layer, start, k, v)

    def keys(self, layer: int, end: int | None = None):
        """Committed (or up to `end`) K, V of a layer as [B, Hkv, S, D] views: device views
        for on-chip layers, host store views otherwise (after pending write-backs land)."""
        end = self.length if end is None else end
        self.whole(layer)
        if layer < self.on_chip:
            return self.chip.keys(layer, end)
        if layer in self.write_backs:
            self.write_backs[layer].synchronize()
        return self.store.view(layer, end)

    def device_keys(self, layer: int, end: int | None = None):
        """`keys` on the device, one layer at a time (the device memory a prefill's held
        layer takes): on-chip layers' views, else one copy of the host store's interleaved
        prefix [S, 2, B, Hkv, D] (one contiguous pinned block: the link's full speed; K or V
        alone is strided, and torch would stage it through unpinned host memory), split on
        the device. What the retrieval cache scores and gathers from: on the host a build
        would read every layer's KV at host-memory speed (a 7B at 128K: 64 GB). On the CPU,
        the store itself."""
        end = self.length if end is None else end
        kv = self.keys(layer, end)  # (pending write-backs land first)
        if layer < self.on_chip or torch.device(self.device).type == "cpu":
            return kv
        (block,) = self.store.chunk(layer, 0, end)  # the scheduler's store is token-major
        block = block.to(self.device, non_blocking=True)
        return block[:, 0].permute(1, 2, 0, 3), block[:, 1].permute(1, 2, 0, 3)

    def recent(self, layer: int, lo: int, hi: int):
        """K, V [B, Hkv, hi-lo, D] of positions lo..hi-1 on the device: from the latest
        forward's own tensors when it wrote all of them (the verified tokens the retrieval
        cache absorbs), so no host synchronisation; otherwise from `keys` (a window layer: its ring)."""
        if self.ring is not None and layer in self.ring:
            return self.ring.recent(layer, lo, hi)
        f = self.fresh.get(layer)
        if f is not None and f[0] <= lo and hi <= f[0] + f[1].shape[2]:
            a, b = lo - f[0], hi - f[0]
            return f[1][:, :, a:b], f[2][:, :, a:b]
        K, V = self.keys(layer, hi)
        return K[:, :, lo:hi], V[:, :, lo:hi]

    def nbytes(self) -> int:
        on = (self.chip.nbytes() if self.chip else 0) + (self.ring.nbytes() if self.ring is not None else 0)
        return on + self.store.nbytes() + (self.sched.nbytes() if self.sched else 0)

    def stats(self) -> dict:
        """Figures for Stats.extra: mean overlap of decode/verify forwards, bytes streamed."""
        fw = [f for f in self.forwards if f["copy_s"] > 0]  # CUDA without --profile: none
        out = {"offload": True, "on_chip": self.on_chip, "transfer_chunk": self.transfer_chunk,
               "streamed_gb": self.copier.bytes / 2 ** 30}
        if self.sched is not None:
            out.update(stage_depth=self.sched.n_slots, staging_mib=self.sched.nbytes() / 2 ** 20)
        if fw:
            out["overlap"] = sum(f["overlap"] for f in fw) / len(fw)
        return out

    def close(self):
        self.copier.close()


@torch.inference_mode()
def prefill_layer_major(model, cache, ids: torch.Tensor, start: int, prefill_chunk: int,
                        progress=None):
    """Prefill ids [B, T] at positions start.. layer by layer: every chunk of `prefill_chunk`
    tokens through layer l (the model's own `layer_step`), then layer l+1, while the cache
    holds layer l's KV on the device. One forward for the cache's hooks; holds the prompt's
    hidden states [B, T, H] (against the KV of one layer, 2 * Hkv * D / H of that per
    layer). Returns the last logits [B, V]; the caller commits start+T."""
    T, n = ids.shape[1], model.config.n_layers
    x = model.embed(ids)  # [B, T, H]
    cos, sin = model.rope(start, T, x.dtype, ids.device)
    spans = [(s, min(s + prefill_chunk, T)) for s in range(0, T, prefill_chunk)]
    cache.begin_forward(start, T)
    for i in range(n):
        cache.hold(i, start + T)
        for s, e in spans:
            x[:, s:e] = model.layer_step(i, x[:, s:e], cos[s:e], sin[s:e], start + s, cache)
        if progress:
            progress(T * (i + 1) // n, T)
    cache.hold(None)
    cache.end_forward()
    return model.head(x, last_only=True)[:, -1]


def use_offload(o, cfg, capacity: int, dtype, device, above: int = 0, ring_depth: int | None = None) -> bool:
    """`auto`: offload when the full KV (global layers whole, window layers in rings of
    `ring_depth`; and `above`, what the levels above it add on the device) would not fit in
    80% of the free device memory; on a CPU the device is the host, so auto means off."""
    if o.offload != "auto":
        return o.offload == "on"
    free = S.device_available(device)
    if free is None:
        return False
    need = cfg.kv_bytes(capacity, _elem(dtype), ring_depth)
    return need + above > 0.8 * free


def make_full_cache(loaded, capacity: int, opts, retrieval_slots: int = 0) -> KVCache:
    """The full cache for `--offload`: FullCache on the device (the kept one where it fits,
    graphs.Kept), or an OffloadedCache. `retrieval_slots`: the size of the retrieval cache
    the run will add on the device (0: none), counted in the memory checks. Window layers
    keep rings as deep as the engine may roll back (`rollback_depth`)."""
    o, ring = opts.offload, rollback_depth(opts.generation)
    ret = RetrievalCache.bytes_for(loaded.cfg, retrieval_slots, loaded.kv_dtype, ring_depth=ring)
    # tensor-parallel ranks decide together (rank 0's free memory): one offloading and the
    # other not would run different collectives (layer-major prefill against chunked)
    if not agree(int(use_offload(o, loaded.cfg, capacity, loaded.kv_dtype, loaded.device, ret, ring))):
        if o.profile:
            raise TriforceError("--profile times the offload pipeline: add --offload on")
        return resident_cache(loaded, capacity, opts.prefill_chunk, retrieval_slots, ring)
    return OffloadedCache(loaded.cfg, capacity, dtype=loaded.kv_dtype, device=loaded.device,
                          on_chip=o.on_chip, transfer_chunk=o.transfer_chunk, depth=o.stage_depth,
                          overlap=o.overlap, prefill_chunk=opts.prefill_chunk, profile=bool(o.profile),
                          retrieval_slots=retrieval_slots, ring_depth=ring)


def resident_cache(loaded, capacity: int, prefill_chunk: int = PREFILL_CHUNK, retrieval_slots: int = 0,
                   ring_depth: int | None = None):
    """A FullCache on the device, checked against its free memory first. Where steps are
    fixed-shape (graphs.graphable) it is the model's kept one (graphs.Kept: capacity
    rounded up to graphs.ROOM), reset in place, when that has this capacity; its kept KV
    moves out of the prefix store (`loaded.prefix`) first. `ring_depth`: window layers' rings."""
    cfg, dtype, device = loaded.cfg, loaded.kv_dtype, loaded.device
    make = lambda c: FullCache(cfg, c, dtype=dtype, device=device, ring_depth=ring_depth)  # noqa: E731
    if graphable(device):  # kept or a batch sequence's own: one capacity class, so the
        capacity = room_for(capacity)  # fixed-shape kernels split its keys alike
    k = kept(loaded.model) if keeps(device) else None
    if k is None:
        check_resident(cfg, capacity, dtype, device, prefill_chunk, retrieval_slots, ring_depth=ring_depth)
        return make(capacity)
    w = k.full_cache(capacity, ring_depth)  # None: a kept one of another capacity or depth is dropped
    r = k.retrieval_cache(retrieval_slots, ring_depth) if retrieval_slots else None
    check_resident(cfg, capacity, dtype, device, prefill_chunk, retrieval_slots,
                   held=(w.nbytes() if w else 0) + (r.nbytes() if r else 0), ring_depth=ring_depth)
    if w is None:
        w = k.keep_full(make(capacity))
    else:
        move_out(loaded.prefix, w, make)
        w.reset()
    w.leased = True  # until the run closes it (finish_stats)
    return w


def check_resident(cfg, capacity: int, dtype, device, prefill_chunk: int, retrieval_slots: int = 0,
                   held: int = 0, ring_depth: int | None = None):
    """Refuse a resident run that cannot fit the device: the full KV, the retrieval cache
    and the larger of a prefill chunk's activations and a rebuild's selection, less `held`
    (kept caches it reuses, allocated already). `ring_depth`: both caches keep their window
    layers in rings (global layers whole), as they are built."""
    kv = cfg.kv_bytes(capacity, _elem(dtype), ring_depth)
    ret = RetrievalCache.bytes_for(cfg, retrieval_slots, dtype, ring_depth=ring_depth)
    pre = prefill_device_bytes(cfg, min(prefill_chunk, capacity), prefill_chunk, 1, _elem(dtype), False)
    rebuild = rebuild_device_bytes(cfg, capacity, retrieval_slots, dtype, False, ring_depth)
    need = kv + ret + max(pre, rebuild) - held
    what = (f"the KV cache ({kv / 2 ** 30:.1f} GB)"
            + (f", the retrieval cache ({ret / 2 ** 30:.1f} GB)" if ret else "") + " and the prefill")
    if S.device_available(device) is not None:  # on the CPU the KV is host memory, as it was
        check_memory(0, need, device, HOST_HINT, RESIDENT_HINT + (", or lower --budget" if ret else ""), what)


def move_out(store, cache, make):
    """`cache` is about to be reset for a new run: entries of the prefix store `store` that
    keep it get a copy of its KV (`make(capacity)`) instead, so what they keep survives."""
    if store is None:
        return
    with store.lock:
        entries = [e for e in store.entries if e.cache is cache]
        queued = any(u[0] is cache for u in store.unsaved)
        if not entries and not queued:
            return
        copy = make(cache.capacity)
        copy_prefix(cache, copy, cache.length)
        for e in entries:
            e.cache = copy
        store.unsaved[:] = [(copy if c is cache else c, *rest) for c, *rest in store.unsaved]


def finish_stats(cache: KVCache, st, opts) -> None:
    """Add the cache's own figures to Stats.extra; write the --profile trace of an
    offloaded cache; close the cache."""
    st.extra.update(cache.stats())
    o = opts.offload
    if o.profile and isinstance(cache, OffloadedCache) and cache.trace is not None:
        Path(o.profile).write_text(json.dumps(cache.trace))
        st.extra["profile"] = o.profile
    cache.close()
