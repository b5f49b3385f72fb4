"""The CUDA path, run dry on the CPU (tests/cuda_dry, docs/gpu.md "The CUDA dry run").

`api.generate` on a fake CUDA device in every mode, resident and offloaded, with and
without graphs, on each fixed-shape attention path, with --on-chip, --profile, kept-prefix
reuse and quantized weights. Each run must be free of: a CPU tensor meeting a CUDA one,
an unordered cross-stream read or reuse, a non_blocking copy of pageable memory, host
syncs / RNG / host allocations / pageable copies inside a capture, and blocking reads in
the decode loop beyond the counted one per verification. The values are real (CPU
arithmetic underneath), so fp32 greedy tokens must equal the CPU's. The planted-bug tests
change one line of the runtime each and show the check that catches it.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys

import pytest
import torch

from cuda_dry import CaptureError, DryRun, plant
from helpers_spec import repetitive_prompt, tiny
from triforce_offload.kernels import triton_attention
from triforce_offload.offload.copier import ChunkCopier, Signal
from triforce_offload.runtime.spec import acceptance
from triforce_offload.runtime.cache import kv as cache
from triforce_offload.runtime import hostread
from triforce_offload.runtime.cache import offloaded
from triforce_offload.runtime import sampling
from triforce_offload.runtime.api import generate
from triforce_offload.runtime.options import RunOptions
from triforce_offload.runtime.cache.prefix import PrefixCache
from triforce_offload.runtime.model.quantized import quantize_model
from triforce_offload.runtime.spec import modes as spec_modes
from triforce_offload.runtime.sampling import SamplingParams

MODES = {"autoregressive": {}, "triforce": {}, "retrieval": {}, "draft-self": dict(mode="draft", draft="self")}
PLACES = {"resident": {}, "offloaded": dict(offload="on", transfer_chunk=7)}
N = 24  # new tokens per run


def opts(mode: str, place: str = "resident", temperature: float = 0.0, **extra) -> RunOptions:
    kw = {"mode": mode, **MODES[mode], **PLACES[place], **extra}
    return RunOptions.of(max_new_tokens=N, budget=64, sampling=SamplingParams(temperature=temperature, seed=0),
                         **kw)


@pytest.fixture(autouse=True)
def explore_freely(monkeypatch):
    """Every level runs within these short runs (the checks watch each level's ops): no cap
    on exploring's share of the time (spec_modes.EXPLORE)."""
    monkeypatch.setattr(spec_modes, "EXPLORE", None)


@pytest.fixture(scope="module")
def model():
    return tiny(vocab=64, layers=2)  # 4 query heads, 2 KV heads, head_dim 8


@pytest.fixture(scope="module")
def prompt():
    return repetitive_prompt(200, 64)


def cpu_tokens(loaded, prompt, o: RunOptions) -> list[int]:
    """api.generate's tokens on the CPU, on one thread (tiny tensors: OpenMP only waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return generate(loaded, prompt, o)[0]
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(model, prompt):
    """Greedy fp32 tokens on the CPU (every mode's, by losslessness)."""
    return cpu_tokens(model, prompt, opts("autoregressive"))


def dry_run(loaded, prompt, o: RunOptions, attention: str = "sdpa"):
    """(tokens, Stats, DryRun) of api.generate on the fake device."""
    with DryRun(attention) as dry:
        toks, st = dry.generate(dry.cuda(loaded), prompt, o)
    return toks, st, dry


def no_capture_failed(st):
    assert not [n for n in st.extra.get("notes", []) if "capture failed" in n]


# ---- every mode on the fake device: clean, and the CPU's tokens

@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_runs_clean(model, prompt, reference, mode, place, graphs):
    toks, st, dry = dry_run(model, prompt, opts(mode, place, graphs=graphs))
    dry.check()
    assert toks == reference
    static_level = place == "resident" or mode in ("triforce", "retrieval")  # the retrieval cache is resident
    assert st.extra["graphs"] == (graphs and static_level)
    no_capture_failed(st)
    assert dry.gpu.reads["uncounted"] == 0 and dry.gpu.reads["counted"] > 0


def batch_equals_solo(model, prompts, o) -> dict:
    """api.generate_batch of `prompts` on the fake device: clean, each sequence's tokens its
    solo run's there; the first sequence's stats."""
    solo = [dry_run(model, p, o)[0] for p in prompts]
    with DryRun() as dry:
        out = dry.generate_batch(dry.cuda(model), prompts, o)
    dry.check()
    assert [toks for toks, _ in out] == solo
    return out[0][1].extra


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("mode", MODES)
def test_a_batch_runs_clean_and_each_sequence_is_its_solo_run(model, mode, place):
    """api.generate_batch on the fake device: three prompts of different lengths, every
    mode, resident and offloaded. The checks hold in every member thread, each sequence's
    tokens are its solo run's on the same device, and the batch really shared forwards: the
    projections run the row-exact Triton kernel (kernels/triton_linear.py, faked row by
    row), the graphed steps' rows join ragged forwards with their caches' fixed-shape
    attention (a device start), captured as one graph per class of round from its second
    time on (`rows.Graphs`); the prompts' chunks of more than 64 rows (cuBLAS), and a
    round's only forward of a model, run by themselves. Every level runs (no bypass): which forwards run then does not
    depend on timings (and fp32 tokens need not be the CPU's at a random tiny model's near
    ties)."""
    prompts = [repetitive_prompt(200, 64), repetitive_prompt(150, 64)[::-1][:130], repetitive_prompt(90, 64)]
    o = opts(mode, place, bypass=False)
    st = batch_equals_solo(model, prompts, o)
    assert st["batch_size"] == 3 and st["batch_forwards_shared"] > 0
    assert st["batch_seqs_per_forward"] > 1.5 and st["batch_forwards_shared"] > st["batch_forwards_alone"]
    if place == "resident" or mode in ("triforce", "retrieval"):  # graphed steps: rounds replay graphs
        assert st["batch_graph_replays"] > 2 * st["batch_graph_captures"] > 0 and st["graphs"], st


def test_a_batch_without_graphs_shares_eager_forwards(model):
    """--no-graphs: the steps are not graphed, so the rounds run eager ragged forwards (no
    batch graph), still shared, each sequence its solo run."""
    prompts = [repetitive_prompt(120, 64), repetitive_prompt(90, 64)]
    o = opts("triforce", "resident", bypass=False, graphs=False)
    st = batch_equals_solo(model, prompts, o)
    assert st["batch_forwards_shared"] > st["batch_forwards_alone"] and "batch_graph_captures" not in st


def test_a_batch_on_cublas_runs_each_forward_by_itself(model, monkeypatch):
    """TRIFORCE_OFFLOAD_GPU_LINEAR=cublas: no projection is row-exact on CUDA, so no forward
    is shared, and each sequence still equals its solo run (on cuBLAS too)."""
    monkeypatch.setenv("TRIFORCE_OFFLOAD_GPU_LINEAR", "cublas")
    prompts = [repetitive_prompt(120, 64), repetitive_prompt(90, 64)]
    o = opts("triforce", "resident", bypass=False)
    st = batch_equals_solo(model, prompts, o)
    assert st["batch_forwards_shared"] == 0 and st["batch_forwards_alone"] > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attention", ["triton", "flash-attn"])
def test_fixed_shape_attention_kernels(model, prompt, reference, attention, mode):
    """Graphed steps through the faked kernels: Triton in fp32 (flash-attn takes bf16 only).
    Every level runs (no bypass): which forwards run then does not depend on timings, so
    the fp32 tokens are the same in every run (a random tiny model has near ties)."""
    loaded = model
    if attention == "flash-attn":
        loaded = dataclasses.replace(model, model=copy.deepcopy(model.model).to(torch.bfloat16),
                                     dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    toks, st, dry = dry_run(loaded, prompt, opts(mode, bypass=False), attention)
    dry.check()
    no_capture_failed(st)
    kernel = "flash_attn_with_kvcache" if attention == "flash-attn" else "_split_body"
    assert dry.gpu.launches[kernel] > 0 and st.extra["graphs"]
    if attention == "triton":
        assert toks == reference and dry.gpu.launches["_merge_body"] == dry.gpu.launches["_split_body"]
    else:
        assert len(toks) == N


@pytest.mark.parametrize("mode", ["autoregressive", "triforce"])
@pytest.mark.parametrize("extra", [dict(on_chip=1, stage_depth=3), dict(profile=True, stage_depth=1)],
                         ids=["on-chip", "profile"])
def test_offload_options(model, prompt, reference, tmp_path, mode, extra):
    if extra.get("profile"):
        extra = dict(extra, profile=str(tmp_path / "trace.json"))
    toks, st, dry = dry_run(model, prompt, opts(mode, "offloaded", **extra))
    dry.check()
    assert toks == reference
    if "profile" in extra:
        trace = json.loads((tmp_path / "trace.json").read_text())
        assert {e["cat"] for e in trace["traceEvents"] if "cat" in e} >= {"copy", "compute", "forward"}


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("mode", ["autoregressive", "triforce"])
def test_kept_prefix_reuse(model, prompt, mode, place):
    """A follow-up takes the kept cache over; a prompt sharing a short prefix gets it copied."""
    o = opts(mode, place)
    with DryRun() as dry:
        loaded = dataclasses.replace(dry.cuda(model), prefix=PrefixCache(1 << 30))
        first, _ = dry.generate(loaded, prompt, o)
        follow = prompt + first + prompt[:40]
        again, st2 = dry.generate(loaded, follow, o)
        other = prompt[:80] + [5, 6, 7] * 20
        third, st3 = dry.generate(loaded, other, o)
    dry.check()
    # the kept cache holds the prompt and every generated token but the last (a speculative
    # round that verified past the last token asked for: that one too)
    done = len(prompt) + N - 1
    assert st2.extra["reused_tokens"] in ((done,) if mode == "autoregressive" else (done, done + 1))
    assert st3.extra["reused_tokens"] == 80
    cold = opts("autoregressive")  # greedy fp32: every mode's tokens, as a cold start
    assert again == cpu_tokens(model, follow, cold) and third == cpu_tokens(model, other, cold)


@pytest.mark.parametrize("mode,place", [("autoregressive", "resident"), ("triforce", "resident"),
                                        ("triforce", "offloaded")])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights(model, prompt, weights, mode, place):
    """--weights int8/int4: QLinear's dequantize-per-call path on CUDA, graphed and offloaded."""
    q = dataclasses.replace(model, model=quantize_model(copy.deepcopy(model.model), weights), weights=weights)
    toks, st, dry = dry_run(q, prompt, opts(mode, place))
    dry.check()
    no_capture_failed(st)
    assert st.extra["weights"] == weights and len(toks) == N


def test_load_a_quantized_checkpoint_onto_the_device(tiny_model_dir):
    """api.load with --device cuda: the device check, bf16 by default, --weights int4 quantized
    at load, the weights moved; then triforce over an offloaded cache through flash-attn."""
    from triforce_offload.runtime import api
    from triforce_offload.runtime.options import ModelOptions
    with DryRun("flash-attn") as dry:
        loaded = api.load(ModelOptions(str(tiny_model_dir), device="cuda", weights="int4"))
        assert (loaded.device.type, loaded.dtype, loaded.weights) == ("cuda", torch.bfloat16, "int4")
        toks, st = dry.generate(loaded, list(range(100, 160)) * 3,
                                RunOptions.of(mode="triforce", max_new_tokens=8, budget=64, offload="on",
                                              transfer_chunk=16, sampling=SamplingParams(seed=0),
                                              bypass=False))  # every level runs: the flash-attn steps
    dry.check()
    no_capture_failed(st)
    assert len(toks) == 8 and dry.gpu.launches["flash_attn_with_kvcache"] > 0


def test_sampling_picks_on_the_device(model, prompt):
    """temperature > 0: each verification picks its tokens on the device (the uniforms
    copied in, one host read of the picks), clean of the dry run's findings; the seed's
    text is the device's autoregressive text token for token (sampling.py), with the level
    bypass on (the path it takes changes no token). Not the CPU's: the device's attention
    rounds otherwise, and a pick near a boundary of the cumulative probabilities follows."""
    o = opts("triforce", temperature=0.8)
    toks, st, dry = dry_run(model, prompt, o)
    dry.check()
    ar, _, dry_ar = dry_run(model, prompt, opts("autoregressive", temperature=0.8))
    dry_ar.check()
    assert toks == ar and len(toks) == N


# ---- the checks fire: one line of the runtime changed each

def planted(model, prompt, o, attention="sdpa"):
    """The violations of a dry run (the run itself may fail, as it would on a GPU)."""
    with DryRun(attention) as dry:
        try:
            dry.generate(dry.cuda(model), prompt, o)
        except (CaptureError, RuntimeError):
            pass
    return dry


def kinds_and_text(dry):
    return dry.kinds(), "\n".join(map(str, dry.violations))


def test_a_copy_without_its_completion_event_is_a_race(model, prompt, monkeypatch):
    plant(monkeypatch, ChunkCopier, "_cuda_copy", "ev.record(self.stream)", "pass")
    kinds, text = kinds_and_text(planted(model, prompt, opts("autoregressive", "offloaded")))
    assert kinds == {"race"} and "written by host-to-device copy" in text


def test_compute_that_does_not_wait_for_a_copy_is_a_race(model, prompt, monkeypatch):
    plant(monkeypatch, Signal, "wait", "torch.cuda.current_stream().wait_event(self.event)", "pass")
    kinds, text = kinds_and_text(planted(model, prompt, opts("autoregressive", "offloaded")))
    assert kinds == {"race"} and "on stream compute reads" in text


def test_a_copy_that_does_not_wait_for_compute_reuses_a_slot_still_read(model, prompt, monkeypatch):
    """Without the copy stream's wait on the compute marker, a staging slot is refilled while
    attention may still read it, and a write-back reads KV before it is computed."""
    plant(monkeypatch, ChunkCopier, "_cuda_copy", "self.stream.wait_event(after.event)", "pass")
    kinds, text = kinds_and_text(planted(model, prompt, opts("autoregressive", "offloaded")))
    assert kinds == {"race", "reuse"} and "reused without waiting for its reader" in text


def test_fresh_kv_freed_without_record_stream_is_reuse(model, prompt, monkeypatch):
    plant(monkeypatch, ChunkCopier, "_cuda_copy", "s.record_stream(self.stream)", "pass")
    kinds, text = kinds_and_text(planted(model, prompt, opts("autoregressive", "offloaded")))
    assert kinds == {"reuse"} and "was freed while stream" in text


def test_a_host_read_of_the_store_before_its_write_back_landed_is_a_race(model, prompt, monkeypatch):
    """Rebuilds read the host store (device_keys): only after the layer's write-back event."""
    plant(monkeypatch, offloaded.OffloadedCache, "keys", "self.write_backs[layer].synchronize()", "pass")
    dry = planted(model, prompt, opts("triforce", "offloaded", rebuild="every:4"))
    kinds, text = kinds_and_text(dry)
    assert kinds == {"race"} and "reads host memory" in text


def test_a_cpu_tensor_in_a_cuda_op(model, prompt, monkeypatch):
    plant(monkeypatch, acceptance, "greedy_verdict", "to_device(draft, p.device)", "torch.tensor(draft)")
    kinds, text = kinds_and_text(planted(model, prompt, opts("triforce")))
    assert kinds == {"device"} and "mixes CUDA tensors with a CPU tensor" in text


def test_a_cpu_generator_for_cuda_sampling(model, prompt, monkeypatch):
    plant(monkeypatch, sampling.Draws, "exp", "torch.Generator(device=device)", "torch.Generator()")
    kinds, _ = kinds_and_text(planted(model, prompt, opts("triforce", temperature=0.8)))
    assert kinds == {"generator"}


@pytest.mark.parametrize("line,finding", [
    ("int(length)", "a scalar read (aten.item.default: .item(), int(), bool()) inside a CUDA graph capture"),
    ("torch.rand(1, device=K.device)", "random numbers (aten.rand.default) inside a CUDA graph capture"),
    ("hostread.to_device([0], K.device)", "a page-locked host allocation inside a CUDA graph capture"),
    ("torch.ones(1).to(K.device)", "a blocking host-to-device copy (Tensor.to(cuda)) inside a CUDA graph capture"),
], ids=["host-sync", "rng", "allocation", "pageable-copy"])
def test_refused_inside_a_capture(model, prompt, monkeypatch, line, finding):
    """What CUDA refuses while capturing raises there (the step falls back to eager, said on
    the stats line) and is a finding; the fallback's warm-ups may add findings of their own
    (an uncounted read, a blocking copy in the decode loop)."""
    plant(monkeypatch, cache, "write_and_attend", "pos, length, shared = slots",
          f"pos, length, shared = slots; {line}")
    monkeypatch.setattr(cache, "hostread", hostread, raising=False)
    kinds, text = kinds_and_text(planted(model, prompt, opts("autoregressive")))
    assert "capture" in kinds and finding in text


def test_a_non_blocking_copy_from_pageable_memory(model, prompt, monkeypatch):
    plant(monkeypatch, hostread, "staged", "pin_memory=True", "pin_memory=False")
    kinds, text = kinds_and_text(planted(model, prompt, opts("triforce")))
    assert "pageable" in kinds and "non_blocking host-to-device copy (Tensor.to(cuda)) from pageable" in text


def test_a_blocking_read_the_decode_loop_does_not_count(model, prompt, monkeypatch):
    plant(monkeypatch, acceptance, "greedy_verdict", "top = argmax(p)  # [g+1]",
          "top = argmax(p); int(top[0])")
    kinds, text = kinds_and_text(planted(model, prompt, opts("triforce")))
    assert kinds == {"read"} and "hostread.to_host does not count" in text


def test_two_reads_in_one_verification(model, prompt, monkeypatch):
    """Each read counted, but two per verification of the top level."""
    plant(monkeypatch, acceptance, "greedy_verdict", "top = argmax(p)  # [g+1]",
          "top = argmax(p); to_host(top[0])")
    kinds, text = kinds_and_text(planted(model, prompt, opts("triforce")))
    assert kinds == {"read"} and "blocking reads in one verification of the top level" in text


def test_a_failed_warm_up_is_joined_before_the_eager_fallback(model, prompt, monkeypatch):
    def refuse(*a, **kw):
        raise RuntimeError("no tile fits")  # e.g. a kernel that refuses the shape at its first launch
    monkeypatch.setattr(triton_attention, "plan", refuse)
    with DryRun("triton") as dry:
        toks, st = dry.generate(dry.cuda(model), prompt, opts("autoregressive"))
    assert any("capture failed" in n for n in st.extra["notes"])
    dry.check()


# ---- the model of streams itself

def test_streams_are_ordered_only_by_events_waits_and_host_syncs():
    with DryRun() as dry:
        buf = dry.to_device(torch.zeros(4))
        copy_stream = torch.cuda.Stream()
        with torch.cuda.stream(copy_stream):
            buf.copy_(torch.ones(4).pin_memory(), non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        torch.cuda.current_stream().wait_event(done)
        buf.sum()  # ordered by the event: clean
        copy_stream.wait_stream(torch.cuda.current_stream())  # its reader is done before the refill
        with torch.cuda.stream(copy_stream):
            buf.copy_(torch.ones(4).pin_memory(), non_blocking=True)
        assert dry.violations == []
        buf.sum()  # not waited for
        assert dry.kinds() == {"race"}
        copy_stream.synchronize()
        torch.cuda.current_stream().synchronize()
        (buf + 1).sum()  # after host syncs: ordered
    assert len(dry.violations) == 1


def test_the_dry_run_leaves_torch_as_it_found_it(model, prompt):
    def state():
        return (torch.cuda.is_available, torch.cuda.Stream, torch.Generator, torch.get_num_threads(),
                hostread.READS.read, triton_attention.triton, dict(os.environ))
    before = state()
    dry_run(model, prompt, opts("triforce"), "flash-attn")
    assert state() == before and not torch.cuda.is_available() and "flash_attn" not in sys.modules
    with pytest.raises(RuntimeError):
        torch.zeros(1, device="cuda")


def test_a_dtype_conversion_inside_a_capture_replays():
    """`aten.to` may alias its input, and reaches the fake device's mode whole under
    inference_mode: one that made a new tensor (positions to float for RoPE) is work a
    replay must redo. When the fake took it for a view, every replay used the positions of
    the capture, and graphed steps drifted from eager ones by 1e-2 in their logits."""
    with DryRun(), torch.inference_mode():
        start = torch.zeros(1, dtype=torch.int64, device="cuda")
        g = torch.cuda.CUDAGraph()
        g.capture_begin()
        out = (start + torch.arange(2, device="cuda", dtype=start.dtype)).float() * 2
        g.capture_end()
        start.fill_(5)
        g.replay()
        assert out.elem.tolist() == [10.0, 12.0]
