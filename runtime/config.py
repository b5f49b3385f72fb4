"""Model configuration for the Llama family (Llama 2/3, SmolLM2, Mistral-style) and Qwen2."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import TriforceError

# HF `architectures` names we can run, mapped to our family name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass
class ModelConfig:
    arch: str = "llama"  # family: "llama" or "qwen2"
    vocab_size: int = 32000  # rows of the embedding and the LM head
    hidden_size: int = 4096  # model width
    intermediate_size: int = 11008  # SwiGLU inner width
    n_layers: int = 32  # transformer blocks
    n_heads: int = 32  # query heads
    n_kv_heads: int = 0  # key/value heads (grouped-query); 0 means n_heads
    head_dim: int = 0  # per-head width; 0 means hidden_size // n_heads
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: dict | None = None  # HF rope_scaling dict (linear, dynamic, yarn, llama3)
    max_position_embeddings: int = 4096  # context the model supports (after scaling)
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_word_embeddings: bool = False  # LM head shares the embedding matrix
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None  # beginning-of-sequence token
    eos_token_ids: list[int] = field(default_factory=list)  # any of these ends generation

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

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """Bytes of K and V over all layers for one token."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * elem_bytes

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}.get(hf.get("model_type"))
        if arch is None:
            name = ", ".join(archs) or hf.get("model_type", "unknown")
            raise TriforceError(f"unsupported architecture {name}; supported: "
                                f"{', '.join(ARCHITECTURES)}")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        if rope_kind(rope) == "default":
            rope = None
        eos = hf.get("eos_token_id")
        eos = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
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
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", arch == "qwen2"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
        )


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
