"""Model configuration: the Llama family (Llama 2/3, SmolLM2, Mistral), Qwen2, Qwen3,
Gemma 3 and Gemma 2, as one dataclass whose fields name what differs between them.

Anything in an HF config that would change the output and is not implemented here (an
unknown RoPE kind, experts, ...) is refused in one line that
names it (`refusals`), never ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import TriforceError

# window attention on a CPU reads a block of BAND_BLOCK positions' rows from the band of its
# first (cache.kv.band_lo): a window layer's ring holds BAND_BLOCK - 1 slots more than window + depth
BAND_BLOCK = 128

# HF `architectures` names we can run, mapped to our family name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma2ForCausalLM": "gemma2",
}
# HF `model_type` names (a GGUF's config names its type, not its class)
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma3_text": "gemma3", "gemma3": "gemma3", "gemma2": "gemma2"}
GEMMA = ("gemma2", "gemma3")
ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "llama3")
LAYER_KINDS = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass
class ModelConfig:
    arch: str = "llama"  # family: "llama", "qwen2", "qwen3", "gemma3" or "gemma2"
    vocab_size: int = 32000  # rows of the embedding and the LM head
    hidden_size: int = 4096  # model width
    intermediate_size: int = 11008  # gated MLP inner width
    n_layers: int = 32  # transformer blocks
    n_heads: int = 32  # query heads
    n_kv_heads: int = 0  # key/value heads (grouped-query); 0 means n_heads
    head_dim: int = 0  # per-head width; 0 means hidden_size // n_heads
    rope_theta: float = 10000.0  # RoPE base (of global layers where the kinds differ)
    rope_scaling: dict | None = None  # HF rope_scaling dict (linear, dynamic, yarn, llama3)
    max_position_embeddings: int = 4096  # context the model supports (after scaling)
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_word_embeddings: bool = False  # LM head shares the embedding matrix
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None  # beginning-of-sequence token
    eos_token_ids: list[int] = field(default_factory=list)  # any of these ends generation
    layer_types: list[str] = field(default_factory=list)  # per layer: full_attention or sliding_attention ([]: all full)
    sliding_window: int | None = None  # keys a sliding layer's query sees, its own included (None: no window)
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3); None: rope_theta, unscaled alike
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    norm_plus_one: bool = False  # RMSNorm multiplies by (1 + w) (Gemma)
    sandwich_norm: bool = False  # norms after attention and after the MLP too (Gemma 2/3)
    embed_scale: float = 1.0  # the embedding's output times this (Gemma: sqrt(hidden_size))
    hidden_act: str = "silu"  # gated MLP activation: silu or gelu_pytorch_tanh
    query_pre_attn_scalar: float | None = None  # attention scale is its ** -0.5 (Gemma); None: head_dim
    final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c) (Gemma 2)
    attn_logit_softcapping: float | None = None  # scaled scores -> c * tanh(scores / c) before the mask and softmax (Gemma 2)

    def __post_init__(self):
        self.n_kv_heads = self.n_kv_heads or self.n_heads
        self.head_dim = self.head_dim or self.hidden_size // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise TriforceError(f"n_heads={self.n_heads} is not a multiple of "
                                f"n_kv_heads={self.n_kv_heads}")
        kind = rope_kind(self.rope_scaling)
        if kind not in ROPE_KINDS:
            raise TriforceError(f"unsupported rope_scaling type {kind!r}; "
                                f"allowed: {', '.join(ROPE_KINDS)}")
        self.layer_types = list(self.layer_types) or ["full_attention"] * self.n_layers
        if len(self.layer_types) != self.n_layers:
            raise TriforceError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if bad:
            raise TriforceError(f"unsupported layer type {bad[0]!r}; allowed: {', '.join(LAYER_KINDS)}")
        if self.hidden_act not in ACTIVATIONS:
            raise TriforceError(f"unsupported activation {self.hidden_act!r}; allowed: {', '.join(ACTIVATIONS)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise TriforceError(f"sliding_window {self.sliding_window}: must be >= 1")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = getattr(self, name)
            if cap is not None and not cap > 0:
                raise TriforceError(f"{name} {cap}: must be > 0 (or absent)")

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def window(self, layer: int) -> int | None:
        """Keys layer `layer`'s queries see (their own included), None: every earlier key."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def windows(self) -> list[int | None]:
        return [self.window(i) for i in range(self.n_layers)]

    @property
    def local_rope(self) -> bool:
        """Sliding layers rotate with their own RoPE base (Gemma 3)."""
        return self.rope_local_theta is not None and "sliding_attention" in self.layer_types

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """Bytes of K and V over all layers for one token."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * elem_bytes

    def kv_bytes(self, capacity: int, elem_bytes: int, ring_depth: int | None = None, batch: int = 1,
                 blocks: bool = True) -> int:
        """Bytes of K and V a cache of `capacity` tokens per layer allocates: every layer
        whole, or with a `ring_depth` (cache.WindowRing.of) the window layers in rings of
        window + depth + BAND_BLOCK - 1 slots (a CPU's; a GPU's take BAND_BLOCK - 1 fewer:
        `blocks` False, also the window alone with depth 0) and only the global layers whole."""
        per_layer = 2 * batch * self.n_kv_heads * self.head_dim * elem_bytes  # one token, one layer
        n_win = sum(w is not None for w in self.windows) if ring_depth is not None else 0
        ring = n_win * (self.sliding_window + ring_depth + (BAND_BLOCK - 1 if blocks else 0)) if n_win else 0
        return ((self.n_layers - n_win) * capacity + ring) * per_layer

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None and not archs:
            arch = MODEL_TYPES.get(hf.get("model_type"))
        if arch is None:
            name = ", ".join(archs) or hf.get("model_type", "unknown")
            raise TriforceError(f"unsupported architecture {name}; supported: "
                                f"{', '.join(ARCHITECTURES)}")
        refuse = refusals(hf, arch)
        if refuse:
            raise TriforceError(f"{archs[0] if archs else arch}: {refuse[0]} is not implemented "
                                "(it would change the output)")
        glob, local = rope_params(hf, arch)
        theta = glob.pop("rope_theta", hf.get("rope_theta", 1e6 if arch == "gemma3" else 10000.0))
        rope = None if rope_kind(glob) == "default" else glob
        eos = hf.get("eos_token_id")
        eos = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
        gemma = arch in GEMMA
        kinds, window = layer_kinds(hf, arch)
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or 0,
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=hf.get("tie_word_embeddings", gemma),
            attention_bias=hf.get("attention_bias", True) if arch == "qwen2" else False,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            layer_types=kinds,
            sliding_window=window,
            rope_local_theta=float(local.get("rope_theta", 10000.0)) if arch == "gemma3" else None,
            qk_norm=arch in ("qwen3", "gemma3"),
            norm_plus_one=gemma,
            sandwich_norm=gemma,
            embed_scale=hf["hidden_size"] ** 0.5 if gemma else 1.0,
            hidden_act=activation(hf, arch),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256) if gemma else None,
            final_logit_softcapping=hf.get("final_logit_softcapping") if gemma else None,
            attn_logit_softcapping=(hf.get("attn_logit_softcapping") or None) if gemma else None,
        )


def rope_params(hf: dict, arch: str) -> tuple[dict, dict]:
    """(global, sliding) RoPE parameter dicts, from either config format: HF 5's
    `rope_parameters` (per layer type for Gemma 3) or the older rope_theta / rope_scaling /
    rope_local_base_freq keys."""
    rp = dict(hf.get("rope_parameters") or {})
    if "full_attention" in rp or "sliding_attention" in rp:
        glob, local = dict(rp.get("full_attention") or {}), dict(rp.get("sliding_attention") or {})
    else:
        glob = dict(rp or hf.get("rope_scaling") or {})
        local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    return glob, local


def layer_kinds(hf: dict, arch: str) -> tuple[list[str], int | None]:
    """Per-layer attention kinds and the window, as transformers reads them: Mistral's
    `sliding_window` covers every layer; Qwen2/Qwen3 window only with `use_sliding_window`,
    and then the layers from `max_window_layers` on (unless `layer_types` says otherwise);
    Gemma's `layer_types`, or every `sliding_window_pattern`-th layer global."""
    n, window = hf["num_hidden_layers"], hf.get("sliding_window")
    if arch == "llama":  # Llama has no window; Mistral's covers every layer
        mistral = hf.get("model_type") == "mistral" or "MistralForCausalLM" in (hf.get("architectures") or [])
        window = window if mistral else None
        return ["sliding_attention" if window else "full_attention"] * n, window
    if arch in ("qwen2", "qwen3"):
        window = window if hf.get("use_sliding_window") else None
        kinds = hf.get("layer_types") or ["sliding_attention" if window and i >= hf.get("max_window_layers", 28)
                                          else "full_attention" for i in range(n)]
        return kinds, window
    pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6 if arch == "gemma3" else 2))
    kinds = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(n)]
    return kinds, window


def activation(hf: dict, arch: str) -> str:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or ("gelu_pytorch_tanh" if arch in GEMMA else "silu")
    return "gelu_pytorch_tanh" if act in ("gelu_pytorch_tanh", "gelu_tanh") else act


def refusals(hf: dict, arch: str) -> list[str]:
    """What this config asks for that the runtime does not implement, each as a phrase
    naming the key (empty: everything in it is honoured)."""
    out = []
    experts = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if hf.get(k)]
    if experts:
        out.append(f"mixture of experts ({experts[0]}={hf[experts[0]]})")
    if hf.get("attn_logit_softcapping") and arch not in GEMMA:  # Gemma's attention has it
        out.append(f"attention logit soft-capping (attn_logit_softcapping={hf['attn_logit_softcapping']})")
    if hf.get("use_bidirectional_attention"):
        out.append("bidirectional attention (use_bidirectional_attention)")
    if hf.get("mlp_bias"):
        out.append("an MLP bias (mlp_bias)")
    if hf.get("attention_bias") and arch != "qwen2":
        out.append("an output-projection bias (attention_bias)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        out.append(f"partial RoPE (partial_rotary_factor={hf['partial_rotary_factor']})")
    for key in ("attention_chunk_size", "no_rope_layers", "sinks", "use_sinks"):
        if hf.get(key):
            out.append(f"{key}")
    glob, local = rope_params(hf, arch)
    for what, rp in (("RoPE", glob), ("sliding layers' RoPE", local)):
        if rope_kind(rp) not in ROPE_KINDS:
            out.append(f"{what} kind {rope_kind(rp)!r} (allowed: {', '.join(ROPE_KINDS)})")
    if arch == "gemma3" and rope_kind(local) != "default":
        out.append(f"a scaled RoPE on sliding layers ({rope_kind(local)})")
    act = activation(hf, arch)
    if act != ("gelu_pytorch_tanh" if arch in GEMMA else "silu"):
        out.append(f"activation {act!r}")
    kinds, window = layer_kinds(hf, arch)
    bad = sorted(set(kinds + list(hf.get("layer_types") or [])) - set(LAYER_KINDS))
    if bad:
        out.append(f"layer type {bad[0]!r}")
    return out


def rope_kind(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def parse_rope_scaling(spec: str, cfg: ModelConfig) -> dict:
    """`linear:4`, `dynamic:4`, `yarn:4`, `llama3:8` -> an HF rope_scaling dict for `cfg`."""
    kind, _, factor = spec.partition(":")
    if kind not in ROPE_KINDS[1:]:
        raise TriforceError(f"--rope-scaling {spec!r}: kind must be one of "
                            f"{', '.join(ROPE_KINDS[1:])} (e.g. linear:4)")
    try:
        f = float(factor)
    except ValueError:
        raise TriforceError(f"--rope-scaling {spec!r}: factor must be a number, e.g. {kind}:4")
    if f < 1:
        raise TriforceError(f"--rope-scaling {spec!r}: factor must be >= 1")
    out = {"rope_type": kind, "factor": f,
           "original_max_position_embeddings": cfg.max_position_embeddings}
    if kind == "llama3":
        out.update(low_freq_factor=1.0, high_freq_factor=4.0)
    return out


def apply_rope_override(cfg: ModelConfig, spec: str) -> ModelConfig:
    """Stretch the context: `--rope-scaling linear:4` turns an 8K model into a 32K one."""
    cfg.rope_scaling = parse_rope_scaling(spec, cfg)
    cfg.max_position_embeddings = int(cfg.max_position_embeddings * cfg.rope_scaling["factor"])
    return cfg


def rope_frequencies(cfg: ModelConfig, seq_len: int) -> tuple[list[float], float]:
    """Inverse frequencies and attention scaling for RoPE, as HF computes them.

    `seq_len` is the longest context this cache will see (used by `dynamic`, which HF
    recomputes as the sequence grows; we fix it at the model's stretched context, so
    logits equal HF's exactly while the sequence stays within the original length).
    """
    d, base, sc = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling or {}
    kind = rope_kind(cfg.rope_scaling)
    factor = float(sc.get("factor", 1.0))
    if kind == "dynamic":
        orig = sc.get("original_max_position_embeddings") or _orig_max(cfg, factor)
        if seq_len > orig:
            base = base * ((factor * seq_len / orig) - (factor - 1)) ** (d / (d - 2))
    inv = [1.0 / base ** (i / d) for i in range(0, d, 2)]
    if kind == "linear":
        inv = [f / factor for f in inv]
    if kind == "yarn":
        return _yarn(inv, cfg, sc, factor)
    if kind == "llama3":
        inv = _llama3(inv, sc, factor)
    return inv, 1.0


def _orig_max(cfg: ModelConfig, factor: float) -> int:
    """HF configs without the key mean max_position_embeddings is the pre-training length."""
    return cfg.max_position_embeddings


def _yarn(inv, cfg, sc, factor):
    d, base = cfg.head_dim, cfg.rope_theta
    orig = sc.get("original_max_position_embeddings") or _orig_max(cfg, factor)
    beta_fast, beta_slow = sc.get("beta_fast", 32), sc.get("beta_slow", 1)
    mscale = sc.get("attention_factor")
    if mscale is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        mscale = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all \
            else _yarn_mscale(factor)

    def dim(rot):
        return (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = dim(beta_fast), dim(beta_slow)
    if sc.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    hi = hi + 0.001 if lo == hi else hi
    out = []
    for i, f in enumerate(inv):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        extra = 1.0 - ramp  # extrapolation weight
        out.append((f / factor) * (1 - extra) + f * extra)
    return out, mscale


def _yarn_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _llama3(inv, sc, factor):
    lo_f, hi_f = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    orig = sc["original_max_position_embeddings"]
    lo_wl, hi_wl = orig / lo_f, orig / hi_f
    out = []
    for f in inv:
        wl = 2 * math.pi / f
        if wl < hi_wl:
            out.append(f)
        elif wl > lo_wl:
            out.append(f / factor)
        else:
            s = (orig / wl - lo_f) / (hi_f - lo_f)
            out.append((1 - s) * f / factor + s * f)
    return out
