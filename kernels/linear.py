"""Linear layers: which GEMM kernel a projection runs on.

On the CPU, float32 `F.linear` in this torch build does not reach oneDNN: a matrix-vector
product over the 49152x576 LM head of SmolLM2 reads its weights at about a third of the
memory bandwidth oneDNN reaches, and a 7-row verification costs 3-4x one row. oneDNN's
linear (the op torch.compile's CPU backend emits) takes the same plain weight tensor, so
nothing is repacked or duplicated (tied embeddings stay shared). bfloat16/float16 and
CUDA already use the fast path through `F.linear` and stay on it.

The choice is probed once: when the op is missing (a torch built without oneDNN, a
non-x86 wheel) or disagrees with `F.linear`, everything uses `F.linear`.
`TRIFORCE_OFFLOAD_LINEAR=torch` forces `F.linear` (for comparisons).
"""
from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F
from ..settings import env

_onednn: bool | None = None


def _probe() -> bool:
    if env("linear") == "torch":
        return False
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 3, 40, generator=g)
        w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
        with torch.inference_mode():
            y = op(x, w, b, "none", [], "")
        return bool(torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4))
    except Exception:  # noqa: BLE001 - any failure means: use F.linear
        return False


def onednn_enabled() -> bool:
    global _onednn
    if _onednn is None:
        _onednn = _probe()
    return _onednn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, routed to oneDNN for float32 on the CPU when no gradient is wanted."""
    if (x.dtype == torch.float32 and x.device.type == "cpu" and weight.dtype == torch.float32
            and weight.is_contiguous() and not (torch.is_grad_enabled() and weight.requires_grad)
            and not torch.compiler.is_compiling() and onednn_enabled()):  # inductor lowers F.linear
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose forward picks the kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
