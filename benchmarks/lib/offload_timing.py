"""Timing helpers for the offload pipeline, shared by `tune` and benchmarks/offload_pipeline.py.

A verification's cost does not depend on the KV values, so long contexts are filled with
random K/V instead of a prefill (a 32K prefill takes minutes on a CPU); the forward
itself runs the real model weights over them.
"""
from __future__ import annotations

import time

import torch

from ..offload.copier import ChunkCopier, Signal
from ..offload.tune import best_chunk, device_sync, link_throughput
from ..runtime.cache.kv import FullCache
from ..runtime.cache.offloaded import OffloadedCache


@torch.inference_mode()
def fill_random(cache: OffloadedCache, n: int, seed: int = 0):
    """Write random K/V at positions [0, n) of every layer and commit n. One random K and V
    are drawn, on the cache's device, and written to every layer: timing does not depend on
    the values, and drawing a 128K 7B cache on the host took minutes."""
    g = torch.Generator(device=cache.device).manual_seed(seed)
    shape = (n, cache.batch, cache.n_kv_heads, cache.head_dim)  # token-major, as the store
    dtype = cache.store.spec.dtype
    k, v = (torch.randn(shape, generator=g, device=cache.device).to(dtype) for _ in range(2))
    for layer in range(cache.n_layers):
        if layer < cache.on_chip:
            cache.chip.k[layer][:, :, :n] = k.permute(1, 2, 0, 3)
            cache.chip.v[layer][:, :, :n] = v.permute(1, 2, 0, 3)
        else:
            cache.store.kv[layer][:n].copy_(torch.stack((k, v), 1))  # one block, K and V interleaved
    cache.commit(n)


@torch.inference_mode()
def verify_once(model, cache: OffloadedCache, tokens: int, device) -> dict:
    """One verification forward of `tokens` tokens after the committed context, started
    from an idle link (prefetch issued right before, as when drafting is instantaneous).
    Returns the forward's timing summary plus the end-to-end latency (from a synchronised
    device to the forward's last kernel done)."""
    n = cache.length
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    cache.sched.reset()  # drop any earlier prefetch: start from an idle link
    cache.copier.flush()
    device_sync(device)
    t0 = time.perf_counter()
    cache.prefetch()
    model(ids, n, cache, last_only=True)
    device_sync(device)
    lat = time.perf_counter() - t0
    cache.rollback(n)  # forget the verified tokens: the next repeat sees the same context
    cache.copier.flush()
    return {**cache.forwards[-1], "latency_s": lat}


class NoCopy(ChunkCopier):
    """Signals every copy at once without moving data: the compute-only reference (the
    staging slots keep stale values, which does not change the timing)."""

    def _submit(self, dst, src, tag, after, track) -> Signal:
        sig = Signal()
        sig.event.set()
        return sig


def make_cache(loaded, context: int, tokens: int, transfer_chunk: int, overlap: bool = True,
               on_chip: int = 0, copier_cls=ChunkCopier, slots: int | None = None,
               profile: bool | None = None) -> OffloadedCache:
    """`profile` (default: on CUDA, where copy and overlap figures need per-chunk events;
    the CPU sums them without spans) records the per-chunk timeline."""
    if profile is None:
        profile = torch.device(loaded.device).type == "cuda"
    cache = OffloadedCache(loaded.cfg, context + tokens, dtype=loaded.dtype, device=loaded.device,
                           on_chip=on_chip, transfer_chunk=transfer_chunk, overlap=overlap,
                           copier_cls=copier_cls, profile=profile, **({"depth": slots} if slots else {}))
    fill_random(cache, context)
    if copier_cls is NoCopy:  # touch the slots: never-written pages all read one zero page
        cache.sched.kv.normal_()
    return cache


def verify_latency(loaded, context: int, tokens: int, transfer_chunk: int, overlap: bool = True,
                   repeats: int = 3, on_chip: int = 0, copier_cls=ChunkCopier) -> dict:
    """Best-of-`repeats` verification (after one warm-up) over a random `context`."""
    cache = make_cache(loaded, context, tokens, transfer_chunk, overlap, on_chip, copier_cls)
    verify_once(loaded.model, cache, tokens, loaded.device)  # warm-up
    runs = [verify_once(loaded.model, cache, tokens, loaded.device) for _ in range(repeats)]
    cache.close()
    return min(runs, key=lambda r: r["latency_s"])


def resident(loaded, context: int, tokens: int) -> FullCache:
    """The compute-alone reference: the same KV resident on the device (FullCache)."""
    full = FullCache(loaded.cfg, context + tokens, dtype=loaded.dtype, device=loaded.device)
    g = torch.Generator(device=loaded.device).manual_seed(0)
    for t in full.k + full.v:
        t[:, :, :context].normal_(generator=g)
    full.commit(context)
    return full


@torch.inference_mode()
def resident_once(model, full: FullCache, tokens: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=full.k[0].device)
    device_sync(ids.device)
    t0 = time.perf_counter()
    model(ids, full.length, full, last_only=True)
    device_sync(ids.device)
    return time.perf_counter() - t0


def copy_once(cache: OffloadedCache) -> float:
    """Seconds to stream one verification's KV (every offloaded layer's prefix) with no
    compute: the link time of a pass."""
    cache.sched.reset()
    cache.copier.flush()
    device_sync(cache.device)
    t0 = time.perf_counter()
    for layer in cache.sched.layers:
        for _ in cache.sched.stream(layer, cache.length):
            pass
    cache.copier.flush()
    device_sync(cache.device)
    return time.perf_counter() - t0


def compare(loaded, context: int, tokens: int, transfer_chunk: int, repeats: int = 3) -> dict:
    """Best-of-`repeats` seconds of: copy alone (every layer's KV into a whole-layer
    staging buffer), compute alone (KV resident), serialized (copy a whole layer, then
    compute it) and overlapped (the pipeline with its default staging). The four are
    measured in interleaved rounds so load drift hits them alike."""
    layer = -(-(context + tokens) // transfer_chunk)  # slots for one whole layer
    caches = {"serialized": make_cache(loaded, context, tokens, transfer_chunk, overlap=False,
                                        slots=layer),
              "overlapped": make_cache(loaded, context, tokens, transfer_chunk)}
    full = resident(loaded, context, tokens)
    best = dict.fromkeys(["copy", "compute", *caches], float("inf"))
    for _ in range(repeats + 1):  # the first round warms up
        best["copy"] = min(best["copy"], copy_once(caches["serialized"]))
        best["compute"] = min(best["compute"], resident_once(loaded.model, full, tokens))
        for name, c in caches.items():
            r = verify_once(loaded.model, c, tokens, loaded.device)
            best[name] = min(best[name], r["latency_s"])
    for c in caches.values():
        c.close()
    return best


def tune_rows(loaded, context: int, tokens: int, sizes: list[int], repeats: int = 2,
              progress=None) -> tuple[list[dict], int]:
    """Per chunk size: link GB/s and verify latency; and the best chunk."""
    bpt = 2 * loaded.cfg.n_kv_heads * loaded.cfg.head_dim * torch.empty(0, dtype=loaded.dtype).element_size()
    rows = []
    for c in sizes:
        gbs = link_throughput(c, context, bpt, loaded.device)
        r = verify_latency(loaded, context, tokens, c, repeats=repeats)
        rows.append({"chunk": c, "copy_bytes": c * bpt, "link_gbps": gbs,
                     "verify_ms": 1000 * r["latency_s"], "overlap": r["overlap"]})
        if progress:
            progress(rows[-1])
    return rows, best_chunk(rows)


class _BlockedTime:
    """Seconds the host spends blocked in `Signal.wait` while active (a class-level wrap)."""

    def __init__(self):
        self.s = 0.0

    def __enter__(self):
        self.orig = orig = Signal.wait

        def wait(sig):
            t = time.perf_counter()
            orig(sig)
            self.s += time.perf_counter() - t
        Signal.wait = wait
        return self

    def __exit__(self, *exc):
        Signal.wait = self.orig


@torch.inference_mode()
def host_per_chunk(cache: OffloadedCache, repeats: int = 3) -> dict:
    """Host seconds per streamed chunk of the pipeline itself (scheduler, copier, timeline):
    a pass over every offloaded layer's committed prefix with no attention, its wall time
    minus the time blocked waiting for copies, divided by the chunks. Best of `repeats`
    after a warm-up pass; the copier does its real copies meanwhile."""
    best = float("inf")
    for r in range(repeats + 1):
        cache.sched.reset()
        cache.copier.flush()
        device_sync(cache.device)
        chunks = 0
        with _BlockedTime() as blocked:
            t0 = time.perf_counter()
            cache.prefetch()
            for layer in cache.sched.layers:
                for _ in cache.sched.stream(layer, cache.length):
                    chunks += 1
            host = time.perf_counter() - t0 - blocked.s
        if r:
            best = min(best, host / chunks)
        cache.copier.flush()
    return {"host_s_per_chunk": best, "chunks": chunks}
