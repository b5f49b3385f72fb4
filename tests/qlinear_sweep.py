"""Sweep of the native quantized linear kernel, run as a script by test_native_checked.py
inside a build with a sanitizer or _FORTIFY_SOURCE: an out-of-bounds access aborts.

Covers int8 and int4 (int8 activations with the packed columns, each compared with the
calls that transpose W themselves), float16 and float32 scales, with and without offsets, groups of 16 to
K, output counts around the 8-row tile (the zero-padded last tile), one row and many, strided
rows, several parts writing side by side into one output, the embedding lookup, and seeded
random shapes (issue 39's fuzzed shapes: bits, K, group, N, M, scales, offsets, strides), and a
model's layers in one call (runtime/model/program.py, against its layer loop); each
case with float activations and with int8 ones (x quantized per row and 32 inputs: compared
with the float64 product of the quantized x, and every row with that row alone).
Exits 1 naming the first case that differs from the float64 reference.
"""
import os
import random
import sys

import torch

from triforce_offload.kernels import qlinear
from triforce_offload.kernels.qlinear import QEmbedding, QLinear, QPart, pack4, quantize_x


def part(bits, N, K, G, f16, with_min, g):
    q = (torch.randint(-128, 128, (N, K), generator=g).to(torch.int8) if bits == 8
         else pack4(torch.randint(0, 16, (N, K), generator=g)))
    dt = torch.float16 if f16 else torch.float32
    s = (torch.rand(N, K // G, generator=g) * 0.02 + 1e-3).to(dt)
    m = (torch.randn(N, K // G, generator=g) * 0.05).to(dt) if with_min else None
    return QPart(q, s, m, bits, G, K)


def unpacked(p, b, x):
    """x through a copy of part p without packed columns (each call transposes its tiles)."""
    os.environ["TRIFORCE_OFFLOAD_CPU_COLUMNS"] = "0"
    try:
        return QLinear([QPart(p.q, p.scale, p.minv, p.bits, p.group, p.in_features)], b, act="int8")(x)
    finally:
        os.environ["TRIFORCE_OFFLOAD_CPU_COLUMNS"] = "1"


def main() -> int:
    os.environ["TRIFORCE_OFFLOAD_CPU_COLUMNS"] = "1"  # the packed columns wherever they run
    if qlinear.load() is None:
        print(f"native kernel unavailable: {qlinear.reason()}")
        return 1
    g = torch.Generator().manual_seed(0)
    n = 0
    for bits, groups in ((8, (16, 32)), (4, (32, 64))):
        for K in (64, 192):
            for G in groups + (K,):
                for N in (1, 7, 8, 9, 17):
                    for M in (1, 3, 16):
                        for f16 in (True, False):
                            p = part(bits, N, K, G, f16, bits == 4 or N % 2, g)
                            b = torch.randn(N, generator=g)
                            x = torch.randn(M, 2 * K, generator=g)[:, ::2] if M == 3 else torch.randn(M, K, generator=g)
                            for act in ("fp32", "int8"):
                                lin = QLinear([p], b, act=act)
                                y = lin(x)
                                if act == "int8" and not torch.equal(unpacked(p, b, x), y):
                                    print(f"packed columns differ: bits {bits} N {N} K {K} G {G} M {M} f16 {f16}")
                                    return 1
                                xr = quantize_x(x) if act == "int8" else x
                                ref = torch.nn.functional.linear(xr.double(), p.dequantize().double(), b.double())
                                rows = torch.cat([lin(x[i:i + 1]) for i in range(M)])
                                if not torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4) or not torch.equal(rows, y):
                                    print(f"differs: bits {bits} N {N} K {K} G {G} M {M} f16 {f16} {act}")
                                    return 1
                                n += 1
    for bits, G in ((8, 16), (8, 32), (8, 128), (4, 32), (4, 64)):  # enough rows for lanes along rows of x
        for M in (64, 70):
            p = part(bits, 11, 128, G, M == 70, bits == 4 or M == 70, g)
            lin = QLinear([p], torch.randn(11, generator=g), act="int8")
            x = torch.randn(M, 128, generator=g)
            y = lin(x)
            ref = torch.nn.functional.linear(quantize_x(x).double(), p.dequantize().double(), lin.bias.double())
            rows = torch.cat([lin(x[i:i + 1]) for i in range(M)])
            if not torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4) or not torch.equal(rows, y):
                print(f"differs: bits {bits} G {G} M {M} (lanes along rows of x)")
                return 1
            n += 1
    rng = random.Random(39)  # fuzzed shapes
    for i in range(60):
        bits, K = rng.choice((4, 8)), 32 * rng.randint(1, 24)
        G = rng.choice([c for c in ((16, 32, 64) if bits == 8 else (32, 64)) if K % c == 0] + [K])
        N, M = rng.randint(1, 70), rng.choice((1, rng.randint(2, 9), rng.randint(10, 40)))
        p = part(bits, N, K, G, rng.random() < 0.5, bits == 4 or rng.random() < 0.5, g)
        step = rng.choice((1, 1, 2, 3))
        x = torch.randn(M, step * K, generator=g)[:, ::step]
        for act in ("fp32", "int8"):
            lin = QLinear([p], torch.randn(N, generator=g) if rng.random() < 0.5 else None, act=act)
            y = lin(x)
            xr = quantize_x(x) if act == "int8" and p.q8_ok() else x  # else x stays float
            b = lin.bias.double() if lin.bias is not None else None
            ref = torch.nn.functional.linear(xr.double(), p.dequantize().double(), b)
            rows = torch.cat([lin(x[j:j + 1]) for j in range(M)])
            if not torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4) or not torch.equal(rows, y):
                print(f"differs: fuzzed {i}: bits {bits} N {N} K {K} G {G} M {M} stride {step} {act}")
                return 1
            if act == "int8" and p.q8_ok() and not torch.equal(unpacked(p, lin.bias, x), y):
                print(f"packed columns differ: fuzzed {i}: bits {bits} N {N} K {K} G {G} M {M}")
                return 1
            n += 1
    for K, M, N in ((64, 1, 9), (192, 5, 17)):  # the fused pass: norm, SwiGLU, residual
        p = part(4, N, K, 32, True, True, g)
        lin = QLinear([p], torch.randn(N, generator=g), act="int8")
        norm = torch.nn.RMSNorm(K, eps=1e-5)
        norm.plus_one = False
        x, res = torch.randn(M, K, generator=g), torch.randn(M, N, generator=g)
        gu = torch.randn(M, 2 * K, generator=g)
        for y, ref in ((lin.fused(x, norm, False, res), res + lin(norm(x))),
                       (lin.fused(gu, None, True, None), lin(torch.nn.functional.silu(gu[:, :K]) * gu[:, K:]))):
            if y is None or not torch.allclose(y, ref, rtol=1e-3, atol=2e-2):
                print(f"differs: fused K {K} M {M} N {N}")
                return 1
            n += 1
    a, c = part(4, 9, 64, 32, True, True, g), part(8, 5, 64, 16, False, False, g)
    x = torch.randn(4, 64, generator=g)
    y = QLinear([a, c])(x)
    if not torch.allclose(y, x @ torch.cat([a.dequantize(), c.dequantize()]).T, rtol=1e-5, atol=1e-4):
        print("differs: two parts")
        return 1
    emb = QEmbedding(a)
    if not torch.equal(emb(torch.tensor([[0, 8, 3]])), a.dequantize()[[0, 8, 3]][None]):
        print("differs: embedding rows")
        return 1
    n += program_cases()
    if n < 0:
        return 1
    print(f"{n + 2} cases match float64 linear (int8 activations {'VNNI' if qlinear.vnni() else 'portable C'})")
    return 0


def program_cases() -> int:
    """A model's layers in one native call (runtime/model/program.py: the driver in this
    library calling the projections and the attention library's rope_attend) against its
    layer loop: full caches (bf16, float32 KV) and a retrieval cache, steps of 1 to 64 tokens.
    Returns the cases run, or -1 naming the first that differs (or did not run)."""
    from helpers_spec import tiny
    from test_batch import quantized
    from triforce_offload.runtime.cache.kv import FullCache
    from triforce_offload.runtime.cache.retrieval import Recorder, RetrievalCache
    from triforce_offload.runtime.model import program

    real, n = program.Program.run, 0
    for L in (quantized(tiny(scale=3.0, seed=1, dim=64)),
              quantized(tiny(scale=3.0, seed=4, dim=192, heads=6, kv=2, layers=3), "int8")):
        for kv_dtype, kind, T in ((torch.bfloat16, "full", 1), (torch.bfloat16, "full", 64), (torch.float32, "full", 5),
                                  (torch.bfloat16, "retrieval", 9), (torch.float32, "retrieval", 1)):
            ids = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(T))
            out, took = [], []
            for on in (False, True):
                program.Program.run = (lambda self, *a: took.append(real(self, *a)) or took[-1]) if on else \
                    (lambda self, *a: False)
                full = Recorder(FullCache(L.cfg, 256, dtype=kv_dtype))
                with torch.inference_mode():
                    L.model(torch.randint(0, 64, (1, 100), generator=torch.Generator().manual_seed(0)), 0, full)
                    full.commit(100)
                    c = full
                    if kind == "retrieval":
                        c = RetrievalCache(L.cfg, 32, 8, 16, dtype=kv_dtype)
                        c.build(full, full.q, 100)
                    took.clear()
                    out.append(L.model(ids, 100, c))
            program.Program.run = real
            if took != [True] or not torch.equal(out[0], out[1]):
                print(f"differs: program {kind} {kv_dtype} T {T} (ran: {took})")
                return -1
            n += 1
        # a batch's ragged forward: three sequences' steps of 1, 7 and 3 tokens
        from triforce_offload.runtime.batch.rows import Rows, forward
        real_rows, out, took = program.Program.run_rows, [], []
        for on in (False, True):
            program.Program.run_rows = (lambda self, *a: took.append(real_rows(self, *a)) or took[-1]) if on else \
                (lambda self, *a: False)
            sets = []
            for n0, T in ((30, 1), (75, 7), (12, 3)):
                c = Recorder(FullCache(L.cfg, 128, dtype=torch.bfloat16))
                with torch.inference_mode():
                    L.model(torch.randint(0, 64, (1, n0), generator=torch.Generator().manual_seed(n0)), 0, c)
                c.commit(n0)
                sets.append(Rows(torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(T)), n0, c))
            out.append(forward(L.model, sets))
        program.Program.run_rows = real_rows
        if took != [True] or not all(torch.equal(a, b) for a, b in zip(*out)):
            print(f"differs: program rows (ran: {took})")
            return -1
        n += 1
    return n


if __name__ == "__main__":
    sys.exit(main())
