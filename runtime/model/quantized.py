"""A model with int8/int4 weights: a module swap after load (gpt-fast's quantize.py), so the
model file stays plain: each projection becomes a `QLinear` with the same forward(x), the
embedding a `QEmbedding`; a tied LM head shares the embedding's `QPart`.

Weights arrive one tensor at a time (from a GGUF's blocks or an HF checkpoint quantized as
it is read), so loading never holds a float copy of the whole model.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterable

import torch

from ...kernels.qlinear import QEmbedding, QLinear, QPart, activations, quantize
from .config import ModelConfig
from ..errors import TriforceError
from .transformer import Rotary, Transformer

# the model's projections and the HF tensors stacked into each (rows in this order)
LINEARS = {("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"), ("self_attn", "o_proj"): ("o_proj",),
           ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"), ("mlp", "down_proj"): ("down_proj",)}
QUANTIZED = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
             "embed_tokens"}


def _quantizes(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and name.split(".")[-2] in QUANTIZED


def quantize_stream(items: Iterable[tuple[str, torch.Tensor]], kind: str):
    """HF (name, float tensor) pairs -> the same with every projection and the embedding as a
    QPart: int8 with one scale per output row, int4 with a scale and offset per 32 inputs
    (per row in int8 where the inputs do not split into groups of 32)."""
    for name, t in items:
        yield name, (quantize_tensor(t, kind, name) if _quantizes(name, t) else t)


def quantize_tensor(t: torch.Tensor, kind: str, name: str = "a weight") -> QPart:
    K = t.shape[1]
    if kind == "int4" and K % 32 == 0:
        return quantize(t, 4, 32)
    if K % 16 == 0:
        return quantize(t, 8, None)
    raise TriforceError(f"--weights {kind}: {name} has {K} inputs, not a multiple of 16; "
                        "use --weights fp32")


def quantize_model(model: Transformer, kind: str) -> Transformer:
    """Swap a loaded dense model's projections and embedding for quantized ones, in place
    (the API's way to quantize a model built in memory; loading quantizes tensor by tensor)."""
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    dtype = model.model.embed_tokens.weight.dtype
    for block in model.model.layers:
        for (parent, attr) in LINEARS:
            lin = getattr(getattr(block, parent), attr)
            setattr(getattr(block, parent), attr, QLinear([quantize_tensor(lin.weight.detach(), kind, attr)],
                                                          None if lin.bias is None else lin.bias.detach()))
    emb = quantize_tensor(model.model.embed_tokens.weight.detach(), kind, "embed_tokens")
    head = emb if tied else quantize_tensor(model.lm_head.weight.detach(), kind, "lm_head")
    model.model.embed_tokens = QEmbedding(emb, dtype)
    model.lm_head = QLinear([head])
    return model


def assemble(cfg: ModelConfig, items, dtype: torch.dtype, device, what: str) -> Transformer:
    """Build the model from (HF name, QPart | float tensor) pairs."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.rotary = Rotary(cfg)
    parts: dict[str, QPart] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, v in items:
        if isinstance(v, QPart):
            parts[name.removesuffix(".weight")] = v
        else:
            dense[name] = v.to(dtype)

    def take(key: str) -> QPart:
        try:
            return parts.pop(key)
        except KeyError:
            raise TriforceError(f"checkpoint {what} lacks weights: {key}.weight") from None

    for i, layer in enumerate(model.model.layers):
        for (parent, attr), srcs in LINEARS.items():
            pre = f"model.layers.{i}.{parent}."
            ps = [take(pre + s) for s in srcs]
            biases = [dense.pop(f"{pre}{s}.bias", None) for s in srcs]
            bias = torch.cat(biases) if all(b is not None for b in biases) else None
            setattr(getattr(layer, parent), attr, QLinear(ps, bias))
    emb = take("model.embed_tokens")
    head = parts.pop("lm_head", None)
    cfg.tie_word_embeddings = head is None or cfg.tie_word_embeddings
    model.model.embed_tokens = QEmbedding(emb, dtype)
    model.lm_head = QLinear([emb if cfg.tie_word_embeddings else head])
    model.load_state_dict(dense, strict=False, assign=True)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise TriforceError(f"checkpoint {what} lacks weights: {', '.join(left[:3])}")
    return model.to(device).eval().requires_grad_(False)


def set_activations(model: torch.nn.Module, mode: str, device) -> str:
    """Set what every quantized linear multiplies (`--activations` `mode` on `device`, see
    qlinear.activations); returns it, or '' for a model without quantized linears."""
    lins = [m for m in model.modules() if isinstance(m, QLinear)]
    if not lins:  # a dense model: nothing to ask the native kernel (or build it) for
        return ""
    act = activations(mode, device)
    for m in lins:
        m.act = act
        if act == "int8":
            m.native_calls()  # the int8 kernel's packed columns made now, not in a first request
    return act


_ACT_LOCK = threading.Lock()


@contextmanager
def activations_set(model: torch.nn.Module, act: str):
    """Every quantized linear multiplies `act` inside the block, then what it did before.
    Blocks of several threads (the sequences of a batch, runtime/batch) nest: the first
    sets, the last restores, and one asking for another precision meanwhile is refused."""
    with _ACT_LOCK:
        held = model.__dict__.get("_act_held")  # [act, blocks inside, restore]
        if held is not None:
            if held[0] != act:
                raise TriforceError(f"this model runs {held[0] or 'float'} activations for the sequences "
                                    f"running now; a sequence asking for {act or 'float'} ones (--offload on "
                                    "keeps float activations) waits for them or runs in another batch")
            held[1] += 1
        else:
            lins = [m for m in model.modules() if isinstance(m, QLinear)] if act else []
            restore = ([(m, m.act) for m in lins], getattr(model, "activations_now", ""))
            for m in lins:
                if m.act != act:
                    m.act = act
            model.activations_now = act  # what KV this run writes was computed with (prefix reuse matches it)
            model.__dict__["_act_held"] = held = [act, 1, restore]
    try:
        yield
    finally:
        with _ACT_LOCK:
            held[1] -= 1
            if held[1] == 0:
                del model.__dict__["_act_held"]
                lins, now = held[2]
                model.activations_now = now
                for m, a in lins:
                    if m.act != a:
                        m.act = a


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight as stored (quantized parts at their size; a tied table once)."""
    seen, total = set(), 0
    for m in model.modules():
        for t in _tensors(m):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def _tensors(m: torch.nn.Module):
    """A module's own weights: parameters, and a quantized part's buffers (not rotary tables)."""
    bufs = m.buffers(recurse=False) if isinstance(m, QPart) else ()
    return [*m.parameters(recurse=False), *(b for b in bufs if b is not None)]


def token_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one decode step reads: every weight, except an embedding table
    not shared with the LM head (a step reads one row of it)."""
    emb, head = model.model.embed_tokens, model.lm_head
    table = [t for m in emb.modules() for t in _tensors(m)]
    tied = bool({t.data_ptr() for t in table} & {t.data_ptr() for m in head.modules() for t in _tensors(m)})
    return weight_bytes(model) - (0 if tied else sum(t.numel() * t.element_size() for t in table))


def weights_name(model: torch.nn.Module) -> str:
    """'int4', 'int4+int8' (GGUF Q4_K_M mixes), 'int8', or the dense dtype."""
    bits = sorted({p.bits for m in model.modules() if isinstance(m, QLinear) for p in m.parts})
    if bits:
        return "+".join(f"int{b}" for b in bits)
    return str(next(model.parameters()).dtype).removeprefix("torch.")
