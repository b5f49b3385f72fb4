"""Weight-only quantized linear layers: int8 and int4 weights; float or per-row int8 activations.

A weight is one or more `QPart`s (rows of the output side by side: q, k and v of a stacked
projection may come from GGUF tensors of different formats). A part holds integers q and,
per group of G inputs of a row, a scale and optionally an offset:
w[n, k] = scale[n, k // G] * q[n, k] + min[n, k // G].
- bits 8: q int8 [N, K], G a multiple of 16;
- bits 4: q uint8 [N, K/2], blocks of 32 weights in 16 bytes (byte j: weight j low nibble,
  weight j+16 high nibble, GGUF's Q4_0/Q4_1 layout), G a multiple of 32.
Scales and offsets are float16 (as GGUF stores them) or float32 (where float16 would round
them, e.g. Q4_K's d * sc).

Kernels, one per device, behind `QLinear.forward` (`kernel()` names the one in use):
- `native`, int8 activations (`act="int8"`, `--activations` auto on a CPU with AVX-512
  VNNI): cpu_linear.c quantizes each row of x by itself to int8 per 32 inputs (Q8_0, as
  llama.cpp does); each (row, output) pair sums its integer products per unit of 32 (16)
  inputs exactly (`vpdpbusd`) and adds float(sum) * (x scale * weight scale) per unit in
  one FMA, with 16 rows of x or 16 weight rows side by side in the lanes. Portable C
  elsewhere (slow).
- `native`, float32 activations: cpu_linear.c on the CPU (AVX-512, AVX2 or NEON by build):
  dequantizes a tile of rows once and dots it with every row of x in float32.
  Either way each row's arithmetic is the same whatever the batch, so a verification of γ+1
  tokens equals γ+1 single-token decodes bit for bit (test_qlinear.py checks it).
- `torch`: the reference: dequantize the weight to x's dtype, then `linear`. The CPU path
  without a C compiler, and the CUDA path (a dequantize per call: correct and capturable in
  CUDA graphs, but it reads the weight twice; a fused GPU kernel is future work).
Activations are quantized per row or not at all, so no kernel's row depends on other rows.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .linear import Linear, exact_ok, gpu_exact, linear

from .native_linear import load, reason  # noqa: F401  (the library: qlinear.load() as before)


def vnni() -> bool:
    """Whether the native kernel was built with AVX-512 VNNI (int8 activations at full speed)."""
    lib = load()
    return bool(lib and lib.triforce_linear_vnni())


def activations(mode: str, device: torch.device | str = "cpu") -> str:
    """The activation precision `--activations` `mode` (auto|fp32|int8) gives on `device`:
    auto is int8 where the native kernel has VNNI (a CPU), fp32 elsewhere. int8 asked for on
    a device with no int8 kernel runs the torch reference, which quantizes x the same way."""
    if mode == "auto":
        return "int8" if torch.device(device).type == "cpu" and vnni() else "fp32"
    return mode


def kernel(device: torch.device | str = "cpu", act: str = "fp32") -> str:
    """Which kernel a quantized linear runs on `device`, with why (for `info` and stats)."""
    if torch.device(device).type != "cpu":
        gemm = "the row-exact Triton GEMM up to 64 rows" if gpu_exact(device) else "cuBLAS"
        return f"torch (dequantize per call, then {gemm}{'; x quantized per 32' if act == 'int8' else ''})"
    lib = load()
    if lib is None:
        return f"torch (dequantize per call; native kernel unavailable: {reason()})"
    if act == "int8":
        if not lib.triforce_linear_vnni():
            return "native (int8 activations per row and 32 inputs, integer dots, portable C, no VNNI: slow)"
        from ..settings import env
        cols = {"0": "each call transposes W's tiles (TRIFORCE_OFFLOAD_CPU_COLUMNS=0)",
                "1": "W's columns packed at load for calls under 64 rows",
                "auto": "W's columns packed at load for calls under 64 rows, within an eighth of the free memory"}
        return f"native (int8 activations per row and 32 inputs, integer dots, AVX-512 VNNI; {cols[env('cpu_columns')]})"
    return f"native ({lib.triforce_linear_vector_bits()}-bit vectors, float32 activations)"


def quantize_x(x: torch.Tensor) -> torch.Tensor:
    """x with each row quantized to int8 per 32 inputs and back (d = max|x| / 127, round half
    to even): the activations the int8 kernel dots with, as floats (the torch reference)."""
    b = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    # a true division, as the kernel's 127.0f / amax: torch's `127.0 / amax` is
    # reciprocal(amax) * 127, a different float in about a quarter of cases
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = (b * inv).round().clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(x.shape).to(x.dtype)


class QPart(nn.Module):
    """N output rows of K inputs as integers q plus per-group scale (and offset)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None, bits: int,
                 group: int, k: int):
        super().__init__()
        assert bits in (4, 8) and k % group == 0 and group % (32 if bits == 4 else 16) == 0
        assert scale.dtype in (torch.float16, torch.float32) and scale.shape == (q.shape[0], k // group)
        self.bits, self.group, self.in_features, self.out_features = bits, group, k, q.shape[0]
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.contiguous())
        self.register_buffer("minv", None if minv is None else minv.to(scale.dtype).contiguous())

    def extra_repr(self) -> str:
        return (f"{self.out_features}x{self.in_features}, int{self.bits}, group {self.group}, "
                f"{str(self.scale.dtype).removeprefix('torch.')} scales{', offsets' if self.minv is not None else ''}")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.minv) if t is not None)

    def dequantize(self, dtype=torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight [N, K] (or its `rows`) in `dtype`: the torch reference of the kernels."""
        q, s, m = self.q, self.scale, self.minv
        if rows is not None:
            q, s, m = q[rows], s[rows], (None if m is None else m[rows])
        n, K, G = q.shape[0], self.in_features, self.group
        if self.bits == 4:
            b = q.view(n, K // 32, 16)
            q = torch.cat([b & 0xF, b >> 4], dim=-1)  # [n, K/32, 32]
        w = q.reshape(n, K // G, G).float() * s.float()[..., None]
        if m is not None:
            w = w + m.float()[..., None]
        return w.reshape(n, K).to(dtype)

    def __getstate__(self):  # a copy packs its own columns (and counts them)
        state = super().__getstate__()
        state.pop("_columns", None)
        return state

    def q8_ok(self) -> bool:
        """Whether the int8-activation kernel takes this layout (else x stays float)."""
        K, G = self.in_features, self.group
        return K % 64 == 0 and (G in (16, 32) or G % 64 == 0)

    def _args(self):
        return (self.q.data_ptr(), self.bits, self.group, self.scale.data_ptr(),
                None if self.minv is None else self.minv.data_ptr(), int(self.scale.dtype == torch.float16))

    def columns(self) -> int | None:
        """The address of this part's weight columns as the int8 kernel's calls of 1-63 rows
        read them (`triforce_qpack`: each tile of 16 weight rows transposed once, here,
        instead of by every call; the same bits), packed on first use; None where they are
        not kept (`TRIFORCE_OFFLOAD_CPU_COLUMNS`, the memory budget, the layout)."""
        cols = self.__dict__.get("_columns", False)
        if cols is False:
            cols = self.__dict__["_columns"] = _pack(self)
        return None if cols is None else cols.data_ptr()


_packed = [0]  # bytes of columns kept by live parts (the auto budget's use)


def _budget() -> int:
    """Bytes of packed columns `auto` keeps: an eighth of the memory available now."""
    import os
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    return avail // 8


def _pack(part: QPart):
    """`part`'s packed columns (a uint8 tensor), or None (see QPart.columns)."""
    import weakref
    from ..settings import env
    lib, mode = load(), env("cpu_columns")
    if lib is None or mode == "0" or part.q.device.type != "cpu" or not part.q8_ok():
        return None
    args = (part.in_features, part.bits, part.group, int(part.scale.dtype == torch.float16),
            int(part.minv is not None), part.out_features)
    n = lib.triforce_qpack_bytes(*args)
    if n < 0 or (mode == "auto" and _packed[0] + n > _budget()):
        return None
    cols = torch.empty(n, dtype=torch.uint8)
    q, bits, G, scale, minv, f16 = part._args()
    if lib.triforce_qpack(part.in_features, q, bits, G, scale, minv, f16, part.out_features, cols.data_ptr()):
        return None
    _packed[0] += n
    weakref.finalize(cols, _release, n)
    return cols


def _release(n: int):
    _packed[0] -= n


class QLinear(nn.Module):
    """Drop-in for a Linear whose weight is `parts` stacked along the output (a module swap
    after load, as gpt-fast's WeightOnlyInt8Linear): same forward(x) -> x @ W^T + bias."""

    def __init__(self, parts: list[QPart], bias: torch.Tensor | None = None, act: str = "fp32"):
        super().__init__()
        self._calls = None  # the native calls (native_calls), kept while buffers and act stay
        self._plans = {}  # (norm, glu) -> fused's plan (_plan), kept as long as _calls
        self.act = act  # "int8": x quantized per row and 32 inputs (see quantize_x), else float
        k = {p.in_features for p in parts}
        assert len(k) == 1, "parts of one linear share their inputs"
        self.parts = nn.ModuleList(merge(parts))
        self.in_features = k.pop()
        self.out_features = sum(p.out_features for p in parts)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    @property
    def act(self) -> str:
        return self._act

    @act.setter
    def act(self, value: str):
        self._act, self._calls = value, None

    @property
    def bits(self) -> int:
        return max(p.bits for p in self.parts)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts) + (0 if self.bias is None else self.bias.numel() * 4)

    def _apply(self, fn, *args, **kwargs):  # .to(), .cuda(), ...: buffers move
        self._calls = None
        for p in self.parts:  # packed columns follow q: made again from where it lands
            p.__dict__.pop("_columns", None)
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):  # native pointers and kernels stay with the original
        return {**super().__getstate__(), "_calls": None, "_plans": {}}

    def __setstate__(self, state):  # a copy's buffers are new
        super().__setstate__(state)
        self._calls, self._plans = None, {}

    def native_calls(self) -> list | None:
        """Per part: (kernel, the part's own arguments, bias pointer, rows, first output column),
        or None where the native kernel does not run (no library, weights not on the CPU). The
        int8-activation kernel where `act` asks for it and the part's layout allows it."""
        if self._calls is None and self.parts[0].q.device.type == "cpu" and load() is not None:
            lib, col, calls = load(), 0, []
            for p in self.parts:
                q8 = self.act == "int8" and p.q8_ok()
                fn = lib.triforce_qlinear_q8 if q8 else lib.triforce_qlinear
                bias = None if self.bias is None else self.bias.data_ptr() + 4 * col
                # the int8 kernel's tail: no norm, SwiGLU or residual; the packed columns or None
                tail = (None, 0.0, 0, None, 0, p.columns()) if q8 else ()
                calls.append((fn, p._args(), bias, p.out_features, col, tail))
                col += p.out_features
            self._calls = calls
            self._plans = {}
        return self._calls

    def _plan(self, norm, glu: bool):
        """What `fused(x, norm, glu, ...)` calls, decided once per (norm, glu) while the
        buffers and `act` stay (a decode step makes ~120 such calls: the checks that do not
        depend on x are not repeated): (kernel, K, N, norm weight pointer, eps, per part
        (arguments, bias, rows, column)), or False where the fused kernel does not take it."""
        calls = self._calls or self.native_calls()
        plan = False
        if (calls is not None and self.act == "int8" and all(p.q8_ok() for p in self.parts)
                and (norm is None or (not getattr(norm, "plus_one", True) and norm.weight.dtype == torch.float32))):
            nw, eps = (norm.weight.data_ptr(), norm.eps) if norm is not None else (None, 0.0)
            plan = (load().triforce_qlinear_q8, self.in_features, self.out_features, nw, eps,
                    tuple((args, bias, rows, col, tail[-1]) for _, args, bias, rows, col, tail in calls))
        if self._calls is not None:
            self._plans[(norm, glu)] = plan
        return plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        calls = self._calls or self.native_calls()
        if calls is None or x.dtype != torch.float32 or x.device.type != "cpu" or torch.compiler.is_compiling():
            return self._reference(x)
        shape = x.shape
        K, N = self.in_features, self.out_features
        x2 = x.reshape(-1, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        M = x2.shape[0]
        out = torch.empty(M, N, dtype=torch.float32)
        xp, ld, op = x2.data_ptr(), x2.stride(0), out.data_ptr()
        for fn, args, bias, rows, col, tail in calls:
            rc = fn(xp, M, K, ld, *args, bias, rows, op + 4 * col, N, *tail)
            if rc:
                raise (MemoryError if rc == -2 else RuntimeError)(f"native quantized linear failed ({rc}) on {self}")
        return out.view(*shape[:-1], N)

    def fused(self, x: torch.Tensor, norm=None, glu: bool = False, residual: torch.Tensor | None = None):
        """residual + self(norm(x)), or residual + self(silu(gate) * up) of x = [gate | up]
        (`glu`), in one native call per part: the norm, the SwiGLU and the residual add go
        into the int8 kernel's pass over each row (`triforce_qlinear_q8`) instead of
        separate small ops. None where that kernel does not run (float activations, a part
        it does not take, a norm other than a plain RMSNorm): the caller composes the ops."""
        plan = self._plans.get((norm, glu)) if self._calls is not None else None
        if plan is None or (plan and norm is not None and norm.weight.data_ptr() != plan[3]):
            plan = self._plan(norm, glu)  # first call, or the norm's weight moved since
        # the cheapest checks first: a decode step makes ~120 of these calls
        if (plan is False or x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous()
                or x.shape[-1] != (2 * plan[1] if glu else plan[1]) or torch.compiler.is_compiling()
                or (residual is not None and (residual.dtype != torch.float32 or not residual.is_contiguous()))):
            return None
        fn, K, N, nw, eps, parts = plan
        shape = x.shape
        M = x.numel() // shape[-1]
        out = torch.empty((*shape[:-1], N), dtype=torch.float32)
        xp, op, ldx, g = x.data_ptr(), out.data_ptr(), shape[-1], int(glu)
        res = None if residual is None else residual.data_ptr()
        for args, bias, rows, col, cols in parts:
            rc = fn(xp, M, K, ldx, *args, bias, rows, op + 4 * col, N, nw, eps, g,
                    None if res is None else res + 4 * col, N, cols)
            if rc:
                raise (MemoryError if rc == -2 else RuntimeError)(f"native quantized linear failed ({rc}) on {self}")
        return out

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.act == "int8" and any(p.q8_ok() for p in self.parts):  # the int8 kernel's reference
            xq = quantize_x(x)
            y = torch.cat([linear(xq if p.q8_ok() else x, p.dequantize(x.dtype)) for p in self.parts], -1)
            return y if bias is None else y + bias
        w = torch.cat([p.dequantize(x.dtype) for p in self.parts]) if len(self.parts) > 1 \
            else self.parts[0].dequantize(x.dtype)
        return linear(x, w, bias)


def merge(parts: list[QPart]) -> list[QPart]:
    """Neighbouring parts of one format as one (q, k and v of the same GGUF type): one kernel
    call instead of several, the same numbers (rows are independent)."""
    out = [parts[0]]
    for p in parts[1:]:
        o = out[-1]
        if (p.bits, p.group, p.scale.dtype, p.minv is None, p.q.device) == \
                (o.bits, o.group, o.scale.dtype, o.minv is None, o.q.device):
            out[-1] = QPart(torch.cat([o.q, p.q]), torch.cat([o.scale, p.scale]),
                            None if p.minv is None else torch.cat([o.minv, p.minv]), p.bits, p.group, p.in_features)
        else:
            out.append(p)
    return out


class QEmbedding(nn.Module):
    """nn.Embedding over a quantized table (shared with a tied LM head's QLinear)."""

    def __init__(self, part: QPart, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.part, self.dtype = part, dtype
        self.num_embeddings, self.embedding_dim = part.out_features, part.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = self.part
        lib = load()
        if ids.device.type != "cpu" or lib is None or torch.compiler.is_compiling():
            return p.dequantize(self.dtype, rows=ids.reshape(-1)).view(*ids.shape, -1)
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), p.in_features, dtype=torch.float32)
        rc = lib.triforce_qrows(flat.data_ptr(), flat.numel(), p.in_features, *p._args(),
                                p.out_features, out.data_ptr())
        if rc:
            raise IndexError(f"token id out of range [0, {p.out_features})")
        return out.view(*ids.shape, -1).to(self.dtype)


# ---- quantizing a dense weight (an HF checkpoint with --weights int8/int4, a requantized GGUF tensor) ----

def pack4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in 0..15 -> [N, K/2] uint8 in the 32-block nibble layout."""
    n, K = q.shape
    b = q.to(torch.uint8).view(n, K // 32, 2, 16)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, K // 2)


def quantize(w: torch.Tensor, bits: int, group: int | None = None) -> QPart:
    """A dense [N, K] weight as a QPart: int8 symmetric per row (group None: one scale per
    row) or per group; int4 asymmetric (scale and offset) per group of `group` (default 32).
    Scales are float16; q is computed against the rounded scale, so the float16 rounding
    costs nothing beyond the quantization itself."""
    n, K = w.shape
    G = group or (K if bits == 8 else 32)
    if K % G or G % (32 if bits == 4 else 16):
        raise ValueError(f"cannot quantize {n}x{K} to int{bits} in groups of {G}")
    g = w.float().reshape(n, K // G, G)
    if bits == 8:
        scale = (g.abs().amax(-1) / 127).clamp_min(1e-8).half()
        q = (g / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
        return QPart(q.reshape(n, K), scale, None, 8, G, K)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8).half()
    minv = lo.half()
    q = ((g - minv.float()[..., None]) / scale.float()[..., None]).round().clamp(0, 15)
    return QPart(pack4(q.reshape(n, K)), scale, minv, 4, G, K)


def rows_exact(model) -> bool:
    """Whether every projection of `model` computes each row independently of the other
    rows of its call (float32 dense on the row-exact kernel, quantized on the native one):
    rows of several sequences may then share a forward (runtime/batch). On CUDA: every
    projection goes through `kernels.linear.linear` (a `Linear`, or a QLinear's dequantized
    weights) and that runs the row-exact Triton kernel there (`gpu_exact`)."""
    p = next(model.parameters(), None)
    if p is not None and p.device.type == "cuda":  # and each dense weight as the kernel takes it
        return gpu_exact(p.device) and all(
            not isinstance(m, nn.Linear) or (isinstance(m, Linear) and m.weight.dtype == p.dtype
                                             and m.weight.dim() == 2 and m.weight.stride(1) == 1)
            for m in model.modules())
    for m in model.modules():
        if isinstance(m, QLinear):
            if load() is None or m.parts[0].q.device.type != "cpu":
                return False
        elif isinstance(m, torch.nn.Linear) and not (isinstance(m, Linear) and exact_ok(m.weight)):
            return False
    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cpu" and any(
        t.dtype == torch.float32 for t in model.parameters())  # the activations are float32
