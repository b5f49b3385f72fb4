"""The memory bandwidth a decode step's reads can reach, measured in the same run as the
benchmark that prints floors beside its rows (`bench`, benchmarks/gpu_decode.py)."""
from __future__ import annotations

import time

import torch


def copy_bandwidth(device: torch.device | str = "cpu", mib: int = 256, reps: int = 10) -> float:
    """Bytes/s of a large copy_ on the device, read + write counted (best of `reps`)."""
    device = torch.device(device)
    n = mib * 2**20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: pages touched, kernel loaded
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            t0.record()
            dst.copy_(src)
            t1.record()
            torch.cuda.synchronize(device)
            best = min(best, t0.elapsed_time(t1) / 1000)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * n / best
