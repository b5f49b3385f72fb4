"""One entry point for every generation mode: load, build caches, generate, report.

`cli` calls this; so do benchmarks and tests. Modes register a runner in `MODES` (runtime/modes.py):
a function (loaded, prompt ids, RunOptions, on_token, progress) -> (new ids, Stats).
The runtime's own are autoregressive and the speculative ones; code outside it adds
comparison modes with `register_mode` (the benchmark library's `zero-inference`).
"""
from __future__ import annotations

import atexit
import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .model import quantized
from .model.config import ModelConfig
from .data import use_chat_template
from .errors import TriforceError
from .conflicts import refuse
from .generate import autoregressive, capacity, stop_ids
from .model.loader import load_model, parse_dtype
from .modes import MODES, register_mode  # noqa: F401  (register_mode: the API's entry)
from .cache.offloaded import finish_stats, make_full_cache
from .options import ModelOptions, RunOptions
from .batch import rows as batch_rows, runner as batch_runner
from .cache.prefix import lease
from .spec.modes import SPEC_MODES
from .model.distributed import world_size
from .model.tp import sync_sampling


@dataclass
class Loaded:
    model: torch.nn.Module  # the target model
    cfg: ModelConfig  # its configuration
    tokenizer: object  # HF tokenizer
    device: torch.device  # where it runs
    dtype: torch.dtype  # activations' dtype (and dense weights')
    prefix: object = None  # a PrefixCache: full caches come from it and go back after a run (serve)
    weights: str = ""  # what the projections are stored as: int4, int8, int4+int8, float32, ...
    load_info: str = ""  # weight bytes, load seconds and the peak host memory while loading
    activations: str = ""  # what quantized linears multiply: int8 (per row and 32 inputs) or fp32
    activations_asked: str = "auto"  # --activations as given (auto yields to --offload on)
    kv_dtype: torch.dtype | None = None  # what every KV cache stores (None: dtype)
    token_bytes: int | None = None  # quantized.token_weight_bytes(model), counted once (spec.modes.read_ratio)
    shared: object = None  # cache.shared.Shared: prefixes held once for the sequences that start with them

    def __post_init__(self):
        self.kv_dtype = self.kv_dtype or self.dtype

    def generate(self, prompt: list[int], opts: RunOptions, on_token=None, progress=None):
        """`generate(self, ...)`: what a batch runs for each of its sequences."""
        return generate(self, prompt, opts, on_token, progress)

    @property
    def eos(self) -> set[int]:
        """Token ids that end generation."""
        ids = set(self.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids


def resolve_device(name: str) -> torch.device:
    """The device for --device `name` (checked by ModelOptions): present, and current."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TriforceError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    device = torch.device(name)
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise TriforceError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(device)  # streams, events and graph captures use the current device
    return device


def default_dtype(device: torch.device) -> str:
    """bf16 on GPUs that support it, else fp16. On CPU fp32: a multi-token verify pass and
    a one-token decode then agree exactly, so greedy speculative output equals
    autoregressive output (bf16 rounds them differently and can flip near-ties)."""
    if device.type == "cuda":
        # emulated bf16 (pre-Ampere: T4, V100) is slow: those get fp16
        return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"
    return "float32"


def load(model: ModelOptions | str | None = None, dtype: str | None = None, device: str = "auto",
         rope_scaling: str | None = None, progress=None, shard=None, weights: str = "auto") -> Loaded:
    """Load a model: `load(ModelOptions(...))`, or `load(path, dtype, device, rope_scaling)`
    (the same fields). `shard(model, cfg) -> cfg` (tensor parallelism: this rank's slice,
    `tp.shard_fn()`) runs on the host before the move, so a GPU never holds the whole model
    (13B in bf16 does not fit a 24 GB card; its half does)."""
    o = model if isinstance(model, ModelOptions) else ModelOptions(model, dtype, device, rope_scaling,
                                                                   weights)
    dev = resolve_device(o.device)
    dt = compute_dtype(o, dev)
    weights = o.weights
    if shard is not None:  # tensor parallelism shards dense weights only: auto means dense there
        if weights in ("int8", "int4"):
            refuse("tp-quantized", weights=weights)
        weights = "fp32" if weights == "auto" else weights
    started = time.perf_counter()
    model, cfg, tok = load_model(o.model, dt, dev if shard is None else "cpu", o.rope_scaling, progress,
                                 weights)
    use_chat_template(tok, o.chat_template, progress and (lambda m: progress(f"warning: {m}")))
    if shard is not None:
        cfg = shard(model, cfg)
        model.to(dev)
    act = quantized.set_activations(model, o.activations, dev)
    loaded = Loaded(model, cfg, tok, dev, dt, weights=quantized.weights_name(model), activations=act,
                    activations_asked=o.activations,
                    kv_dtype=kv_dtype(o.kv_dtype, dev, dt, act))
    loaded.load_info = (f"{quantized.weight_bytes(model) / 1e6:.0f} MB, loaded in "
                        f"{time.perf_counter() - started:.1f} s, peak host memory {peak_rss_gb():.2f} GB")
    settle()
    return loaded


_unfreeze_at_exit = False


def settle():
    """What exists now (a loaded model's modules, tensors, GGUF fields) leaves the cyclic
    garbage collector's generations (`gc.freeze`): a collection of the oldest generation,
    which a decode's allocations trigger now and then, no longer walks it (about 7% of a
    batch's driving thread in a profile). Objects still go when their last reference does;
    only cycles among frozen ones wait for the exit, where they are unfrozen again."""
    global _unfreeze_at_exit
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True


def kv_dtype(name: str, dev: torch.device, dt: torch.dtype, activations: str) -> torch.dtype:
    """--kv-dtype: what the caches store. auto: bfloat16 on a CPU where quantized linears take
    int8 activations (the model runs at the GGUF's precision, as llama.cpp's default f16 KV
    does; the native attention kernel reads bf16 keys and values with float32 queries, half
    the bytes of a float32 KV), else the compute dtype (a float32 model stays exact)."""
    if name == "auto":
        return torch.bfloat16 if dev.type == "cpu" and dt == torch.float32 and activations == "int8" else dt
    return parse_dtype(name)


def compute_dtype(o: ModelOptions, dev: torch.device) -> torch.dtype:
    """--dtype, else what dense --weights name (bf16 weights compute in bf16), else the device's
    default. Dense weights run at the compute dtype, so the two cannot disagree."""
    named = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(o.weights)
    dt = parse_dtype(o.dtype) if o.dtype else named or parse_dtype(default_dtype(dev))
    if named is not None and dt != named:
        refuse("weights-dtype", weights=o.weights, dtype=o.dtype)
    return dt


def peak_rss_gb() -> float:
    """The process's peak resident memory so far (GB): after a load, what loading took."""
    import resource
    import sys
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / (1 << 30) if sys.platform == "darwin" else kb / (1 << 20)


def run_autoregressive(loaded: Loaded, prompt, opts: RunOptions, on_token=None, progress=None):
    # FullCache, or OffloadedCache with --offload
    return run_with_cache(lambda cap: make_full_cache(loaded, cap, opts), loaded, prompt, opts,
                          on_token, progress, reuse=True)


def run_with_cache(make_cache, loaded, prompt, opts, on_token=None, progress=None, reuse=False):
    """Autoregressive decoding over the full cache `make_cache(capacity)` builds (`reuse`:
    or a kept one of loaded.prefix holding a prefix of the prompt); the cache's own
    figures (overlap, streamed GB, --profile trace) go into the Stats."""
    cap, max_new = capacity(loaded, len(prompt), opts)
    with lease(loaded if reuse else None, prompt, cap, make_cache) as kv:
        toks, st = autoregressive(loaded.model, kv.cache, prompt, opts.sampling, max_new,
                                  stop_ids(loaded, opts), on_token, opts.prefill_chunk, progress,
                                  opts.graphs, kv.start, opts.generation.compile)
        finish_stats(kv.cache, st, opts)
        kv.ids = prompt + toks
    kv.report(st)
    return toks, st


register_mode("autoregressive", run_autoregressive)
for _name, _runner in SPEC_MODES.items():  # triforce, retrieval, draft (runtime/spec/modes.py)
    register_mode(_name, _runner)


def generate(loaded: Loaded, prompt: list[int], opts: RunOptions, on_token=None, progress=None):
    """Generate with the chosen mode. Returns (new token ids, Stats)."""
    if not prompt:
        raise TriforceError("the prompt is empty")
    opts = opts.but(seed=sync_sampling(opts.sampling).seed)  # tensor-parallel ranks in lockstep
    act = run_activations(loaded, opts)
    with quantized.activations_set(loaded.model, act):
        toks, st = MODES[opts.mode](loaded, prompt, opts, on_token, progress)
    if world_size() > 1:
        st.extra.setdefault("tp", world_size())
    st.extra.setdefault("mode", opts.mode)
    st.extra.setdefault("weights", loaded.weights)
    if act:
        st.extra.setdefault("activations", act)
    return toks, st


def generate_batch(loaded: Loaded, prompts: list[list[int]], opts, on_token=None, memory: int | None = None,
                   share: bool = True):
    """Several prompts together, each sequence computed as it would be alone (runtime/batch:
    its tokens equal `generate`'s for that prompt). `opts`: one RunOptions or one per prompt;
    `on_token(i, t)`. Returns each prompt's (new token ids, Stats); a batch that does not fit
    `memory` bytes (default: what is free) is refused before anything is allocated. `share`:
    prompts that start with the same tokens hold that prefix's KV once, prefilled once
    (`shared_prefixes`); their answers stay their solo answers."""
    prefixes = shared_prefixes(loaded, prompts, opts) if share else []
    o = opts[0] if isinstance(opts, (list, tuple)) and opts else opts
    return batch_runner.generate_batch(loaded, prompts, opts, on_token, memory, prefixes,
                                       (lambda: holding(loaded, prefixes, o)) if prefixes else None)


def shared_prefixes(loaded: Loaded, prompts: list[list[int]], opts) -> list[tuple]:
    """The prefixes that two or more of `prompts` start with, worth holding once
    (cache.shared.common_prefixes, aligned so that each answer stays its solo answer); none
    where caches cannot share: another device than the CPU, fixed-shape steps, --tp,
    --offload on, options that differ between prompts, or a model whose prefill KV depends
    on where its chunks end and has window layers."""
    from .cache.kv import FullCache
    from .cache.shared import alignment, common_prefixes
    from .graphs import graphable
    from .spec.engine import rollback_depth
    per = opts if isinstance(opts, (list, tuple)) else [opts]
    o = per[0] if per else None
    if (o is None or loaded.device.type != "cpu" or graphable(loaded.device) or world_size() > 1
            or any(p != o for p in per) or o.offload.offload == "on"):
        return []
    with quantized.activations_set(loaded.model, run_activations(loaded, o)):
        probe = FullCache(loaded.cfg, 1, dtype=loaded.kv_dtype, device=loaded.device,
                          ring_depth=rollback_depth(o.generation))
        invariant = batch_rows.chunk_invariant(loaded.model, probe)
    if not invariant and any(w is not None for w in loaded.cfg.windows):
        return []
    return common_prefixes([p for p in prompts if p], alignment(invariant, o.prefill_chunk))


@contextmanager
def holding(loaded: Loaded, prefixes: list[tuple], opts: RunOptions, progress=None):
    """Prefill each of `prefixes` once (under `opts`' numerics) and hold it in
    `loaded.shared` while the body runs: runs whose prompts start with one lease caches that
    share it (cache.prefix.lease). Yields the segments."""
    from .cache.kv import FullCache
    from .cache.prefix import numerics
    from .cache.shared import Segment, Shared
    from .generate import prefill
    from .hostread import to_device
    from .spec.engine import rollback_depth
    segs = []
    try:
        with quantized.activations_set(loaded.model, run_activations(loaded, opts)):
            for ids in prefixes:
                cache = FullCache(loaded.cfg, len(ids), dtype=loaded.kv_dtype, device=loaded.device,
                                  ring_depth=rollback_depth(opts.generation))
                prefill(loaded.model, cache, to_device([list(ids)], loaded.device), 0, opts.prefill_chunk, progress)
                if loaded.shared is None:
                    loaded.shared = Shared()
                segs.append(Segment(ids, cache, numerics(loaded)))
                loaded.shared.add(segs[-1])
        yield segs
    finally:
        for seg in segs:
            loaded.shared.remove(seg)


def run_activations(loaded: Loaded, opts: RunOptions) -> str:
    """What this run's quantized linears multiply: the model's own, except that `auto` keeps
    float activations with --offload on. Streamed attention merges chunks by log-sum-exp in
    another order than a verification's causal block, so offloaded rows agree with their
    decodes to float rounding, not bit for bit; int8 activations would turn that into
    different tokens between modes."""
    if loaded.activations == "int8" and loaded.activations_asked == "auto" and opts.offload.offload == "on":
        return "fp32"
    return loaded.activations
