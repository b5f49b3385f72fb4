"""The native CPU attention kernel (cpu_attention.c): compiled once, loaded with ctypes.

The C file is compiled with the system compiler (`$CC`, else cc/gcc) for this machine's
CPU into the cache folder (`$TRIFORCE_OFFLOAD_CACHE`, default ~/.cache/triforce-offload),
keyed by the source, the flags and the CPU, so a later run just loads it. No compiler, a
failed build, or `TRIFORCE_OFFLOAD_NATIVE=0` means `available()` is False and attention
stays on torch's kernels (kernels/attention.py); nothing else changes.

Built is not the same as used: the kernel's register tiles are sized for AVX-512 (32
registers of 16 floats). On a 256-bit (AVX2) build they spill, and on an AVX2 EPYC it
measured 1.5-2x slower than torch's SDPA for one query token and 12-17x slower for seven
(benchmarks/attention_kernels.py), so by default (`TRIFORCE_OFFLOAD_NATIVE` unset or
`auto`) attention dispatches to it only when the build targets 512-bit vectors;
`TRIFORCE_OFFLOAD_NATIVE=1` uses it anyway (the tests do, to check it everywhere).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from ..settings import env, environment

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11"]
# retried without these when a build fails (no -march=native: clang on some ARM; no OpenMP:
# Apple clang without libomp, where the kernel then runs on one thread)
FALLBACK_DROPS = [(), ("-march=native",), ("-march=native", "-fopenmp")]
BLOCK = 256  # keys per work item: fixed, so a row's blocks (and their merge order) do not
# depend on how many keys the other rows of the call see (a verification against decodes)
ONE_CALL_TOKENS = 64  # `rope_attend` takes steps (decodes, verifications, drafts), not prefill chunks:
# its RoPE and writes run on one thread, torch's ops over a chunk's thousands of rows on all
SCRATCH_BYTES = 32 << 20  # per-block partial results of one call

_lib = None  # ctypes handle, False once a build failed
_error = ""  # why the kernel is unavailable
_bits = 0  # vector width the loaded build targets (asked once: supports() runs on every attention call)


def cache_dir() -> Path:
    return environment().cache_root() / "native"


def _cpu_id() -> str:
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + platform.processor() + flags


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def flags() -> list[str]:
    """FLAGS plus `$TRIFORCE_OFFLOAD_NATIVE_CFLAGS` (e.g. `-fsanitize=address,undefined` or
    `-D_FORTIFY_SOURCE=3`: the tests build a checked kernel this way)."""
    return FLAGS + env("native_cflags").split()


def build(source: Path | None = None) -> Path:
    """Compile (or find the cached build of) a kernel source (default the attention kernel;
    kernels/qlinear.py builds cpu_linear.c the same way); raises RuntimeError with the reason."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    source = source or SOURCE
    src = source.read_bytes()
    all_flags = flags()
    key = hashlib.sha256(src + " ".join([cc] + all_flags).encode() + _cpu_id().encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        first = None
        for drop in FALLBACK_DROPS:  # a compiler without -march=native or OpenMP still builds
            use = [f for f in all_flags if f not in drop]
            r = subprocess.run([cc, *use, str(source), "-o", str(tmp_so), "-lm"],
                               capture_output=True, text=True)
            if r.returncode == 0:
                os.replace(tmp_so, out)  # atomic: concurrent builders do not see half a file
                return out
            if first is None:
                errors = [l for l in r.stderr.splitlines() if "error" in l] or [f"exit code {r.returncode}"]
                first = f"{cc} failed: {errors[0].strip()}"
    raise RuntimeError(first)


def load():
    """The ctypes library, or None (with the reason in `reason()`)."""
    global _lib, _error, _bits
    if _lib is None:
        if env("native") == "0":
            _lib, _error = False, "disabled by TRIFORCE_OFFLOAD_NATIVE=0"
        else:
            try:
                lib = ctypes.CDLL(str(build()))
                f = lib.triforce_attend
                f.restype = ctypes.c_int
                f.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_float, ctypes.c_float]
                              + [ctypes.c_int64] * 6
                              + [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3)
                base = ([ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_float, ctypes.c_float]
                        + [ctypes.c_int64] * 6 + [ctypes.c_void_p, ctypes.c_int64])
                lib.triforce_attend_parts.restype = ctypes.c_int
                lib.triforce_attend_parts.argtypes = base + [ctypes.c_void_p]
                lib.triforce_attend_band.restype = ctypes.c_int
                lib.triforce_attend_band.argtypes = (base[:-1] + [ctypes.c_void_p, ctypes.c_int64]
                                                     + [ctypes.c_void_p] * 3)
                lib.triforce_attend_after.restype = ctypes.c_int
                lib.triforce_attend_after.argtypes = base + [ctypes.c_int64] + [ctypes.c_void_p] * 3
                lib.triforce_attend_seqs.restype = ctypes.c_int
                lib.triforce_attend_seqs.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_float]
                                                     + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 8
                                                     + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2
                                                     + [ctypes.c_int64] + [ctypes.c_void_p] * 2)
                lib.triforce_rope_attend.restype = ctypes.c_int
                lib.triforce_rope_attend.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4
                                                     + [ctypes.c_int, ctypes.c_float, ctypes.c_float]
                                                     + [ctypes.c_int64] * 5 + [ctypes.c_void_p, ctypes.c_int64]
                                                     + [ctypes.c_void_p] * 5)
                lib.triforce_rope_attend_seqs.restype = ctypes.c_int
                lib.triforce_rope_attend_seqs.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
                                                          + [ctypes.c_void_p] * 2
                                                          + [ctypes.c_int, ctypes.c_float, ctypes.c_float]
                                                          + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4
                                                          + [ctypes.c_int64] + [ctypes.c_void_p] * 3)
                lib.triforce_vector_bits.restype = ctypes.c_int
                lib.triforce_bf16_path.restype = ctypes.c_int
                _bits = lib.triforce_vector_bits()
                _lib = lib
            except (OSError, RuntimeError, AttributeError) as e:
                _lib, _error = False, str(e)
    return _lib or None


def available() -> bool:
    return load() is not None


def reason() -> str:
    load()
    return _error


def vector_bits() -> int:
    """Vector width the build targets (512 for AVX-512, 256 for AVX2), 0 when not built."""
    return _bits if load() else 0


def enabled() -> bool:
    """Whether attention dispatches to the kernel: built, and either a 512-bit build
    (`TRIFORCE_OFFLOAD_NATIVE` unset or `auto`) or forced with `TRIFORCE_OFFLOAD_NATIVE=1`."""
    return available() and (env("native") == "1" or vector_bits() >= 512)


def bf16_dot(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention over a CPU cache of `dtype` runs the kernel's bf16 path (queries and
    probabilities rounded to bfloat16, pairs of products by vdpbf16ps): bfloat16 K and V,
    head sizes a multiple of 32, a build for a CPU with AVX512_BF16, and the kernel enabled."""
    return (dtype == torch.bfloat16 and head_dim % 32 == 0 and enabled()
            and bool(load().triforce_bf16_path()))


def status() -> str:
    """One phrase for `triforce-offload info`: which attention kernel runs and why (also
    for soft-capped scores, Gemma 2's, which torch's SDPA cannot do)."""
    capped = "; soft-capped attention: explicit fp32 scores"
    if not available():
        return f"torch ({reason()}){capped}"
    if enabled():
        bf = "; bf16 KV by vdpbf16ps" if load().triforce_bf16_path() else ""
        return (f"native ({vector_bits()}-bit vectors{bf}; soft-capping in the kernel; a decode, "
                f"verification or draft step's RoPE, KV write and attention in one call per layer, "
                f"a batch's steps together)")
    return (f"torch (native kernel built for {vector_bits()}-bit vectors, slower than torch "
            f"there; TRIFORCE_OFFLOAD_NATIVE=1 forces it){capped}")


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel takes: one sequence on the CPU, float32 or bfloat16,
    K and V with unit stride on the head dimension and matching strides; and `enabled()`."""
    return (q.device.type == "cpu" and k.device.type == "cpu" and q.shape[0] == 1
            and k.dtype in (torch.float32, torch.bfloat16) and k.shape[-1] % 16 == 0
            and k.shape[-1] <= 256
            and k.stride(-1) == 1 and enabled())


@functools.lru_cache(maxsize=16)
def visible_keys(q_pos0: int, T: int, G: int, k_pos0: int, S: int) -> torch.Tensor:
    """[G*T] int64: how many keys each folded query row sees. The same for every layer of a
    forward, so it is computed once per forward, not once per layer (the kernel only reads it);
    built from a Python list: no tensor ops in the first layer's step."""
    return torch.tensor(visible_row(q_pos0, T, k_pos0, S) * G, dtype=torch.int64)


def visible_row(q_pos0: int, T: int, k_pos0: int, S: int) -> list[int]:
    """How many of S keys (positions k_pos0..) each of T query tokens at q_pos0.. sees."""
    return [min(max(q_pos0 + t - k_pos0 + 1, 0), S) for t in range(T)]


@functools.lru_cache(maxsize=16)
def band_start(q_pos0: int, T: int, G: int, k_pos0: int, window: int) -> torch.Tensor:
    """[G*T] int64: each folded query row's first visible key (a window layer: the key at
    its position - window + 1, counted from k_pos0; 0 where that is before the keys)."""
    row = [max(q_pos0 + t - window + 1 - k_pos0, 0) for t in range(T)]
    return torch.tensor(row * G, dtype=torch.int64)


def _check(rc: int, D: int):
    if rc == -2:
        raise MemoryError("native attention: no memory for its scratch buffers")
    if rc != 0:
        raise RuntimeError(f"native attention refused D={D}, block={BLOCK}")


def _same_strides(k, v):
    return (k, v) if v.stride() == k.stride() else (k.contiguous(), v.contiguous())


def attend_parts(qf, k, v, scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """A shared prefix's part of attention (runtime/cache/shared.py): folded query rows qf
    [Hkv, R, D] (float32, of one or many sequences, every one placed after the prefix) over
    k, v [1, Hkv, S, D], S a multiple of BLOCK, every key seen by every row. The per-block
    results [Hkv, S / BLOCK, R, D + 2] that `attend(..., pre=...)` finishes: each block's
    the same bits as in a call over the whole of a row's keys."""
    H, R, D = qf.shape
    S = k.shape[2]
    if S % BLOCK:
        raise ValueError(f"a shared prefix of {S} keys: a multiple of {BLOCK} is needed")
    k, v = _same_strides(k, v)
    qf = qf.float().contiguous()
    part = torch.empty(H, S // BLOCK, R, D + 2, dtype=torch.float32)
    ks = k.stride()
    nvis = torch.full((R,), S, dtype=torch.int64)
    _check(load().triforce_attend_parts(qf.data_ptr(), k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16),
                                        D ** -0.5 if scale is None else scale, float(softcap or 0.0), H, R, D, S,
                                        ks[1], ks[2], nvis.data_ptr(), BLOCK, part.data_ptr()), D)
    return part


class Seqs:
    """A forward's sequences for `attend_seqs`, the same for each of its layers: sequence i
    has T[i] query tokens at positions q_pos0[i].. in the forward's rows a[i].. (of N), and S[i]
    keys from position k_pos0[i] in buffers of head stride hs[i] and key stride ss[i]. Its
    G*T[i] folded rows (g, t) follow the earlier sequences' in `perm`, each the index of its
    row g*N + a[i] + t in q [Hkv, G*N, D] and in the output."""

    def __init__(self, rows: list[tuple[int, int, int, int, int, int, int]], G: int, N: int):
        perm, nvis, cols, r0 = [], [], [[] for _ in range(5)], 0
        for a, T, q_pos0, k_pos0, S, hs, ss in rows:
            vis = visible_row(q_pos0, T, k_pos0, S)
            for g in range(G):
                perm.extend(range(g * N + a, g * N + a + T))
                nvis.extend(vis)
            for c, x in zip(cols, (S, hs, ss, r0, G * T)):
                c.append(x)
            r0 += G * T
        self.meta = torch.tensor(cols, dtype=torch.int64)  # [5, n]: S, hs, ss, first row, rows
        self.nvis = torch.tensor(nvis, dtype=torch.int64)
        self.perm = torch.tensor(perm, dtype=torch.int64)
        self.n, self.rows, self.out_rows = len(rows), r0, G * N
        self._ptrs = [self.meta[i].data_ptr() for i in range(5)]

    def fold(self, q: torch.Tensor) -> torch.Tensor:
        """These sequences' rows of the forward's q [1, Hq, N, D]: [Hkv, Rtot, D] float32."""
        H = q.shape[1] * q.shape[2] // self.out_rows
        return q.reshape(H, self.out_rows, q.shape[-1]).index_select(1, self.perm).float()


def attend_seqs(plan: Seqs, qf: torch.Tensor, kv: list[tuple], out: torch.Tensor, bf16: bool,
                pre: torch.Tensor | None = None, softcap: float | None = None, scale: float | None = None,
                secs: torch.Tensor | None = None):
    """Many sequences' attention in one call: the folded rows qf [Hkv, Rtot, D] (`plan.fold`)
    of each sequence over its own keys (kv: per sequence its K and V buffers, strides as
    `plan` says, bfloat16 where `bf16` else float32), after a shared prefix where `pre`
    [Hkv, k_pos0 / BLOCK, Rtot, D + 2] holds every row's per-block results over it
    (`attend_parts` over qf). Written into out [1, Hq, N, D] float32 (contiguous) at the
    rows' places: each row the bits `attend` gives its sequence alone. `secs` (float64
    [n]): each sequence's thread-seconds in the call (what a batch charges it)."""
    H, Rtot, D = qf.shape
    if Rtot != plan.rows or not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError(f"attend_seqs: {Rtot} query rows for a plan of {plan.rows}, or an output "
                         "not contiguous float32")
    npre = 0 if pre is None else pre.shape[1]
    if pre is not None and tuple(pre.shape) != (H, npre, Rtot, D + 2):
        raise ValueError(f"a shared prefix's per-block results of shape {tuple(pre.shape)}")
    if any(k.stride() != v.stride() for k, v in kv):
        raise ValueError("attend_seqs: a sequence's K and V buffers of different strides")
    ptrs = torch.tensor([[k.data_ptr() for k, _ in kv], [v.data_ptr() for _, v in kv]], dtype=torch.int64)
    scale = D ** -0.5 if scale is None else scale
    _check(load().triforce_attend_seqs(qf.data_ptr(), int(bf16), scale, float(softcap or 0.0), H, D, plan.n,
                                       ptrs[0].data_ptr(), ptrs[1].data_ptr(), *plan._ptrs, plan.nvis.data_ptr(),
                                       BLOCK, npre, None if pre is None else pre.data_ptr(), plan.perm.data_ptr(),
                                       plan.out_rows, out.data_ptr(), None if secs is None else secs.data_ptr()), D)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, T: int, D: int) -> bool:
    """Whether cos, sin are the [T, 1, D] float32 contiguous tables the one-call kernels read
    row by row (`Rotary`'s, one row per token)."""
    return (cos.dtype == sin.dtype == torch.float32 and tuple(cos.shape) == tuple(sin.shape) == (T, 1, D)
            and cos.is_contiguous() and sin.is_contiguous() and cos.device.type == sin.device.type == "cpu")


class SeqSteps:
    """A ragged forward's sequences for `rope_attend_seqs`, the same for each of its layers
    of a kind: sequence i has T tokens in the forward's rows a.. (of qkv, cos, sin) at
    positions q_pos0.., written to its K, V buffers' slots slot.. (slot 0 at position
    k_pos0; head stride hs, key stride ss), attending over slots 0 .. slot+T-1."""

    def __init__(self, rows: list[tuple[int, int, int, int, int, int, int]], G: int):
        nvis, cols, self.folded = [], [[] for _ in range(5)], []
        for a, T, q_pos0, k_pos0, slot, hs, ss in rows:
            if min(a, T, slot) < 0:
                raise ValueError(f"SeqSteps: a sequence at row {a} with {T} tokens at slot {slot}")
            self.folded.append((len(nvis), G * T))  # its folded rows in the call's queries
            nvis.extend(visible_row(q_pos0, T, k_pos0, slot + T) * G)  # folded rows (g, t)
            for c, x in zip(cols, (a, T, slot, hs, ss)):
                c.append(x)
        self.meta = torch.tensor(cols, dtype=torch.int64)  # [5, n]: a, T, slot, hs, ss
        self.nvis = torch.tensor(nvis, dtype=torch.int64)
        self.n, self.G, self.rows = len(rows), G, len(nvis)
        self.end = max((a + T for a, T, *_ in rows), default=0)  # qkv rows the call reads
        self.steps = [(T, slot, hs, ss) for _, T, _, _, slot, hs, ss in rows]

    def fits(self, H: int, D: int) -> bool:
        """Whether the call's per-block results stay under SCRATCH_BYTES (else the separate
        steps slice them)."""
        blocks = sum(self.G * T * -(-(slot + T) // BLOCK) for T, slot, _, _ in self.steps)  # rows x blocks
        return blocks * H * (D + 2) * 4 <= SCRATCH_BYTES

    def takes(self, kv: list[tuple], dtype: torch.dtype, H: int, D: int) -> bool:
        """Whether the buffers kv (per sequence K, V: CPU tensors [1, H, slots, D] of `dtype`)
        are laid out as planned, with room for each step's slots: what the kernel writes and
        reads stays inside them. One pass, every layer of a forward (a few us a sequence)."""
        if len(kv) != self.n:
            return False
        for (k, v), (T, slot, hs, ss) in zip(kv, self.steps):
            st, sh = k.stride(), k.shape
            if not (k.dtype == v.dtype == dtype and k.is_cpu and v.is_cpu and len(sh) == 4 and sh == v.shape
                    and st == v.stride() and sh[0] == 1 and sh[1] == H and sh[3] == D and st[1] == hs
                    and st[2] == ss and st[3] == 1 and slot + T <= sh[2]):
                return False
        return True


def rope_attend_seqs(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SeqSteps, kv: list[tuple],
                     heads: int, softcap: float | None = None, secs: torch.Tensor | None = None):
    """`rope_attend` for the rows of several sequences in one call (`triforce_rope_attend_seqs`):
    each sequence's RoPE, its K, V written into its own buffers (kv: per sequence, strides
    and slots as `plan` says, all float32 or all bfloat16) and its attention, as
    `attend_seqs` computes it, the output laid out for the o projection. qkv [1, N, heads +
    2 H, D] float32 with contiguous rows; cos, sin [N, 1, D] float32 (each row's position).
    -> (o [1, N, heads * D], qf [H, plan.rows, D]: the rotated queries folded as
    `attend_seqs` takes them). Each row the bits of the separate steps (callers check what
    the kernel takes: `supports`, `SeqSteps.fits`, `transformer.one_call_ok`)."""
    _, N, nh, D = qkv.shape
    K0 = kv[0][0]
    H = K0.shape[1]
    if (qkv.dtype != torch.float32 or qkv.stride(-1) != 1 or qkv.stride(-2) != D or not qkv.is_cpu
            or not rope_tables(cos, sin, N, D) or nh != heads + 2 * H or heads % H or heads // H != plan.G
            or plan.end > N or K0.dtype not in (torch.float32, torch.bfloat16)
            or not plan.takes(kv, K0.dtype, H, D)):
        raise ValueError(f"rope_attend_seqs: qkv {tuple(qkv.shape)} {qkv.dtype}, cos {tuple(cos.shape)}, "
                         f"{len(kv)} caches for a plan of {plan.n} sequences, {heads} heads")
    ptrs = torch.tensor([[k.data_ptr() for k, _ in kv], [v.data_ptr() for _, v in kv]], dtype=torch.int64)
    qf = torch.empty(H, plan.rows, D, dtype=torch.float32)
    o = torch.empty(1, N, heads * D, dtype=torch.float32)
    _check(load().triforce_rope_attend_seqs(qkv.data_ptr(), qkv.stride(1), heads, cos.data_ptr(), sin.data_ptr(),
                                            int(K0.dtype == torch.bfloat16), D ** -0.5, float(softcap or 0.0), H, D,
                                            plan.n, ptrs[0].data_ptr(), ptrs[1].data_ptr(), plan.meta.data_ptr(),
                                            plan.nvis.data_ptr(), BLOCK, qf.data_ptr(), o.data_ptr(),
                                            None if secs is None else secs.data_ptr()), D)
    return o, qf


def scratch_rows(H: int, nb: int, D: int) -> int:
    """Query rows one kernel call takes over nb blocks of keys: per-block partial results
    cost H * nb * (D + 2) floats per row, so a prefill chunk of thousands of rows goes
    through in slices that keep them under SCRATCH_BYTES (at least 16 rows)."""
    return max(16, SCRATCH_BYTES // (H * nb * (D + 2) * 4))


def rope_attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                slot: int, q_pos0: int, k_pos0: int, heads: int, softcap: float | None = None):
    """One attention layer's step for T new tokens in one call (`triforce_rope_attend`):
    RoPE of their q and k heads, their k and v written into the cache, attention over the
    cache, the output laid out for the o projection. The separate steps' numbers bit for bit:
    rotate's RoPE (runtime/model/transformer.py checks it against its own once per process
    and head size, `one_call_ok`), the cache's write, `attend` with the same arguments.

    qkv [1, T, heads + 2 H, D] float32 with contiguous rows (the qkv projection's output:
    q heads, k heads, v heads); cos, sin [T, 1, D] float32 (`Rotary`'s); k, v [1, H, slots, D]
    the cache (float32 or bfloat16, unit stride on D, the same strides). The new tokens go
    to slots slot .. slot+T-1, at positions q_pos0 ..; attention reads slots 0 .. slot+T-1,
    slot 0 at position k_pos0, each query the keys at or before its position.
    -> (o [1, T, heads * D] float32, qf [H, G*T, D]: the rotated queries, row g*T + t of KV
    head h for query head h*G + g), or None where the call does not take these tensors (the
    caller takes the separate steps): other dtypes or layouts, more rows than one call's
    scratch holds, the kernel disabled, more than ONE_CALL_TOKENS tokens."""
    _, T, nh, D = qkv.shape
    H = k.shape[1]
    if (T > ONE_CALL_TOKENS or qkv.dtype != torch.float32 or qkv.stride(-1) != 1 or qkv.stride(-2) != D
            or not rope_tables(cos, sin, T, D) or nh != heads + 2 * H or heads % H
            or v.dtype != k.dtype or k.stride() != v.stride() or slot + T > k.shape[2]
            or not supports(qkv, k)):  # what attend takes (and where attention dispatches to it)
        return None
    R, S = heads // H * T, slot + T
    nb = max(1, -(-S // BLOCK))
    if R > scratch_rows(H, nb, D):
        return None
    qf = torch.empty(H, R, D, dtype=torch.float32)
    part = torch.empty(H, nb, R, D + 2, dtype=torch.float32)
    out = torch.empty(H, R, D, dtype=torch.float32)
    lse = torch.empty(H, R, dtype=torch.float32)
    o = torch.empty(1, T, heads * D, dtype=torch.float32)
    ks = k.stride()
    rc = load().triforce_rope_attend(qkv.data_ptr(), T, qkv.stride(1), heads, cos.data_ptr(), sin.data_ptr(),
                                     k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16), D ** -0.5,
                                     float(softcap or 0.0), H, D, slot, ks[1], ks[2],
                                     visible_keys(q_pos0, T, heads // H, k_pos0, S).data_ptr(), BLOCK,
                                     qf.data_ptr(), part.data_ptr(), out.data_ptr(), lse.data_ptr(), o.data_ptr())
    _check(rc, D)
    return o, qf


def attend(q, k, v, q_pos0: int, k_pos0: int = 0, scale: float | None = None, out_dtype=None,
           softcap: float | None = None, pre=None, pre_kv=None, window: int | None = None):
    """Causal attention of q [1, Hq, T, D] over k, v [1, Hkv, S, D] -> (out [1, Hq, T, D]
    in `out_dtype` (default q's), lse [1, Hq, T] float32); a query that sees no key gets
    out 0 and lse -inf. Query t sits at position q_pos0 + t and sees
    the keys at positions <= its own (keys start at k_pos0). `softcap` (None or 0: off):
    the scaled scores become softcap * tanh(score / softcap) before the softmax (Gemma 2).
    Keys before k_pos0 that every query sees (a shared prefix, k_pos0 a multiple of BLOCK):
    `pre_kv` = (K, V) [1, Hkv, k_pos0, D], or their per-block results for these rows
    already computed (`pre`, from `attend_parts`: [Hkv, k_pos0 / BLOCK, G*T, D + 2]); every
    row's output is then the bits of one call over all its keys in one buffer. `window`: a
    sliding layer's band, query t seeing only keys after position q_pos0 + t - window (the
    keys' blocks still start at k_pos0: where the caller starts them fixes a row's bits)."""
    _, Hq, T, D = q.shape
    H, S = k.shape[1], k.shape[2]
    k, v = _same_strides(k, v)
    G = Hq // H
    scale = D ** -0.5 if scale is None else scale
    qf = q.float().reshape(H, G * T, D).contiguous()  # rows of a KV head side by side
    nvis = visible_keys(q_pos0, T, G, k_pos0, S)
    R = G * T
    block = BLOCK
    shared = pre is not None or pre_kv is not None
    nlo = band_start(q_pos0, T, G, k_pos0, window) if window is not None else None
    if nlo is not None and shared:
        raise ValueError("a window layer's band after a shared prefix")
    npre = k_pos0 // block if shared else 0
    if shared and k_pos0 % block:
        raise ValueError(f"a shared prefix of {k_pos0} keys: a multiple of {block} is needed")
    if pre is not None and tuple(pre.shape) != (H, npre, R, D + 2):
        raise ValueError(f"a shared prefix's per-block results of shape {tuple(pre.shape)}, "
                         f"not {(H, npre, R, D + 2)}")
    nb = npre + max(1, -(-S // block))
    rows = scratch_rows(H, nb, D)
    part = torch.empty(H, nb, min(rows, R), D + 2, dtype=torch.float32)
    out = torch.empty(H, R, D, dtype=torch.float32)
    lse = torch.empty(H, R, dtype=torch.float32)
    lib, bf16, ks, cap = load(), int(k.dtype == torch.bfloat16), k.stride(), float(softcap or 0.0)

    def call(r0, r1, o, ls):  # rows r0..r1 -> o, ls: the kernel over every key
        if r0 == 0 and r1 == R:  # every row (a decode, a verification): no slices
            qs, nv, n = qf, nvis, R
        else:
            qs, nv, n = qf[:, r0:r1].contiguous(), nvis[r0:r1], r1 - r0
        p = part if n == part.shape[2] else torch.empty(H, nb, n, D + 2, dtype=torch.float32)
        if nlo is not None:
            return _check(lib.triforce_attend_band(qs.data_ptr(), k.data_ptr(), v.data_ptr(), bf16, scale, cap, H, n,
                                                   D, S, ks[1], ks[2], nv.data_ptr(), nlo[r0:r1].data_ptr(), block,
                                                   p.data_ptr(), o.data_ptr(), ls.data_ptr()), D)
        if not shared:
            rc = lib.triforce_attend(qs.data_ptr(), k.data_ptr(), v.data_ptr(), bf16, scale, cap, H, n, D, S,
                                     ks[1], ks[2], nv.data_ptr(), block, p.data_ptr(), o.data_ptr(), ls.data_ptr())
            return _check(rc, D)
        p[:, :npre] = pre[:, :, r0:r1] if pre is not None else attend_parts(qs, *pre_kv, scale, softcap)
        _check(lib.triforce_attend_after(qs.data_ptr(), k.data_ptr(), v.data_ptr(), bf16, scale, cap, H, n, D,
                                         S, ks[1], ks[2], nv.data_ptr(), block, npre, p.data_ptr(), o.data_ptr(),
                                         ls.data_ptr()), D)

    if R <= rows:  # a decode or a verification: one call, no slices (the common case, per layer)
        call(0, R, out, lse)
    else:
        for r0 in range(0, R, rows):
            r1 = min(R, r0 + rows)
            o, ls = out[:, r0:r1].contiguous(), lse[:, r0:r1].contiguous()
            call(r0, r1, o, ls)
            out[:, r0:r1] = o
            lse[:, r0:r1] = ls
    return out.reshape(1, Hq, T, D).to(out_dtype or q.dtype), lse.reshape(1, Hq, T)
