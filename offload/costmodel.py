"""Analytic cost model: predicted ms per generated token for offloaded decoding.

Three modes (see `predict`):

- ``autoregressive``: weights on the GPU(s) (tensor parallel over ``tp`` cards), the KV of
  the first ``on_chip`` layers on the GPU, the rest in pinned host memory, streamed over
  PCIe for every token; each GPU streams its share of KV heads over its own link.
- ``deepspeed``: DeepSpeed-ZeRO-Inference with KV offload: one GPU holds the weights, the
  host CPU computes attention reading the whole KV at host-memory speed.
- ``triforce``: L0 small draft (streaming cache) -> L1 target weights + retrieval cache of
  ``budget`` tokens -> L2 target over the full, offloaded cache.

Assumptions (all stated, none fitted to the paper table):

1. Decode kernels are roofline-bound: time = max(bytes / (HBM peak x ``hbm_eff``),
   flops / tensor TFLOP/s). ``hbm_eff`` = 0.8 is a typical achieved fraction (assumption).
2. A link copy of b bytes costs b / peak + ``copy_latency_us`` (10 us, an assumption for
   cudaMemcpyAsync launch + DMA setup), so small transfer chunks waste link time. K and V
   of a chunk are one copy (the store interleaves them). All links together are capped by
   host DRAM bandwidth.
3. Transfers overlap compute, but the link can run ahead of compute only by the staging
   ring (``staging_bytes``: STAGE_DEPTH slots of ``transfer_chunk`` tokens of one layer,
   exactly what the runtime allocates): compute of the on-chip layers beyond what fills
   the ring is not overlapped. A prefill holds one offloaded layer's KV on the device
   (layer-major, so nothing is re-streamed): counted in GPU memory. A pass costs
   max(transfer + unhidden compute, compute) + the tail (last layer after the last byte)
   + a fixed per-forward overhead (launches, sampling, host sync, all-reduces).
4. Drafting leaves the link idle, so the staging buffers are prefetched then.
5. Speculation: each level accepts i.i.d. with rate alpha; tokens per verification of
   gamma drafts = (1 - alpha^(gamma+1)) / (1 - alpha) (Leviathan et al. 2023). L0 drafts
   ``gamma1`` tokens per L1 pass, L1 makes ``gamma2`` tokens per L2 pass.
6. Retrieval-cache upkeep is free: it is rebuilt while the full KV passes through the GPU
   during verification. Device-to-host write-back of new KV (a few tokens) is ignored.
7. Tensor parallel over cards without P2P (RTX 4090): two all-reduces per layer through
   host memory, ``allreduce_us`` each (assumption: tens of us for small messages).
8. Weights that do not fit next to everything else are streamed every forward.
9. CPU attention (ZeRO-Inference) reaches ``host_attn_gbps``: assumed 0.8 of a STREAM
   measurement of a dual-channel DDR5 desktop (~60 GB/s).
10. Weight precision (``ModelSpec.weights``): int8 is stored at 8.5 bits a weight (Q8_0's
   fp16 scale per 32; per-row int8 of an HF checkpoint is ~8.0), int4 at 5 bits (fp16
   scale and offset per 32: the runtime's layout for every 4/5/6-bit GGUF format). The
   memory they free goes to on-chip KV. On the GPU the runtime's quantized linear today
   dequantizes to bf16 per call (docs/weights.md), so a step reads the packed weights and
   writes and reads a bf16 copy: `step_read_bytes` counts that, not an ideal kernel's read.
11. Layer kinds (``ModelSpec.layer_types``, HF's names): a sliding-window layer keeps a ring of
   window + ``Settings.ring_depth`` tokens on the device (the runtime's ``cache.WindowRing``,
   one in the full cache and one in the retrieval cache) and is never offloaded or
   streamed; only global layers hold the context, on chip (the first ``on_chip`` layers'
   global ones, as ``--on-chip`` counts) or in host memory, streamed. Attention of a
   window layer reads min(keys, window) keys. Its compute between two offloaded global
   layers hides up to one staging ring of the next layer's transfer.
12. A batch (``Settings.batch`` sequences of ``context`` tokens each, the runtime's batched
   engine: one forward per round for every sequence's rows) reads the weights once per
   forward and each sequence's KV for itself: weight matmuls cost as one forward of all the
   rows, attention, KV memory, rings, retrieval caches, the draft's windows and the offloaded
   KV's transfer scale with the batch; staging buffers and the prefill's one layer do not (one
   prompt prefills at a time). Every sequence speculates at the same rates, so a round yields
   a token per sequence per ms_per_token: aggregate tokens/s = batch * 1000 / ms_per_token.

Memory sizes are GiB (2**30, as nvidia-smi reports); bandwidths are decimal GB/s.
Hardware sources are next to each preset value below.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

WEIGHT_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "int8": 8.5, "int4": 5.0}  # assumption 10
GB = 1e9  # bandwidths: decimal GB/s, as datasheets give them
GIB = 2 ** 30  # memory sizes: GiB
GPU_RESERVE_GIB = 1.5  # CUDA context + activations + allocator slack (assumption)
GPU_RESERVE_FRAC = 0.05  # ... or this fraction of the card, whichever is larger
HOST_RESERVE_FRAC = 0.1  # OS, page cache, the process itself (assumption)
MODES = ("autoregressive", "deepspeed", "triforce")
STAGE_DEPTH = 2  # staging ring slots of one transfer chunk each (2: double-buffered)
MIN_COPY_BYTES = 4 * 2 ** 20  # pinned copies reach the link's speed from ~4 MB (docs/gpu.md)
LAYER_KINDS = ("full_attention", "sliding_attention")  # HF's `layer_types` names
RUN_GAMMA1 = 4  # `run --gamma1`'s default (GenerationOptions.gamma1): the rings' depth without an L0 draft


def staging_bytes(transfer_chunk: int, kv_layer_bytes: float, depth: int = STAGE_DEPTH) -> float:
    """Device bytes of the staging ring: `depth` slots, each the K and V of `transfer_chunk`
    tokens of one layer (kv_layer_bytes: one GPU's K+V bytes of a token in one layer).
    The runtime allocates exactly this; `plan`, `--plan auto` and the predictions count it."""
    return depth * transfer_chunk * kv_layer_bytes


def default_transfer_chunk(kv_layer_bytes: float, min_copy_bytes: float = MIN_COPY_BYTES) -> int:
    """Tokens per copy when none is given or tuned: one copy (the K and V of one layer's
    chunk, interleaved in the store) moves at least `min_copy_bytes` (MIN_COPY_BYTES, or
    where a tuned profile's link curve reaches its speed: `tune.min_copy_bytes`)."""
    return max(1, math.ceil(min_copy_bytes / kv_layer_bytes))


@dataclass(frozen=True)
class Hardware:
    """One machine: identical GPUs, each with its own PCIe link to host memory."""

    name: str = "rtx4090"  # label only
    gpus: int = 1  # GPUs used (tensor-parallel degree by default)
    gpu_mem_gb: float = 24.0  # memory per GPU, GiB
    hbm_gbps: float = 1008.0  # peak device-memory bandwidth per GPU, GB/s
    hbm_eff: float = 0.8  # fraction of hbm_gbps decode kernels reach (assumption 1)
    tflops: float = 82.6  # fp16 tensor TFLOP/s per GPU, dense, fp32 accumulate
    pcie_gbps: float = 25.0  # effective pinned host->device GB/s per GPU link
    copy_latency_us: float = 10.0  # fixed cost of one async copy (assumption 2)
    host_mem_gb: float = 256.0  # host RAM, GiB
    host_mem_gbps: float = 60.0  # host DRAM bandwidth: caps the sum of all links
    host_attn_gbps: float = 48.0  # KV bandwidth CPU attention reaches (assumption 9)
    allreduce_us: float = 50.0  # one small all-reduce across the GPUs (assumption 7)
    layer_us: float = 20.0  # per-layer launch overhead not hidden behind GPU work
    step_ms: float = 0.3  # per forward: sampling, .item() sync, Python

    @classmethod
    def from_profile(cls, prof: dict, base: Hardware | None = None) -> Hardware:
        """Hardware from a `triforce-offload tune` profile dict; missing keys keep `base`.

        Reads ``device`` (picks a preset when it names one), ``link_gbps`` (a number or
        a {chunk: GB/s} map; the best measurement becomes the link bandwidth),
        ``compute_gbps`` (measured device-memory GB/s) and, when present, ``gpus``,
        ``gpu_mem_gb``, ``host_mem_gb``, ``host_gbps``.
        """
        hw = base or _preset_for_device(str(prof.get("device", ""))) or cls()
        upd = {}
        link = _best(prof.get("link_gbps"))
        if link:
            upd["pcie_gbps"] = link
        comp = _best(prof.get("compute_gbps"))
        if comp:  # a measurement is already the achieved bandwidth
            upd.update(hbm_gbps=comp, hbm_eff=1.0)
        for key, attr in (("gpus", "gpus"), ("gpu_mem_gb", "gpu_mem_gb"),
                          ("host_mem_gb", "host_mem_gb"), ("host_gbps", "host_mem_gbps")):
            val = _best(prof.get(key))
            if val:
                upd[attr] = int(val) if attr == "gpus" else val
        if prof.get("device"):
            upd["name"] = str(prof["device"])
        return replace(hw, **upd)


def _best(val) -> float | None:
    """Largest positive number in a number / list / dict of measurements, else None."""
    if isinstance(val, dict):
        val = list(val.values())
    vals = val if isinstance(val, (list, tuple)) else [val]
    nums = []
    for v in vals:
        try:
            nums.append(float(v))
        except (TypeError, ValueError):
            continue
    nums = [v for v in nums if v > 0 and math.isfinite(v)]
    return max(nums) if nums else None


def _preset_for_device(dev: str) -> Hardware | None:
    """A preset whose card a device string names ("NVIDIA GeForce RTX 4090" -> rtx4090)."""
    d = dev.lower()
    if "4090" in d:
        return RTX4090
    if "a100" in d:
        return A100_80G
    return None


@dataclass(frozen=True)
class ModelSpec:
    """Decoder architecture (Llama, Qwen, Mistral, Gemma: the same weight shapes); sizes in
    elements unless named bytes. `layer_types` and `window` say which layers attend over a
    sliding window (a ring of window + rollback depth tokens at run time, assumption 11)."""

    name: str  # label only
    layers: int  # decoder layers
    heads: int  # query heads
    kv_heads: int  # key/value heads (grouped-query attention when < heads)
    hidden: int  # model width
    intermediate: int  # MLP width (SwiGLU: gate, up, down)
    vocab: int  # vocabulary size
    head_dim: int = 0  # per-head width; 0 means hidden // heads
    dtype_bytes: int = 2  # bytes per weight and per KV element (fp16/bf16)
    tied: bool = False  # lm_head shares the embedding matrix
    max_context: int = 0  # tokens the model attends over (max_position_embeddings); 0: unknown
    weights: str = ""  # weight precision (WEIGHT_BITS); "": dtype_bytes like the KV
    tokenizer: str = ""  # tokenizer family of a preset ("" unknown): drafts must share it
    window: int = 0  # keys a sliding layer's query sees, its own included (0: no window)
    layer_types: tuple = ()  # per layer: "full_attention" or "sliding_attention"; (): all full

    def __post_init__(self):
        for f in ("layers", "heads", "kv_heads", "hidden", "intermediate", "vocab"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model {self.name!r}: {f} must be positive")
        kinds = tuple(self.layer_types) or ("full_attention",) * self.layers
        if len(kinds) != self.layers or set(kinds) - set(LAYER_KINDS):
            raise ValueError(f"model {self.name!r}: layer_types must give one of "
                             f"{', '.join(LAYER_KINDS)} for each of its {self.layers} layers")
        if "sliding_attention" in kinds and self.window <= 0:
            raise ValueError(f"model {self.name!r}: sliding layers need a window > 0")
        object.__setattr__(self, "layer_types", kinds)
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads must be a multiple of kv_heads")
        if not self.head_dim:  # frozen: set the derived default in place
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.weights and self.weights not in WEIGHT_BITS:
            raise ValueError(f"weights {self.weights!r}: expected one of {', '.join(WEIGHT_BITS)}")

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "", layer_types=(), window: int | None = None) -> ModelSpec:
        """From a HF config.json dict (llama / qwen2 / mistral keys); `layer_types` and
        `window` as the runtime reads them (`runtime.config.layer_kinds`; (): all global)."""
        try:
            heads = int(cfg["num_attention_heads"])
            return cls(
                name=name or str(cfg.get("_name_or_path") or cfg.get("model_type", "model")),
                layers=int(cfg["num_hidden_layers"]), heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads),
                hidden=int(cfg["hidden_size"]), intermediate=int(cfg["intermediate_size"]),
                vocab=int(cfg["vocab_size"]), head_dim=int(cfg.get("head_dim") or 0),
                dtype_bytes=4 if cfg.get("torch_dtype") == "float32" else 2,
                tied=bool(cfg.get("tie_word_embeddings", _gemma(cfg))),  # Gemma ties by default
                max_context=int(cfg.get("max_position_embeddings") or 0),
                window=int(window or 0), layer_types=tuple(layer_types))
        except KeyError as e:
            raise ValueError(f"config.json lacks {e.args[0]!r}") from None

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (attention + SwiGLU MLP + 2 norms)."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        return 2 * q + kv + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        """All weights: embeddings, layers, final norm, lm_head unless tied."""
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return emb + self.layers * self.layer_params + self.hidden

    @property
    def weight_bits(self) -> float:
        """Stored bits per weight, scales included (assumption 10)."""
        return WEIGHT_BITS[self.weights] if self.weights else 8.0 * self.dtype_bytes

    @property
    def quantized(self) -> bool:
        return self.weights in ("int8", "int4")

    @property
    def weight_bytes(self) -> int:
        return round(self.params * self.weight_bits / 8)

    @property
    def step_params(self) -> int:
        """Weights a forward reads: all but an untied embedding table (gathered, not read)."""
        return self.params - (0 if self.tied else self.vocab * self.hidden)

    @property
    def step_bytes(self) -> int:
        """Weight bytes a forward reads (`step_params` at their stored size)."""
        return round(self.step_params * self.weight_bits / 8)

    @property
    def step_read_bytes(self) -> int:
        """Device-memory bytes a forward's matmuls move with the runtime's GPU kernel:
        quantized weights are dequantized to bf16 per call (assumption 10)."""
        if not self.quantized:
            return self.step_bytes
        return self.step_bytes + 2 * 2 * self.step_params

    @property
    def kv_layer_bytes(self) -> int:
        """K + V bytes of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_token_bytes(self) -> int:
        """K + V bytes of one token over all layers."""
        return self.layers * self.kv_layer_bytes

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Indices of the layers that attend over the whole context."""
        return tuple(i for i, k in enumerate(self.layer_types) if k == "full_attention")

    @property
    def n_global(self) -> int:
        return len(self.global_layers)

    @property
    def n_window(self) -> int:
        """Sliding-window layers (a ring each on the device)."""
        return self.layers - self.n_global

    def ring_tokens(self, depth: int) -> int:
        """Slots of one window layer's ring (cache.WindowRing): window + depth."""
        return self.window + depth if self.n_window else 0

    def kv_bytes(self, tokens: float, depth: int) -> float:
        """K + V bytes of a cache holding `tokens` tokens in every global layer and a ring
        of `depth` in every window layer (what the runtime's caches allocate)."""
        return (self.n_global * tokens + self.n_window * self.ring_tokens(depth)) * self.kv_layer_bytes

    def kv_read_bytes(self, keys: float) -> float:
        """K + V bytes one query's attention reads over `keys` earlier tokens, all layers."""
        return (self.n_global * keys + self.n_window * min(keys, self.window)) * self.kv_layer_bytes

    def chip_globals(self, on_chip: int) -> int:
        """Global layers among the first `on_chip` layers (what `--on-chip` keeps on the device)."""
        return sum(i < on_chip for i in self.global_layers)

    def on_chip_for(self, n_global: int) -> int:
        """The `--on-chip` value that keeps `n_global` global layers on the device: all
        layers when that is every global layer, else the smallest."""
        if n_global >= self.n_global:
            return self.layers
        return self.global_layers[n_global - 1] + 1 if n_global > 0 else 0

    @property
    def kinds(self) -> str:
        """The layer kinds in words: "34 layers: 29 window (1024), 5 global"."""
        if not self.n_window:
            return f"{self.layers} layers, all global"
        if not self.n_global:
            return f"{self.layers} layers, all window ({self.window})"
        return f"{self.layers} layers: {self.n_window} window ({self.window}), {self.n_global} global"


def _gemma(cfg: dict) -> bool:
    """A Gemma config (model_type or architectures), whose embeddings are tied unless it says not."""
    names = [str(cfg.get("model_type", ""))] + [str(a) for a in cfg.get("architectures") or []]
    return any(n.lower().startswith("gemma") for n in names)


def pattern_kinds(layers: int, pattern: int) -> tuple[str, ...]:
    """Gemma's `sliding_window_pattern`: every pattern-th layer global, the rest sliding
    (as transformers and `runtime.config.layer_kinds` build `layer_types`)."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers))


# Architectures from the models' config.json files; tokenizers from their tokenizer files
# (llama-68m was trained with Llama 2's 32000-token SentencePiece vocabulary).
LLAMA2_7B_128K = ModelSpec("llama2-7b-128k", 32, 32, 32, 4096, 11008, 32000, max_context=131072,
                           tokenizer="llama2")
LLAMA2_13B_128K = ModelSpec("llama2-13b-128k", 40, 40, 40, 5120, 13824, 32000, max_context=131072,
                            tokenizer="llama2")
LLAMA31_8B = ModelSpec("llama-3.1-8b", 32, 32, 8, 4096, 14336, 128256, max_context=131072,
                       tokenizer="llama3")
LLAMA_68M = ModelSpec("llama-68m", 2, 12, 12, 768, 3072, 32000,
                      max_context=2048, tokenizer="llama2")  # JackFram/llama-68m
# Gemma 3 (google/gemma-3-*: the text config; 1 global layer in 6, window 512 in the small
# ones, 1024 from 4B on; embeddings tied) and models with one kind of layer for contrast.
GEMMA3_270M = ModelSpec("gemma-3-270m", 18, 4, 1, 640, 2048, 262144, head_dim=256, tied=True,
                        max_context=32768, tokenizer="gemma3", window=512, layer_types=pattern_kinds(18, 6))
GEMMA3_1B = ModelSpec("gemma-3-1b", 26, 4, 1, 1152, 6912, 262144, head_dim=256, tied=True,
                      max_context=32768, tokenizer="gemma3", window=512, layer_types=pattern_kinds(26, 6))
GEMMA3_4B = ModelSpec("gemma-3-4b", 34, 8, 4, 2560, 10240, 262208, head_dim=256, tied=True,
                      max_context=131072, tokenizer="gemma3", window=1024, layer_types=pattern_kinds(34, 6))
GEMMA3_12B = ModelSpec("gemma-3-12b", 48, 16, 8, 3840, 15360, 262208, head_dim=256, tied=True,
                       max_context=131072, tokenizer="gemma3", window=1024, layer_types=pattern_kinds(48, 6))
GEMMA3_27B = ModelSpec("gemma-3-27b", 62, 32, 16, 5376, 21504, 262208, head_dim=128, tied=True,
                       max_context=131072, tokenizer="gemma3", window=1024, layer_types=pattern_kinds(62, 6))
QWEN3_8B = ModelSpec("qwen3-8b", 36, 32, 8, 4096, 12288, 151936, head_dim=128,
                     max_context=40960, tokenizer="qwen")  # Qwen/Qwen3-8B: no sliding window
MISTRAL_7B = ModelSpec("mistral-7b-v0.1", 32, 32, 8, 4096, 14336, 32000, max_context=32768,
                       tokenizer="mistral", window=4096,
                       layer_types=("sliding_attention",) * 32)  # a 4096 window on every layer
MODELS = {m.name: m for m in (LLAMA2_7B_128K, LLAMA2_13B_128K, LLAMA31_8B, LLAMA_68M, GEMMA3_270M,
                              GEMMA3_1B, GEMMA3_4B, GEMMA3_12B, GEMMA3_27B, QWEN3_8B, MISTRAL_7B)}

# RTX 4090: 24 GB GDDR6X at 1008 GB/s and 82.6 TFLOP/s fp16 tensor with fp32 accumulate
# (what torch matmuls use; 165 with fp16 accumulate) from NVIDIA's Ada whitepaper, app. A.
# PCIe 4.0 x16 is 31.5 GB/s raw; pinned H2D measures ~25 GB/s (cuda-samples
# bandwidthTest reports on 4090 boards). No P2P on GeForce Ada: all-reduce via host.
RTX4090 = Hardware()
TWO_4090 = replace(RTX4090, name="2x4090", gpus=2)
# A100 80GB: 2039 GB/s HBM2e (SXM; PCIe card 1935), 312 TFLOP/s fp16 dense tensor
# (A100 datasheet); host link PCIe 4.0 x16, ~25 GB/s pinned. NVLink all-reduce ~10 us.
A100_80G = Hardware(name="a100-80g", gpu_mem_gb=80.0, hbm_gbps=2039.0, tflops=312.0,
                    allreduce_us=10.0)
HARDWARE = {"rtx4090": RTX4090, "2x4090": TWO_4090, "a100-80g": A100_80G}


@dataclass(frozen=True)
class Settings:
    """Run settings the runtime exposes as flags; acceptance rates are measured inputs."""

    context: int = 131072  # tokens in the KV cache
    budget: int = 4096  # L1 retrieval-cache tokens
    retrieval_chunk: int = 8  # tokens per retrieval chunk (scoring granularity; no cost here)
    gamma1: int = 1  # L0 drafts per L1 verification (0: L1 drafts by itself)
    gamma2: int = 6  # L1 tokens per L2 verification
    on_chip: int | None = None  # layers whose KV stays on GPU; None: as many as fit
    transfer_chunk: int = 4096  # tokens per host->device copy
    alpha0: float = 0.6  # P(L1 accepts an L0 draft token)
    alpha1: float = 0.9  # P(L2 accepts an L1 token)
    draft: ModelSpec | None = LLAMA_68M  # L0 model; None: no L0 level
    draft_window: int = 256  # L0 streaming cache: sink + recent tokens
    tp: int = 0  # tensor-parallel degree; 0: all of hw.gpus
    batch: int = 1  # sequences decoded together, each of `context` tokens (assumption 12)

    @property
    def ring_depth(self) -> int:
        """Slots a window layer's ring keeps beyond its window: the runtime's
        `engine.rollback_depth` for the run these settings print (γ1 + γ2 + 2; γ1 is
        `run`'s default where there is no L0 draft to set it)."""
        g1 = self.gamma1 if self.draft is not None and self.gamma1 > 0 else RUN_GAMMA1
        return g1 + self.gamma2 + 2


@dataclass(frozen=True)
class Prediction:
    """Predicted cost; per-token numbers are averaged over a speculation cycle."""

    mode: str
    ms_per_token: float
    transfer_ms: float  # host->device link time per token
    compute_ms: float  # GPU (and host-attention) compute per token
    levels: dict = field(default_factory=dict)  # ms per token by level (L0, L1, L2)
    tokens_per_pass: float = 1.0  # tokens one full-cache pass yields
    on_chip: int = 0  # on-chip layers used
    batch: int = 1  # sequences: each gets a token every ms_per_token

    @property
    def tokens_per_s(self) -> float:
        """Aggregate tokens per second over the batch."""
        return self.batch * 1e3 / self.ms_per_token


@dataclass(frozen=True)
class Memory:
    """Memory a configuration needs, GiB: per GPU, and host in total."""

    gpu_gb: float
    host_gb: float
    parts: dict = field(default_factory=dict)  # GiB per GPU by item


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens one verification of gamma drafts yields, bonus token included."""
    if gamma <= 0:
        return 1.0
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def _tp(hw: Hardware, s: Settings, mode: str) -> int:
    return 1 if mode == "deepspeed" else (s.tp or hw.gpus)


def gpu_capacity(hw: Hardware) -> float:
    """Usable bytes per GPU after the reserve."""
    reserve = max(GPU_RESERVE_GIB, GPU_RESERVE_FRAC * hw.gpu_mem_gb)
    return (hw.gpu_mem_gb - reserve) * GIB


def _gpu_parts(m: ModelSpec, s: Settings, mode: str, tp: int, on_chip: int) -> dict:
    """Bytes per GPU by item: the global layers' KV as placed, window layers' rings always
    on the device (assumption 11)."""
    parts = {"weights": m.weight_bytes / tp}
    if mode == "deepspeed":
        return parts
    B = s.batch  # per sequence: its KV, rings, retrieval cache and draft window (assumption 12)
    parts["on_chip_kv"] = B * m.chip_globals(on_chip) * s.context * m.kv_layer_bytes / tp
    if m.n_window:
        parts["rings"] = B * m.n_window * m.ring_tokens(s.ring_depth) * m.kv_layer_bytes / tp
    if m.chip_globals(on_chip) < m.n_global:
        parts["staging"] = staging_bytes(s.transfer_chunk, m.kv_layer_bytes / tp)
        parts["prefill_layer"] = s.context * m.kv_layer_bytes / tp
    if mode == "triforce":  # budget slots on global layers, its own rings on window layers
        parts["retrieval"] = B * m.kv_bytes(s.budget, s.ring_depth) / tp
        if s.draft is not None:  # replicated on every GPU
            parts["draft"] = s.draft.weight_bytes + B * s.draft_window * s.draft.kv_token_bytes
    return parts


def max_on_chip(hw: Hardware, m: ModelSpec, s: Settings, mode: str) -> int:
    """The `--on-chip` value keeping the most global layers' KV on the GPU(s) that fits
    next to everything else (`ModelSpec.on_chip_for`)."""
    tp = _tp(hw, s, mode)
    if mode == "deepspeed":
        return 0
    for k in range(m.n_global, -1, -1):
        n = m.on_chip_for(k)
        if sum(_gpu_parts(m, s, mode, tp, n).values()) <= gpu_capacity(hw):
            return n
    return 0


def _on_chip(hw, m, s, mode) -> int:
    if mode == "deepspeed":
        return 0
    n = max_on_chip(hw, m, s, mode) if s.on_chip is None else s.on_chip
    return max(0, min(n, m.layers))


def memory_use(hw: Hardware, m: ModelSpec, s: Settings, mode: str = "triforce") -> Memory:
    """GPU (per card) and host memory the configuration needs, GiB."""
    tp, on_chip = _tp(hw, s, mode), _on_chip(hw, m, s, mode)
    parts = {k: v / GIB for k, v in _gpu_parts(m, s, mode, tp, on_chip).items()}
    if mode == "deepspeed":  # ZeRO-Inference: every layer's KV in host memory
        host = s.batch * m.kv_bytes(s.context, s.ring_depth) / GIB
    else:  # the offloaded global layers
        host = s.batch * (m.n_global - m.chip_globals(on_chip)) * s.context * m.kv_layer_bytes / GIB
    return Memory(sum(parts.values()), host, parts)


def host_capacity(hw: Hardware) -> float:
    """Usable host bytes after the reserve."""
    return hw.host_mem_gb * (1 - HOST_RESERVE_FRAC) * GIB


# ---- timing primitives (all return ms) ----

def _ms(nbytes: float, gbps: float) -> float:
    return 1e3 * nbytes / (gbps * GB) if nbytes > 0 else 0.0


def _roof(hw: Hardware, nbytes: float, flops: float) -> float:
    """Kernel time bound by memory or by tensor cores, whichever is slower."""
    return max(_ms(nbytes, hw.hbm_gbps * hw.hbm_eff), 1e3 * flops / (hw.tflops * 1e12))


def _dense(hw: Hardware, m: ModelSpec, tp: int, n: int) -> float:
    """Weight matmuls of one forward over n tokens (of every sequence of a batch)."""
    return _roof(hw, m.step_read_bytes / tp, 2.0 * m.params / tp * n)


def _attn(hw: Hardware, m: ModelSpec, tp: int, n: int, kv: int, layers: int, seqs: int = 1) -> float:
    """Attention of n queries over kv cached tokens in `layers` layers, for each of `seqs`
    sequences (each reads its own KV)."""
    nbytes = seqs * layers * kv * m.kv_layer_bytes / tp
    flops = seqs * layers * 4.0 * n * kv * m.heads * m.head_dim / tp
    return _roof(hw, nbytes, flops)


def _attn_window(hw: Hardware, m: ModelSpec, tp: int, n: int, kv: int, seqs: int = 1) -> float:
    """Attention of n queries in every window layer: over min(kv, window) keys."""
    return _attn(hw, m, tp, n, min(kv, m.window), m.n_window, seqs) if m.n_window else 0.0


def _segments(m: ModelSpec, on_chip: int) -> int:
    """Offloaded global layers right after a layer computed on the device (window or on
    chip): each such stretch of compute can hide one staging ring of transfer."""
    dev = [k != "full_attention" or i < on_chip for i, k in enumerate(m.layer_types)]
    return sum(1 for i in range(1, m.layers) if not dev[i] and dev[i - 1])


def _overhead(hw: Hardware, m: ModelSpec, tp: int) -> float:
    """Per-forward cost not hidden behind GPU work: launches, sync, all-reduces."""
    ar = 2 * m.layers * hw.allreduce_us if tp > 1 else 0.0
    return hw.step_ms + (m.layers * hw.layer_us + ar) / 1e3


def link_gbps(hw: Hardware, copy_bytes: float, tp: int = 1) -> float:
    """Effective GB/s of one GPU's link for copies of copy_bytes (assumption 2)."""
    peak = min(hw.pcie_gbps, hw.host_mem_gbps / max(tp, 1))
    if copy_bytes <= 0:
        return peak
    t = copy_bytes / (peak * GB) + hw.copy_latency_us * 1e-6
    return copy_bytes / t / GB


def _copy_bytes(m: ModelSpec, s: Settings, tp: int) -> float:
    """One copy: K and V of transfer_chunk tokens of one layer, this GPU's heads."""
    return s.transfer_chunk * m.kv_layer_bytes / tp


def _streamed_weights(hw, m, s, mode, tp, on_chip) -> float:
    """Weight bytes per GPU that do not fit and are streamed every forward (assump. 8)."""
    over = sum(_gpu_parts(m, s, mode, tp, on_chip).values()) - gpu_capacity(hw)
    return min(max(over, 0.0), m.weight_bytes / tp)


@dataclass(frozen=True)
class _Pass:
    total: float  # ms of the pass
    xfer: float  # link ms
    comp: float  # compute ms


def _full_pass(hw, m, s, tp, n, on_chip, wstream, idle_ms=0.0) -> _Pass:
    """One target forward of n tokens per sequence over the whole context, KV partly
    streamed (every sequence's: assumption 12).

    idle_ms: link time available before the pass (drafting) to fill the staging buffers.
    """
    on = m.chip_globals(on_chip)
    off = m.n_global - on  # streamed layers: window layers never are (assumption 11)
    B = s.batch
    link = link_gbps(hw, _copy_bytes(m, s, tp), tp)
    xfer = _ms(B * off * s.context * m.kv_layer_bytes / tp + wstream, link)
    stage = _ms(staging_bytes(s.transfer_chunk, m.kv_layer_bytes / tp), link) if off else 0.0
    pre = min(idle_ms, stage, xfer)
    dense = _dense(hw, m, tp, n * B)
    c_on = (dense * (m.layers - off) / m.layers + _attn(hw, m, tp, n, s.context, on, B)
            + _attn_window(hw, m, tp, n, s.context, B))
    c_off = dense * off / m.layers + _attn(hw, m, tp, n, s.context, off, B)
    # the link runs ahead only by the staging space, once per stretch of device layers
    hidden_on = min(c_on, max(_segments(m, on_chip) * stage - pre, 0.0))
    tail = dense / m.layers if off else 0.0
    body = max(xfer - pre + c_on - hidden_on, c_on + c_off)
    return _Pass(body + tail + _overhead(hw, m, tp), xfer, c_on + c_off)


def _autoregressive(hw, m, s) -> Prediction:
    """One full pass per token; the link streams the offloaded layers every time."""
    tp, on_chip = _tp(hw, s, "autoregressive"), _on_chip(hw, m, s, "autoregressive")
    ws = _streamed_weights(hw, m, s, "autoregressive", tp, on_chip)
    p = _full_pass(hw, m, s, tp, 1, on_chip, ws)
    return Prediction("autoregressive", p.total, p.xfer, p.comp, {"L2": p.total}, 1.0,
                      on_chip, s.batch)


def _deepspeed(hw, m, s) -> Prediction:
    """ZeRO-Inference: GPU matmuls, CPU attention over host KV, layer by layer in series."""
    ws = _streamed_weights(hw, m, s, "deepspeed", 1, 0)
    xfer = _ms(ws, link_gbps(hw, ws / m.layers)) if ws else 0.0
    gpu = _dense(hw, m, 1, s.batch) + _overhead(hw, m, 1)
    cpu = _ms(s.batch * m.kv_read_bytes(s.context), hw.host_attn_gbps)
    hops = 2 * m.layers * hw.copy_latency_us / 1e3  # q/k/v out, attention output back
    total = max(xfer, gpu) + cpu + hops
    return Prediction("deepspeed", total, xfer, gpu + cpu, {"L2": total}, 1.0, 0, s.batch)


def _l1_step(hw, m, s, tp, wstream) -> float:
    """L1: target weights over the retrieval cache, verifying gamma1 drafts (+1)."""
    link = link_gbps(hw, wstream / m.layers, tp) if wstream else 1.0
    n = s.gamma1 + 1 if s.draft is not None else 1
    comp = _dense(hw, m, tp, n * s.batch) + _attn(hw, m, tp, n, s.budget, m.n_global, s.batch) \
        + _attn_window(hw, m, tp, n, s.context, s.batch)
    return comp + _ms(wstream, link) + _overhead(hw, m, tp)


def _l0_step(hw, d: ModelSpec, s) -> float:
    """L0: the small draft, replicated on every GPU, one token over its window."""
    return _dense(hw, d, 1, s.batch) + _attn(hw, d, 1, 1, s.draft_window, d.n_global, s.batch) \
        + _attn_window(hw, d, 1, 1, s.draft_window, s.batch) + _overhead(hw, d, 1)


def _triforce(hw, m, s) -> Prediction:
    """Cycle = L0/L1 drafting of gamma2 tokens + one L2 pass; per token = cycle / E2."""
    tp, on_chip = _tp(hw, s, "triforce"), _on_chip(hw, m, s, "triforce")
    ws = _streamed_weights(hw, m, s, "triforce", tp, on_chip)
    use_l0 = s.draft is not None and s.gamma1 > 0
    rounds = s.gamma2 / expected_tokens(s.alpha0, s.gamma1) if use_l0 else s.gamma2
    l0 = rounds * s.gamma1 * _l0_step(hw, s.draft, s) if use_l0 else 0.0
    l1 = rounds * _l1_step(hw, m, s, tp, ws)
    p = _full_pass(hw, m, s, tp, s.gamma2 + 1, on_chip, ws, idle_ms=l0 + l1)
    e2 = expected_tokens(s.alpha1, s.gamma2)
    levels = {"L0": l0 / e2, "L1": l1 / e2, "L2": p.total / e2}
    return Prediction("triforce", (l0 + l1 + p.total) / e2, p.xfer / e2,
                      (l0 + l1 + p.comp) / e2, levels, e2, on_chip, s.batch)


def predict(hw: Hardware, model: ModelSpec, settings: Settings,
            mode: str = "triforce") -> Prediction:
    """Predicted ms per generated token for one mode (see module docstring)."""
    fns = {"autoregressive": _autoregressive, "deepspeed": _deepspeed,
           "triforce": _triforce}
    if mode not in fns:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    _check(settings)
    return fns[mode](hw, model, settings)


def _check(s: Settings) -> None:
    """Reject settings the formulas cannot use."""
    if s.context <= 0 or s.transfer_chunk <= 0 or s.batch < 1:
        raise ValueError("context, transfer_chunk and batch must be positive")
    if s.gamma2 < 1 or s.gamma1 < 0:
        raise ValueError(f"gamma2 must be >= 1 and gamma1 >= 0, got {s.gamma2}, {s.gamma1}")
    for a in (s.alpha0, s.alpha1):
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance rate {a} is not in [0, 1]")


# ---- the TriForce paper's offloading table (arXiv 2404.11912, Table 3 / project page) ----
# Settings the paper's repo (Infini-AI-Lab/TriForce README) publishes: 2x4090 budget 12288,
# gamma 16; 1x4090 budget 8192, gamma 12; L0 = JackFram/llama-68m proposing one token per
# L1 verification (gamma1 = 1). Acceptance: alpha1 = 0.9, alpha0 = 0.6 (our assumption;
# the table does not give them). On-chip layers: as many as fit (ours, not the repo's).
PAPER_ALPHA0, PAPER_ALPHA1 = 0.6, 0.9
_TF2 = Settings(budget=12288, gamma1=1, gamma2=16, alpha0=PAPER_ALPHA0, alpha1=PAPER_ALPHA1)
_TF1 = replace(_TF2, budget=8192, gamma2=12)
PAPER_ROWS = (
    ("2x4090 llama2-7b-128k", TWO_4090, LLAMA2_7B_128K, "triforce", _TF2, 108.0),
    ("2x4090 llama2-7b-128k", TWO_4090, LLAMA2_7B_128K, "autoregressive", _TF2, 840.0),
    ("2x4090 llama2-13b-128k", TWO_4090, LLAMA2_13B_128K, "triforce", _TF2, 226.0),
    ("2x4090 llama2-13b-128k", TWO_4090, LLAMA2_13B_128K, "autoregressive", _TF2, 1794.0),
    ("1x4090 llama2-7b-128k", RTX4090, LLAMA2_7B_128K, "triforce", _TF1, 312.0),
    ("1x4090 llama2-7b-128k", RTX4090, LLAMA2_7B_128K, "deepspeed", _TF1, 1516.0),
)


def paper_table() -> list[tuple[str, str, float, float]]:
    """Rows of (setup, mode, predicted ms/token, paper ms/token)."""
    return [(name, mode, predict(hw, m, s, mode).ms_per_token, paper)
            for name, hw, m, mode, s, paper in PAPER_ROWS]
