"""A CPU forward's layers in one native call (`triforce_forward_layers`, kernels/cpu_linear.c).

A decode, draft or verification step of one sequence on the CPU makes five native calls per
layer (the qkv projection with its norm, RoPE + the K/V write + attention, the o projection
with the residual, gate|up with its norm, down with SwiGLU and the residual): all of a
layer's arithmetic, with ~100 us of Python, torch and ctypes around them (half of a short
context's step on a 2-core CPU). `Program` hands the kernel the same calls for every layer
at once: each projection's arguments as `QLinear.fused` passes them (its plan), the
attention's as the cache's `rope_attend` does (`KVCache.one_call_layers`: every layer held
whole in the cache's own buffers at one slot). The same calls in the same order on the same
buffers' contents: the same bits, which tests/test_program.py checks against the layer loop.

Where anything differs from that (a layer the plain pre-norm block does not describe: Gemma's
sandwich norms, GELU, q/k norms; float activations; a projection the int8 kernel does not take;
hooks; a cache or step that one call per layer does not take; more rows than its scratch),
`Transformer.forward` runs its layer loop instead. TRIFORCE_OFFLOAD_PROGRAM=0 turns it off.
"""
from __future__ import annotations

import ctypes
import struct
import weakref

import torch

from ...kernels import native
from ...kernels import native_linear
from ...kernels.qlinear import QLinear
from ...settings import env

PART_W, MAX_PARTS = 10, 4  # as cpu_linear.c
PROJ_W = 6 + MAX_PARTS * PART_W
LAYER_W = 4 * PROJ_W


def _proj_words(lin, norm, glu: bool) -> list[int] | None:
    """A projection's PROJ_W words (its K, N, norm, eps, glu and parts, from `QLinear._plan`),
    or None where the int8 kernel's fused call does not take it."""
    if not isinstance(lin, QLinear):
        return None
    plan = lin._plan(norm, glu)
    if not plan or plan[0] is not native_linear.load().triforce_qlinear_q8 or len(plan[5]) > MAX_PARTS:
        return None
    _, K, N, nw, eps, parts = plan
    words = [K, N, nw or 0, struct.unpack("<I", struct.pack("<f", eps))[0], int(glu), len(parts)]
    for args, bias, rows, col, cols in parts:
        q, bits, group, scale, minv, f16 = args
        words += [q, bits, group, scale, minv or 0, f16, bias or 0, rows, col, cols or 0]
    return words + [0] * (PROJ_W - len(words))


def _check(rc: int):
    if rc:
        raise (MemoryError if rc == -2 else RuntimeError)(f"native forward of the layers failed ({rc})")


class Program:
    """The static half: every layer's projections, built once per model (`build`); `run`
    takes a step through it where it applies."""

    def __init__(self, model, words: list[int], checks: list, hooks: tuple):
        cfg = model.config
        self.L, self.Hq, self.H, self.D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.G = self.Hq // self.H
        self.hidden = cfg.hidden_size
        self.n_qkv = (self.Hq + 2 * self.H) * self.D
        self.n_gu = 2 * cfg.intermediate_size
        self.prog = torch.tensor(words, dtype=torch.int64)
        self.checks = checks  # per projection (QLinear, its native calls, its norm, the norm's weight pointer)
        self.lib = native_linear.load()
        self.rope_attend = ctypes.cast(native.load().triforce_rope_attend, ctypes.c_void_p).value
        self.rope_attend_seqs = ctypes.cast(native.load().triforce_rope_attend_seqs, ctypes.c_void_p).value
        self.modules = [m for b in model.model.layers for m in (b, b.self_attn, b.mlp)]
        self.hooks = hooks  # torch's global module hooks (transformer._HOOKS)
        # (a module's children, name, child) of the layers: none replaced since (`current`)
        self.tree = [(parent._modules, name, child) for parent in [model.model.layers] + self.modules
                     for name, child in parent._modules.items()]
        self._kv = None  # the last direct cache's buffers (`buffers`)

    @classmethod
    def build(cls, model, one_call: bool, hooks: tuple) -> "Program | None":
        """The program of `model`'s layers, or None where one of them is not what the call
        computes (then the layer loop runs every step). `one_call`: the attention's one call
        gives the separate steps' bits here (transformer.one_call_ok); `hooks`: torch's global
        module hooks (transformer._HOOKS)."""
        cfg = model.config
        # one_call (one_call_ok) covers the head sizes the kernel takes
        if (env("program") == "0" or native_linear.load() is None or not native.enabled() or not one_call
                or cfg.n_heads % cfg.n_kv_heads):
            return None
        hid, D, Hq, H, I = cfg.hidden_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.intermediate_size
        words, checks = [], []
        for b in model.model.layers:
            a, m = b.self_attn, b.mlp
            if b.sandwich or not a.one_call or m.gelu:  # one_call: no q/k norms, no q scale
                return None
            for lin, norm, glu, K, N in ((a.qkv_proj, b.input_layernorm, False, hid, (Hq + 2 * H) * D),
                                         (a.o_proj, None, False, Hq * D, hid),
                                         (m.gate_up_proj, b.post_attention_layernorm, False, hid, 2 * I),
                                         (m.down_proj, None, True, I, hid)):
                w = _proj_words(lin, norm, glu)
                if w is None or w[0] != K or w[1] != N:  # the shapes the call's buffers have
                    return None
                words += w
                checks.append((lin, lin._calls, norm, None if norm is None else norm.weight.data_ptr()))
        return cls(model, words, checks, hooks)

    def current(self) -> bool:
        """The projections' native calls are still the ones the program was built from (an
        `act` change or a move drops them: QLinear.native_calls), each norm's weight where
        it was (QLinear.fused plans again where one moved), and no module of the layers
        replaced by another."""
        for lin, calls, norm, nw in self.checks:
            if lin._calls is not calls or (norm is not None and norm.weight.data_ptr() != nw):
                return False
        for children, name, child in self.tree:  # a projection, norm or block swapped for another
            if children.get(name) is not child:
                return False
        return True

    def buffers(self, direct, S: int):
        """(K, V pointers [L, 2] int64, dtype, strides) of the direct cache's layers, where every
        one is a [1, H, >= S, D] CPU buffer of one dtype and layout; else None. Kept while the
        cache holds the same tensors (a check of identity per layer)."""
        kv = [direct.own(layer) for layer in range(self.L)]
        got = self._kv  # weak references: a finished run's cache is not kept alive here
        if got is not None and got[0]() is direct and got[5] >= S and all(
                a[0] is b[0]() and a[1] is b[1]() for a, b in zip(kv, got[1])):
            return got[2], got[3], got[4]
        k0 = kv[0][0]
        dtype, st = k0.dtype, k0.stride()
        if (dtype not in (torch.float32, torch.bfloat16) or st[-1] != 1 or k0.dim() != 4 or k0.shape[0] != 1
                or k0.shape[1] != self.H or k0.shape[-1] != self.D):
            return None
        ptrs, cap = [], k0.shape[2]
        for k, v in kv:
            if k.dtype != dtype or v.dtype != dtype or k.stride() != st or v.stride() != st or not k.is_cpu or not v.is_cpu \
                    or k.shape != k0.shape or v.shape != k0.shape:
                return None
            ptrs += [k.data_ptr(), v.data_ptr()]
        if cap < S:
            return None
        ptrs = torch.tensor(ptrs, dtype=torch.int64)
        self._kv = (weakref.ref(direct), [(weakref.ref(k), weakref.ref(v)) for k, v in kv], ptrs, dtype, st, cap)
        return ptrs, dtype, st

    def usable(self, x: torch.Tensor, cos, sin) -> bool:
        """x, cos, sin as the call takes them, and nothing that should see the layers' calls."""
        T = x.shape[1]
        if (x.shape[0] != 1 or x.shape[2] != self.hidden or x.dtype != torch.float32 or not x.is_contiguous()
                or not x.is_cpu or cos.shape[-1] != self.D or not native.rope_tables(cos, sin, T, self.D)
                or env("program") == "0" or not native.enabled()):  # as the layer loop reads them each call
            return False
        for m in self.modules:  # hooks see each module's call: the layer loop makes them
            if m._forward_hooks or m._forward_pre_hooks:
                return False
        return not any(self.hooks)

    def scratch(self, T: int) -> tuple:
        """The activations' buffers of a T-row call: y, qkv, o, h."""
        f = torch.float32
        return (torch.empty(T, self.hidden, dtype=f), torch.empty(T, self.n_qkv, dtype=f),
                torch.empty(T, self.Hq * self.D, dtype=f), torch.empty(T, self.n_gu, dtype=f))

    def run_rows(self, x: torch.Tensor, cos, sin, cache) -> bool:
        """`run` for a batch's ragged forward (`Transformer.forward_rows`: x [1, N, hidden] the
        rows of several sequences, cos, sin [N, 1, D] each row's, `cache` a batch.rows.Ragged)
        where every layer takes `Ragged.rope_attend`'s one call with one plan (`one_call_rows`)."""
        N = x.shape[1]
        if not self.usable(x, cos, sin):
            return False
        one = cache.one_call_rows(self.Hq, self.D)
        if one is None:
            return False
        plan, kv, dtype, softcap = one
        if (dtype not in (torch.float32, torch.bfloat16) or plan.G != self.G or plan.rows % self.G
                or kv.numel() != 2 * plan.n * self.L):  # what the call reads: this model's heads and layers
            return False
        qf = torch.empty(self.L, self.H, plan.rows, self.D, dtype=torch.float32)
        secs = torch.zeros(self.L, plan.n, dtype=torch.float64)
        y, qkv, o, h = self.scratch(N)
        rc = self.lib.triforce_forward_layers_seqs(
            self.L, self.prog.data_ptr(), kv.data_ptr(), qf.data_ptr(), self.H * plan.rows * self.D,
            self.rope_attend_seqs, N, x.data_ptr(), y.data_ptr(), qkv.data_ptr(), o.data_ptr(), h.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), int(dtype == torch.bfloat16), self.D ** -0.5, float(softcap or 0.0),
            self.Hq, self.H, self.D, plan.n, plan.meta.data_ptr(), plan.nvis.data_ptr(), native.BLOCK,
            secs.data_ptr())
        _check(rc)
        cache.one_call_done(plan, qf, secs)
        return True

    def run(self, x: torch.Tensor, cos, sin, start, cache) -> bool:
        """(Where `current`: Transformer._program asks.) Layers 0.. over hidden states x [1, T, hidden] (float32, contiguous; replaced in
        place by the last layer's output) of the tokens at positions start.. (cos, sin
        theirs, [T, 1, D]), attending through `cache` (between its begin_forward and
        end_forward); False (x untouched, nothing written) where the call does not apply."""
        T = x.shape[1]
        D, H = self.D, self.H
        if T > native.ONE_CALL_TOKENS or not isinstance(start, int) or not self.usable(x, cos, sin):
            return False
        one = cache.one_call_layers(start, T)
        if one is None:
            return False
        direct, slot, recorder = one
        S, R = slot + T, self.G * T
        nb = max(1, -(-S // native.BLOCK))
        got = self.buffers(direct, S) if R <= native.scratch_rows(H, nb, D) else None
        if got is None:
            return False
        kv, dtype, st = got
        qf = torch.empty(self.L, H, R, D, dtype=torch.float32)
        y, qkv, o, h = self.scratch(T)
        part = torch.empty(H, nb, R, D + 2, dtype=torch.float32)
        out = torch.empty(H, R, D, dtype=torch.float32)
        lse = torch.empty(H, R, dtype=torch.float32)
        nvis = native.visible_keys(start, T, self.G, direct.first_position, S)
        rc = self.lib.triforce_forward_layers(
            self.L, self.prog.data_ptr(), kv.data_ptr(), qf.data_ptr(), self.rope_attend, T, x.data_ptr(),
            y.data_ptr(), qkv.data_ptr(), o.data_ptr(), h.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            int(dtype == torch.bfloat16), D ** -0.5, float(direct.softcap or 0.0), self.Hq, H, D, slot, st[1], st[2],
            nvis.data_ptr(), native.BLOCK, part.data_ptr(), out.data_ptr(), lse.data_ptr())
        _check(rc)
        if recorder is not None:
            recorder.record_layers(qf, T)
        return True
