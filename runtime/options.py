"""Every option of the runtime, one typed dataclass per concern.

| type | concern |
|---|---|
| `ModelOptions` | which model, dtype, device, RoPE stretch, chat template |
| `SamplingParams` | temperature, top-p, top-k, seed |
| `GenerationOptions` | mode, length, prefill, drafter and gammas (+ the sampling fields) |
| `RetrievalOptions` | the retrieval level: budget, retrieval chunk, rebuilds |
| `OffloadOptions` | the full cache in host memory: offload, on-chip layers, transfer chunk, staging |
| `ReuseOptions` | KV kept across runs: in host memory (serve), on disk (--kv-dir) |
| `ParallelOptions` | tensor-parallel ranks |
| `RunOptions` | what `api.generate` takes: generation + retrieval + offload |

Each field holds its default, its check and its help text once (`settings.opt`); the CLI
builds its options from these fields (`cli/options.py`), the Python API takes the objects,
and `RunOptions.of(**flat)` routes flat names (as the CLI spells them, underscored) to
their group, refusing unknown names. Field names are unique across the types.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

from ..offload.costmodel import STAGE_DEPTH
from ..settings import Options, at_least, one_of, opt
from .errors import TriforceError
from .conflicts import refuse
from .modes import mode_names

# The retrieval budget `auto` keeps this fraction of the prompt (rounded to whole retrieval
# chunks, at least BUDGET_MIN tokens): chosen by benchmarks/budget_fraction.py, see docs/speculative.md.
BUDGET_FRACTION = 1 / 8
BUDGET_MIN = 256


def _dtype(v: str):
    from .model.loader import DTYPES
    return None if v.lower() in DTYPES else "allowed are float32, bfloat16, float16 (or fp32, bf16, fp16)"


def _device(v: str):
    ok = v in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", v)
    return None if ok else "allowed are auto, cpu, cuda, cuda:N"


def _chat_template(v: str):
    from .data import chat_template_source
    chat_template_source(v)  # refuses a missing file or bad Jinja in its own words, before loading


@dataclass
class ModelOptions(Options):
    model: str | None = opt(None, "HF model directory or .gguf file, or a model in the Hugging Face "
                            "cache by name: org/name, org/name@rev, org/name:Q4_K_M, org/name/file.gguf "
                            "(default: bundled SmolLM2-135M-Instruct).")
    dtype: str | None = opt(None, "float32|bfloat16|float16 (fp32/bf16/fp16) (default: float32 "
                            "on CPU, bfloat16 on GPUs (float16 without bf16)).", check=_dtype)
    device: str = opt("auto", "auto|cpu|cuda|cuda:N.", check=_device)
    rope_scaling: str | None = opt(None, "Stretch the context, e.g. linear:4 "
                                   "(kinds: linear, dynamic, yarn, llama3).")
    weights: str = opt("auto", "auto|fp32|bf16|int8|int4: precision of the projection and "
                       "embedding weights. auto: a GGUF keeps its own (Q8_0 int8, Q4_x int4, ...), "
                       "an HF checkpoint stays dense at --dtype; int8/int4 quantize at load.",
                       check=one_of("auto", "fp32", "bf16", "int8", "int4"))
    activations: str = opt("auto", "auto|fp32|int8: what int8/int4 weights multiply. int8: each "
                           "row of activations quantized to int8 per 32 inputs (as llama.cpp does), "
                           "integer dot products. auto: int8 on a CPU whose native kernel has "
                           "AVX-512 VNNI (fp32 for runs with --offload on), else fp32. Dense weights "
                           "always take float activations.",
                           check=one_of("auto", "fp32", "int8"))
    kv_dtype: str = opt("auto", "auto|fp32|bf16|fp16: what the KV caches store. auto: bf16 on a CPU "
                        "where quantized linears take int8 activations (--activations), else the "
                        "compute dtype.", check=lambda v: None if v == "auto" else _dtype(v))
    chat_template: str | None = opt(None, "chatml|gemma|llama3|none|FILE: the chat template "
                                    "instead of the model's own (none: plain text; FILE: a Jinja file). "
                                    "Default: the model's; plain text if it has none.", check=_chat_template)


@dataclass
class SamplingParams(Options):
    temperature: float = opt(0.0, "0 is greedy.", check=lambda v: "must be a finite number" if not math.isfinite(v)
                             else None if v >= 0 else "must be >= 0 (0 is greedy)")
    top_p: float = opt(1.0, "Nucleus sampling mass.", check=lambda v: "must be a finite number" if not math.isfinite(v)
                       else None if 0 < v <= 1 else "must be in (0, 1]")
    top_k: int = opt(0, "Keep the k most likely tokens (0: all).", check=at_least(0))
    seed: int | None = opt(None, "Seed for sampling, 0 <= seed < 2**64.",
                           check=lambda v: None if 0 <= v < 2 ** 64 else "must be in [0, 2**64)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _mode(v: str):
    return None if v in mode_names() else f"allowed are {', '.join(mode_names())}"


def _draft(v: str):
    return None if v.strip() else "give ngram, self or a draft model path"


def _gamma2(v: str):
    ok = v == "auto" or (v.isdigit() and int(v) >= 1)
    return None if ok else "must be an integer >= 1 or 'auto'"


@dataclass
class GenerationOptions(SamplingParams):
    mode: str = opt("triforce", "triforce|retrieval|draft|autoregressive (and other registered modes).",
                    check=_mode)
    max_new_tokens: int = opt(256, "Stop after this many new tokens.", check=at_least(1))
    prefill_chunk: int = opt(512, "Tokens per prefill forward.", check=at_least(1))
    max_context: int | None = opt(None, "Cap the cache capacity (tokens).", check=at_least(1))
    graphs: bool = opt(True, "Replay fixed-shape decode and verification steps as CUDA graphs "
                       "(GPU only; prefill stays eager).")
    compile: bool = opt(False, "torch.compile the fixed-shape decode and verification steps (CUDA, "
                        "resident cache; fuses each layer's small ops, compiles once per step shape). "
                        "Off until measured to pay on a GPU.")
    ignore_eos: bool = opt(False, "Generate exactly max_new_tokens (benchmarks).", cli=False)
    draft: str = opt("ngram", "Bottom drafter: ngram (prompt lookup), self (the target over a "
                     "streaming cache) or a draft model path (same tokenizer).", check=_draft)
    gamma1: int = opt(4, "Tokens the drafter proposes per check (the n-gram drafter: at most, each "
                      "draft sized by what it is expected to pay).", check=at_least(1))
    gamma2: str = opt("6", "Tokens the retrieval level proposes per verification, or 'auto' "
                      "(adapt to acceptance and cost).", check=_gamma2)
    draft_sink: int = opt(16, "Streaming draft cache: first tokens kept.", check=at_least(0))
    draft_window: int = opt(240, "Streaming draft cache: recent tokens kept.", check=at_least(1))
    ngram: int = opt(3, "Longest n-gram the prompt-lookup drafter matches.", check=at_least(1))
    bypass: bool = opt(True, "Size each n-gram draft by its measured acceptance and cost, and skip the "
                       "retrieval level while it does not pay, retrying it later (--no-bypass: every "
                       "level always runs and the n-gram drafter drafts what it finds, e.g. for seeded "
                       "sampling that repeats run to run).")

    def __post_init__(self):
        self.gamma2 = str(self.gamma2)
        super().__post_init__()

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(**{f.name: getattr(self, f.name) for f in fields(SamplingParams)})

    @property
    def gamma2_start(self) -> int:
        """gamma2 of the first verification ('auto' starts at 6 and adapts)."""
        return 6 if self.gamma2 == "auto" else int(self.gamma2)


@dataclass
class Rebuild:
    """When to rebuild the retrieval cache: `never`, `every:N` tokens, or `adaptive`."""

    kind: str = "never"  # never | every | adaptive
    every: int = 0  # tokens between rebuilds for `every`
    threshold: float = 0.6  # adaptive: rebuild when the middle level's acceptance EMA drops below
    min_tokens: int = 32  # adaptive: at least this many tokens between rebuilds

    @classmethod
    def parse(cls, spec: str) -> "Rebuild":
        if spec in ("never", "adaptive"):
            return cls(spec)
        kind, _, n = spec.partition(":")
        if kind == "every" and n.isdigit() and int(n) > 0:
            return cls("every", int(n))
        raise TriforceError(f"--rebuild {spec!r}: allowed are never, every:N (N >= 1), adaptive")

    def due(self, since: int, acc_ema: float) -> bool:
        if self.kind == "every":
            return since >= self.every
        return self.kind == "adaptive" and since >= self.min_tokens and acc_ema < self.threshold


def _rebuild(v: str):
    Rebuild.parse(v)  # refuses a bad policy in its own words (--rebuild 'x': allowed are ...)


@dataclass
class RetrievalOptions(Options):
    budget: int | None = opt(None, "Retrieval cache tokens per layer and KV head "
                             f"(default: 1/{round(1 / BUDGET_FRACTION)} of the prompt, at least {BUDGET_MIN}).",
                             check=at_least(2))
    retrieval_chunk: int = opt(8, "Tokens per retrieval chunk (scored and selected as one).",
                               check=at_least(1), aliases=("--chunk",))
    rebuild: str = opt("never", "Retrieval cache rebuild: never|every:N|adaptive.", check=_rebuild)

    def validate(self):
        if self.budget is not None and self.budget < 2 * self.retrieval_chunk:
            refuse("budget-chunk", budget=self.budget, chunk=self.retrieval_chunk, least=2 * self.retrieval_chunk)

    def budget_for(self, n_prompt: int) -> int:
        """The budget in tokens for a prompt of n_prompt tokens: the given one, or `auto`
        (BUDGET_FRACTION of the prompt in whole chunks, at least BUDGET_MIN)."""
        if self.budget is not None:
            return self.budget
        c = self.retrieval_chunk
        return max(BUDGET_MIN, math.ceil(n_prompt * BUDGET_FRACTION / c) * c, 2 * c)


@dataclass
class OffloadOptions(Options):
    offload: str = opt("auto", "auto|on|off: keep the full KV in host memory and stream it "
                       "(auto: on when it does not fit the device; off on CPU).",
                       check=one_of("auto", "on", "off"))
    on_chip: int = opt(0, "With --offload: the first N layers keep their KV on the device.",
                       check=at_least(0))
    transfer_chunk: int | None = opt(None, "Tokens per host->device copy (default: from "
                                     "`triforce-offload tune`, else >= 4 MB per copy).", check=at_least(1))
    stage_depth: int = opt(STAGE_DEPTH, "With --offload: staging ring slots of one transfer chunk "
                           "each; also how far copies run ahead while the draft levels run "
                           "(2: double-buffered).", check=at_least(1))
    profile: str | None = opt(None, "With --offload: write a Chrome trace JSON of the last "
                              "verification (copy/compute/wait per layer).")
    overlap: bool = opt(True, "False: the serialized reference (copy, then compute).", cli=False)


def parse_size(text: str) -> int:
    """'4G', '512M', '1.5GiB', '100000' -> bytes (powers of 1024); ValueError if not a size."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if m is None:
        raise ValueError(text)
    return int(float(m[1]) * 1024 ** " kmgt".index(m[2] or " "))


def _size(v: str):
    try:
        parse_size(v)
    except ValueError:
        return "give a size such as 4G, 512M or a byte count"
    return None


@dataclass
class ReuseOptions(Options):
    kv_cache_mem: str = opt("4G", "serve: host memory for the KV of finished requests, kept for "
                            "prompts that share their prefix (0: none).", check=_size)
    kv_dir: str | None = opt(None, "Save each run's KV in this folder and load a saved prefix "
                             "instead of prefilling it (same model, dtype and RoPE only).")
    kv_dir_limit: str = opt("20G", "Size limit of --kv-dir; the least recently used entries go first.",
                            check=_size)


@dataclass
class ServeOptions(Options):
    host: str = opt("127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
    port: int = opt(8000, "Port to listen on (0: a free one, printed at start).",
                    check=lambda v: None if 0 <= v <= 65535 else "must be 0..65535")
    served_model_name: str | None = opt(None, "Model id in /v1/models and requests "
                                        "(default: the model's file or folder name).")
    api_key: str | None = opt(None, "Require 'Authorization: Bearer KEY' (401 without).")
    max_queue: int = opt(16, "Requests that may wait for the model; more get 429.", check=at_least(1))
    max_batch: int = opt(4, "Requests generating at once: their forwards share rounds (each answer "
                         "stays equal to its answer alone); a request joins when one leaves and "
                         "its KV caches fit --kv-memory (docs/batching.md).", check=at_least(1))
    prefill_budget: int = opt(0, "Prompt tokens all requests prefill in one round (0: one "
                              "--prefill-chunk): a long prompt prefills a chunk per round while "
                              "the running streams go on.", check=at_least(0))
    max_stall: float = opt(3.0, "While requests decode, a round that also prefills a prompt takes "
                           "at most this times a round of their decodes alone: the prompt prefills in "
                           "shorter chunks, sized by measurement (where its chunk boundaries change "
                           "no output: docs/batching.md). 0: chunks of --prefill-chunk.",
                           check=lambda v: None if v == 0 or v > 1 else "must be 0 (off) or > 1")
    kv_memory: str = opt("auto", "Memory the running requests' KV caches may take together, e.g. "
                         "8G (auto: 90% of what is free after loading, less --kv-cache-mem). A "
                         "request that does not fit beside the running ones waits; one that "
                         "never fits gets 400.", check=lambda v: None if v == "auto" else _size(v))
    request_timeout: float = opt(600.0, "Seconds a request may take from arrival; generation then "
                                 "stops (finish_reason length).",
                                 check=lambda v: None if v > 0 else "must be > 0")
    max_body: str = opt("auto", "Largest request body, e.g. 16M; a larger one gets 413. auto: twice "
                        "what a prompt that fits the context can take, plus 1M.",
                        check=lambda v: None if v == "auto" else _size(v))


@dataclass
class ParallelOptions(Options):
    tp: int = opt(1, "Tensor-parallel ranks: split heads and MLP over N processes (gloo on CPU, "
                  "NCCL one GPU each); also works under torchrun.", check=at_least(1), flag="--tp")


GROUPS = {"generation": GenerationOptions, "retrieval": RetrievalOptions, "offload": OffloadOptions}


@dataclass
class RunOptions:
    """Everything `api.generate` needs besides the model and the prompt."""

    generation: GenerationOptions = field(default_factory=GenerationOptions)
    retrieval: RetrievalOptions = field(default_factory=RetrievalOptions)
    offload: OffloadOptions = field(default_factory=OffloadOptions)

    @classmethod
    def of(cls, sampling: SamplingParams | None = None, **flat) -> "RunOptions":
        """From flat names (`mode=`, `budget=`, `transfer_chunk=`, ...); None means the
        default; `sampling` sets the sampling fields; an unknown name is refused."""
        if sampling is not None:
            flat = {**{f.name: getattr(sampling, f.name) for f in fields(SamplingParams)}, **flat}
        return cls().but(**flat)

    def but(self, **flat) -> "RunOptions":
        """A copy with flat changes (None: keep), each routed to the group owning the name."""
        parts = {g: {} for g in GROUPS}
        for k, v in flat.items():
            g = next((g for g, t in GROUPS.items() if k in t.names()), None)
            if g is None:
                known = sorted(n for t in GROUPS.values() for n in t.names())
                raise TriforceError(f"unknown option {k!r}; known are {', '.join(known)}")
            if v is not None:
                parts[g][k] = v
        return RunOptions(**{g: getattr(self, g).but(**kw) for g, kw in parts.items()})

    # the generation fields every mode reads
    mode = property(lambda self: self.generation.mode)
    sampling = property(lambda self: self.generation.sampling)
    max_new_tokens = property(lambda self: self.generation.max_new_tokens)
    prefill_chunk = property(lambda self: self.generation.prefill_chunk)
    max_context = property(lambda self: self.generation.max_context)
    ignore_eos = property(lambda self: self.generation.ignore_eos)
    graphs = property(lambda self: self.generation.graphs)
