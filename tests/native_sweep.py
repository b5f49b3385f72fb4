"""Reference sweep of the native CPU attention kernel, run as a script by
test_native_checked.py inside a kernel built with a sanitizer or _FORTIFY_SOURCE, so an
out-of-bounds access aborts the process instead of passing by luck.

Covers what once wrote out of bounds (a row slice whose rows all stop before later key
blocks: issue 12) and its neighbours: decode and tiled row counts, row slicing, several
blocks, queries that see only the first keys, keys far beyond the last visible position,
prefill chunks over prompt lengths around the block and tile sizes, fp32 and bf16, head
sizes 16-128, grouped-query ratios 1 and 3, no keys at all, and soft-capped scores (Gemma 2:
row tails of every length 1-16); then seeded random shapes (issue 39's fuzzed shapes): block
and scratch sizes, dtypes, head sizes 16-256, grouped-query ratios, row and key counts,
query and key offsets, cache capacities and soft caps drawn at random.
Exits 1 naming the first case whose output differs from plain float64 attention.
"""
import itertools
import random
import sys

import torch

from triforce_offload.kernels import native


def reference(q, k, v, q_pos0, k_pos0=0, softcap=None):
    """Plain float64 causal attention: out [B,Hq,T,D], lse [B,Hq,T]; `softcap`: scaled scores
    -> softcap * tanh(score / softcap) before the mask (Gemma 2)."""
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    kk = k.double().repeat_interleave(G, dim=1)
    vv = v.double().repeat_interleave(G, dim=1)
    s = q.double() @ kk.transpose(-1, -2) * D ** -0.5
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    qp = torch.arange(q_pos0, q_pos0 + T)[:, None]
    kp = torch.arange(k_pos0, k_pos0 + k.shape[2])[None, :]
    s = s.masked_fill(kp > qp, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.nan_to_num(lse, neginf=0.0)[..., None])
    return (p @ vv).float(), lse.float()


def check(name, q, K, V, q_pos0, k_pos0=0, softcap=None):
    out, lse = native.attend(q, K, V, q_pos0, k_pos0, out_dtype=torch.float32, softcap=softcap)
    ref, ref_lse = reference(q, K, V, q_pos0, k_pos0, softcap)
    tol = 2e-6 if K.dtype == torch.float32 else 1e-2
    lse_tol = 1e-5 if K.dtype == torch.float32 else 4e-3  # bf16 KV: probabilities rounded to bf16 (2^-9)
    try:
        torch.testing.assert_close(lse, ref_lse, rtol=lse_tol, atol=lse_tol)
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    except AssertionError as e:
        print(f"FAIL {name}: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(1)


def tensors(g, Hkv, G, T, S, D, dtype, cap_extra=7):
    """q [1, Hkv*G, T, D] and K, V views of a larger preallocated cache (as the caches pass them)."""
    K = torch.randn(1, Hkv, S + cap_extra, D, generator=g).to(dtype)[:, :, :S]
    V = torch.randn(1, Hkv, S + cap_extra, D, generator=g).to(dtype)[:, :, :S]
    return torch.randn(1, Hkv * G, T, D, generator=g).to(dtype), K, V


def main():
    assert native.available(), native.reason()
    g = torch.Generator().manual_seed(0)
    n = 0
    for dtype, D, G in itertools.product((torch.float32, torch.bfloat16), (16, 64, 80, 128), (1, 3)):
        # the reproducer class: few rows at the very start of a long cache
        q, K, V = tensors(g, 3, G, 1, 2100, D, dtype)
        check(f"decode at 0 over 2100 keys {dtype} D={D} G={G}", q, K, V, 0)
        # queries that see only the first keys, tiled path (>= 8 rows)
        q, K, V = tensors(g, 2, G, 9, 1500, D, dtype)
        check(f"9 rows at 0 over 1500 keys {dtype} D={D} G={G}", q, K, V, 0)
        # keys far beyond the last visible position, keys starting past 0
        q, K, V = tensors(g, 2, G, 3, 900, D, dtype)
        check(f"keys beyond view {dtype} D={D} G={G}", q, K, V, 140, 40)
        n += 3
    # prefill chunks over prompt lengths (row slicing forced by a small scratch, several blocks)
    native.SCRATCH_BYTES, native.BLOCK = 64 << 10, 64
    for dtype in (torch.float32, torch.bfloat16):
        for L, chunk in itertools.product((1, 15, 17, 255, 257, 700), (1, 7, 64, 512)):
            q, K, V = tensors(g, 3, 3, L, L, 64, dtype)
            for s in range(0, L, chunk):
                e = min(L, s + chunk)
                check(f"prefill L={L} chunk={chunk} [{s}:{e}] {dtype}",
                      q[:, :, s:e], K[:, :, :e], V[:, :, :e], s)
                n += 1
    # soft-capped scores: rows ending at every offset of a vector, decode and tiled rows
    for dtype, T in itertools.product((torch.float32, torch.bfloat16), (1, 9)):
        for L in range(40, 57):
            q, K, V = tensors(g, 2, 3, T, L, 64, dtype)
            check(f"softcap L={L} T={T} {dtype}", q * 4, K, V, L - T, softcap=3.0)
            n += 1
    # no keys at all, and one key
    for S in (0, 1):
        q, K, V = tensors(g, 2, 3, 1, S, 32, torch.float32)
        out, lse = native.attend(q, K, V, 0, 0, out_dtype=torch.float32)
        assert (S == 0) == bool(torch.isinf(lse).all()), f"S={S}: lse {lse}"
        n += 1
    n += fuzzed(g)
    n += many(g)
    n += one_call(g)
    n += one_call_seqs(g)
    print(f"{n} native attention cases match float64 attention (and one call per sequence)")


def fuzzed(g, cases: int = 80, seed: int = 39) -> int:
    """Random shapes within what the kernel takes (D a multiple of 16 up to 256, blocks a
    multiple of 32 keys): each case against float64 attention."""
    rng = random.Random(seed)
    for i in range(cases):
        native.BLOCK = rng.choice((32, 64, 96, 256))
        native.SCRATCH_BYTES = rng.choice((16 << 10, 256 << 10, 32 << 20))
        dtype = rng.choice((torch.float32, torch.bfloat16))
        D, G, Hkv = 16 * rng.randint(1, 16), rng.randint(1, 4), rng.randint(1, 3)
        T = rng.choice((1, rng.randint(2, 7), rng.randint(8, 40)))
        S = rng.choice((0, 1, rng.randint(2, 64), rng.randint(65, 3000)))
        k_pos0 = rng.randint(0, 50)
        q_pos0 = rng.randint(0, k_pos0 + S + 10)
        softcap = rng.choice((None, None, 2.0 + 40 * rng.random()))
        q, K, V = tensors(g, Hkv, G, T, S, D, dtype, cap_extra=rng.randint(0, 40))
        check(f"fuzzed {i}: block {native.BLOCK} scratch {native.SCRATCH_BYTES} {dtype} D={D} G={G} "
              f"Hkv={Hkv} T={T} S={S} q_pos0={q_pos0} k_pos0={k_pos0} softcap={softcap}",
              q * 2, K, V, q_pos0, k_pos0, softcap)
    return cases


def random_case(rng, max_dv: int) -> tuple:
    """A random case's kernel settings (native.BLOCK; the default scratch) and shapes:
    (KV dtype, head size 16..16*max_dv, query heads per KV head, KV heads)."""
    native.BLOCK = rng.choice((32, 64, 256))
    native.SCRATCH_BYTES = 32 << 20
    dtype = rng.choice((torch.float32, torch.bfloat16))
    return dtype, 16 * rng.randint(1, max_dv), rng.randint(1, 4), rng.randint(1, 3)


def many(g, cases: int = 24, seed: int = 7) -> int:
    """native.attend_seqs (a batch's sequences in one call) over random sequences, after a
    shared prefix or not: every row the bits of its sequence's own native.attend."""
    rng = random.Random(seed)
    for i in range(cases):
        dtype, D, G, Hkv = random_case(rng, 8)
        prefix = rng.choice((0, native.BLOCK * rng.randint(1, 4)))
        softcap = rng.choice((None, 5.0))
        pre_kv = tensors(g, Hkv, 1, 1, prefix, D, dtype)[1:] if prefix else None
        shape = [(rng.choice((1, rng.randint(2, 12))), rng.randint(1, 700)) for _ in range(rng.randint(1, 6))]
        N = sum(t for t, _ in shape)
        q = torch.randn(1, Hkv * G, N, D, generator=g)
        bufs, rows, refs, a = [], [], [], 0
        for T, S in shape:
            T = min(T, S)
            cap = S + rng.randint(0, 40)  # K and V of one buffer shape (a cache's)
            K, V = (torch.randn(1, Hkv, cap, D, generator=g).to(dtype) for _ in range(2))
            start = prefix + S - T
            refs.append(native.attend(q[:, :, a: a + T], K[:, :, :S], V[:, :, :S], start, prefix,
                                      softcap=softcap, pre_kv=pre_kv)[0])
            bufs.append((K, V))
            rows.append((a, T, start, prefix, S, K.stride(1), K.stride(2)))
            a += T
        q = q[:, :, :a]
        plan = native.Seqs(rows, G, a)
        qf = plan.fold(q)
        pre = native.attend_parts(qf, *pre_kv, softcap=softcap) if prefix else None
        out = torch.empty(q.shape)
        native.attend_seqs(plan, qf, bufs, out, dtype == torch.bfloat16, pre, softcap=softcap)
        for (a, T, *_), ref in zip(rows, refs):
            if not torch.equal(out[:, :, a: a + T], ref):
                print(f"FAIL attend_seqs {i}: {dtype} D={D} G={G} Hkv={Hkv} prefix={prefix} {shape}",
                      file=sys.stderr)
                sys.exit(1)
    return cases


def separate_steps(qkv, cos, sin, K, V, slot: int, k_pos0: int, heads: int, softcap=None):
    """What the model computes without native.rope_attend: transformer.rotate of the q and k
    heads, the new K and V rows written into K, V at slot.. (in place), native.attend over
    slots 0..slot+T-1 (slot 0 at position k_pos0) -> (o [1, T, heads * D], the rotated
    queries [H, G*T, D] in rope_attend's layout)."""
    from triforce_offload.runtime.model.transformer import rotate
    T, D, H = qkv.shape[1], qkv.shape[-1], K.shape[1]
    qk = rotate(qkv[:, :, : heads + H], cos, sin)
    q = qk[:, :, :heads].transpose(1, 2)
    K[:, :, slot: slot + T] = qk[:, :, heads:].transpose(1, 2)
    V[:, :, slot: slot + T] = qkv[:, :, heads + H:].transpose(1, 2)
    o = native.attend(q, K[:, :, : slot + T], V[:, :, : slot + T], k_pos0 + slot, k_pos0, softcap=softcap)[0]
    return o.transpose(1, 2).reshape(1, T, heads * D), q.reshape(H, heads // H * T, D)


def one_call(g, cases: int = 24, seed: int = 11) -> int:
    """native.rope_attend (RoPE, the cache's write and attention in one call) over random
    shapes: the separate steps' bits (transformer.rotate, the write, native.attend) at every
    head size the model calls it for (`one_call_ok`: every size on an x86-64 CPU with FMA)."""
    from triforce_offload.runtime.model.transformer import one_call_ok
    rng = random.Random(seed)
    for i in range(cases):
        dtype, D, G, H = random_case(rng, 16)
        T, slot, k_pos0 = rng.choice((1, rng.randint(2, 7), rng.randint(8, 24))), rng.randint(0, 900), rng.randint(0, 99)
        softcap = rng.choice((None, 5.0))
        Hq = G * H
        qkv = torch.randn(1, T, Hq + 2 * H, D, generator=g)
        f = torch.randn(T, 1, D // 2, generator=g) * 3
        cos, sin = torch.cat([f.cos(), f.cos()], -1), torch.cat([-f.sin(), f.sin()], -1)
        cap = slot + T + rng.randint(0, 40)  # K and V of one buffer shape (a cache's)
        K, V = (torch.randn(1, H, cap, D, generator=g).to(dtype) for _ in range(2))
        K1, V1 = K.clone(), V.clone()
        got = native.rope_attend(qkv, cos, sin, K1, V1, slot, k_pos0 + slot, k_pos0, Hq, softcap=softcap)
        if not one_call_ok(D):  # torch's RoPE rounds otherwise here: the model does not call it
            continue
        o, qf = separate_steps(qkv, cos, sin, K, V, slot, k_pos0, Hq, softcap)
        if got is None or not (torch.equal(got[0], o) and torch.equal(got[1], qf)
                               and torch.equal(K1, K) and torch.equal(V1, V)):
            print(f"FAIL rope_attend {i}: {dtype} D={D} G={G} H={H} T={T} slot={slot} k_pos0={k_pos0} "
                  f"softcap={softcap}", file=sys.stderr)
            sys.exit(1)
    return cases


def seqs_separately(g, dtype, D: int, G: int, H: int, steps: list[tuple[int, int, int]], softcap=None):
    """native.rope_attend_seqs for sequences of `steps` (T, slot, k_pos0) against each one's
    separate steps alone (`separate_steps`): the outputs, the rotated queries and every
    cache's rows, bit for bit. -> whether all are equal."""
    Hq, N = G * H, sum(T for T, _, _ in steps)
    qkv = torch.randn(1, N, Hq + 2 * H, D, generator=g)
    f = torch.randn(N, 1, D // 2, generator=g) * 3
    cos, sin = torch.cat([f.cos(), f.cos()], -1), torch.cat([-f.sin(), f.sin()], -1)
    bufs, rows, a = [], [], 0
    for T, slot, k_pos0 in steps:
        K, V = (torch.randn(1, H, slot + T + 5, D, generator=g).to(dtype) for _ in range(2))
        bufs.append((K, V))
        rows.append((a, T, k_pos0 + slot, k_pos0, slot, K.stride(1), K.stride(2)))
        a += T
    plan = native.SeqSteps(rows, G)
    mine = [(K.clone(), V.clone()) for K, V in bufs]
    o, qf = native.rope_attend_seqs(qkv, cos, sin, plan, mine, Hq, softcap)
    a = r = 0
    for (T, slot, k_pos0), (K, V), (K1, V1) in zip(steps, bufs, mine):
        want_o, want_q = separate_steps(qkv[:, a: a + T], cos[a: a + T], sin[a: a + T], K, V, slot, k_pos0, Hq, softcap)
        if not (torch.equal(o[:, a: a + T], want_o) and torch.equal(qf[:, r: r + G * T], want_q)
                and torch.equal(K1, K) and torch.equal(V1, V)):
            return False
        a, r = a + T, r + G * T
    return True


def one_call_seqs(g, cases: int = 16, seed: int = 13) -> int:
    """native.rope_attend_seqs (a ragged forward's layer in one call) over random sequences:
    each one's separate steps' bits."""
    from triforce_offload.runtime.model.transformer import one_call_ok
    rng = random.Random(seed)
    for i in range(cases):
        dtype, D, G, H = random_case(rng, 16)
        steps = [(rng.choice((1, rng.randint(2, 7), rng.randint(8, 24))), rng.randint(0, 600), rng.randint(0, 99))
                 for _ in range(rng.randint(1, 5))]
        softcap = rng.choice((None, 5.0))
        if one_call_ok(D) and not seqs_separately(g, dtype, D, G, H, steps, softcap):
            print(f"FAIL rope_attend_seqs {i}: {dtype} D={D} G={G} H={H} steps={steps} softcap={softcap}",
                  file=sys.stderr)
            sys.exit(1)
    return cases


if __name__ == "__main__":
    main()
