"""Offload timing by events (issue 14 items 5-6): copy spans, copy_s and overlap from the
timeline's clock events resolved lazily (the same code on the CPU, with perf_counter events,
as on CUDA, with torch.cuda.Event pairs), the prefetch that runs while the draft levels do
shown in the verification's trace, and the CUDA event path itself (marked `cuda`); offloaded
tokens against resident ones in every mode (on the CPU, and marked `cuda` on a GPU)."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from triforce_offload.offload.timeline import Clock, HostEvent, Span, Timeline, cuda_clock
from triforce_offload.offload.tune import link_gbps
from triforce_offload.runtime import api
from triforce_offload.runtime.model.config import ModelConfig
from triforce_offload.runtime.model.transformer import Transformer
from triforce_offload.runtime.cache.offloaded import OffloadedCache
from triforce_offload.runtime.sampling import SamplingParams

CFG = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, n_layers=4, n_heads=6,
                  n_kv_heads=2, max_position_embeddings=256)
CAP = 128
NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda(test):
    """A GPU test: marked `cuda` (what `pytest -m cuda` selects: gpu_session.py stage a),
    and skipped where no GPU is."""
    return pytest.mark.cuda(NO_GPU(test))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(CFG).eval()


class LateEvent(HostEvent):
    """A GPU-like event on the CPU: its time is taken at record, but it only reports done
    once synchronised (as if the device lagged), and `elapsed_time` refuses events that were
    not synchronised (cudaErrorNotReady). Counts synchronisations."""

    syncs = 0

    def __init__(self):
        super().__init__()
        self.landed = False

    def query(self):
        return self.landed

    def synchronize(self):
        LateEvent.syncs += 1
        self.landed = True

    def elapsed_time(self, end):
        if not (self.landed and end.landed):
            raise RuntimeError("elapsed_time on an event that has not completed")
        return super().elapsed_time(end)


@torch.inference_mode()
def verifications(model, cache, n: int, tokens: int = 5):
    """Prefill 60 tokens (one forward) on an empty cache, then `n` verification forwards of
    `tokens` tokens, each after a commit and the next forward's prefetch (as the engine
    issues them) and 2 ms of 'drafting'."""
    ids = torch.randint(0, CFG.vocab_size, (1, CAP), generator=torch.Generator().manual_seed(2))
    if cache.length == 0:
        model(ids[:, :60], 0, cache)
        cache.commit(60)
        cache.prefetch()
    pos = cache.length
    for _ in range(n):
        time.sleep(0.002)  # the draft levels: the link streams the prefetch meanwhile
        model(ids[:, pos:pos + tokens], pos, cache)
        pos += tokens - 1  # one token rejected
        cache.commit(pos)
        cache.prefetch()


def check_forward(s: dict):
    assert s["copy_s"] > 0 and s["wall_s"] > 0
    assert 0.0 <= s["overlap"] <= 1.0
    assert 0.0 <= s["wait_s"] <= s["wall_s"] and s["compute_s"] == pytest.approx(s["wall_s"] - s["wait_s"])


def test_copy_spans_copy_s_and_overlap(model, tmp_path):
    """An offloaded forward has copy spans, copy_s > 0 and 0 <= overlap <= 1; its Chrome
    trace has a copy track, compute spans, and the forward (spans: --profile)."""
    cache = OffloadedCache(CFG, CAP, transfer_chunk=8, on_chip=1, profile=True)
    verifications(model, cache, 3)
    fw = cache.forwards
    assert [f["tokens"] for f in fw[-3:]] == [5, 5, 5]
    for s in fw[-3:]:
        check_forward(s)
    st = cache.stats()
    assert 0.0 <= st["overlap"] <= 1.0
    ev = cache.trace["traceEvents"]
    threads = {e["args"]["name"]: e["tid"] for e in ev if e["ph"] == "M"}
    copies = [e for e in ev if e["ph"] == "X" and e.get("cat") in ("copy", "prefetch")]
    assert copies and all(e["tid"] in (threads["copy"], threads["prefetch"]) for e in copies)
    assert all(e["dur"] >= 0 for e in ev if e["ph"] == "X")
    assert any(e["cat"] == "compute" and e["name"] == "attention L3" for e in ev if e["ph"] == "X")
    assert [e["name"] for e in ev if e.get("cat") == "forward"] == ["forward (5 tokens)"]
    json.dumps(cache.trace)  # serialisable as written by --profile
    cache.close()


def test_resolution_is_lazy_and_never_waits_in_the_decode_path(model):
    """With events that land only when synchronised (a lagging device), forwards record
    spans without a single synchronisation; at most PENDING forwards stay unresolved (the
    oldest are then long done on a real device); reading `forwards` resolves the rest,
    through the same clock arithmetic as CUDA (reference event + elapsed_time)."""
    cache = OffloadedCache(CFG, CAP, transfer_chunk=8, on_chip=1)
    cache.timeline.clock = Clock(LateEvent)
    LateEvent.syncs = 0
    k = cache.PENDING
    verifications(model, cache, k - 1)  # prefill + k-1 verifications: k forwards
    assert LateEvent.syncs == 0 and len(cache._pending) == k and cache._forwards == []
    verifications(model, cache, 2)  # past the bound: the oldest are resolved, in order
    assert len(cache._pending) == k and LateEvent.syncs > 0
    fw = cache.forwards
    assert cache._pending == [] and len(fw) == k + 2
    for s in fw[-2:]:
        check_forward(s)
    walls = [s["wall_s"] for s in fw]
    assert all(w > 0 for w in walls)
    cache.close()


class GpuEvent:
    """An event stamped on another clock (a GPU timer with its own origin) whose
    elapsed_time comes back in float32 milliseconds, as cudaEventElapsedTime's does."""

    now = 0.0  # the fake device's clock, seconds

    def __init__(self):
        self.t = None

    def record(self, stream=None):
        self.t = GpuEvent.now

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return float(np.float32((end.t - self.t) * 1e3))


def test_clock_resolves_device_events_to_host_seconds():
    """Device times map to host seconds through the reference event; after a forward is
    settled later ones are measured from its start (rebase), so float32 milliseconds stay
    exact to the microsecond an hour into a run. A wait span ends at max(issued, copy end)."""
    GpuEvent.now = 5000.0
    clock = Clock(GpuEvent)
    host0 = clock.ref_s

    def ev(t):
        GpuEvent.now = t
        return clock.event()

    a, b = ev(5000.25), ev(5000.75)
    assert clock.seconds(a) == pytest.approx(host0 + 0.25, abs=1e-6)
    tl = Timeline(clock=clock)
    hour = 5000.0 + 3600
    t0, c0, c1, w, t1 = ev(hour), ev(hour + 1e-4), ev(hour + 4e-4), ev(hour + 2e-4), ev(hour + 1e-3)
    tl.span("copy", "c", c0, c1)
    tl.span("wait", "w", w, None, until=c1)  # compute stalled from 0.2 ms to the copy's end
    tl.span("wait", "w2", ev(hour + 9e-4), None, until=c1)  # copy long landed: no stall
    s, spans = tl.settle(tl.take(t0, t1, 3))
    assert s["wall_s"] == pytest.approx(1e-3, abs=3e-4)  # float32 ms an hour on: 0.25 ms grain
    assert s["copy_s"] == pytest.approx(3e-4, abs=3e-4) and s["wait_s"] == pytest.approx(2e-4, abs=3e-4)
    # from now on, measured from that forward's start: microsecond-exact
    u0, u1, u2 = ev(hour + 0.5), ev(hour + 0.5 + 7e-6), ev(hour + 0.5 + 1e-3)
    tl.span("copy", "c", u0, u1)
    s2, _ = tl.settle(tl.take(u0, u2, 1))
    assert s2["copy_s"] == pytest.approx(7e-6, abs=1e-7) and s2["wall_s"] == pytest.approx(1e-3, abs=1e-7)


def test_span_records_events_and_wait_until():
    tl = Timeline()
    with Span(tl, "compute", "x", layer=1):
        time.sleep(0.001)
    end = tl.event()
    with Span(tl, "wait", "w", until=end):  # the awaited event is already past: no stall
        pass
    (_, _, a, b, args), (_, _, wa, wb, _) = tl.resolve()
    assert b - a >= 0.001 and args == {"layer": 1} and wb == wa
    with Span(None, "compute", "nothing"):  # no timeline: records nothing
        pass


@pytest.mark.parametrize("depth", [2, 4])
def test_triforce_offload_trace_shows_prefetch(tiny_model_dir, tmp_path, depth):
    """A triforce+offload run: the verification's --profile trace holds copies that started
    before the forward's first compute span (the commit's/engine's prefetch, streamed while
    the draft levels ran), on the `prefetch` thread; the forward's own copies on `copy`.
    Every level runs (no bypass: a tiny model's retrieval level, which could pay little, is
    not scored in 12 tokens, and without drafting levels the prefetch has no head start)."""
    loaded = api.load(str(tiny_model_dir), "float32", "cpu")
    prompt = torch.randint(5, 1000, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    trace = tmp_path / "trace.json"
    opts = api.RunOptions.of(mode="triforce", max_new_tokens=12, prefill_chunk=128, ignore_eos=True,
                          sampling=SamplingParams(),
                          **{"offload": "on", "transfer_chunk": 16, "stage_depth": depth,
                                 "profile": str(trace), "budget": 64, "bypass": False})
    toks, st = api.generate(loaded, prompt, opts)
    assert len(toks) >= 12 and st.extra["offload"] and 0.0 <= st.extra["overlap"] <= 1.0
    ev = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    (fw,) = [e for e in ev if e["cat"] == "forward"]
    first = min(e["ts"] for e in ev if e["cat"] == "compute")
    assert first >= fw["ts"]
    pre = [e for e in ev if e["cat"] == "prefetch"]
    assert pre and all(e["ts"] < fw["ts"] <= first and e["args"]["prefetch"] for e in pre)
    assert len(pre) <= depth  # the ring's slots: what can stream ahead of the forward
    assert any(e["cat"] == "copy" and e["ts"] >= fw["ts"] for e in ev)  # the rest streams in it


def test_link_gbps_on_cpu():
    assert link_gbps("cpu", mib=16, repeats=1) > 0


@cuda
def test_cuda_copy_spans_from_events(model):
    """On a GPU: copy spans come from event pairs on the copy stream (copy_s > 0), the
    overlap is in [0, 1], the trace has the copy track, and the forward never synchronised
    (the pending forward is resolved only when read)."""
    dev = torch.device("cuda")
    m = Transformer(CFG).eval().to(dev)
    m.load_state_dict(model.state_dict())
    cache = OffloadedCache(CFG, CAP, device=dev, transfer_chunk=8, on_chip=1)
    assert isinstance(cache.timeline.clock.ref, torch.cuda.Event)
    with torch.inference_mode():
        ids = torch.randint(0, CFG.vocab_size, (1, 70), device=dev)
        m(ids[:, :60], 0, cache)
        cache.commit(60)
        m(ids[:, 60:65], 60, cache)
    spans = cache._pending[-1].spans if cache._pending else []
    assert all(isinstance(a, torch.cuda.Event) for _, _, a, _, _, _ in spans)
    s = cache.forwards[-1]
    check_forward(s)
    ev = cache.trace["traceEvents"]
    assert any(e.get("cat") in ("copy", "prefetch") for e in ev)
    cache.close()


@cuda
def test_cuda_clock_matches_host_clock():
    """A CUDA event pair around a 50 ms sleep kernel resolves to ~50 ms of host time."""
    clock = cuda_clock("cuda")
    a = clock.event()
    torch.cuda._sleep(int(50e6))  # ~50 ms of spinning at ~1 GHz (order of magnitude)
    b = clock.event()
    t_host = time.perf_counter()
    sa, sb = clock.seconds(a), clock.seconds(b)
    assert sb > sa and sa <= t_host + 1e-3
    assert abs((sb - sa) * 1e3 - a.elapsed_time(b)) < 1e-2


@cuda
def test_cuda_link_gbps():
    assert link_gbps("cuda", mib=64, repeats=1) > 1.0


ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def pipeline_bench(tmp_path, *args):
    import subprocess
    import sys
    out = tmp_path / "op.jsonl"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "offload_pipeline.py"), "--geometry", "smollm2",
           "--layers", "2", "--contexts", "256,512", "--repeats", "1", "--link-mib", "16",
           "--out", str(out), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, [json.loads(x) for x in out.read_text().splitlines()]


def check_rows(rows, device: str):
    assert [r["context"] for r in rows] == [256, 512]
    for r in rows:
        assert r["device"].startswith(device) and r["link_gbps"] > 0
        # SmolLM2 geometry, 2 layers: K and V of 3 heads x 64 per token and layer
        elem = 4 if r["dtype"] == "float32" else 2
        assert r["kv_gb"] == pytest.approx(r["context"] * 2 * 2 * 3 * 64 * elem / 1e9)
        assert r["floor_ms"] == pytest.approx(1e3 * r["kv_gb"] / r["link_gbps"])
        for k in ("verify", "decode"):
            assert r[f"{k}_ms"] > 0
            assert r[f"{k}_x_floor"] == pytest.approx(r[f"{k}_ms"] / r["floor_ms"])
        assert r["verify_copy_ms"] > 0 and 0.0 <= r["verify_overlap"] <= 1.0
        # host microseconds per streamed chunk: a pass of 2 layers' prefix in 64-token chunks
        assert r["host_us_per_chunk"] > 0 and r["chunks_per_pass"] == 2 * (r["context"] // 64)


def test_offload_pipeline_bench_on_cpu(tmp_path):
    """benchmarks/offload_pipeline.py on the CPU: per context the KV bytes, the link GB/s
    measured in the run, verify and decode ms and their ratio to the link floor, the
    forward's copy time and overlap from its timeline; the serial reference columns."""
    stdout, rows = pipeline_bench(tmp_path, "--chunk", "64")
    check_rows(rows, "cpu")
    assert all(r["serialized_ms"] > 0 and r["compute_ms"] > 0 for r in rows)
    assert "x floor" in stdout and "link" in stdout and "serial ms" in stdout
    assert "host us/chunk" in stdout


def test_per_chunk_spans_only_under_profile(model):
    """Without --profile a forward records no per-chunk span (copier and scheduler have no
    timeline), yet its summary has copy_s, wait_s and overlap from the copier's and the
    scheduler's sums; with it, copies are spans."""
    plain = OffloadedCache(CFG, CAP, transfer_chunk=8, on_chip=1)
    spans = []
    plain.timeline.span = lambda *a, **kw: spans.append(a)  # any span recorded
    verifications(model, plain, 3)
    assert spans == [] and plain.copier.timeline is None and plain.sched.timeline is None
    for s in plain.forwards[-3:]:
        check_forward(s)
    assert 0.0 <= plain.stats()["overlap"] <= 1.0 and plain.trace["traceEvents"]
    plain.close()
    prof = OffloadedCache(CFG, CAP, transfer_chunk=8, on_chip=1, profile=True)
    verifications(model, prof, 1)
    assert any(e.get("cat") == "copy" for e in prof.trace["traceEvents"])
    prof.close()


def test_run_records_spans_only_with_profile(tiny_model_dir, tmp_path):
    """`--profile` turns the per-chunk timeline on; a plain offloaded run keeps it off."""
    from triforce_offload.runtime.cache import offloaded
    made = []
    orig = offloaded.OffloadedCache.__init__

    def init(self, *a, **kw):
        orig(self, *a, **kw)
        made.append(self.spans is not None)
    offloaded.OffloadedCache.__init__ = init
    try:
        L = api.load(str(tiny_model_dir), "fp32", "cpu")
        for prof in (None, str(tmp_path / "t.json")):
            api.generate(L, list(range(5, 80)), api.RunOptions.of(max_new_tokens=4, mode="autoregressive",
                         **{"offload": "on", "transfer_chunk": 16, "profile": prof}))
    finally:
        offloaded.OffloadedCache.__init__ = orig
    assert made == [False, True]


def test_offload_pipeline_prefill_streams_nothing_but_the_prefetch(tmp_path):
    """--prefill: an offloaded prefill through api.generate; host->device bytes are at most
    the prefetch after it (2 transfer chunks of one layer), far below one pass over the KV."""
    stdout, rows = pipeline_bench(tmp_path, "--chunk", "64", "--no-compare", "--prefill")
    for r in rows:
        assert r["prefill_tokens"] == r["context"] - 1 and r["prefill_s"] > 0
        assert r["prefill_tok_per_s"] == pytest.approx(r["prefill_tokens"] / r["prefill_s"])
        chunk_gb = 64 * 2 * 3 * 64 * 4 / 1e9  # K+V of 64 tokens of one layer, fp32
        assert 0 < r["prefill_streamed_gb"] <= 2 * chunk_gb + 1e-12 < r["kv_gb"]
    assert "# prefill of 255 tokens" in stdout


@cuda
def test_offload_pipeline_bench_on_cuda(tmp_path):
    stdout, rows = pipeline_bench(tmp_path, "--device", "cuda", "--no-compare")
    check_rows(rows, "cuda")
    assert "serialized_ms" not in rows[0]


@cuda
def test_tune_rows_overlap_on_cuda():
    """`tune` on a GPU: synchronised latencies and a non-zero overlap from CUDA events
    (it printed 0.00 for every chunk size when copies had no span)."""
    from triforce_offload.bench.offload_timing import tune_rows
    dev = torch.device("cuda")
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, n_layers=4, n_heads=6,
                      n_kv_heads=2, max_position_embeddings=8192)
    torch.manual_seed(0)
    m = Transformer(cfg).eval().to(dev)
    loaded = api.Loaded(m, cfg, None, dev, torch.float32)
    rows, best = tune_rows(loaded, 4000, 6, [64, 512], repeats=2)
    assert best in (64, 512) and all(r["link_gbps"] > 0 and r["verify_ms"] > 0 for r in rows)
    assert all(0.0 <= r["overlap"] <= 1.0 for r in rows) and any(r["overlap"] > 0 for r in rows)


def test_gpu_tests_are_selected_by_the_cuda_marker():
    """`pytest -m cuda` (what gpu_session.py a runs) selects this file's GPU tests."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "cuda", "-p", "no:cacheprovider",
                        __file__], capture_output=True, text=True, timeout=300, cwd=ROOT)
    names = {line.split("::")[1].split("[")[0] for line in r.stdout.splitlines() if "::" in line}
    assert names == {"test_cuda_copy_spans_from_events", "test_cuda_clock_matches_host_clock",
                     "test_cuda_link_gbps", "test_offload_pipeline_bench_on_cuda",
                     "test_tune_rows_overlap_on_cuda", "test_offloaded_tokens_equal_resident_eager"}, r.stdout


SPEC_MODES = [("autoregressive", {}), ("retrieval", {"budget": 64}), ("triforce", {"budget": 64}),
              ("draft", {"draft": "self", "draft_sink": 4, "draft_window": 16})]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, NO_GPU])])
@pytest.mark.parametrize("mode,extra", SPEC_MODES)
def test_offloaded_tokens_equal_resident_eager(device, mode, extra):
    """fp32, greedy: the full cache offloaded (every layer streamed in 7-token chunks on the
    copy stream, waited on through events) gives the tokens of the resident cache without
    graphs, in every mode. On a GPU a stream-ordering bug (a read before its copy landed,
    a slot refilled under its reader) would show here as other tokens."""
    from helpers_spec import repetitive_prompt, tiny
    L = tiny(scale=3.0, seed=1)
    dev = torch.device(device)
    L = api.Loaded(L.model.to(dev), L.cfg, L.tokenizer, dev, torch.float32)
    prompt = repetitive_prompt(300, L.cfg.vocab_size, seed=3)

    def run(**kw):
        return api.generate(L, prompt, api.RunOptions.of(mode=mode, max_new_tokens=40, graphs=False,
                                                         sampling=SamplingParams(), **extra, **kw))
    resident, st_r = run()
    offloaded, st = run(offload="on", transfer_chunk=7)
    assert not st_r.extra.get("offload") and st.extra["offload"] and st.extra["streamed_gb"] > 0
    assert len(resident) == 40 and offloaded == resident
