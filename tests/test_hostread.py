"""Blocking device-to-host reads in the decode loop: at most one per verification of the
top level, all through `hostread.to_host`, and none that bypass it.

On the CPU nothing actually syncs, so two independent counts: the helper's own (`READS`),
and a dispatch mode that sees every raw read (`aten._local_scalar_dense`, `aten.item`, a
copy from a non-CPU tensor to the CPU) — `int(t)`, `t.item()`, `bool(t)`, `float(t)` all
go through `_local_scalar_dense`. The helper's reads of CPU tensors (`tolist`) are not
dispatched, so the raw count must be zero during decoding.
"""
import ast
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers_spec import repetitive_prompt, tiny
from triforce_offload.runtime.api import RunOptions, generate
from triforce_offload.runtime.spec.acceptance import accept, one_hot, verdict


@pytest.fixture(autouse=True)
def explore_freely(monkeypatch):
    """Every level gets probed within these 40-token runs (the reads of each are counted):
    no cap on exploring's share of the time (spec_modes.EXPLORE)."""
    from triforce_offload.runtime.spec import modes as spec_modes
    monkeypatch.setattr(spec_modes, "EXPLORE", None)
from triforce_offload.runtime.spec.drafters import NgramDrafter
from triforce_offload.runtime import hostread
from triforce_offload.runtime.hostread import READS, to_device
from triforce_offload.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
RAW = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}


class RawReads(TorchDispatchMode):
    """Counts raw blocking reads while `on` is set."""

    def __init__(self):
        super().__init__()
        self.on, self.raw = False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.on and (func in RAW or self._to_cpu(func, args, kwargs)):
            self.raw.append(str(func))
        return func(*args, **kwargs)

    @staticmethod
    def _to_cpu(func, args, kwargs) -> bool:
        src = args[1] if func is torch.ops.aten.copy_.default else args[0]
        dst = (args[0].device if func is torch.ops.aten.copy_.default
               else kwargs.get("device")) if func in (torch.ops.aten.copy_.default,
                                                      torch.ops.aten._to_copy.default) else None
        return (dst is not None and torch.device(dst).type == "cpu"
                and isinstance(src, torch.Tensor) and src.device.type != "cpu")


def decode_reads(mode, temperature=0.0, **extra):
    """Generate with the dispatch mode counting raw reads from the first decoded token on."""
    L = tiny(vocab=64, layers=2)
    prompt = repetitive_prompt(300, 64)
    watch = RawReads()

    def on_token(_):
        watch.on = True
    with watch:
        opts = RunOptions.of(mode=mode, max_new_tokens=40, budget=64, **extra,
                             sampling=SamplingParams(temperature=temperature, seed=0))
        toks, st = generate(L, prompt, opts, on_token=on_token)
    return toks, st, watch.raw


@pytest.mark.parametrize("draft", ["ngram", "self"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_triforce_top_verification_reads_once(draft, temperature):
    # every level runs (the retrieval level's reads are counted: on this tiny model it does not pay)
    toks, st, raw = decode_reads("triforce", draft=draft, temperature=temperature, bypass=False)
    assert len(toks) == 40 and raw == []  # nothing bypasses the helper
    top, mid = st.extra["levels"]["full"], st.extra["levels"]["retrieval"]
    assert top["verifications"] > 1 and top["max_host_reads"] == 1
    assert top["host_reads"] == top["verifications"] and st.extra["host_reads"]["full"] == 1.0
    assert mid["max_host_reads"] == 1  # the retrieval level's verifications: one each too
    if draft == "ngram":  # host data: the drafts need no read
        assert st.extra["host_reads"]["ngram"] == 0
    else:  # a model drafter reads each drafted token back
        assert st.extra["host_reads"]["self"] > 0


def test_accept_is_one_read_and_verdict_none():
    p = one_hot([3, 1, 2, 0], 5)
    watch = RawReads()
    watch.on = True
    n0 = READS.count["other"]
    with watch:
        v = verdict([3, 1, 4], one_hot([3, 1, 4], 5), p)
        assert READS.count["other"] == n0
        assert accept([3, 1, 4], one_hot([3, 1, 4], 5), p) == (2, 2)
        assert accept([], one_hot([], 5), p) == (0, 3)
    assert READS.count["other"] == n0 + 2 and watch.raw == []
    assert v.tolist() == [2, 2]


DECODE_LOOP = ["runtime/spec/acceptance.py", "runtime/spec/drafters.py", "runtime/spec/engine.py",
               "runtime/sampling.py", "runtime/spec/modes.py", "runtime/generate.py",
               "runtime/cache/retrieval.py"]


HOST_ONLY = "# host tensor: not a device read"  # a line that converts a tensor known to be on the CPU


def raw_reads_in(path: Path) -> list[str]:
    """`.item()`, `.tolist()`, `.cpu()`, `.numpy()` calls, and int/float/bool of a call's
    result (`int(sample(p))`, `int(ok.sum())`), outside runtime/hostread.py, except on a
    line marked HOST_ONLY (its tensor checked to be on the CPU: see the test below)."""
    bad, lines = [], path.read_text().splitlines()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or HOST_ONLY in lines[node.lineno - 1]:
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("item", "tolist", "cpu", "numpy"):
            bad.append(f"{path.name}:{node.lineno} .{f.attr}()")
        if (isinstance(f, ast.Name) and f.id in ("int", "float", "bool") and node.args
                and _tensorish(node.args[0])):
            bad.append(f"{path.name}:{node.lineno} {f.id}(...)")
    return bad


def _tensorish(a) -> bool:
    """A call's result (`sample(p)`, `ok.sum()`) or an element of a named value (`tok[0]`);
    not text parsing such as `int(line.split()[1])`."""
    return isinstance(a, ast.Call) or (isinstance(a, ast.Subscript) and isinstance(a.value, ast.Name))


def test_decode_loop_modules_read_only_through_the_helper():
    bad = [b for m in DECODE_LOOP for b in raw_reads_in(ROOT / m)]
    assert bad == [], bad
    marked = [(m, i) for m in DECODE_LOOP for i, line in enumerate((ROOT / m).read_text().splitlines())
              if HOST_ONLY in line]
    assert marked == [("runtime/sampling.py", marked[0][1])], marked  # sampling.argmax alone


def test_argmax_reads_numpy_only_from_cpu_tensors(monkeypatch):
    """sampling.argmax (numpy's, marked HOST_ONLY) takes the CPU's float32 rows only: a
    device tensor (here a meta one) or another dtype goes to torch's argmax, and numpy's
    answer is torch's, first maximum and NaN included."""
    from triforce_offload.runtime.sampling import argmax
    calls = []
    real = torch.Tensor.numpy
    monkeypatch.setattr(torch.Tensor, "numpy",
                        lambda self, *a, **k: calls.append(self.device.type) or real(self, *a, **k))
    for x in (torch.randn(3, 100), torch.tensor([1.0, float("nan"), 3.0, float("nan")]),
              torch.tensor([[2.0, 2.0, 1.0]]), torch.full((2, 5), -float("inf")), torch.randn(4, 6)[:, ::2]):
        assert torch.equal(argmax(x), x.argmax(-1))
    assert calls == ["cpu"] * 5
    assert argmax(torch.empty(2, 7, device="meta")).device.type == "meta"
    assert argmax(torch.randn(2, 7).bfloat16()).dtype == torch.long and calls == ["cpu"] * 5


def tensors_made_on_a_device(path: Path) -> list[str]:
    """`torch.tensor(..., device=...)` calls: on CUDA a blocking copy from pageable memory."""
    return [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "tensor" and any(k.arg == "device" for k in node.keywords)]


def test_host_values_reach_the_device_only_through_to_device():
    files = [*sorted((ROOT / "runtime").glob("*.py")), *sorted((ROOT / "kernels").glob("*.py"))]
    bad = [b for m in files for b in tensors_made_on_a_device(m)]
    assert bad == [], bad


@pytest.mark.parametrize("mode,extra", [("autoregressive", {}), ("retrieval", {}), ("triforce", {}),
                                        ("draft", {"draft": "self"}),
                                        ("triforce", {"draft": "self", "offload": "on", "transfer_chunk": 16})])
def test_decoding_makes_no_tensor_on_a_device_from_host_values(monkeypatch, mode, extra):
    """Every mode (prefill ids, drafts, one-hot q, verdicts): no torch.tensor(..., device=)."""
    made, real = [], torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **kw: made.append(kw.get("device")) or real(*a, **kw))
    toks, _, _ = decode_reads(mode, **extra)
    assert len(toks) == 40 and made and all(d is None for d in made)


class Copies(TorchDispatchMode):
    """Logs (source device, target device, non_blocking) of every copy between devices."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and "device" in kwargs:
            self.log.append((args[0].device.type, torch.device(kwargs["device"]).type,
                             kwargs.get("non_blocking", False)))
        return func(*args, **kwargs)


def test_to_device_builds_on_the_cpu_and_copies_from_page_locked_memory_elsewhere(monkeypatch):
    """On the CPU: torch.tensor's own result (int64). Elsewhere (the meta device stands in
    for CUDA here): built by `staged` (page-locked on CUDA), then one non-blocking copy."""
    for v in ([[5, 1, 2]], [7], []):
        t = to_device(v, "cpu")
        assert t.dtype == torch.long and t.device.type == "cpu" and t.tolist() == v
    staged = []
    monkeypatch.setattr(hostread, "staged", lambda v, dtype: staged.append(v) or torch.tensor(v, dtype=dtype))
    with Copies() as c:
        t = to_device([[5, 1, 2]], torch.device("meta"))
        assert to_device([3], "cpu").tolist() == [3]  # the CPU never stages
    assert t.device.type == "meta" and t.shape == (1, 3) and t.dtype == torch.long
    assert staged == [[[5, 1, 2]]] and c.log == [("cpu", "meta", True)]


def test_staged_asks_for_page_locked_memory(monkeypatch):
    asked, real = [], torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **kw: asked.append(kw) or real(*a, **{**kw, "pin_memory": False}))
    assert hostread.staged([1, 2], torch.long).tolist() == [1, 2]
    assert asked == [{"dtype": torch.long, "pin_memory": True}]


def scan(seq, g, max_n=3, min_n=2):
    """The n-gram lookup as it was (a numpy scan of the whole sequence per draft)."""
    a = np.asarray(seq, dtype=np.int64)
    L = len(a)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        hit = np.ones(L - n, dtype=bool)
        for j in range(n):
            hit &= a[j: L - n + j] == a[L - n + j]
        idx = np.flatnonzero(hit)
        if idx.size:
            s = int(idx[-1]) + n
            return a[s: s + g].tolist()
    return []


@pytest.mark.parametrize("min_n,max_n", [(2, 3), (1, 4)])
def test_incremental_ngram_index_drafts_as_the_scan(min_n, max_n):
    """Random appends, drafts and engine-style rollbacks (truncate, append, roll back):
    every proposal equals the full scan's (the most recent match: one candidate)."""
    rng = random.Random(min_n)
    dr = NgramDrafter(6, max_n=max_n, min_n=min_n, candidates=1)
    seq = [rng.randrange(6) for _ in range(50)]
    for _ in range(400):
        m = len(seq)
        want = scan(seq, 4, max_n, min_n)
        seq += dr.lookup(seq, 4)
        assert seq[m:] == want
        seq += [rng.randrange(6) for _ in range(rng.randrange(3))]  # levels above add tokens
        k = rng.randrange(m - 5, len(seq) + 1)  # accepted prefix, maybe below the draft
        del seq[k:]
        seq.append(rng.randrange(6))
        dr.rollback(k)
    assert dr.index.toks == seq[:len(dr.index.toks)]


def test_ngram_lookup_on_a_new_list_reindexes():
    dr = NgramDrafter(10, max_n=3)
    assert dr.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 3) == [7, 8, 5]
    assert dr.lookup([4, 5, 6, 4, 5], 4) == [6, 4, 5]  # another list: not the old tokens
    seq = [4, 5, 6, 4, 5, 7, 4, 5]
    assert dr.lookup(seq, 2) == [7, 4]  # extends the same prefix
    del seq[5:]
    assert dr.lookup(seq, 2) == [6, 4]  # truncated without a rollback
