"""Attention over key blocks that stream in one by one (the offloaded cache's layers),
merged by log-sum-exp: `StreamedAttention`.

Per streamed block, one fused kernel that returns the block's output and log-sum-exp,
reads K/V once, never materialises the score matrix and never repeats K/V (grouped-query
heads are folded into the query axis: q [B, Hq, T, D] -> [B, Hkv, G*T, D], done once per
layer). The kernel by path:
- "cuda": `aten._scaled_dot_product_flash_attention` (fp16/bf16, head_dim % 8 == 0,
  <= 256; LSE [B, H, rows]) or else `aten._scaled_dot_product_efficient_attention` with
  compute_log_sumexp (LSE padded to a multiple of 32 rows: sliced, a view).
- "cpu": `aten._scaled_dot_product_flash_attention_for_cpu` (takes strided K/V, so the
  token-major staging slots need no copy; ~1.7x the reference for a 4K-token block).
- "reference": `attention.attention_lse` (fp32 scores, or the native CPU kernel), for
  anything else, and for soft-capped scores (`softcap`, Gemma 2), which torch's fused
  kernels cannot do. Capping is per score, so the log-sum-exp merge is unchanged.
`path` defaults to the tensors' device; tests force "cuda" on CPU tensors (with a
dispatch mode that stands in for the CUDA kernels) to count its ops.

The merge is batched: block results wait in a list and fold into the running accumulator
every `group` blocks with one merge of 11 single-kernel ops (stack x2, amax, sub, exp,
sum, mul, sum, div, log, add). A streamed block therefore costs 1 + 11/group launches
(<= 2 from group 11 on; 1.7 at the default 16) instead of ~20 for reference-plus-merge,
with at most `group` partial outputs ([B, Hkv, G*T, D] each) alive.

Every block must leave no query row without a visible key (true for streamed blocks,
which precede every query, and for a forward's own tokens): no -inf guards are needed.
"""
from __future__ import annotations

import torch

from .attention import _fold, _unfold, attention_lse, flash_attn_fits, like_q

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention
GROUP = 16  # block results merged at once (memory: GROUP outputs of [B, Hkv, G*T, D])


def default_path(device) -> str:
    if torch.device(device).type == "cuda":
        return "cuda"
    return "cpu" if _FLASH_CPU is not None else "reference"


def _efficient_ok(q: torch.Tensor) -> bool:
    """The memory-efficient kernel: rows of a multiple of 16 bytes."""
    return q.dtype.is_floating_point and (q.shape[-1] * q.element_size()) % 16 == 0


def fused_lse(q, k, v, scale: float, path: str, causal: bool = False):
    """One kernel: (out [B, H, L, D] in q's dtype, lse [B, H, L] fp32) of q over k, v with
    equal head counts; `causal` (q and k the same positions) aligns the diagonal."""
    k, v = like_q(q, k, v)
    if path == "cpu":
        return _FLASH_CPU(q, k, v, 0.0, causal, scale=scale)
    if flash_attn_fits(q):
        o, lse = _FLASH(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return o, lse
    o, lse = _EFFICIENT(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    return o, lse[..., : q.shape[2]]  # the kernel pads the LSE rows to a multiple of 32


class StreamedAttention:
    """Softmax attention of q [B, Hq, T, D] over key blocks fed one by one; `result` gives
    the output over all of them [B, Hq, T, D]."""

    def __init__(self, q, n_kv: int, scale: float | None = None, path: str | None = None,
                 group: int = GROUP, softcap: float | None = None):
        self.q, self.n_kv, self.group = q, n_kv, group
        self.scale = q.shape[-1] ** -0.5 if scale is None else scale
        self.softcap = softcap or None  # scores -> softcap * tanh(score / softcap)
        self.path = path or default_path(q.device)
        if self.softcap or (self.path == "cuda" and not (flash_attn_fits(q) or _efficient_ok(q))):
            self.path = "reference"
        self.qf = _fold(q, n_kv).contiguous()  # [B, Hkv, G*T, D], folded once for all blocks
        self.outs, self.lses = [], []  # pending block results, folded layout
        self.o = self.lse = None  # running accumulator: [B, Hkv, G*T, D] fp32, [B, Hkv, G*T] fp32

    def add(self, k, v):
        """A block k, v [B, Hkv, S, D] that every query sees whole (keys before the first query)."""
        if self.path == "reference":
            o, lse = attention_lse(self.q, k, v, k.shape[2], 0, self.scale, self.softcap)  # all visible
            self._push(_fold(o, self.n_kv), lse.reshape(self.qf.shape[:3]))
        else:
            self._push(*fused_lse(self.qf, k, v, self.scale, self.path))

    def add_causal(self, k, v, q_pos0: int, k_pos0: int):
        """A block with a causal edge, such as the forward's own tokens."""
        B, Hq, T, D = self.q.shape
        if self.path == "cuda" and q_pos0 == k_pos0 and k.shape[2] == T:
            g = Hq // self.n_kv  # T tokens only: repeating K/V here costs nothing
            kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            o, lse = fused_lse(self.q, kr, vr, self.scale, "cuda", causal=True)
        else:
            o, lse = attention_lse(self.q, k, v, q_pos0, k_pos0, self.scale, self.softcap)
        self._push(_fold(o, self.n_kv), lse.reshape(self.qf.shape[:3]))

    def _push(self, o, lse):
        self.outs.append(o)
        self.lses.append(lse)
        if len(self.outs) >= self.group:
            self._merge()

    def _merge(self):
        """Fold the pending blocks into the accumulator: 11 single-kernel ops."""
        outs, lses = self.outs, self.lses
        if self.o is not None:
            outs, lses = [self.o, *outs], [self.lse, *lses]
        lse = torch.stack(lses)  # [N, B, Hkv, G*T]
        m = lse.amax(0)
        w = (lse - m).exp_()  # weight of each block per query row, up to 1/sum
        s = w.sum(0)
        o = (w.unsqueeze(-1) * torch.stack(outs)).sum(0)  # fp32 (w promotes)
        self.o, self.lse = o.div_(s.unsqueeze(-1)), s.log_().add_(m)
        self.outs, self.lses = [], []

    def result(self, dtype=None) -> torch.Tensor:
        if self.outs:
            self._merge()
        o = _unfold(self.o, self.q.shape[1])
        return o if dtype is None else o.to(dtype)

