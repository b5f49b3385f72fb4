"""Counting the work a forward dispatches: aten ops per layer, their shapes, host syncs.

A `TorchDispatchMode` sees every aten op a forward issues. Views and metadata-only ops
are not work (they launch nothing); everything else is: each is a kernel launch on a GPU
(unless a CUDA graph replays it) and a pass over memory on the CPU. Ops are attributed
to the transformer block that issued them (hooks on `model.model.layers`), so
`per_layer()` is the per-layer cost and `outside` the per-forward one (embedding,
rotary cos/sin, final norm, LM head). `aten._local_scalar_dense` (what `.item()`, `int()`
and `bool()` of a tensor reach) is a host synchronisation and is listed in `syncs`, with
the other ops in `SYNCS`: a fixed-shape forward (runtime/graphs.py) must have none.

Two ways to count, both reported by `decode_step_ops`:
- dispatched (default): the ops as the model's Python issues them. A composite op such as
  `F.rms_norm` is one op; on CUDA it is one fused kernel.
- `kernels=True`: composite ops this device has no kernel for are expanded into the ops
  they run (on the CPU `rms_norm` becomes pow, mean, add, rsqrt, mul, mul): the kernels
  this device actually launches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .hostread import to_device

# ops that return a view of their input's storage: no data moves
VIEWS = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "t", "transpose", "expand", "expand_as",
    "slice", "select", "unsqueeze", "squeeze", "as_strided", "detach", "alias", "permute",
    "split", "split_with_sizes", "chunk", "unbind", "narrow", "diagonal", "movedim",
    "unfold", "view_as_real", "view_as_complex", "_reshape_copy_view",
})
# ops that change metadata only (no kernel)
METADATA = frozenset({"detach_", "lift_fresh", "sym_size", "sym_stride", "sym_numel",
                      "sym_storage_offset", "is_contiguous", "dim", "size", "stride", "numel",
                      "is_same_size", "_has_compatible_shallow_copy_type"})
# composite ops that are a view or return their input unless they must copy or convert:
# work only when the result has storage of its own
MAYBE_COPIES = frozenset({"reshape", "reshape_as", "view_as", "flatten", "unflatten",
                          "contiguous", "to", "type_as", "_to_copy"})
# ops that read a device value on the host (a host sync on CUDA): `_local_scalar_dense` and
# the composites that reach it (under inference mode the dispatch mode sees `item` itself),
# and ops whose output shape depends on the data
SYNCS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero",
                   "masked_select"})


@dataclass(frozen=True)
class Op:
    name: str  # aten op without overload, e.g. "mm", "index_copy_"
    shapes: tuple  # ((shape, dtype), ...) of its tensor arguments
    layer: int | None  # index of the block that issued it; None outside every block


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a)


def _shares_storage(out, args) -> bool:
    outs = list(_tensors(out if isinstance(out, (list, tuple)) else [out]))
    ptrs = {t.untyped_storage().data_ptr() for t in _tensors(args) if t.numel()}
    return bool(outs) and all(t.untyped_storage().data_ptr() in ptrs for t in outs)


def is_work(name: str, out, args) -> bool:
    """Whether an op with this aten name and result did work (not a view, alias or no-op)."""
    if name in VIEWS or name in METADATA:
        return False
    if name in MAYBE_COPIES:
        return not _shares_storage(out, args)
    return True


class OpCount(TorchDispatchMode):
    """Records the work ops dispatched inside it (`ops`), and the host syncs (`syncs`)."""

    def __init__(self, kernels: bool = False):
        super().__init__()
        self.kernels = kernels  # expand composite ops the device has no kernel for
        self.ops: list[Op] = []
        self.syncs: list[Op] = []
        self.layer: int | None = None  # set by the block hooks of `count`

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.kernels and _composite_here(func, args):
            with self:  # the ops the composite runs come back through this mode
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if is_work(name, out, args):
            op = Op(name, tuple((tuple(t.shape), str(t.dtype).replace("torch.", ""))
                                for t in _tensors(args)), self.layer)
            self.ops.append(op)
            if name in SYNCS:
                self.syncs.append(op)
        return out

    def per_layer(self) -> list[int]:
        """Work ops issued inside each block, in block order."""
        n = 1 + max((o.layer for o in self.ops if o.layer is not None), default=-1)
        counts = [0] * n
        for o in self.ops:
            if o.layer is not None:
                counts[o.layer] += 1
        return counts

    @property
    def outside(self) -> int:
        """Work ops issued outside every block (once per forward)."""
        return sum(o.layer is None for o in self.ops)

    def signature(self) -> list[tuple]:
        """(name, shapes) of every work op in order: equal for two steps that replay alike."""
        return [(o.name, o.shapes) for o in self.ops]


def _composite_here(func, args) -> bool:
    """A CompositeImplicitAutograd op with no kernel of its own for its tensors' device:
    what runs is its decomposition."""
    name = func.name()
    if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"):
        return False
    t = next(_tensors(args), None)
    key = "CUDA" if t is not None and t.device.type == "cuda" else "CPU"
    return not torch._C._dispatch_has_kernel_for_dispatch_key(name, key)


def count(model, run, kernels: bool = False) -> OpCount:
    """Call `run()` (a forward of `model`, directly or through a graphs.Step) once under
    inference mode and return what it dispatched, attributed to `model`'s blocks."""
    c = OpCount(kernels)
    hooks = []
    for i, block in enumerate(model.model.layers):
        hooks.append(block.register_forward_pre_hook(lambda *_, i=i: setattr(c, "layer", i)))
        hooks.append(block.register_forward_hook(lambda *_: setattr(c, "layer", None)))
    try:
        with torch.inference_mode(), c:
            run()
    finally:
        for h in hooks:
            h.remove()
    return c


def decode_step_ops(model, cfg, context: int = 32) -> dict:
    """Work ops per layer of a one-token decode step after `context` tokens, on the eager
    path (a growing full cache, int start) and on the fixed-shape path (a static full
    cache, start on the device: what a CUDA graph captures), dispatched and as kernels;
    plus the host syncs inside the fixed-shape step (must be 0)."""
    from .cache.kv import FullCache
    p = next(model.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, context + 1), generator=g).to(p.device)
    out = {"context": context}
    for path, static in (("eager", False), ("fixed", True)):
        cache = FullCache(cfg, context + 8, dtype=p.dtype, device=p.device, static=static)
        with torch.inference_mode():
            model(ids[:, :context], 0, cache)
        cache.commit(context)
        start = to_device([context], p.device) if static else context
        for kernels in (False, True):
            c = count(model, lambda: model(ids[:, context:], start, cache), kernels)
            key = f"{path}_kernels" if kernels else path
            out[key] = max(c.per_layer())
            if static and not kernels:
                out["fixed_syncs"] = len(c.syncs)
                out["outside"] = c.outside
    return out
