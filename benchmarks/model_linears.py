"""Every quantized projection of a loaded model at M rows of activations, as a forward runs them.

Usage:
    python benchmarks/model_linears.py                     # the bundled model, rows 1, 2, 4, 8
    python benchmarks/model_linears.py --model gemma-3-270m-q4_k_m.gguf --rows 1 7 --threads 2
    python benchmarks/model_linears.py --rows 1 2 4 7 16 28 --columns   # packed columns against none

One pass is every `QLinear` of the model (each layer's q/k/v, o, gate/up and down, and the
LM head) called once with M rows, with the activations the model was loaded with (int8 per
row and 32 inputs on an AVX-512 VNNI CPU): what a decode (M = 1), a verification (γ+1) or a
batch's ragged forward spends in its projections. Prints, per M, the best of `--repeats`
timed blocks of `--passes` passes in ms per pass, and the weight bytes read per ms (GB/s)
beside the machine's copy bandwidth (the floor a pass cannot beat).
"""
from __future__ import annotations

import argparse
import time

import torch

from triforce_offload.bench.bandwidth import copy_bandwidth
from triforce_offload.kernels.qlinear import QLinear
from triforce_offload.runtime import api


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF path or hub name (default: the bundled model)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--columns", action="store_true",
                   help="also time each M without the packed weight columns (each call transposing "
                        "its tiles), the two alternating block by block: medians and the median "
                        "of the paired ratios")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    loaded = api.load(a.model)
    lins = [m for m in loaded.model.modules() if isinstance(m, QLinear)]
    if not lins:
        raise SystemExit("the model has no quantized projections (load a GGUF)")
    nbytes = sum(m.nbytes() for m in lins)
    floor = copy_bandwidth("cpu", 256, reps=5) / 1e9  # GB/s, as bench measures its floors
    print(f"{len(lins)} projections, {nbytes / 1e6:.1f} MB of weights, activations {loaded.activations}, "
          f"{a.threads} threads; copy bandwidth {floor:.1f} GB/s (a pass's floor: {nbytes / floor / 1e6:.2f} ms)")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for M in a.rows:
            xs = [torch.randn(1, M, m.in_features, generator=g) for m in lins]
            one = lambda: [m(x) for m, x in zip(lins, xs)]  # noqa: E731
            one()
            if a.columns:
                packed = [m._calls for m in lins]
                bare = [[c[:5] + ((c[5][:-1] + (None,)) if c[5] else (),) for c in calls] for calls in packed]
                pairs = []
                for _ in range(a.repeats):
                    ts = []
                    for calls in (packed, bare):
                        for m, c in zip(lins, calls):
                            m._calls = c
                        one()
                        ts.append(_timed(lambda: [one() for _ in range(a.passes)]) / a.passes)
                    pairs.append(ts)
                for m, c in zip(lins, packed):
                    m._calls = c
                med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
                print(f"rows {M}: packed columns {med([p for p, _ in pairs]) * 1e3:.2f} ms per pass, "
                      f"transposing {med([b for _, b in pairs]) * 1e3:.2f}; paired ratio "
                      f"{med([b / p for p, b in pairs]):.2f}x")
                continue
            best = min(_timed(lambda: [one() for _ in range(a.passes)]) for _ in range(a.repeats)) / a.passes
            print(f"rows {M}: {best * 1e3:.2f} ms per pass, {nbytes / best / 1e9:.1f} GB/s of weights")


if __name__ == "__main__":
    main()
