"""`bench`: every generation mode and the outside references, side by side, in one process.

One model, one prompt per context. For each (context, temperature, repeat) every
contender generates `new_tokens` tokens (end-of-sequence ignored) from the same prompt:

| contender | what |
|---|---|
| autoregressive | our one-token-at-a-time decode, full KV on the device |
| autoregressive+offload | the same with the KV in the host store, streamed in chunks |
| zero-inference | DeepSpeed ZeRO-Inference's strategy: KV and attention on the host |
| draft | drafter -> target (classic speculative decoding) |
| retrieval | target over the retrieval cache -> target (TriForce without L0) |
| triforce | drafter -> target + retrieval cache -> target + full cache |
| draft+offload, retrieval+offload, triforce+offload | the same with the full cache in the host store, streamed |
| hf, hf-lookup | transformers `generate`, plain and prompt-lookup assisted |
| llama.cpp, llama.cpp-lookup | llama-cpp-python on the GGUF, plain and prompt lookup |
| deepspeed | DeepSpeed ZeRO-Inference (ZeRO-3, weights in pinned host memory); CUDA, opt-in |

ms/token counts decode only (first new token to last). Peak memory is the peak RSS
above the RSS before the run (sampled by a thread), so it shows what a run adds, not
the weights every run shares. `lossless` compares greedy tokens with autoregressive's.

One prefill per context (`reuse_prefill`): on the CPU our in-memory contenders share the
prompt's KV through a PrefixCache, as the server does (each run prefills the last prompt
token again, for its queries; a run of ours with its own KV drops it first), and llama.cpp
keeps its context between runs (its own prefix reuse).
Decoding is what is measured, and it starts from the same KV either way; runs of one
repeat follow each other within seconds instead of a prefill apart, so the ratios between
contenders (`speedup`: the median over repeats of each repeat's ratio) see the same
machine. Offloaded contenders and the transformers/DeepSpeed peers prefill every run.
Library code: returns rows, never prints.
"""
from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field

import psutil
import torch

from ..runtime import api
from ..runtime.data import builtin_prompt, long_prompt
from ..runtime.errors import TriforceError
from ..runtime.model.loader import default_model_path, resolve
from ..runtime.cache.prefix import ROOM, PrefixCache
from ..runtime.sampling import SamplingParams
from . import peers
from . import zero_inference  # noqa: F401  (registers the `zero-inference` mode)

# name -> (kind, our mode or peer variant, RunOptions.of flat options for our modes)
CONTENDERS = {
    "autoregressive": ("ours", "autoregressive", {"offload": "off"}),
    "autoregressive+offload": ("ours", "autoregressive", {"offload": "on"}),
    "zero-inference": ("ours", "zero-inference", {}),
    "draft": ("ours", "draft", {"offload": "off"}),
    "retrieval": ("ours", "retrieval", {"offload": "off"}),
    "triforce": ("ours", "triforce", {"offload": "off"}),
    "draft+offload": ("ours", "draft", {"offload": "on"}),
    "retrieval+offload": ("ours", "retrieval", {"offload": "on"}),
    "triforce+offload": ("ours", "triforce", {"offload": "on"}),
    "hf": ("transformers", "plain", {}),
    "hf-lookup": ("transformers", "lookup", {}),
    "llama.cpp": ("llama.cpp", "plain", {}),
    "llama.cpp-lookup": ("llama.cpp", "lookup", {}),
    "deepspeed": ("deepspeed", "zero-3", {}),
}
BASELINE = "autoregressive"
OFFLOAD_BASELINE = "autoregressive+offload"  # what the offloaded contenders are compared with
PEER = "llama.cpp"  # what a user would otherwise pick: our rows get `vs_llama_cpp` beside it
EXTRA_BASELINES = ["deepspeed"]  # opt-in peers (`--baseline`): not in the default modes
DEFAULT_MODES = [m for m in CONTENDERS if m not in EXTRA_BASELINES]


@dataclass
class BenchOptions:
    contexts: list[int] = field(default_factory=lambda: [2048])  # prompt + new tokens
    new_tokens: int = 64  # tokens generated per run
    temperatures: list[float] = field(default_factory=lambda: [0.0])  # 0 is greedy
    repeats: int = 1  # runs per (contender, context, temperature); the median is reported
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))  # contenders to run
    seed: int = 0  # sampling seed (the same for every contender)
    spec: dict = field(default_factory=dict)  # extra options for our modes (budget, gamma1, ...)
    lookup: int = 10  # prompt-lookup draft length for transformers and llama.cpp
    gguf: str | None = None  # GGUF for llama.cpp; None: the --model file or the bundled one
    threads: int = 0  # llama.cpp threads; 0: torch's thread count
    prompt: str = "summary"  # built-in prompt: summary (essays + a request) or continue (essay text)
    reuse_prefill: bool = True  # one prefill per context for our in-memory contenders and llama.cpp (Bench.shared)

    def check(self):
        bad = [m for m in self.modes if m not in CONTENDERS]
        if bad:
            raise TriforceError(f"--modes {','.join(bad)}: allowed are {', '.join(CONTENDERS)}")
        if self.new_tokens < 2 or self.repeats < 1:
            raise TriforceError(f"--new-tokens {self.new_tokens} / --repeats {self.repeats}: "
                                "need at least 2 new tokens and 1 repeat")
        for c in self.contexts:
            if c < self.new_tokens + 64:
                raise TriforceError(f"--contexts {c}: must be at least --new-tokens + 64 "
                                    f"= {self.new_tokens + 64}")


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every `every` seconds."""

    def __init__(self, every: float = 0.005):
        self.every, self.peak, self._stop = every, 0, threading.Event()

    def __enter__(self):
        self.proc = psutil.Process()
        self.base = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(self.every)

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def gb(self) -> float:
        return max(self.peak - self.base, 0) / 2**30


class Bench:
    """Holds the loaded model and the lazily built peers while the runs go by."""

    def __init__(self, loaded: api.Loaded, o: BenchOptions, model_path=None):
        self.loaded, self.o, self.model_path = loaded, o, model_path
        self.hf = None  # transformers model, loaded on first use
        self.llms = {}  # (context, variant) -> llama_cpp.Llama
        self.ds = None  # peers.DeepSpeedPeer, loaded on first use
        self.store = None  # the PrefixCache our in-memory runs share (reuse_prefill)
        self.store_ctx = None  # the context whose prompt it keeps

    def shared(self, extra: dict):
        """The PrefixCache a run of ours with flat options `extra` takes its prompt's KV
        from (room for one context's full cache), or None: it prefills on its own. Only on
        the CPU: on a GPU the kept KV would hold memory the other contenders need."""
        if (not self.o.reuse_prefill or extra.get("offload") != "off" or self.loaded.prefix is not None
                or self.loaded.device.type != "cpu"):
            return None
        if self.store is None:
            self.store = kept_store(self.loaded, max(self.o.contexts))
        return self.store

    def close(self):
        if self.store is not None:
            self.store.clear()

    def gguf(self):
        """The GGUF file llama.cpp reads, or None when there is none."""
        if self.o.gguf:
            return self.o.gguf
        if self.model_path is None:
            return default_model_path()
        return self.model_path if str(self.model_path).endswith(".gguf") else None

    def skip_note(self, name: str) -> str | None:
        """Why a contender cannot run here, or None."""
        if CONTENDERS[name][0] == "deepspeed":
            return peers.deepspeed_missing()
        if CONTENDERS[name][0] != "llama.cpp":
            return None
        if self.gguf() is None:
            return "llama.cpp needs a GGUF: pass --gguf FILE (or --model FILE.gguf)"
        return peers.llama_cpp_missing()

    def run(self, name: str, ctx: int, prompt: list[int], temp: float) -> dict:
        kind, variant, extra = CONTENDERS[name]
        store = self.shared(extra) if kind == "ours" else None
        if self.store is not None and (self.store_ctx != ctx or (kind == "ours" and store is None)):
            # each context's first run prefills all of its prompt; a run of ours with its
            # own KV (offloaded: a host store as large) does not hold two copies
            self.store.clear()
        self.store_ctx = ctx
        # a run that takes the kept KV counts what its own cache would hold (the prompt and
        # the new tokens); the prefill's working memory is left out (--fresh-prefill has it)
        kept = kv_bytes(self.loaded, len(prompt) + self.o.new_tokens) / 2**30 if store and store.entries else 0.0
        with PeakRSS() as mem:
            if kind == "ours":
                prev = self.loaded.prefix  # a caller's own PrefixCache stays (shared() is None then)
                self.loaded.prefix = prev if store is None else store
                try:
                    row = self._ours(variant, extra, prompt, temp)
                finally:
                    self.loaded.prefix = prev
            elif kind == "transformers":
                row = self._hf(variant, prompt, temp)
            elif kind == "deepspeed":
                row = self._deepspeed(prompt, temp)
            else:
                row = self._llama_cpp(variant, ctx, prompt, temp)
        row["peak_gb"] = mem.gb + kept
        return row

    def _ours(self, mode: str, extra: dict, prompt, temp) -> dict:
        opts = api.RunOptions.of(mode=mode, max_new_tokens=self.o.new_tokens, ignore_eos=True,
                              sampling=SamplingParams(temp, seed=self.o.seed),
                              **{**self.o.spec, **extra})
        toks, st = api.generate(self.loaded, prompt, opts)
        row = {"tokens": toks, "ms_per_token": 1000 * st.decode_s / max(len(toks) - 1, 1),
               "prefill_s": st.prefill_s}
        for k in ("reused_tokens", "acceptance", "mean_accepted", "overlap", "notes", "bypassed_tokens",
                  "ms_per_token_by_skipped", "running", "exploring_ms", "retrieval_scorings", "drafts",
                  "sized_drafts"):
            if st.extra.get(k) not in (None, [], {}):
                row[k] = st.extra[k]
        return row

    def _hf(self, variant: str, prompt, temp) -> dict:
        if self.hf is None:
            d = resolve(self.model_path)
            self.hf = peers.load_hf(d, self.loaded.dtype).to(self.loaded.device)
        lookup = self.o.lookup if variant == "lookup" else 0
        r = peers.hf_generate(self.hf, prompt, self.o.new_tokens, temp, self.o.seed, lookup)
        return {"tokens": r.tokens, "ms_per_token": r.ms_per_token}

    def _deepspeed(self, prompt, temp) -> dict:
        if self.ds is None:
            self.ds = peers.load_deepspeed(resolve(self.model_path), self.loaded.dtype)
        r = peers.deepspeed_generate(self.ds, prompt, self.o.new_tokens, temp, self.o.seed)
        return {"tokens": r.tokens, "ms_per_token": r.ms_per_token, **r.extra,
                "note": "DeepSpeed ZeRO-Inference: weights streamed from pinned host memory"}

    def _llama_cpp(self, variant: str, ctx: int, prompt, temp) -> dict:
        key = (ctx, variant)
        if key not in self.llms:
            self.llms.clear()  # one llama.cpp context alive at a time
            lookup = self.o.lookup if variant == "lookup" else 0
            threads = self.o.threads or torch.get_num_threads()
            self.llms[key] = peers.load_llama_cpp(self.gguf(), ctx + 64, threads, lookup,
                                                  self.o.seed)
        r = peers.llama_cpp_generate(self.llms[key], prompt, self.o.new_tokens, temp, self.o.seed,
                                     reuse=self.o.reuse_prefill)
        return {"tokens": r.tokens, "ms_per_token": r.ms_per_token,
                "note": "quantized GGUF weights (not the same arithmetic)"}


def check_baselines(names: list[str]) -> list[str]:
    """The `--baseline` names, refused with the allowed ones when unknown."""
    bad = [n for n in names if n not in EXTRA_BASELINES]
    if bad:
        raise TriforceError(f"--baseline {','.join(bad)}: "
                            f"allowed are {', '.join(EXTRA_BASELINES)}")
    return names


def bench_prompt(tokenizer, ctx: int, new_tokens: int, kind: str = "summary") -> list[int]:
    """The built-in prompt (`summary`: essays plus a summary request, chat-wrapped;
    `continue`: essay text), leaving room for the new tokens."""
    ids = long_prompt(tokenizer, ctx - new_tokens - 64) if kind == "summary" else \
        builtin_prompt(tokenizer, kind, ctx - new_tokens - 64)
    return ids[: ctx - new_tokens]


def plan_runs(o: BenchOptions) -> list[tuple[int, float, int, str]]:
    """(context, temperature, repeat, contender) in run order: the baseline first in even
    repeats and last in odd ones, so a place in the order (after a contender that left the
    caches cold, or the machine's speed drifting through a repeat) weighs on every
    contender alike over the repeats."""
    order = sorted(o.modes, key=lambda m: m != BASELINE)
    return [(c, t, r, m) for c in o.contexts for t in o.temperatures
            for r in range(o.repeats) for m in (order if r % 2 == 0 else order[::-1])]


def run_bench(loaded: api.Loaded, o: BenchOptions, model_path=None, progress=None, on_row=None):
    """Every run as a row dict (skipped contenders: one row with a `skipped` note).

    progress(done, total, label) is called before each run, on_row(row) after it (so a
    long sweep can be saved as it goes)."""
    o.check()
    b, runs = Bench(loaded, o, model_path), plan_runs(o)
    prompts = {c: bench_prompt(loaded.tokenizer, c, o.new_tokens, o.prompt) for c in o.contexts}
    warm_up(loaded)
    rows, skipped = [], set()
    emit = lambda row: (rows.append(row), on_row and on_row(row))
    try:
        _runs(b, runs, prompts, progress, emit, skipped)
    finally:
        b.close()
    return rows


def _runs(b: Bench, runs, prompts, progress, emit, skipped):
    for i, (ctx, temp, rep, name) in enumerate(runs):
        if progress:
            progress(i, len(runs), f"{name} @ {ctx} T={temp:g}")
        note = b.skip_note(name)
        if note:
            if name not in skipped:
                emit({"mode": name, "skipped": note})
            skipped.add(name)
            continue
        r = b.run(name, ctx, prompts[ctx], temp)
        emit({"mode": name, "context": ctx, "prompt_tokens": len(prompts[ctx]),
              "temperature": temp, "repeat": rep, "new_tokens": len(r["tokens"]), **r})
    if progress:
        progress(len(runs), len(runs), "done")


def warm_up(loaded: api.Loaded):
    """One short generation, so the first timed run does not pay for lazy initialisation."""
    ids = loaded.tokenizer("Warm up.").input_ids
    api.generate(loaded, ids, api.RunOptions.of(max_new_tokens=4, ignore_eos=True))


def floors(loaded, contexts: list[int], bps: float) -> dict[int, float]:
    """Per context, the physical floor of one decode step in ms: the bytes it must read (the
    weights as stored, and at the cache's dtype the KV of the whole context in a global layer,
    of the window in a sliding-window layer) over `bps`."""
    from ..runtime.model.quantized import token_weight_bytes
    w = token_weight_bytes(loaded.model)
    return {c: 1000 * (w + kv_bytes(loaded, c)) / bps for c in contexts}


def kv_bytes(loaded, tokens: int) -> int:
    """Bytes of `tokens` tokens' KV at the cache's dtype (a window layer: its window's)."""
    return loaded.cfg.kv_bytes(tokens, loaded.kv_dtype.itemsize, ring_depth=0, blocks=False)


def summarize(rows: list[dict]) -> list[dict]:
    """One row per (mode, context, temperature): median ms/token over repeats, speedup over
    autoregressive (and, for contenders whose KV lives in host memory, `offload_speedup`
    over autoregressive+offload; and, where llama.cpp ran, `vs_llama_cpp`: its time over
    ours; each the median over repeats of each repeat's ratio, whose runs follow each
    other, so a machine's drift between repeats cancels), and lossless = greedy tokens equal autoregressive's (None
    if not greedy; for peers, `peer` is set: other kernels or quantized weights may flip
    near-ties)."""
    groups = {}
    for r in rows:
        if "skipped" not in r:
            groups.setdefault((r["mode"], r["context"], r["temperature"]), []).append(r)
    med = {k: statistics.median(x["ms_per_token"] for x in g) for k, g in groups.items()}
    base = {(c, t): g for (m, c, t), g in groups.items() if m == BASELINE}
    base_off = {(c, t): g for (m, c, t), g in groups.items() if m == OFFLOAD_BASELINE}
    peer = {(c, t): g for (m, c, t), g in groups.items() if m == PEER}
    ref = {(c, t): g[0]["tokens"] for (m, c, t), g in groups.items() if m == BASELINE}
    out = []
    for (m, c, t), g in groups.items():
        ms = med[(m, c, t)]
        s = {"mode": m, "context": c, "temperature": t, "ms_per_token": ms,
             "tokens_per_s": 1000 / ms if ms else 0.0, "repeats": len(g),
             "peak_gb": max(x["peak_gb"] for x in g),
             "speedup": paired_ratio(base.get((c, t)), g),
             "lossless": (g[0]["tokens"] == ref[(c, t)]) if t == 0 and (c, t) in ref else None}
        off = paired_ratio(base_off.get((c, t)), g) if CONTENDERS[m][2].get("offload") == "on" else None
        if off is not None:
            s["offload_speedup"] = off
        vs = paired_ratio(peer.get((c, t)), g) if CONTENDERS[m][0] == "ours" else None
        if vs is not None:
            s["vs_llama_cpp"] = vs  # llama.cpp's ms/token over ours, paired like speedup
        s.update(_mean_acceptance(g), peer=CONTENDERS[m][0] != "ours")
        s.update({k: g[0][k] for k in ("note",) if k in g[0]})
        out.append(s)
    order = list(CONTENDERS)
    out.sort(key=lambda s: (s["context"], s["temperature"], order.index(s["mode"])))
    return out + [{"mode": r["mode"], "skipped": r["skipped"]} for r in rows if "skipped" in r]


def paired_ratio(base: list[dict] | None, g: list[dict]) -> float | None:
    """The median over repeats of base's ms/token over g's in the same repeat (None without
    a base; the ratio of medians where the repeats do not pair up)."""
    return paired(base, g, lambda x: x["ms_per_token"]) if base else None


def paired(num: list[dict], den: list[dict], f) -> float | None:
    """The median over repeats (a row's `repeat`, else its place) of f(num's row) / f(den's
    row) of the same repeat; the ratio of the medians where the repeats do not pair up;
    None where den's median is 0."""
    a = {x.get("repeat", i): f(x) for i, x in enumerate(num)}
    b = {x.get("repeat", i): f(x) for i, x in enumerate(den)}
    if set(a) == set(b) and all(b.values()):
        return statistics.median(a[r] / b[r] for r in a)
    top = statistics.median(b.values())
    return statistics.median(a.values()) / top if top else None


def kept_store(loaded, context: int, sequences: int = 1) -> PrefixCache | None:
    """The PrefixCache our in-memory runs take their prompts' KV from (room for twice the
    full caches of `sequences` prompts of `context` tokens: the kept ones and those the runs
    hold; capacities round up to ROOM tokens), or None where runs prefill on their own: not
    on the CPU (on a GPU the kept KV would hold memory the other contenders need), or a
    caller's own store."""
    if loaded.device.type != "cpu" or loaded.prefix is not None:
        return None
    return PrefixCache(2 * sequences * kv_bytes(loaded, context + 2 * ROOM))


def _mean_acceptance(g: list[dict]) -> dict:
    """Acceptance per level and mean accepted tokens per verification, averaged over repeats."""
    if "acceptance" not in g[0]:
        return {}
    levels = g[0]["acceptance"].keys()
    acc = {k: statistics.mean(x["acceptance"][k] for x in g) for k in levels}
    return {"acceptance": acc, "mean_accepted": statistics.mean(x.get("mean_accepted", 0) for x in g)}
