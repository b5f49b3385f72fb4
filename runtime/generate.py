"""Prefill and autoregressive generation, with the statistics every mode reports."""
from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, field

import torch

from .errors import TriforceError
from .cache.kv import exact_bands, prefill_end
from .graphs import Step, kept, prefill_tokens, run_alone, run_model
from .hostread import to_device, to_host
from .cache.offloaded import prefill_layer_major
from .sampling import SamplingParams, draws, next_token


@dataclass
class Stats:
    prompt_tokens: int = 0  # tokens in the prompt
    new_tokens: int = 0  # tokens generated
    prefill_s: float = 0.0  # wall time of prefill
    decode_s: float = 0.0  # wall time of decoding (after prefill)
    peak_memory_gb: float = 0.0  # peak RSS (CPU) or peak allocated (CUDA)
    extra: dict = field(default_factory=dict)  # mode-specific figures (acceptance, ...)

    @property
    def decode_ms_per_token(self) -> float:
        return 1000 * self.decode_s / max(self.new_tokens, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "extra"}
        d.update(decode_ms_per_token=self.decode_ms_per_token, tokens_per_s=self.tokens_per_s)
        d.update(self.extra)
        return d


def peak_memory_gb(device) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return host_peak_bytes() / 2**30


def host_peak_bytes() -> int:
    """Peak RSS of this process. VmHWM belongs to this address space; ru_maxrss would also
    count the parent's RSS at fork time (Linux carries it across exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def check_context(n_prompt: int, max_new: int, limit: int, what: str = "the model's context"):
    if n_prompt >= limit:
        raise TriforceError(f"prompt of {n_prompt} tokens does not fit {what} of {limit} tokens; "
                            "shorten the prompt or stretch it with --rope-scaling")
    return min(max_new, limit - n_prompt)


def capacity(loaded, n_prompt: int, opts) -> tuple[int, int]:
    """(cache capacity, max new tokens) after checking the prompt fits the context."""
    limit, what = loaded.cfg.max_position_embeddings, "the model's context"
    if opts.max_context and opts.max_context < limit:
        limit, what = opts.max_context, "--max-context"
    max_new = check_context(n_prompt, opts.max_new_tokens, limit, what)
    return n_prompt + max_new + 64, max_new  # slack for speculative look-ahead


def stop_ids(loaded, opts) -> set[int]:
    """Token ids that end generation (none with opts.ignore_eos)."""
    return set() if opts.ignore_eos else loaded.eos


@torch.inference_mode()
def prefill(model, cache, ids: torch.Tensor, start: int = 0, prefill_chunk: int = 512, progress=None):
    """Run ids [B, T] through the model `prefill_chunk` tokens per forward; commit; start
    the first decode forward's prefetch; last logits [B, V]. Returns with the device idle
    (CUDA): the prefill's time is its own, not the first decode step's."""
    if cache.layer_major:  # an offloaded cache: nothing re-streamed
        logits = run_alone(lambda: prefill_layer_major(model, cache, ids, start, prefill_chunk, progress))
        cache.commit(start + ids.shape[1])
    else:
        logits = _prefill_chunks(model, cache, ids, start, prefill_chunk, progress)
    cache.prefetch()
    if logits is not None and logits.device.type == "cuda":
        torch.cuda.synchronize(logits.device)
    return logits


def _prefill_chunks(model, cache, ids, start, prefill_chunk, progress):
    T = ids.shape[1]
    logits, s = None, 0
    banded = any(w is not None for w in model.config.windows)
    while s < T:  # in a batch, chunks may be shorter while others decode (Batcher.chunk_tokens)
        # with window layers whose rows depend on the forward, ends on multiples of BAND_BLOCK
        e = prefill_end(start + s, prefill_tokens(model, cache, prefill_chunk), start + T,
                        banded and not exact_bands(model.config, ids.device)) - start
        logits = run_model(model, cache, ids[:, s:e], start + s, last_only=True)[:, -1]  # in a batch's round
        cache.commit(start + e)
        if progress:
            progress(e, T)
        s = e
    return logits


@torch.inference_mode()
def decode(model, cache, first_logits, start: int, sp: SamplingParams, max_new: int,
           eos: set[int], on_token=None, gen=None, step=None):
    """Autoregressive decoding from the logits of the last prompt token; returns new token ids.
    `step` (a graphs.Step over model and cache) runs the one-token forwards; default eager.
    `on_token(t)` returning True ends generation after t (a stop string, a cancelled request)."""
    out, logits, pos = [], first_logits, start
    gen = gen or draws(sp)
    step = step or Step(model, cache, graphs=False)
    for _ in range(max_new):
        tok = next_token(logits, sp, gen, pos)  # [B]: token index pos
        t = to_host(tok[0])  # the one blocking read per token
        out.append(t)
        if (on_token and on_token(t)) or t in eos or len(out) == max_new:
            break
        logits = step(tok[:, None], pos)[:, -1]
        pos += 1
        cache.commit(pos)
        cache.prefetch()  # the next step's first layers stream while this token is sampled
    return out


def autoregressive(model, cache, prompt: list[int], sp: SamplingParams, max_new: int,
                   eos: set[int], on_token=None, prefill_chunk: int = 512, progress=None,
                   graphs: bool = True, start: int = 0, compile: bool = False):
    """Prefill (eager) then decode one token at a time (CUDA graphs where the cache allows).
    `cache` may hold the KV of prompt[:start] already (a kept prefix): only the rest is
    prefilled. Returns (new token ids, Stats)."""
    dev = next(model.parameters()).device
    ids = to_device([prompt[start:]], dev)
    t0 = time.perf_counter()
    logits = prefill(model, cache, ids, start, prefill_chunk, progress)
    t1 = time.perf_counter()
    step = kept(model).step(model, cache, graphs, compile)  # captured in an earlier run, if kept
    toks = decode(model, cache, logits, len(prompt), sp, max_new, eos, on_token, step=step)
    t2 = time.perf_counter()
    st = Stats(len(prompt), len(toks), t1 - t0, t2 - t1, peak_memory_gb(dev))
    st.extra.update(step.figures())
    return toks, st
