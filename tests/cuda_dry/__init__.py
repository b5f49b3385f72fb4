"""A dry run of the CUDA path on a CPU-only torch (docs/gpu.md, "The CUDA dry run").

    with DryRun(attention="sdpa") as dry:
        L = dry.cuda(loaded)                     # the model's weights on the fake device
        toks, st = dry.generate(L, prompt, opts)  # api.generate, the decode loop marked
    dry.check()                                   # AssertionError listing every violation

Tensors on the fake device are real CPU tensors (`tensor.DryTensor`), so every value is
what the CPU computes; streams, events and graphs are faked (`fakes`) with vector clocks
(`gpu`), and every aten op is checked (`tensor.Checker`). `plant` edits one line of a
runtime function for a test, to show that a check fires.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import os
import sys
import textwrap

import torch

from . import fakes, tensor
from .gpu import CUDA, CaptureError, Event, Gpu, Violation
from .tensor import A, Checker, DryTensor, Router

__all__ = ["DryRun", "plant", "Violation", "CaptureError", "DryTensor"]

ATTENTION = ("flash-attn", "triton", "sdpa")


class _Patches:
    """setattr with the old values restored in reverse order."""

    def __init__(self):
        self.undo = []

    def set(self, obj, name, value):
        had = name in vars(obj)
        self.undo.append((obj, name, vars(obj).get(name) if had else None, had))
        setattr(obj, name, value)

    def restore(self):
        for obj, name, old, had in reversed(self.undo):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self.undo = []


def _clear_caches():
    from triforce_offload.kernels import attention, linear, triton_attention
    for f in (attention._flash_attn_reason, attention._static_path, attention.sm80,
              triton_attention._capability, triton_attention._sm_count, linear._gpu_exact):
        f.cache_clear()


class DryRun:
    """The fake CUDA device, its checks, and the fakes installed while the block runs.

    `attention`: the fixed-shape attention path (TRIFORCE_OFFLOAD_ATTENTION); flash-attn and
    Triton are faked for it (flash-attn runs bf16/fp16 only: fp32 steps fall to Triton).
    `free`, `total`: the device memory `torch.cuda.mem_get_info` reports."""

    def __init__(self, attention: str = "sdpa", free: int = 20 << 30, total: int = 24 << 30):
        assert attention in ATTENTION, attention
        self.attention = attention
        self.gpu = Gpu(free, total)
        self._patches = _Patches()
        self._env = None

    @property
    def violations(self) -> list[Violation]:
        return self.gpu.violations

    def kinds(self) -> set[str]:
        return {v.kind for v in self.violations}

    def check(self):
        """AssertionError listing the violations found, if any."""
        assert not self.violations, "CUDA dry run found:\n" + "\n".join(map(str, self.violations))

    # ---- set-up

    def __enter__(self) -> "DryRun":
        from triforce_offload.kernels import triton_attention, triton_linear
        from triforce_offload.runtime import hostread
        p, g = self._patches, self.gpu
        p.set(triton_linear, "triton", fakes.FakeTriton)  # the row-exact projections (as on a GPU)
        p.set(triton_linear, "_KERNELS", {})
        fakes.GPU = g
        p.set(Event, "gpu", g)
        for name, fake in fakes.cuda_namespace().items():
            p.set(torch.cuda, name, fake)
        p.set(torch, "Generator", fakes.DryGenerator)
        if self.attention in ("flash-attn", "triton"):
            p.set(triton_attention, "triton", fakes.FakeTriton)
            p.set(triton_attention, "_KERNELS", {})
        self._flash = sys.modules.pop("flash_attn", None)
        if self.attention == "flash-attn":
            sys.modules["flash_attn"] = fakes.flash_attn_module()
        self._env = os.environ.get("TRIFORCE_OFFLOAD_ATTENTION")
        os.environ["TRIFORCE_OFFLOAD_ATTENTION"] = self.attention
        read = hostread.READS.read

        def counted(t):  # hostread.to_host: the one blocking read it counts
            g.counting += 1
            g.copies_in_read = 0
            try:
                return read(t)
            finally:
                g.counting -= 1
        p.set(hostread.READS, "read", counted)
        _clear_caches()
        self._overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(True)  # Module.to: new Parameters
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny tensors: one thread is fastest (no OpenMP barriers)
        self.checker = fakes.CHECKER = tensor.CHECKER = Checker(g)
        self.router = Router(g)
        self.router.__enter__()
        self.checker.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self.checker.__exit__(*exc)
            self.router.__exit__(*exc)
        finally:
            self.gpu.active = False
            torch.set_num_threads(self._threads)
            torch.__future__.set_overwrite_module_params_on_conversion(self._overwrite)
            self._patches.restore()
            sys.modules.pop("flash_attn", None)
            if self._flash is not None:
                sys.modules["flash_attn"] = self._flash
            if self._env is None:
                os.environ.pop("TRIFORCE_OFFLOAD_ATTENTION", None)
            else:
                os.environ["TRIFORCE_OFFLOAD_ATTENTION"] = self._env
            _clear_caches()
        return False

    # ---- use

    def to_device(self, t: torch.Tensor) -> DryTensor:
        return A._to_copy.default(t, device=CUDA)

    def cuda(self, loaded):
        """A copy of `loaded` (an api.Loaded) with its model's weights on the fake device
        (tied weights stay tied)."""
        model = copy.deepcopy(loaded.model).requires_grad_(False)
        moved = {}
        for m in model.modules():
            for store in (m._parameters, m._buffers):
                for name, t in store.items():
                    if t is None:
                        continue
                    if id(t) not in moved:
                        d = self.to_device(t.detach())
                        moved[id(t)] = torch.nn.Parameter(d, requires_grad=False) if name in m._parameters else d
                    store[name] = moved[id(t)]
        return dataclasses.replace(loaded, model=model, device=torch.device("cuda"))

    def generate_batch(self, loaded, prompts, opts):
        """api.generate_batch on the fake device. A batch's sequences run in member threads
        (runtime/batch/runner.py) and torch's dispatch modes are per thread, so each member
        thread enters the fake device's modes too. The decode loop is not marked (the
        members' prefills and decodes interleave): the other checks apply."""
        from triforce_offload.runtime.api import generate_batch
        from triforce_offload.runtime.batch.runner import Batch
        member = Batch._member

        def in_modes(batch, *args, **kwargs):
            with self.router, self.checker:
                return member(batch, *args, **kwargs)
        Batch._member = in_modes
        try:
            return generate_batch(loaded, prompts, opts)
        finally:
            Batch._member = member

    def generate(self, loaded, prompt, opts, on_token=None, progress=None):
        """api.generate with the decode loop marked (from the first generated token on,
        every blocking device-to-host read must be a counted one) and, for the speculative
        modes, at most one counted read per verification of the top level."""
        from triforce_offload.runtime.api import generate
        g = self.gpu

        def tok(t):
            g.decoding = True
            return on_token(t) if on_token else None
        g.decoding = False
        try:
            toks, st = generate(loaded, prompt, opts, on_token=tok, progress=progress)
        finally:
            g.decoding = False
        top = st.extra.get("levels", {}).get("full")
        if top is not None and top["max_host_reads"] > 1:
            g.violate("read", f"{top['max_host_reads']} blocking reads in one verification of the top level "
                              "(one is the goal: the accepted count and the next token together)")
        return toks, st


def plant(monkeypatch, owner, name: str, old: str, new: str):
    """Install owner.name (a function of a module or class) with its source's `old` text
    replaced by `new`: a planted bug, one line of the real code changed."""
    fn = inspect.unwrap(vars(owner)[name]) if isinstance(owner, type) else getattr(owner, name)
    src = textwrap.dedent(inspect.getsource(fn))
    assert src.count(old) == 1, f"{old!r} is not once in {name}'s source"
    ns = {}
    exec(compile(src.replace(old, new), inspect.getsourcefile(fn), "exec"), fn.__globals__, ns)
    monkeypatch.setattr(owner, name, ns[name])
