"""Offload engine on the CPU: offloaded / ZeRO-Inference caches against the in-memory one,
copy-before-read ordering, write-back, memory pre-check, tuner profile, timeline."""
from __future__ import annotations

import json
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from triforce_offload.bench.zero_inference import ZeroInferenceCache
from triforce_offload.cli.tune import parse_sizes
from triforce_offload.offload.copier import ChunkCopier, Signal
from triforce_offload.offload.errors import OffloadError
from triforce_offload.offload.store import HostKVStore, StoreSpec
from triforce_offload.offload.timeline import Timeline
from triforce_offload.offload import costmodel as cm
from triforce_offload.offload import tune
from triforce_offload.runtime.api import RunOptions
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.model.config import ModelConfig
from triforce_offload.runtime.errors import TriforceError
from triforce_offload.runtime.generate import autoregressive, prefill
from triforce_offload.runtime.model.transformer import Transformer
from triforce_offload.runtime.cache.offloaded import OffloadedCache, finish_stats, make_full_cache
from triforce_offload.runtime.cache.retrieval import Recorder, RetrievalCache
from triforce_offload.runtime.sampling import SamplingParams

CFG = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, n_layers=4, n_heads=6,
                  n_kv_heads=2, max_position_embeddings=256)
CAP = 96


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(CFG).eval()


@torch.inference_mode()
def script(model, cache):
    """Prefill in odd chunks, decode, two pending verify forwards in a row, partial accept
    (rollback), a rollback below a committed length, decode again. Returns all logits."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (1, 60), generator=g)
    outs = []
    for s, e in ((0, 13), (13, 29), (29, 41)):  # prefill
        outs.append(model(ids[:, s:e], s, cache))
        cache.commit(e)
        cache.prefetch()  # as generate does after a commit
    outs.append(model(ids[:, 41:42], 41, cache))  # decode
    cache.commit(42)
    cache.prefetch()
    outs.append(model(ids[:, 42:46], 42, cache))  # verify 4 pending ...
    outs.append(model(ids[:, 46:49], 46, cache))  # ... and 3 more on top, uncommitted
    cache.commit(44)  # accept 2: positions >= 44 leave no trace
    cache.prefetch()
    outs.append(model(ids[:, 50:55], 44, cache))  # different tokens at 44..48
    cache.commit(49)
    cache.prefetch()  # a pass for 49 ...
    cache.rollback(47)  # roll back committed tokens
    cache.prefetch()  # ... abandoned for 47
    outs.append(model(ids[:, 55:58], 47, cache))
    cache.commit(50)
    return outs


@pytest.fixture(scope="module")
def reference(model):
    return script(model, FullCache(CFG, CAP))


def check_same(outs, ref):
    for a, b in zip(outs, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("chunk", [3, 16, 200])
@pytest.mark.parametrize("on_chip", [0, 2, 4])
def test_offloaded_matches_full_cache(model, reference, chunk, on_chip):
    cache = OffloadedCache(CFG, CAP, on_chip=on_chip, transfer_chunk=chunk)
    check_same(script(model, cache), reference)
    cache.close()


@pytest.mark.parametrize("depth", [1, 3, 40])
def test_serialized_and_small_ring_match(model, reference, depth):
    """overlap=False (copy a group, then compute), rings of 1 and 3 chunks and one of
    more than a layer's chunks."""
    for overlap in (False, True):
        cache = OffloadedCache(CFG, CAP, transfer_chunk=7, depth=depth, overlap=overlap)
        check_same(script(model, cache), reference)
        cache.close()


def test_zero_inference_matches_full_cache(model, reference):
    check_same(script(model, ZeroInferenceCache(CFG, CAP)), reference)


def test_greedy_tokens_identical(model):
    prompt = torch.randint(0, CFG.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    run = lambda c: autoregressive(model, c, prompt, SamplingParams(), 20, set(), prefill_chunk=16)[0]
    want = run(FullCache(CFG, CAP))
    assert run(OffloadedCache(CFG, CAP, transfer_chunk=9, on_chip=1)) == want
    assert run(ZeroInferenceCache(CFG, CAP)) == want


class SlowCopier(ChunkCopier):
    """Every memcpy takes a while, so a read that does not wait would overtake it."""

    def copy(self, dst, src):
        time.sleep(0.002)
        super().copy(dst, src)


def test_attention_never_reads_before_copy_signalled(model, reference):
    cache = OffloadedCache(CFG, CAP, transfer_chunk=6, copier_cls=SlowCopier, log_order=True)
    check_same(script(model, cache), reference)
    order = cache.timeline.order
    reads = [i for i, (kind, _) in enumerate(order) if kind == "read"]
    assert len(reads) > 20
    for i in reads:
        tag = order[i][1]
        assert ("signal", tag) in order[:i], f"chunk {tag} read before its copy was signalled"
    cache.close()


class CountingCopier(ChunkCopier):
    """Logs every fetch and write-back: the tensors it moves and their bytes."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log = []

    def fetch(self, dst, src, tag, after=None):
        self.log.append(("fetch", len(src), sum(t.nbytes for t in src), all(t.is_contiguous() for t in src)))
        return super().fetch(dst, src, tag, after)

    def write_back(self, dst, src, tag):
        self.log.append(("wb", len(src), sum(t.nbytes for t in src), all(t.is_contiguous() for t in src)))
        return super().write_back(dst, src, tag)


def test_k_and_v_of_a_chunk_move_in_one_copy(model):
    """The store interleaves K and V ([S, 2, B, Hkv, D]): a streamed chunk is one contiguous
    copy each way, and a decode step moves exactly the offloaded prefix's K+V bytes."""
    off = OffloadedCache(CFG, CAP, transfer_chunk=8, on_chip=1, copier_cls=CountingCopier)
    ids = torch.randint(0, CFG.vocab_size, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        model(ids[:, :20], 0, off)
        off.commit(20)
        off.copier.log.clear()
        model(ids[:, 20:21], 20, off)  # decode: stream 20 tokens of each offloaded layer
    log, per_token = off.copier.log, off.store.spec.bytes_per_token()
    fetches, wbs = [r for r in log if r[0] == "fetch"], [r for r in log if r[0] == "wb"]
    offloaded = CFG.n_layers - 1
    assert len(fetches) == offloaded * 3  # chunks of 8, 8, 4 tokens
    assert all(n == 1 and contiguous for _, n, _, contiguous in fetches + wbs)
    assert sum(b for _, _, b, _ in fetches) == offloaded * 20 * per_token
    assert len(wbs) == offloaded and all(b == per_token for _, _, b, _ in wbs)
    full = FullCache(CFG, CAP)
    with torch.inference_mode():
        model(ids[:, :21], 0, full)
    for layer in range(1, CFG.n_layers):  # the interleaved halves hold what a full cache holds
        for a, b in zip(off.keys(layer, 21), full.keys(layer, 21)):
            torch.testing.assert_close(a, b)
    off.close()


class CopyLog(TorchDispatchMode):
    """The sources of every device copy (`aten._to_copy`, `aten.to`) dispatched."""

    def __init__(self):
        super().__init__()
        self.sources = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to):
            self.sources.append(args[0])
        return func(*args, **(kwargs or {}))


def test_device_keys_move_an_offloaded_layer_in_one_contiguous_copy(model):
    """The retrieval build's per-layer upload: one copy of the interleaved prefix (K or V
    alone is strided, which torch would stage through unpinned host memory), split on the
    device. The meta device stands in for a GPU: what matters is the copy's source."""
    off = OffloadedCache(CFG, CAP, transfer_chunk=8, on_chip=1)
    with torch.inference_mode():
        model(torch.randint(0, CFG.vocab_size, (1, 20)), 0, off)
        off.commit(20)
        host = off.keys(2)
        off.device = torch.device("meta")
        with CopyLog() as log:
            k, v = off.device_keys(2)
    [src] = log.sources
    assert src.is_contiguous() and src.shape == (20, 2, 1, CFG.n_kv_heads, CFG.head_dim)
    assert src.data_ptr() == off.store.kv[2].data_ptr()
    assert k.device.type == "meta" and k.shape == v.shape == host[0].shape
    off.device = torch.device("cpu")
    off.close()


def test_write_back_persists(model):
    full, off = FullCache(CFG, CAP), OffloadedCache(CFG, CAP, transfer_chunk=8, on_chip=1)
    ids = torch.randint(0, CFG.vocab_size, (1, 30))
    with torch.inference_mode():
        for c in (full, off):
            model(ids[:, :20], 0, c)
            c.commit(20)
            model(ids[:, 20:25], 20, c)
            c.commit(23)
    for layer in range(CFG.n_layers):
        for a, b in zip(off.keys(layer), full.keys(layer)):
            assert a.shape == (1, CFG.n_kv_heads, 23, CFG.head_dim)
            torch.testing.assert_close(a, b)
    assert off.store.k[3].data_ptr() == off.keys(3)[0].data_ptr()  # a host view, not a copy
    off.close()


def test_memory_precheck_refuses_with_numbers():
    big = ModelConfig(vocab_size=10, hidden_size=4096, intermediate_size=8, n_layers=80,
                      n_heads=32, n_kv_heads=8, max_position_embeddings=1 << 30)
    with pytest.raises(OffloadError, match=r"needs [\d.]+ GB of host memory but [\d.]+ GB "
                                           r"is available; lower --max-context"):
        OffloadedCache(big, 1 << 26, dtype=torch.float16)
    with pytest.raises(OffloadError, match="GB"):
        ZeroInferenceCache(big, 1 << 26)


def test_bad_options():
    with pytest.raises(TriforceError, match="--on-chip 9"):
        OffloadedCache(CFG, CAP, on_chip=9)
    with pytest.raises(TriforceError, match="--transfer-chunk 0"):  # the option checks it, once
        RunOptions.of(offload="on", transfer_chunk=0)
    with pytest.raises(TriforceError, match="capacity"):
        with torch.inference_mode():
            Transformer(CFG)(torch.zeros(1, CAP + 1, dtype=torch.long), 0, OffloadedCache(CFG, CAP))


class FakeLoaded:
    cfg, dtype, kv_dtype, device = CFG, torch.float32, torch.float32, torch.device("cpu")


def test_make_full_cache_choices(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIFORCE_OFFLOAD_CACHE", str(tmp_path))
    mk = lambda **kw: make_full_cache(FakeLoaded, CAP, RunOptions.of(**kw))
    assert type(mk()) is FullCache  # auto on a CPU: the device is the host
    assert type(mk(offload="off")) is FullCache
    c = mk(offload="on")  # >= 4 MB per copy, at most the capacity
    assert isinstance(c, OffloadedCache) and c.transfer_chunk == CAP
    tune.save_profile("cpu", [], 96, {})  # a tuned profile is the default chunk ...
    assert mk(offload="on").transfer_chunk == 96
    assert mk(offload="on", transfer_chunk=32).transfer_chunk == 32  # ... and the flag overrides it
    with pytest.raises(TriforceError, match="--offload 'maybe'"):
        mk(offload="maybe")
    with pytest.raises(TriforceError, match="--profile"):
        mk(profile="x.json")


def test_profile_trace_and_overlap_stats(model, tmp_path):
    path = tmp_path / "trace.json"
    opts = RunOptions.of(**{"offload": "on", "transfer_chunk": 8, "profile": str(path)})
    cache = make_full_cache(FakeLoaded, CAP, opts)
    prompt = list(range(1, 50))
    _, st = autoregressive(model, cache, prompt, SamplingParams(), 5, set(), prefill_chunk=64)
    finish_stats(cache, st, opts)
    assert st.extra["offload"] and st.extra["streamed_gb"] > 0
    assert 0.0 <= st.extra.get("overlap", 0.0) <= 1.0
    ev = json.loads(path.read_text())["traceEvents"]
    names = {e["name"] for e in ev}
    assert any(n.startswith("attention L3") for n in names)
    assert any(n.startswith("copy (0,") for n in names)


def test_timeline_overlap_math():
    tl = Timeline()
    tl.span("copy", "c", 0.0, 0.6)
    tl.span("wait", "w", 0.5, 0.6)  # compute waited 0.1 of a 1.0 s forward: compute 0.9
    s = tl.summary(0.0, 1.0)
    assert s["compute_s"] == pytest.approx(0.9) and s["copy_s"] == pytest.approx(0.6)
    assert s["overlap"] == pytest.approx((0.6 + 0.9 - 1.0) / 0.6)
    assert {e["ph"] for e in tl.chrome_trace()["traceEvents"]} == {"X", "M"}


def test_copier_orders_write_back_before_fetch():
    """A fetch submitted after a write-back sees the written data (FIFO copies)."""
    spec = StoreSpec([0], 1, 4, 16)
    store = HostKVStore(spec)
    cp = ChunkCopier("cpu")
    stage = torch.empty(16, 1, 1, 4)
    for i in range(20):
        new = torch.full((16, 1, 1, 4), float(i))
        cp.write_back((store.k[0],), (new,), i)
        cp.fetch((stage,), (store.k[0],), i).wait()
        assert torch.all(stage == i)
    worker = cp.thread
    cp.close()
    assert not worker.is_alive()


def test_tune_helpers(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIFORCE_OFFLOAD_CACHE", str(tmp_path))
    assert parse_sizes("64-512") == [64, 128, 256, 512]
    assert parse_sizes("5,7") == [5, 7]
    with pytest.raises(OffloadError, match="--sizes"):
        parse_sizes("big")
    assert tune.profile_chunk("cpu") is None
    rows = [{"chunk": 64, "verify_ms": 3.0}, {"chunk": 256, "verify_ms": 2.0}]
    p = tune.save_profile("cpu", rows, tune.best_chunk(rows), {"context": 1})
    assert p.parent == tmp_path / "profiles" and tune.profile_chunk("cpu") == 256
    assert tune.link_throughput(64, 1000, 768, "cpu", repeats=1) > 0


def test_min_copy_size_from_the_tuned_link_curve(tmp_path, monkeypatch):
    """A profile tuned on another model (other K+V bytes per token) gives its link curve:
    the smallest copy at 90% of the best GB/s sets the chunk; the same model gets the
    tuned chunk itself; no curve: 4 MiB per copy."""
    monkeypatch.setenv("TRIFORCE_OFFLOAD_CACHE", str(tmp_path))
    assert tune.transfer_chunk_for("cpu", 1024) == 4 * 2 ** 20 // 1024  # K+V bytes of a token
    rows = [{"chunk": c, "copy_bytes": c * 256, "link_gbps": g, "verify_ms": 1.0}
            for c, g in ((64, 2.0), (256, 9.5), (1024, 10.0), (4096, 9.8))]
    tune.save_profile("cpu", rows, 1024, {"bytes_per_token": 512})
    assert tune.min_copy_bytes(tune.load_profile("cpu")) == 256 * 256  # 9.5 >= 0.9 * 10
    assert tune.transfer_chunk_for("cpu", 512) == 1024  # the tuned model: its chunk
    assert tune.transfer_chunk_for("cpu", 1024) == 256 * 256 // 1024  # another: the curve
    assert tune.transfer_chunk_for("cpu", 1024, given=7) == 7
    old = {**tune.load_profile("cpu"), "copies": None}  # saved when K and V were two copies:
    assert tune.min_copy_bytes(old) == 2 * 256 * 256  # its copy_bytes were half of each copy


@pytest.mark.parametrize("overlap", [False, True])
def test_prefill_never_restreams(model, overlap):
    """A multi-chunk prefill streams nothing for a fresh prompt (chunk-major forwards
    would stream the growing prefix on every chunk); a continued prefill streams the
    committed prefix once. Logits and the decode after it equal the resident cache's."""
    ids = torch.randint(0, CFG.vocab_size, (1, 80), generator=torch.Generator().manual_seed(5))
    full = FullCache(CFG, CAP)
    off = OffloadedCache(CFG, CAP, transfer_chunk=5, on_chip=1, overlap=overlap)
    one_pass = lambda n: (CFG.n_layers - 1) * n * off.store.spec.bytes_per_token()
    with torch.inference_mode():
        want = [prefill(model, full, ids[:, :60], prefill_chunk=8), prefill(model, full, ids[:, 60:75], 60, 4)]
        got = [prefill(model, off, ids[:, :60], prefill_chunk=8)]
        off.copier.flush()
        first = off.copier.bytes
        got.append(prefill(model, off, ids[:, 60:75], 60, 4))
        off.copier.flush()
        second = off.copier.bytes - first
        want.append(model(ids[:, 75:76], 75, full))
        got.append(model(ids[:, 75:76], 75, off))
    # with overlap, each prefill ends by starting the next forward's prefetch (at most one pass)
    assert first <= (one_pass(60) if overlap else 0)
    assert second <= one_pass(60) + (one_pass(75) if overlap else 0)
    if not overlap:
        assert second == one_pass(60)  # the committed prefix, once
    assert off.held is None
    check_same(got, want)
    off.close()


class HostSyncs(TorchDispatchMode):
    """Counts device->host scalar reads (`.item()`, `bool(t)`) dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_retrieval_absorbs_verified_kv_without_host_sync(model, monkeypatch):
    """The retrieval cache takes verified tokens' KV from the verification forward's device
    tensors: no wait on a write-back signal, no host scalar read; the KV is the target's."""
    ids = torch.randint(0, CFG.vocab_size, (1, 70), generator=torch.Generator().manual_seed(7))
    off = Recorder(OffloadedCache(CFG, CAP, transfer_chunk=8, on_chip=1))
    with torch.inference_mode():
        prefill(model, off, ids[:, :50], prefill_chunk=16)
        ret = RetrievalCache(CFG, budget=16, retrieval_chunk=4, extra=30)
        ret.build(off, off.q, 50)
        model(ids[:, 50:55], 50, off)  # a verification of 5 tokens; 3 accepted
        off.commit(53)
        waits = []
        monkeypatch.setattr(Signal, "wait", lambda s: waits.append(s))
        monkeypatch.setattr(Signal, "synchronize", lambda s: waits.append(s))
        with HostSyncs() as hs:
            ret.absorb(off, 50, 53)
            ret.commit(53)
        monkeypatch.undo()
        assert waits == [] and hs.n == 0
        model(ids[:, 53:57], 53, off)  # two pending forwards: absorb spans both, from the host
        model(ids[:, 57:60], 57, off)
        off.commit(59)
        ret.absorb(off, 53, 59)
        ret.commit(59)
    for layer in range(CFG.n_layers):
        for got, want in zip((ret.k[layer], ret.v[layer]), off.keys(layer, 59)):
            torch.testing.assert_close(got[:, :, ret._slot(50): ret._slot(59)], want[:, :, 50:59])
    assert ret.length == 59
    off.close()


def test_staging_bytes_equal_the_cost_model():
    """The runtime's staging ring is `costmodel.staging_bytes` (what `plan` and `--plan
    auto` count): depth x transfer chunk of one layer, not whole layers; the default
    transfer chunk moves >= 4 MiB per copy (K or V of one layer's chunk)."""
    cfg = ModelConfig(vocab_size=97, hidden_size=576, intermediate_size=64, n_layers=2, n_heads=9,
                      n_kv_heads=3, max_position_embeddings=1 << 15)  # SmolLM2's attention shape
    m = cm.ModelSpec("smol", cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_size,
                     cfg.intermediate_size, cfg.vocab_size, dtype_bytes=2)
    hw = cm.HARDWARE["rtx4090"]
    for chunk, depth in ((256, 2), (1000, 3)):
        c = OffloadedCache(cfg, 4096, dtype=torch.bfloat16, transfer_chunk=chunk, depth=depth, on_chip=1)
        want = cm.staging_bytes(chunk, m.kv_layer_bytes, depth)
        assert c.sched.nbytes() == want == depth * chunk * c.store.spec.bytes_per_token()
        c.close()
    s = cm.Settings(context=4096, transfer_chunk=256, on_chip=1, draft=None)
    assert cm.memory_use(hw, m, s).parts["staging"] * cm.GIB == cm.staging_bytes(256, m.kv_layer_bytes)
    n = cm.default_transfer_chunk(m.kv_layer_bytes)
    c = OffloadedCache(cfg, n + 8, dtype=torch.bfloat16, on_chip=1)
    per_copy = lambda t: t * c.store.spec.bytes_per_token()  # K and V: one copy
    assert c.transfer_chunk == n and per_copy(n) >= 4 * 2 ** 20 > per_copy(n - 1)
    assert cm.default_transfer_chunk(2 * 32 * 128 * 2) == 256  # Llama2-7B bf16: 4 MiB per copy
    c.close()


class MarkingCopier(ChunkCopier):
    """A CPU copier that hands out numbered compute markers, as the CUDA one records events,
    and checks each fetch: a staging slot that was read is refilled only with a marker
    taken after the reader's compute was issued (else a CUDA copy would overwrite the slot
    before the attention reading it ran)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.clock, self.read_at, self.refills = 0, {}, 0

    def marker(self):
        self.clock += 1
        s = Signal()
        s.event.set()
        s.seq = self.clock
        return s

    def fetch(self, dst, src, tag, after=None):
        ptr = dst[0].data_ptr()
        if ptr in self.read_at:
            assert after is not None and after.seq > self.read_at[ptr], f"slot refilled for {tag} unordered"
            self.refills += 1
        return super().fetch(dst, src, tag, after)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_staging_slot_is_refilled_only_after_its_reader(overlap):
    """Two forwards (with the prefetch between them) over 3 offloaded layers of 5 chunks
    through a 2-slot ring: every refill waits for the compute that read the slot, in the
    overlapped pipeline and in the serialized reference."""
    from triforce_offload.offload.pipeline import TransferPipeline
    spec = StoreSpec([1, 2, 3], 2, 8, 64)
    store = HostKVStore(spec, pin=False)
    copier = MarkingCopier("cpu")
    sched = TransferPipeline(store, copier, 8, "cpu", depth=2, overlap=overlap)
    for _ in range(2):
        for layer in spec.layers:
            for c0, k, v in sched.stream(layer, 40):
                copier.read_at[k.data_ptr()] = copier.clock  # the reader's compute is issued now
        sched.start(40)  # the prefetch of the next forward (after a commit)
    assert copier.refills >= 2 * 3 * 5 - 2
    copier.close()


class FakeCudart:
    """Stands in for torch.cuda.cudart() with exactly the calls it binds (no
    cudaGetLastError: torch does not bind it); logs cudaHostRegister / Unregister."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("reg", ptr, nbytes))
        return 712 if self.fail else 0  # cudaErrorHostMemoryAlreadyRegistered

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unreg", ptr, 0))
        return 0

    def cudaGetErrorString(self, err):
        return f"error {err}"


def _on_a_fake_card(monkeypatch, rt):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)


def test_host_store_is_one_page_aligned_buffer_pinned_once(monkeypatch):
    """Every layer's interleaved K and V is a view into one page-aligned buffer of whole pages, registered with
    one cudaHostRegister at (about) its exact size (torch's pin_memory would round every
    block up to a power of two: up to twice the host memory check_memory counted), and
    unregistered when the store goes, before its memory is freed."""
    import gc
    from triforce_offload.offload.store import PAGE
    rt = FakeCudart()
    _on_a_fake_card(monkeypatch, rt)
    spec = StoreSpec([2, 3], 3, 64, 1000, dtype=torch.bfloat16)  # 384,000 B per tensor
    store = HostKVStore(spec, pin=True)
    tensors = list(store.kv.values())  # one [S, 2, B, Hkv, D] per layer
    assert len(tensors) == 2 and all(store.k[l].data_ptr() == t.data_ptr() for l, t in store.kv.items())
    [(kind, ptr, n)] = rt.calls
    assert kind == "reg" and ptr % PAGE == 0 and n % PAGE == 0 and spec.nbytes() <= n < spec.nbytes() + 4 * PAGE
    assert all(ptr <= t.data_ptr() < ptr + n and t.data_ptr() % PAGE == 0 for t in tensors)
    assert store.nbytes() == spec.nbytes() and store.pinned
    del store, tensors
    gc.collect()
    assert rt.calls[1:] == [("unreg", ptr, 0)]


def test_a_refused_registration_leaves_no_cuda_error_pending(monkeypatch):
    """The driver refuses: the runtime's last error is reset through a call that exists
    (torch's binding has no cudaGetLastError), nothing stays registered, and the store
    falls back to torch's pinned allocator."""
    from triforce_offload.offload import store as S
    rt, cleared, pinned = FakeCudart(fail=True), [], []
    _on_a_fake_card(monkeypatch, rt)
    monkeypatch.setattr(S, "clear_last_error", lambda: cleared.append(1) or True)
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, pin_memory=False, **kw: pinned.append(pin_memory) or zeros(*a, **kw))
    store = HostKVStore(StoreSpec([0, 1], 2, 16, 100), pin=True)
    assert [k for k, _, _ in rt.calls] == ["reg"] and cleared == [1]
    assert pinned == [False] + [True] * 2 and store.pinned  # the flat buffer, then one pinned K+V per layer


MAPS = """\
7f0000000000-7f0000001000 r-xp 00000000 08:01 11 /opt/jax/lib/libcudart.so.12
7f0000002000-7f0000003000 r-xp 00000000 08:01 12 /site/nvidia/cuda_runtime/lib/libcudart.so.12
7f0000004000-7f0000005000 r-xp 00000000 08:01 13 /site/torch/lib/libtorch_cuda_linalg.so
7f0000006000-7f0000007000 r-xp 00000000 08:01 14 /site/torch/lib/libtorch_cuda.so
7f0000008000-7f0000009000 rw-p 00000000 00:00 0 [heap]
"""


class FakeDl:
    """ctypes.CDLL over a fake dynamic linker: libtorch_cuda was linked with the nvidia
    wheel's libcudart (dlsym through its handle finds that one); another package mapped a
    second libcudart, first in sorted order. Logs which copy's last error is cleared."""

    LINKED = {"/site/torch/lib/libtorch_cuda.so": "/site/nvidia/cuda_runtime/lib/libcudart.so.12"}

    def __init__(self):
        self.opened, self.cleared = [], []

    def __call__(self, path, mode=0):
        import os
        self.opened.append((path, mode))
        runtime = self.LINKED.get(path, path if "libcudart" in path else None)
        lib = type("Lib", (), {})()
        if runtime:
            lib.cudaGetLastError = lambda: self.cleared.append(runtime) or 0
        assert mode & os.RTLD_NOLOAD  # never loads a library of its own
        return lib


def test_the_refused_registrations_error_is_cleared_in_torchs_cudart(monkeypatch, tmp_path):
    """With two libcudart copies mapped, the last error is reset in the one torch's own CUDA
    library resolved (dlsym through its handle), not the first path in sorted order."""
    import ctypes
    from triforce_offload.offload import store as S
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    monkeypatch.setattr(S, "MAPS", str(maps))
    dl = FakeDl()
    monkeypatch.setattr(ctypes, "CDLL", dl)
    _on_a_fake_card(monkeypatch, FakeCudart(fail=True))
    assert S._mapped("libtorch_cuda") == ["/site/torch/lib/libtorch_cuda.so"]
    buf = S.page_aligned(S.PAGE)
    assert not S.pin_in_place(buf, buf)
    assert dl.cleared == ["/site/nvidia/cuda_runtime/lib/libcudart.so.12"]
    assert [p for p, _ in dl.opened] == ["/site/torch/lib/libtorch_cuda.so"]


def test_a_cudart_binding_with_get_last_error_is_used_first(monkeypatch):
    from triforce_offload.offload import store as S
    rt = FakeCudart()
    rt.cudaGetLastError = lambda: rt.calls.append(("get", 0, 0)) or 0
    _on_a_fake_card(monkeypatch, rt)
    monkeypatch.setattr(S, "_mapped", lambda name: pytest.fail("looked for libraries"))
    assert S.clear_last_error() and rt.calls == [("get", 0, 0)]


def test_without_torchs_cuda_library_a_launch_consumes_the_error(monkeypatch, tmp_path):
    from triforce_offload.offload import store as S
    maps = tmp_path / "maps"
    maps.write_text("\n".join(line for line in MAPS.splitlines() if "torch" not in line))
    monkeypatch.setattr(S, "MAPS", str(maps))
    _on_a_fake_card(monkeypatch, FakeCudart())
    made = []

    def zeros(*a, device=None, **kw):
        made.append(device)
        raise RuntimeError("CUDA error: part or all of the requested memory range is already mapped")
    monkeypatch.setattr(torch, "zeros", zeros)
    assert not S.clear_last_error() and made == ["cuda"]


def test_mapped_finds_torchs_loaded_libraries():
    from triforce_offload.offload import store as S
    assert [p.rsplit("/", 1)[1] for p in S._mapped("libtorch_cpu")] == ["libtorch_cpu.so"]
    assert S._mapped("libtorch_cp") == []  # a whole name, not a prefix


def test_pinning_without_cuda_takes_the_fallback_with_the_real_binding():
    """The real path, no fakes: without CUDA nothing is registered (there is nothing to
    register with) and the store is plain memory, still one page-aligned buffer."""
    from triforce_offload.offload.store import PAGE, page_aligned, pin_in_place
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: test_cuda_refused_registration_leaves_launches_working")
    store = HostKVStore(StoreSpec([0, 1], 2, 16, 100), pin=True)
    assert not store.pinned and store.k[0].data_ptr() % PAGE == 0
    buf = page_aligned(10_000)
    assert buf.data_ptr() % PAGE == 0 and buf.numel() == 3 * PAGE and not pin_in_place(buf, store)


@pytest.mark.cuda
def test_cuda_refused_registration_leaves_launches_working():
    """On a card: registering the store's buffer a second time is refused (already
    registered); pin_in_place says so and the next kernel launch does not raise it."""
    from triforce_offload.offload import store as S
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    store = HostKVStore(StoreSpec([0, 1], 2, 64, 4096, dtype=torch.float16))
    assert store.pinned and store.k[0].is_pinned()
    buf = S.page_aligned(S._pages(1))
    assert S.pin_in_place(buf, buf) and not S.pin_in_place(buf, buf)  # 712: already registered
    x = torch.ones(8, device="cuda").add_(1)  # would raise the pending error
    torch.cuda.synchronize()
    assert float(x.sum()) == 16.0


def test_retrieval_build_from_an_offloaded_cache_scores_device_copies(model, monkeypatch):
    """The retrieval cache built from an offloaded full cache reads each layer through
    `device_keys` (on a GPU: one contiguous copy per layer, scored there, not on the host)
    and selects exactly what a build from the resident cache selects."""
    ids = torch.randint(0, CFG.vocab_size, (1, 90), generator=torch.Generator().manual_seed(5))
    full, off = Recorder(FullCache(CFG, CAP)), Recorder(OffloadedCache(CFG, CAP, transfer_chunk=7, on_chip=1))
    with torch.inference_mode():
        for c in (full, off):
            prefill(model, c, ids, prefill_chunk=32)
    calls = []
    real = OffloadedCache.device_keys
    monkeypatch.setattr(OffloadedCache, "device_keys",
                        lambda self, layer, end=None: calls.append(layer) or real(self, layer, end))
    a, b = (RetrievalCache(CFG, 32, 8, 16) for _ in range(2))
    a.build(full, full.q, 90)
    b.build(off, off.q, 90)
    assert calls == list(range(CFG.n_layers)) and not a.holds_all
    for layer in range(CFG.n_layers):
        assert torch.equal(a.k[layer], b.k[layer]) and torch.equal(a.v[layer], b.v[layer])
    off.inner.close()


def test_prefill_activations_count_against_device_memory(monkeypatch):
    """A device with room for the on-chip layers, the staging ring and the held layer's KV
    but not for the prefill's own tensors (the prompt's hidden states, every layer's latest
    chunk of K, V, one chunk's layer step) is refused up front with one line naming them."""
    from triforce_offload.offload import store as S
    cfg = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=512, n_layers=4,
                      n_heads=4, n_kv_heads=1, head_dim=64, max_position_embeddings=8192)
    cap, chunk, tpt = 8192, 64, 2 * 1 * 64 * 4  # fp32 K+V bytes of a token in one layer
    kv_stage_held = cm.staging_bytes(chunk, tpt) + cap * tpt  # what the check counted before
    free = []
    monkeypatch.setattr(S, "device_available", lambda d: free[0])
    mk = lambda: OffloadedCache(cfg, cap, transfer_chunk=chunk)  # noqa: E731
    free.append(int(kv_stage_held / 0.9 * 1.05))  # fits the KV, staging and held layer only
    with pytest.raises(OffloadError) as e:
        mk()
    msg = str(e.value)
    assert "\n" not in msg and "prefill" in msg and "--prefill-chunk" in msg
    free[0] = int(kv_stage_held / 0.9 * 20)  # hidden states [T, H]: 3x the held layer here
    mk().close()
