"""CUDA tensors that are CPU tensors underneath, and the modes that check every op on them.

A `DryTensor` wraps a real CPU tensor (`elem`) and reports `device` cuda:0 to Python; to
C++ it is a CPU tensor, so no binding installs a CUDA device guard (which a CPU-only torch
cannot build) and every value is real: token ids, lengths and logits are what the CPU
computes. C++ composite ops may pick CPU kernels internally (SDPA's CPU flash kernel):
kernel choice inside an op is not what this checks.

`Checker` (a TorchDispatchMode) sees every aten op: it runs the op on the CPU tensors,
wraps the results, and checks
- devices: a CPU tensor (other than a 0-dim scalar) meeting a CUDA one, a generator of the
  other device;
- copies: host<->device by `copy_`/`_to_copy` (a `non_blocking` one needs contiguous
  pinned host memory; a blocking one synchronises the host; a blocking device-to-host
  read in the decode loop must be a counted one, `hostread.to_host`);
- streams: each op's reads and writes on the current stream (`gpu.Gpu.access`);
- captures: ops are recorded into the graph, not checked for access order; RNG, host
  synchronisation, host allocation and host copies raise there, as CUDA does.
`Router` (a TorchFunctionMode) reroutes the few Python entry points that would reach a
CUDA device guard or CUDA's pinned allocator: `torch.tensor(..., device=cuda|pin_memory=)`,
`Tensor.to(cuda)`/`.cuda()`, `pin_memory()`, `is_pinned()`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .gpu import CUDA, Block, Gpu

A = torch.ops.aten
RNG = torch.Tag.nondeterministic_seeded
NO_ACCESS = {A.detach.default, A.alias.default, A.lift_fresh.default, A._unsafe_view.default}
CPU = torch.device("cpu")
# ops that read device values on the host (composite ones reach the mode whole under inference_mode)
READ_OPS = {A._local_scalar_dense.default, A.item.default, A.is_nonzero.default, A.equal.default}


def _sptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def span(t: torch.Tensor) -> tuple[int, int]:
    """Bytes [lo, hi) a view of `t` reaches (the bounding range of a strided view)."""
    if t.numel() == 0:
        return 0, 0
    e = t.element_size()
    lo = _sptr(t) + t.storage_offset() * e
    far = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1)
    return lo, lo + (far + 1) * e


class DryTensor(torch.Tensor):
    """A fake CUDA tensor over a real CPU tensor `elem`, in allocation `block`."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor, block: Block):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                device=CPU, requires_grad=False)
        r.elem, r.block = elem, block
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a dry-run CUDA tensor outside the dry run")

    device = property(lambda self: CUDA)
    is_cuda = property(lambda self: True)

    def get_device(self) -> int:
        return 0

    def data_ptr(self) -> int:
        return self.elem.data_ptr()

    def untyped_storage(self):
        return self.elem.untyped_storage()

    def is_pinned(self) -> bool:
        return False

    def tolist(self):
        CHECKER.read(self, "Tensor.tolist()")
        return self.elem.tolist()

    def numpy(self, *a, **kw):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first")

    def record_stream(self, stream):
        self.block.recorded.add(stream.id)

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        copy = kwargs.get("copy", False)
        if device is not None and device.type != "cuda":
            return A._to_copy.default(self, dtype=dtype or self.dtype, device=device, non_blocking=non_blocking)
        if (dtype is None or dtype == self.dtype) and not copy:
            return self
        return A._to_copy.default(self, dtype=dtype or self.dtype)

    def cpu(self):
        return self.to(CPU)

    def cuda(self, device=None, non_blocking=False):
        return self

    def __repr__(self):
        return f"DryTensor(cuda:0, {tuple(self.shape)}, {self.dtype})"


CHECKER: "Checker" = None  # the active dispatch mode (DryTensor.tolist reads through it)


def _leaves(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _leaves(y)
    else:
        yield x


def _map(f, x):
    if isinstance(x, (list, tuple)):
        return type(x)(_map(f, y) for y in x)
    if isinstance(x, dict):
        return {k: _map(f, v) for k, v in x.items()}
    return f(x)


def _unwrap(x):
    return x.elem if isinstance(x, DryTensor) else x


def _aliases(out, args) -> bool:
    """Whether every tensor `out` holds shares storage with a DryTensor of `args`."""
    mine = {_sptr(t.elem) for t in _leaves(args) if isinstance(t, DryTensor)}
    return all(_sptr(t.elem) in mine for t in _leaves(out) if isinstance(t, DryTensor))


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


# ---- CUDA-only kernels, run on the CPU (their argument rules checked)

def _flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    assert q.dtype in (torch.float16, torch.bfloat16), f"flash attention takes fp16/bf16, got {q.dtype}"
    assert q.shape[-1] % 8 == 0 and q.shape[-1] <= 256, f"flash attention: head_dim {q.shape[-1]}"
    assert q.shape[1] == k.shape[1] == v.shape[1], "flash attention: equal head counts"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "flash attention: contiguous head_dim"
    o, lse = A._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    return o, lse, None, None, 0, 0, torch.zeros(()), torch.zeros(()), None


def _efficient(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    assert attn_bias is None and compute_log_sumexp
    assert (q.shape[-1] * q.element_size()) % 16 == 0, "efficient attention: rows of 16-byte multiples"
    o, lse = A._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    return o, F.pad(lse, (0, -lse.shape[-1] % 32), value=math.inf), torch.zeros(()), torch.zeros(())


CUDA_ONLY = {A._scaled_dot_product_flash_attention.default: _flash,
             A._scaled_dot_product_efficient_attention.default: _efficient}


def _draws(func, args, kwargs) -> bool:
    """The op draws random numbers (attention only with dropout)."""
    if RNG not in func.tags:
        return False
    for i, a in enumerate(func._schema.arguments):
        if a.name in ("dropout_p", "p"):
            p = args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
            return bool(p)
    return True


class Checker(TorchDispatchMode):
    """Runs every aten op on the CPU tensors, wraps CUDA results, checks (module docstring)."""

    def __init__(self, gpu: Gpu):
        super().__init__()
        self.gpu = gpu

    # ---- entry

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is A.copy_.default:
            return self._copy(func, args, kwargs)
        if func is A._to_copy.default:
            return self._to_copy(func, args, kwargs)
        if func in READ_OPS and isinstance(args[0], DryTensor):
            self.read(args[0], f"a scalar read ({func}: .item(), int(), bool())")
        return self._op(func, args, kwargs)

    # ---- ordinary ops

    def _op(self, func, args, kwargs):
        gpu = self.gpu
        dry, host = [], []
        for t in _leaves((args, kwargs)):
            if isinstance(t, DryTensor):
                dry.append(t)
            elif isinstance(t, torch.Tensor):
                host.append(t)
        dev = kwargs.get("device")
        on_gpu = _is_cuda(dev) if dev is not None else bool(dry)
        name = str(func)
        if dry and any(t.dim() for t in host):
            gpu.violate("device", f"{name} mixes CUDA tensors with a CPU tensor of shape "
                                  f"{tuple(next(t for t in host if t.dim()).shape)}")
        pin = kwargs.get("pin_memory")
        if gpu.capture is not None and _draws(func, args, kwargs):
            gpu.capture_check(f"random numbers ({name})")
        ukw = {k: (CPU if k == "device" and on_gpu else False if k == "pin_memory" else _unwrap(v))
               for k, v in kwargs.items()}
        out = CUDA_ONLY.get(func, func)(*_map(_unwrap, args), **ukw)
        if pin:
            _map(lambda t: gpu.pinned_alloc(t) if isinstance(t, torch.Tensor) else t, out)
        if not on_gpu:
            self._host_accesses(func, args, name)
            return out
        wrapped = self._wrap(out, dry, name)
        self._accesses(func, args, kwargs, wrapped, name)
        return wrapped

    def _wrap(self, out, dry, name):
        """Results as DryTensors: an input returned (in place) as that input, a view in
        its input's block, anything else a new block on the current stream."""
        by_id = {id(t.elem): t for t in dry}
        by_storage = {}
        for t in dry:
            if t.elem.numel():
                by_storage.setdefault(_sptr(t.elem), t.block)

        def wrap(x):
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) in by_id:
                return by_id[id(x)]
            block = by_storage.get(_sptr(x)) if x.numel() else None
            if block is None:
                block = self.gpu.new_block(f"{name} output {tuple(x.shape)}")
                self.gpu.allocated += x.untyped_storage().nbytes()
            if torch.is_inference_mode_enabled() and not x.is_inference():
                with torch.inference_mode(False):  # a view of a normal tensor stays normal
                    return DryTensor(x, block)
            return DryTensor(x, block)
        return _map(wrap, out)

    def _accesses(self, func, args, kwargs, wrapped, name):
        """Reads of the inputs, writes of mutated inputs and fresh outputs, on the current
        stream (recorded into the graph while capturing). An op that may alias its input
        (`aten.to`, which reaches the mode whole under inference_mode) and made a new tensor
        is work like any other: a dtype conversion inside a capture must replay."""
        if func in NO_ACCESS or (func.is_view and _aliases(wrapped, args)):
            return
        acc = []
        schema = func._schema.arguments
        for i, a in enumerate(schema):
            v = args[i] if i < len(args) else kwargs.get(a.name)
            kind = "w" if a.alias_info is not None and a.alias_info.is_write else "r"
            for t in _leaves(v):
                if isinstance(t, DryTensor):
                    acc.append((t, kind))
        ins = {id(t) for t, _ in acc}
        for w in _leaves(wrapped):
            if isinstance(w, DryTensor) and id(w) not in ins:
                acc.append((w, "w"))
        g = self.gpu
        if g.capture is not None:
            g.capture.record(func, args, kwargs, wrapped, acc)
            return
        self.apply(acc, g.current, name)

    def apply(self, acc, stream, name):
        tick = self.gpu.issue(stream)
        for kind in ("r", "w"):
            for t, k in acc:
                if k == kind:
                    lo, hi = span(t.elem)
                    self.gpu.access(t.block, lo, hi, k, stream, tick, name)

    def _host_accesses(self, func, args, name):
        """A host op on host memory that a stream copies from or into: ordered after it?"""
        g = self.gpu
        if not g.hostblocks or func.is_view:
            return
        for i, a in enumerate(func._schema.arguments):
            if i >= len(args):
                break
            for t in _leaves(args[i]):
                if isinstance(t, torch.Tensor) and t.numel():
                    b = g.hostblocks.get(_sptr(t))
                    if b is not None:
                        kind = "w" if a.alias_info is not None and a.alias_info.is_write else "r"
                        g.access(b, *span(t), kind, None, 0, name)

    # ---- copies between host and device

    def _copy(self, func, args, kwargs):
        dst, src = args[0], args[1]
        nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        d_gpu, s_gpu = isinstance(dst, DryTensor), isinstance(src, DryTensor)
        if d_gpu == s_gpu:
            return self._op(func, args, kwargs)
        self._transfer(src, dst, src if d_gpu else dst, nb, "copy_")
        dst_elem = dst.elem if d_gpu else dst
        dst_elem.copy_(src.elem if s_gpu else src)
        return dst

    def _to_copy(self, func, args, kwargs):
        x = args[0]
        to_gpu = _is_cuda(kwargs.get("device")) or (kwargs.get("device") is None and isinstance(x, DryTensor))
        if to_gpu == isinstance(x, DryTensor):
            return self._op(func, args, kwargs)
        nb = kwargs.get("non_blocking", False)
        ukw = {k: (CPU if k == "device" else _unwrap(v)) for k, v in kwargs.items() if k != "non_blocking"}
        out = func(_unwrap(x), **ukw)
        if to_gpu:
            self._transfer(x, None, x, nb, "Tensor.to(cuda)")
            res = DryTensor(out, self.gpu.new_block(f"a copy to the device {tuple(out.shape)}"))
            self._write(res, "Tensor.to(cuda)")
            return res
        if nb:
            self.gpu.pinned_alloc(out)  # torch copies into pinned memory for non_blocking
        self._transfer(x, out, out, nb, "Tensor.to(cpu)")
        return out

    def _transfer(self, src, dst, host, non_blocking, what):
        """Checks and accesses of one host<->device copy on the current stream: `host` is
        the host side; dst None: a fresh device tensor (written by the caller)."""
        g = self.gpu
        h2d = not isinstance(src, DryTensor)
        way = "host-to-device" if h2d else "device-to-host"
        pinned = g.is_pinned(host)
        if g.capture is not None:
            if not (non_blocking and pinned and host.is_contiguous()):
                g.capture_check(f"a {'blocking' if not non_blocking else 'pageable'} {way} copy ({what})")
            g.violate("capture", f"a {way} copy ({what}) of pinned host memory inside a CUDA graph capture: "
                                 "every replay copies that host buffer again, as it is then")
        if non_blocking and not (pinned and host.is_contiguous()):
            why = "pageable memory" if not pinned else "a strided view of pinned memory (staged in a pageable copy)"
            g.violate("pageable", f"a non_blocking {way} copy ({what}) {'from' if h2d else 'into'} {why}: "
                                  "it blocks the host instead of overlapping")
        stream = g.current
        tick = g.issue(stream)
        if h2d:
            g.access(g.host_block(host), *span(host), "r", stream, tick, f"{way} copy")
            if dst is not None:
                g.access(dst.block, *span(dst.elem), "w", stream, tick, f"{way} copy")
        else:
            g.access(src.block, *span(src.elem), "r", stream, tick, f"{way} copy")
            g.access(g.host_block(host), *span(host), "w", stream, tick, f"{way} copy")
        if not non_blocking or not (pinned and host.is_contiguous()):
            g.host_sync(stream.vc, f"a blocking {way} copy ({what})")
            if not h2d:
                g.blocking_read(f"{what} (a blocking device-to-host copy)")
            elif g.decoding:
                g.violate("pageable", f"a blocking host-to-device copy ({what}) in the decode loop: the "
                                      "host waits for the device")

    def _write(self, t: DryTensor, what):
        g = self.gpu
        g.access(t.block, *span(t.elem), "w", g.current, g.current.vc[g.current.id], what)

    def read(self, t: DryTensor, what: str):
        """A blocking read of a device tensor's values on the host."""
        g = self.gpu
        g.capture_check(what, sync=True)
        stream = g.current
        tick = g.issue(stream)
        g.access(t.block, *span(t.elem), "r", stream, tick, what)
        g.host_sync(stream.vc, what)
        g.blocking_read(what)


class Router(TorchFunctionMode):
    """Python entry points that a CPU-only torch cannot take with a CUDA device or pinned memory."""

    def __init__(self, gpu: Gpu):
        super().__init__()
        self.gpu = gpu
        self.routes = {torch.tensor: self._tensor, torch.Tensor.to: self._to, torch.Tensor.cuda: self._cuda,
                       torch.Tensor.pin_memory: self._pin, torch.Tensor.is_pinned: self._is_pinned}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = self.routes.get(func)
        if route is not None:
            return route(func, *args, **kwargs)
        gen = kwargs.get("generator")
        if gen is not None:
            self._generator(func, gen, args, kwargs)
        return func(*args, **kwargs)

    def _generator(self, func, gen, args, kwargs):
        """A generator draws for tensors of its own device (checked here: the dispatcher hands
        a generator to the aten op as a new Python object)."""
        dev = kwargs.get("device")
        on_gpu = _is_cuda(dev) if dev is not None else any(isinstance(t, DryTensor) for t in _leaves(args))
        g_cuda = getattr(gen, "dry_device", CPU).type == "cuda"
        if g_cuda != on_gpu:
            name = getattr(func, "__name__", str(func))
            self.gpu.violate("generator", f"{name}: a {'CUDA' if g_cuda else 'CPU'} generator draws for "
                                          f"{'CUDA' if on_gpu else 'CPU'} tensors")

    def _tensor(self, func, data, dtype=None, device=None, requires_grad=False, pin_memory=False):
        t = func(data, dtype=dtype)
        if pin_memory:
            self.gpu.pinned_alloc(t)
        if _is_cuda(device):
            return A._to_copy.default(t, device=CUDA)  # a blocking copy from pageable memory
        return t

    def _to(self, func, self_, *args, **kwargs):
        if isinstance(self_, DryTensor):
            return self_.to(*args, **kwargs)
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if _is_cuda(device):
            return A._to_copy.default(self_, dtype=dtype or self_.dtype, device=CUDA, non_blocking=non_blocking)
        return func(self_, *args, **kwargs)

    def _cuda(self, func, self_, device=None, non_blocking=False, **kw):
        return self._to(func, self_, CUDA, non_blocking=non_blocking)

    def _pin(self, func, self_, *a, **kw):
        if isinstance(self_, DryTensor):
            raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")
        return self.gpu.pinned_alloc(self_.clone())

    def _is_pinned(self, func, self_, *a, **kw):
        return not isinstance(self_, DryTensor) and self.gpu.is_pinned(self_)
