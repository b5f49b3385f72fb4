"""Capture once (runtime/graphs.py: Kept) and the device memory checks, on the CPU.

Graphs: `TRIFORCE_OFFLOAD_STATIC=1` runs the fixed-shape path on CPU tensors and the
steps take their capture path through a fake graph (`AddressGraph`): its capture runs the
forward once and records the storage of every tensor the forward reads or writes that it
did not make itself; each replay runs the forward again and fails if that storage is not
the same (a CUDA graph replays the addresses it captured: a cache reallocated under a
kept graph would be read stale there). A second request with the same shapes captures
nothing and gives the same tokens.

Memory: device memory is faked (`store.device_available`); nothing is allocated on a
device, the refusals come before any allocation.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers_spec import repetitive_prompt, run, tiny
from triforce_offload.offload import store as S
from triforce_offload.offload.errors import OffloadError
from triforce_offload.runtime import api, graphs
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.model.config import ModelConfig
from triforce_offload.runtime.cache.offloaded import OffloadedCache
from triforce_offload.runtime.cache.prefix import PrefixCache
from triforce_offload.runtime.sampling import SamplingParams

GB = 2 ** 30


class Touched(TorchDispatchMode):
    """Storage of the tensors ops read or write that no earlier op of this forward made."""

    def __init__(self):
        super().__init__()
        self.outer, self.made = set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in [*args, *(kwargs or {}).values()]:
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() not in self.made:
                self.outer.add(a.untyped_storage().data_ptr())
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                self.made.add(o.untyped_storage().data_ptr())
        return out


class AddressGraph:
    """A 'CUDA graph' on the CPU: replays run the forward again over the captured storage."""

    captures = 0

    def __init__(self, run):
        AddressGraph.captures += 1
        self.run = run
        with Touched() as t:
            self.out = run()
        self.outer = t.outer

    def replay(self):
        with Touched() as t:
            out = self.run()
        assert t.outer == self.outer, "a replay would read or write other memory than its capture"
        self.out.copy_(out)


@pytest.fixture
def on_a_card(monkeypatch):
    """Steps over static caches capture and replay (AddressGraph), as on CUDA."""
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    init = graphs.Step.__init__

    def graphed(self, model, cache, graphs_on=True, compile=False):
        init(self, model, cache, graphs_on, compile)
        self.graphed = self.static = bool(graphs_on and cache.static)

    def capture(self, device, ids, run):
        graphs.settle(run, False)  # the warm-up, as _capture_on runs it
        g = AddressGraph(run)
        return graphs._Graph(g, ids, g.out)
    monkeypatch.setattr(graphs.Step, "__init__", graphed)
    monkeypatch.setattr(graphs.Step, "_capture_on", capture)
    AddressGraph.captures = 0
    return AddressGraph


def request(L, prompt, mode, n=24, **extra):
    toks, st = run(L, prompt, mode, n, **extra)
    return toks, st.extra.get("graph_captures", 0), st.extra["graphs"]


# the level bypass decides by measured seconds: a later run may try a level configuration,
# and so a width, the first did not (captured once then, per model): off here
MODES = [("autoregressive", {}), ("triforce", {"budget": 64, "gamma2": 3, "bypass": False}),
         ("retrieval", {"budget": 64, "gamma2": 3, "bypass": False}),
         ("triforce", {"gamma2": 4, "bypass": False})]


@pytest.mark.parametrize("mode,extra", MODES)
def test_second_request_captures_nothing(on_a_card, mode, extra):
    """Request 1 captures its widths; request 2 (same prompt) and request 3 (another prompt
    of another length, same capacity class) replay them: no capture, the tokens of a run
    without graphs."""
    L = tiny(scale=3.0, seed=1)
    p1, p2 = repetitive_prompt(300, 64, seed=3), repetitive_prompt(290, 64, seed=5)
    ref1, _ = run(L, p1, "autoregressive", 24, graphs=False)
    ref2, _ = run(L, p2, "autoregressive", 24, graphs=False)
    first, n1, replayed = request(L, p1, mode, **extra)
    assert first == ref1 and n1 >= 1 and replayed and on_a_card.captures == n1
    again, n2, replayed = request(L, p1, mode, **extra)
    assert again == first and n2 == 0 and replayed and on_a_card.captures == n1
    other, n3, _ = request(L, p2, mode, **extra)
    if mode == "autoregressive":  # speculative widths depend on the text (gamma2, bypass)
        assert n3 == 0
    assert other == ref2 and on_a_card.captures == n1 + n3


def test_kept_caches_are_reset_in_place_not_reallocated(on_a_card):
    """The kept full cache, its Recorder and the retrieval cache are the same objects over
    the same storage in the next request; a reset that reallocated would fail the replay."""
    L = tiny(scale=3.0, seed=1)
    p = repetitive_prompt(300, 64, seed=3)
    request(L, p, "triforce", budget=64, gamma2=3, bypass=False)
    k = graphs.kept(L.model)
    full, rec, ret = k.full, k.recorder, k.retrieval
    ptrs = [t.data_ptr() for t in full.k + ret.k]
    request(L, p, "triforce", budget=64, gamma2=3, bypass=False)
    assert (k.full, k.recorder, k.retrieval) == (full, rec, ret)
    assert [t.data_ptr() for t in full.k + ret.k] == ptrs and not full.leased


def test_a_reallocating_reset_is_caught(on_a_card, monkeypatch):
    """The fake graph's check fires: a kept cache whose buffers are new after the reset."""
    L = tiny(scale=3.0, seed=1)
    p = repetitive_prompt(300, 64, seed=3)
    request(L, p, "autoregressive")

    def realloc(self):
        self.k = [torch.zeros_like(t) for t in self.k]
        self.v = [torch.zeros_like(t) for t in self.v]
        self.length = 0
    monkeypatch.setattr(FullCache, "reset", realloc)
    with pytest.raises(AssertionError, match="other memory than its capture"):
        request(L, p, "autoregressive")


def test_another_capacity_class_drops_the_kept_set(on_a_card):
    """One set of caches per model: a run needing a larger capacity drops the kept one (and
    its graphs) before allocating, and captures; the next run of that class does not."""
    L = tiny(scale=3.0, seed=1)
    p = repetitive_prompt(300, 64, seed=3)
    request(L, p, "autoregressive")
    small = graphs.kept(L.model).full
    long = repetitive_prompt(1200, 64, seed=3)
    _, n, _ = request(L, long, "autoregressive")
    k = graphs.kept(L.model)
    assert n >= 1 and k.full is not small and k.full.capacity == 2 * graphs.ROOM
    assert all(s.cache is k.full for s in k.steps.values())
    assert request(L, long, "autoregressive")[1] == 0


def test_serving_with_a_prefix_store_captures_once(on_a_card):
    """serve keeps finished requests' KV (PrefixCache): an unrelated request reuses the kept
    graphed cache, whose KV moves out to a copy the store keeps; a later request sharing
    the first one's prefix still reuses that KV and gives the cold start's tokens."""
    L = tiny(scale=3.0, seed=1)
    L.prefix = PrefixCache(1 << 30)
    doc, qa, qb = repetitive_prompt(300, 64, seed=3), [1, 2, 3, 4, 5], [9, 8, 7]
    other = repetitive_prompt(280, 64, seed=7)
    o = dict(budget=64, gamma2=3, ignore_eos=True, bypass=False)
    a, n1, _ = request(L, doc + qa, "triforce", **o)
    kept_full = graphs.kept(L.model).full
    b, n2, _ = request(L, other, "triforce", **o)
    assert n1 >= 1 and n2 == 0 and graphs.kept(L.model).full is kept_full
    assert all(e.cache is not kept_full for e in L.prefix.entries[:-1])  # moved out
    toks, st = run(L, doc + qb, "triforce", 24, **o)
    assert st.extra["reused_tokens"] == 300
    L.prefix = None
    assert toks == run(L, doc + qb, "triforce", 24, **o)[0]
    assert a == run(L, doc + qa, "triforce", 24, **o)[0]


# --- memory checks ------------------------------------------------------------------------

LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, n_layers=32,
                        n_heads=32, n_kv_heads=8, max_position_embeddings=131072)


class Card:
    """A Loaded on a 'cuda' device: an 8B model's geometry, nothing allocated on a device."""
    cfg, dtype, kv_dtype, device, prefix = LLAMA3_8B, torch.bfloat16, torch.bfloat16, torch.device("cuda"), None
    model = torch.nn.Linear(1, 1)
    activations, activations_asked = "", "auto"  # dense: no quantized linears


class Passed(Exception):
    """The memory check passed (what follows would allocate on the device)."""


def free_on_card(monkeypatch, nbytes: float):
    monkeypatch.setattr(S, "device_available", lambda d: None if torch.device(d).type == "cpu" else int(nbytes))


@pytest.fixture
def card(monkeypatch):
    """A 24 GB card holding the 8B's bf16 weights (16 GB) and the CUDA context: 6.5 GB free.
    Caches stop right after their memory check."""
    free_on_card(monkeypatch, 6.5 * GB)
    monkeypatch.setattr(S, "host_available", lambda: 512 * GB)
    check = OffloadedCache._check

    def check_only(self, *a):
        check(self, *a)
        raise Passed
    monkeypatch.setattr(OffloadedCache, "_check", check_only)
    monkeypatch.setattr(FullCache, "__init__", lambda self, *a, **k: (_ for _ in ()).throw(Passed()))
    return Card


def generate(loaded, n: int, mode: str, **extra):
    opts = api.RunOptions.of(mode=mode, max_new_tokens=64, sampling=SamplingParams(), **extra)
    return api.generate(loaded, list(range(n)), opts)


def test_resident_kv_that_cannot_fit_is_refused_in_one_line(card):
    """--offload off at 120K: 14.8 GB of KV on 6.5 GB free is one line naming the flags, not
    a CUDA out-of-memory error half-way through."""
    with pytest.raises(OffloadError) as e:
        generate(card, 120000, "autoregressive", offload="off")
    msg = str(e.value)
    assert "\n" not in msg and "the KV cache (14.8 GB)" in msg and "--offload on" in msg
    with pytest.raises(Passed):  # 20K tokens: 2.5 GB
        generate(card, 20000, "autoregressive", offload="off")


def test_resident_check_counts_the_retrieval_cache(monkeypatch, card):
    """A resident KV that fits, beside a retrieval cache (1/8 of the prompt) that does not."""
    kv = 20480 * LLAMA3_8B.kv_bytes_per_token(2)  # 20K tokens + 128, in a class of 1024
    free_on_card(monkeypatch, (kv + 0.2 * GB) / 0.9)  # the retrieval cache: 0.375 GB
    with pytest.raises(Passed):
        generate(card, 20000, "autoregressive", offload="off")
    with pytest.raises(OffloadError, match=r"retrieval cache \(0.4 GB\).*--offload on, or lower --budget"):
        generate(card, 20000, "triforce", offload="off")


def test_offloaded_check_counts_the_retrieval_cache(card):
    """Offloaded at 120K with 6 layers on chip: their KV, staging and the prefill fit the
    card's 6.5 GB; with the retrieval cache of 1/8 of the prompt (1.9 GB) they do not:
    refused before the prefill, in one line."""
    with pytest.raises(Passed):
        generate(card, 120000, "autoregressive", offload="on", transfer_chunk=4096, on_chip=6)
    with pytest.raises(OffloadError) as e:
        generate(card, 120000, "triforce", offload="on", transfer_chunk=4096, on_chip=6)
    msg = str(e.value)
    assert "\n" not in msg and "retrieval cache (1.9 GB)" in msg


def test_rebuild_block_counts_when_it_is_the_larger_peak():
    """A rebuild holds one layer's whole prefix on the device (device_keys) and the
    selection; counted in place of the prefill where it is larger (a short prefill chunk)."""
    from triforce_offload.runtime.cache.offloaded import layer_bytes, rebuild_device_bytes
    r = rebuild_device_bytes(LLAMA3_8B, 131072, 16384, torch.bfloat16, offloaded=True)
    assert r == layer_bytes(LLAMA3_8B, 131072, torch.bfloat16) + 2 * layer_bytes(LLAMA3_8B, 16384, torch.bfloat16)
    assert rebuild_device_bytes(LLAMA3_8B, 131072, 0, torch.bfloat16, True) == 0


def test_auto_offload_counts_the_retrieval_cache(monkeypatch):
    """auto keeps the KV resident only when the retrieval cache fits beside it."""
    from triforce_offload.runtime.cache.offloaded import use_offload
    o = api.RunOptions.of().offload
    need = 10000 * LLAMA3_8B.kv_bytes_per_token(2)
    free_on_card(monkeypatch, need / 0.8 + 1)
    assert not use_offload(o, LLAMA3_8B, 10000, torch.bfloat16, "cuda")
    assert use_offload(o, LLAMA3_8B, 10000, torch.bfloat16, "cuda", above=GB // 4)
