"""One entry point for every generation mode: load, build caches, generate, report.

`cli` calls this; so do benchmarks and tests. Modes register a runner in `MODES`:
a function (loaded, prompt ids, RunOptions, on_token, progress) -> (new ids, Stats).
The runtime's own are autoregressive and the speculative ones; code outside it adds
comparison modes with `register_mode` (the benchmark library's `zero-inference`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .errors import TriforceError
from .generate import autoregressive, capacity, stop_ids
from .loader import load_model, parse_dtype
from .offloaded import finish_stats, make_full_cache
from .options import ModelOptions, RunOptions
from .prefix_cache import lease
from .spec_modes import SPEC_MODES
from .distributed import world_size
from .tp import sync_sampling


@dataclass
class Loaded:
    model: torch.nn.Module  # the target model
    cfg: ModelConfig  # its configuration
    tokenizer: object  # HF tokenizer
    device: torch.device  # where it runs
    dtype: torch.dtype  # weights and KV dtype
    prefix: object = None  # a PrefixCache: full caches come from it and go back after a run (serve)

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
         rope_scaling: str | None = None, progress=None, shard=None) -> Loaded:
    """Load a model: `load(ModelOptions(...))`, or `load(path, dtype, device, rope_scaling)`
    (the same fields). `shard(model, cfg) -> cfg` (tensor parallelism: this rank's slice,
    `tp.shard_fn()`) runs on the host before the move, so a GPU never holds the whole model
    (13B in bf16 does not fit a 24 GB card; its half does)."""
    o = model if isinstance(model, ModelOptions) else ModelOptions(model, dtype, device, rope_scaling)
    dev = resolve_device(o.device)
    dt = parse_dtype(o.dtype or default_dtype(dev))
    model, cfg, tok = load_model(o.model, dt, dev if shard is None else "cpu", o.rope_scaling, progress)
    if shard is not None:
        cfg = shard(model, cfg)
        model.to(dev)
    return Loaded(model, cfg, tok, dev, dt)


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


MODES = {"autoregressive": run_autoregressive}
MODES.update(SPEC_MODES)  # triforce, retrieval, draft (runtime/spec_modes.py)


def register_mode(name: str, runner) -> None:
    """Make `runner` selectable as `RunOptions.mode` (and `run --mode`) under `name`."""
    if MODES.get(name, runner) is not runner:
        raise TriforceError(f"mode {name!r} is registered already")
    MODES[name] = runner


def generate(loaded: Loaded, prompt: list[int], opts: RunOptions, on_token=None, progress=None):
    """Generate with the chosen mode. Returns (new token ids, Stats)."""
    if not prompt:
        raise TriforceError("the prompt is empty")
    opts = opts.but(seed=sync_sampling(opts.sampling).seed)  # tensor-parallel ranks in lockstep
    toks, st = MODES[opts.mode](loaded, prompt, opts, on_token, progress)
    if world_size() > 1:
        st.extra.setdefault("tp", world_size())
    st.extra.setdefault("mode", opts.mode)
    return toks, st
