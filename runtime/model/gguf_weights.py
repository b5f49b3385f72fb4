"""GGUF weights at their own precision: quantized blocks become `QPart`s without a float copy.

Each GGUF tensor is read from the memory-mapped file on its own and turned into the
kernel's format (kernels/qlinear.py: w = scale * q + min per group):

| GGUF type | kept as | exact? |
|---|---|---|
| Q8_0 | int8, group 32, float16 scale | yes |
| Q4_0 | int4, group 32, scale d, offset -8d (float16) | yes |
| Q4_1 | int4, group 32, scale d, offset m (float16) | yes |
| Q5_0, Q5_1 | int8 (5-bit values), group 32, float16 | yes |
| Q4_K | int4, group 32, float32 scale d*sc and offset -dmin*m | yes (scales in float32) |
| Q5_K | int8 (5-bit values), group 32, float32 scale and offset | yes |
| Q6_K | int8 (6-bit values), group 16, float32 scale d*sc | yes |
| F32, F16, BF16 (2-D) | int8 per group of 32, or int4 when asked | requantized |
| anything else (Q2_K, Q3_K, IQ*) | dequantized by `gguf`, requantized to int4 per 32 | requantized |

`--weights int8|int4` asks for one class: a tensor already in it is kept exactly, the others
are dequantized one at a time and requantized. llama-architecture files store q and k with
their rows permuted for llama.cpp's RoPE; whole rows move back (as transformers does), which
a row-wise block format allows without touching the blocks.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from ...kernels.qlinear import QPart, pack4, quantize
from ..errors import TriforceError

# GGUF tensor names -> the HF names the model loads (N is the layer)
NAMES = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm",
         "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's sandwich: llama.cpp's names for the norms around attention and the MLP
GEMMA_NAMES = {**NAMES, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
GEMMA_ARCHS = ("gemma2", "gemma3")
COMPUTED = {"rope_freqs"}  # tensors the runtime computes from the config instead

# the class a quantized type keeps under --weights auto
INT4_TYPES = {"Q4_0", "Q4_1", "Q4_K"}
INT8_TYPES = {"Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"}
DENSE_TYPES = {"F32", "F16", "BF16"}


def hf_name(name: str, arch: str = "llama") -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (None: computed,
    such as rope_freqs); a tensor with no place in the model is refused in one line."""
    names = GEMMA_NAMES if arch in GEMMA_ARCHS else NAMES
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in names:
        return f"{names[parts[0]]}.{parts[1]}"
    if parts[0] in COMPUTED:
        return None
    raise TriforceError(f"GGUF tensor {name} ({arch}) has no place in the model: not implemented")


def weight_class(reader) -> str:
    """'int4', 'int8' or 'dense': what the file's projection weights are, by the most common
    type among its 2-D tensors (token embeddings aside: files often keep them at Q8_0/Q6_K)."""
    counts: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) == 2 and not t.name.startswith("token_embd"):
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    if not counts:
        return "dense"
    top = max(counts, key=counts.get)
    return "int4" if top not in INT8_TYPES | DENSE_TYPES else "int8" if top in INT8_TYPES else "dense"


def _f16(raw: np.ndarray, lo: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., lo:lo + 2]).view(np.float16)[..., 0]


def _scale_min_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins -> [.., 8] each (ggml get_scale_min_k4)."""
    sc = sc.astype(np.uint8)
    s = np.empty(sc.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(s)
    s[..., :4] = sc[..., 0:4] & 63
    m[..., :4] = sc[..., 4:8] & 63
    s[..., 4:] = (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)
    m[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return s, m


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def convert(kind: str, raw: np.ndarray, K: int) -> QPart | None:
    """Raw blocks [N, bytes per row] of GGUF type `kind` -> an exact QPart (None: no exact form)."""
    N = raw.shape[0]
    if kind == "Q8_0":
        b = raw.reshape(N, K // 32, 34)
        return QPart(_t(b[..., 2:].view(np.int8).reshape(N, K)), _t(_f16(b, 0)), None, 8, 32, K)
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        b = raw.reshape(N, K // 32, size)
        d = _f16(b, 0)
        m = (-8 * d.astype(np.float32)).astype(np.float16) if kind == "Q4_0" else _f16(b, 2)
        return QPart(_t(b[..., size - 16:].reshape(N, K // 2)), _t(d), _t(m), 4, 32, K)
    if kind in ("Q5_0", "Q5_1"):
        size = 22 if kind == "Q5_0" else 24
        b = raw.reshape(N, K // 32, size)
        d = _f16(b, 0)
        qh = np.ascontiguousarray(b[..., size - 20:size - 16]).view(np.uint32)  # [N, nb, 1]
        qs = b[..., size - 16:]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # [N, nb, 32]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1) | high
        if kind == "Q5_0":
            return QPart(_t((q.astype(np.int16) - 16).astype(np.int8).reshape(N, K)), _t(d), None, 8, 32, K)
        return QPart(_t(q.astype(np.int8).reshape(N, K)), _t(d), _t(_f16(b, 2)), 8, 32, K)
    if kind in ("Q4_K", "Q5_K"):
        size = 144 if kind == "Q4_K" else 176
        b = raw.reshape(N, K // 256, size)
        d, dmin = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
        s, m = _scale_min_k4(b[..., 4:16])
        scale = (d[..., None] * s).reshape(N, K // 32)
        minv = (-(dmin[..., None] * m)).reshape(N, K // 32)
        ql = b[..., size - 128:].reshape(N, K // 256, 4, 32)  # 4 chunks of 64 weights
        q = np.stack([ql & 0xF, ql >> 4], axis=3)  # [N, nb, 4, 2, 32]: 32 low, then 32 high
        if kind == "Q5_K":
            qh = b[..., 16:48]  # [N, nb, 32]: bit 2j -> chunk j low half, 2j+1 -> high half
            bits = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, nb, 8, 32]
            q = q | (bits.reshape(N, K // 256, 4, 2, 32) << 4)
            return QPart(_t(q.astype(np.int8).reshape(N, K)), _t(scale), _t(minv), 8, 32, K)
        return QPart(pack4(_t(q.reshape(N, K))), _t(scale), _t(minv), 4, 32, K)
    if kind == "Q6_K":
        b = raw.reshape(N, K // 256, 210)
        ql, qh = b[..., :128].reshape(N, -1, 2, 64), b[..., 128:192].reshape(N, -1, 2, 32)
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)  # [N, nb, 16]
        d = _f16(b, 208).astype(np.float32)
        q1 = (ql[..., :32] & 0xF) | ((qh & 3) << 4)
        q2 = (ql[..., 32:] & 0xF) | (((qh >> 2) & 3) << 4)
        q3 = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
        q4 = (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)
        q = np.stack([q1, q2, q3, q4], axis=3).astype(np.int16) - 32  # [N, nb, 2, 4, 32]
        return QPart(_t(q.astype(np.int8).reshape(N, K)), _t((d[..., None] * sc).reshape(N, K // 16)),
                     None, 8, 16, K)
    return None


def tensor_part(t, want: str | None) -> QPart:
    """GGUF tensor `t` (2-D) as a QPart of class `want` ('int4'/'int8'; None: its own class,
    int8 for a float tensor): exact where its type belongs to that class, else dequantized
    (this tensor alone) and requantized."""
    from gguf import dequantize
    kind = t.tensor_type.name
    K, N = int(t.shape[0]), int(t.shape[1])  # GGUF lists the inner dimension first
    own = "int4" if kind in INT4_TYPES else "int8" if kind in INT8_TYPES else None
    if want is None:
        want = own or ("int8" if kind in DENSE_TYPES else "int4")
    if own == want:
        part = convert(kind, np.asarray(t.data).reshape(N, -1), K)
        if part is not None:
            return part
    w = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(N, K))
    return quantize(w, 8 if want == "int8" else 4, 32)


def permute_rows(part: QPart, n_head: int) -> QPart:
    """Undo llama.cpp's q/k row permutation (transformers' `_reverse_permute_weights`) on the
    rows of a QPart: whole rows move, blocks stay as they are."""
    N = part.out_features
    dim = N // n_head // 2
    idx = torch.arange(N).reshape(n_head, dim, 2).transpose(1, 2).reshape(N)
    return QPart(part.q[idx], part.scale[idx], None if part.minv is None else part.minv[idx],
                 part.bits, part.group, part.in_features)


@functools.lru_cache(maxsize=2)
def _reader(path: str, size: int, mtime: float):
    from gguf import GGUFReader
    return GGUFReader(path)


def reader(path):
    """gguf's reader of `path` (parsing the metadata of a 49K-token vocabulary takes seconds:
    the class check and the load share one)."""
    st = Path(path).stat()
    try:
        return _reader(str(path), st.st_size, st.st_mtime)
    except (ValueError, OSError) as e:
        raise TriforceError(f"model file {str(path)!r} is not a readable GGUF: {e}") from None


def read(path, want: str | None, cfg, progress=None):
    """Yield (HF name, QPart or dense float32 tensor) for every tensor of the GGUF at `path`:
    2-D weights as QParts of class `want` (None: each its own), norms and biases as float32."""
    from gguf import dequantize
    reader_ = reader(path)
    arch = _arch(reader_)
    llama = arch == "llama"
    for t in _progress(reader_.tensors, progress):
        name = hf_name(t.name, arch)
        if name is None:
            continue  # rope_freqs: computed, not loaded
        if len(t.shape) == 2:
            part = tensor_part(t, want)
            if llama and ".q_proj." in name:
                part = permute_rows(part, cfg.n_heads)
            elif llama and ".k_proj." in name:
                part = permute_rows(part, cfg.n_kv_heads)
            yield name, part
        else:
            w = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).copy())
            if arch in GEMMA_ARCHS and name.endswith("norm.weight"):
                w -= 1  # llama.cpp stores Gemma's (1 + w) norm scales with the 1 added
            yield name, w


def _arch(reader) -> str:
    f = reader.fields.get("general.architecture")
    return bytes(f.parts[f.data[0]]).decode() if f is not None else ""


def _progress(tensors, progress):
    if progress is None:
        return tensors
    from tqdm import tqdm
    return tqdm(tensors, desc="reading GGUF blocks", unit="tensor", leave=False)
