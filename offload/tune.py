"""Transfer-chunk tuning: link throughput per chunk size and the per-device profile JSON.

Link efficiency rises with chunk size (fewer, larger copies) while overlap and staging
memory favour small chunks, so the best size is measured per machine. `tune` writes
`<cache>/profiles/<device>.json`; `run` reads `profile_chunk(device)` by default and
`--transfer-chunk` overrides it. The cache root is `$TRIFORCE_OFFLOAD_CACHE`
(default `~/.cache/triforce-offload`), as for the dequantized models.
"""
from __future__ import annotations

import json
import platform
import re
import time
from pathlib import Path

import torch

from .copier import ChunkCopier
from .costmodel import MIN_COPY_BYTES, default_transfer_chunk
from ..settings import environment

SIZES = tuple(2 ** i for i in range(6, 15))  # 64 .. 16384 tokens


def device_name(device) -> str:
    """A file-name-safe name for this device: the GPU model, or the CPU model on a CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = "cpu-" + (_cpu_model() or platform.machine())
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def profile_path(device) -> Path:
    return environment().cache_root() / "profiles" / f"{device_name(device)}.json"


def load_profile(device) -> dict | None:
    p = profile_path(device)
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def profile_chunk(device) -> int | None:
    """The tuned transfer chunk for this device, or None when `tune` has not run here."""
    prof = load_profile(device)
    return int(prof["transfer_chunk"]) if prof and "transfer_chunk" in prof else None


LINK_SPEED = 0.9  # a copy size "reaches the link's speed" at this fraction of the best GB/s


COPIES = "kv"  # a profile's copy_bytes count K and V of a chunk together (one copy)


def min_copy_bytes(prof: dict | None) -> int:
    """The smallest copy that reaches LINK_SPEED of the link's best GB/s on the profile's
    measured curve (rows with `copy_bytes`); MIN_COPY_BYTES without one. Profiles saved
    before K and V became one copy (no `copies: kv`) recorded half of each timed copy."""
    rows = [r for r in (prof or {}).get("rows", []) if r.get("copy_bytes") and r.get("link_gbps")]
    if not rows:
        return MIN_COPY_BYTES
    scale = 1 if prof.get("copies") == COPIES else 2
    top = max(r["link_gbps"] for r in rows)
    return scale * min(r["copy_bytes"] for r in rows if r["link_gbps"] >= LINK_SPEED * top)


def transfer_chunk_for(device, kv_layer_bytes: float, given: int | None = None) -> int:
    """The transfer chunk every offloaded cache uses: `given` (--transfer-chunk or a plan),
    else the chunk `tune` chose for this device (for a profile that names its K+V bytes per
    token, only for a model with those bytes), else enough tokens per copy to reach the
    link's speed: from the profile's link curve, or MIN_COPY_BYTES."""
    if given:
        return given
    prof = load_profile(device)
    if prof and "transfer_chunk" in prof and prof.get("bytes_per_token", kv_layer_bytes) == kv_layer_bytes:
        return int(prof["transfer_chunk"])
    return default_transfer_chunk(kv_layer_bytes, min_copy_bytes(prof))


def save_profile(device, rows: list[dict], chunk: int, meta: dict) -> Path:
    """Write the profile: the chosen chunk, the measured rows (with `copy_bytes`, the link
    curve `min_copy_bytes` reads) and `meta` (`bytes_per_token` of the tuned model)."""
    p = profile_path(device)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"device": device_name(device), "transfer_chunk": chunk,
                             "copies": COPIES, "rows": rows, **meta}, indent=1))
    return p


def device_sync(device):
    """Wait for everything queued on the device (CUDA; a no-op on the CPU): timings read
    the host clock only after this, never while kernels or copies are still queued."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def link_throughput(chunk: int, tokens: int, bytes_per_token: int, device, repeats: int = 3) -> float:
    """GB/s of host->device copies of `tokens` tokens in `chunk`-token pieces (best of N
    after a warm-up round), from a synchronised device to the last copy landed."""
    elems = max(1, bytes_per_token // 4)
    pin = torch.device(device).type == "cuda"
    src = torch.randn(tokens, elems, pin_memory=pin)  # [S, bytes/4] float32 host KV
    dst = torch.empty(2, chunk, elems, device=device)  # two staging slots
    cp = ChunkCopier(device)
    best = float("inf")
    for r in range(repeats + 1):  # round 0 warms up (thread start, first-touch page faults)
        device_sync(device)
        t0 = time.perf_counter()
        for i, c in enumerate(range(0, tokens, chunk)):
            n = min(chunk, tokens - c)
            cp.fetch((dst[i % 2, :n],), (src[c:c + n],), i)
        cp.flush()
        device_sync(device)
        if r:
            best = min(best, time.perf_counter() - t0)
    cp.close()
    return src.numel() * 4 / best / 1e9


def link_gbps(device, mib: int = 256, repeats: int = 3) -> float:
    """GB/s (1e9 bytes/s) of one host->device copy of `mib` MiB, best of `repeats` after a
    warm-up: on CUDA from pinned memory on a side stream, timed by a CUDA event pair; on
    the CPU the copier's memcpy (what streams the KV there), timed by perf_counter events.
    The link floor of an offloaded forward is its streamed bytes / this."""
    from .timeline import device_clock
    device = torch.device(device)
    cuda = device.type == "cuda"
    n = mib * 2 ** 20
    src = torch.ones(n, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    cp = ChunkCopier(device)
    clock = device_clock(device)
    stream = cp.stream if cuda else None
    best = float("inf")
    for r in range(repeats + 1):
        device_sync(device)
        a = clock.event(stream)
        if cuda:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        else:
            cp.copy((dst,), (src,))
        b = clock.event(stream)
        b.synchronize()
        if r:
            best = min(best, a.elapsed_time(b) / 1e3)
    cp.close()
    return n / best / 1e9


def best_chunk(rows: list[dict]) -> int:
    """The chunk with the lowest verify latency (ties: the larger chunk)."""
    return min(rows, key=lambda r: (r["verify_ms"], -r["chunk"]))["chunk"]
