"""`triforce-offload plan` and `run --plan auto`: TriForce settings from the cost model's
plan search (`offload/plan.py`), with the parsers of the command's GPU, context and model
strings ("2x4090", "128k", a preset or a model folder)."""
from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Optional

import torch
import typer
from rich.table import Table

from ..offload import costmodel as cm
from ..offload import plan as pl
from ..runtime.model import hub
from ..runtime.model.config import ARCHITECTURES, MODEL_TYPES, layer_kinds, parse_rope_scaling
from ..runtime.errors import TriforceError
from ..runtime.options import ModelOptions
from .app import app
from .options import options, pick
from .show import err, out


def _value(fn, *args):
    """Parser/search ValueErrors are user mistakes: one line, exit 2."""
    try:
        return fn(*args)
    except ValueError as e:
        raise TriforceError(str(e)) from None


@app.command()
@options
def plan(
    model_opts: Annotated[ModelOptions, pick("rope_scaling", "weights")],
    gpus: str = typer.Option("2x4090", help="[N x]GPU: 4090, 2x4090, a100-80g ..."),
    model: str = typer.Option("llama2-7b-128k", help=f"Preset ({', '.join(cm.MODELS)}) "
                              "or a HF model folder / config.json."),
    context: str = typer.Option("128k", help="Context in tokens: 131072, 128k, 1M (at most "
                                "the model's, unless --rope-scaling stretches it)."),
    gpu_mem: Optional[float] = typer.Option(None, help="GiB per GPU \\[default: the card's]."),
    host_mem: Optional[float] = typer.Option(None, help="GiB of host RAM \\[default: 256]."),
    alpha0: float = typer.Option(0.6, help="Acceptance of L0 drafts by L1 (measured by bench)."),
    alpha1: float = typer.Option(0.9, help="Acceptance of L1 tokens by L2 at a 4K budget."),
    draft_model: bool = typer.Option(True, "--draft-model/--no-draft-model",
                                     help="Plan with a llama-68m L0 draft (else L1 drafts alone)."),
    model_path: Optional[str] = typer.Option(None, help="Model path for the printed command "
                                             "\\[default: --model]."),
    draft_path: str = typer.Option("path/to/llama-68m", help="L0 draft model path for the "
                                   "printed command (same tokenizer as the target)."),
    batch: int = typer.Option(1, help="Sequences decoded together, each of --context tokens "
                              "(serve --max-batch): KV, rings and retrieval caches per sequence, "
                              "weights shared."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Search on-chip layers, budget, gamma2 and transfer chunk for the lowest predicted
    ms/token that fits memory; print the plan and the command line to run it."""
    rope_scaling = model_opts.rope_scaling
    hw = _value(parse_gpus, gpus)
    spec = _value(parse_model, model)
    if model_opts.weights != "auto":
        spec = replace(spec, weights=model_opts.weights)
    ctx = _value(parse_context, context)
    check_context(spec, ctx, rope_scaling)
    for a, flag in ((alpha0, "--alpha0"), (alpha1, "--alpha1")):
        if not 0 <= a <= 1:
            raise TriforceError(f"{flag} {a}: must be in [0, 1]")
    if batch < 1:
        raise TriforceError(f"--batch {batch}: must be >= 1")
    draft, note = draft_for(spec, draft_model)
    p = _value(lambda: pl.search_plan(hw, spec, ctx, gpu_mem, host_mem, alpha0, alpha1, draft=draft,
                                      batch=batch))
    cmd = serve_command(p, run_command(p, model_path or model, draft_path if draft else None, rope_scaling))
    if p.batch > 1 and p.tp > 1:
        note = (note + " " if note else "") + (f"serve batches on one GPU (no --tp): the batch of {p.batch} "
                                                f"over {p.tp} GPUs is a prediction only.")
    if as_json:
        print(json.dumps({**plan_dict(p), "rope_scaling": rope_scaling, "draft_note": note,
                          "command": cmd}))
        return
    out.print(plan_table(p))
    if note:
        err.print(note, highlight=False)
    out.print(cmd, highlight=False, soft_wrap=True)


def draft_for(spec: cm.ModelSpec, wanted: bool) -> tuple[cm.ModelSpec | None, str]:
    """The L0 draft to plan with (llama-68m only for a target with Llama 2's tokenizer:
    a draft must share the target's tokenizer) and a note when there is none."""
    if not wanted:
        return None, ""
    d = cm.LLAMA_68M
    if spec.tokenizer and spec.tokenizer == d.tokenizer:
        return d, ""
    why = (f"has the {spec.tokenizer} tokenizer" if spec.tokenizer
           else "has a tokenizer the planner cannot check")
    return None, (f"no L0 draft: {d.name} uses the {d.tokenizer} tokenizer and {spec.name} {why}; "
                  "planned with the retrieval level drafting (pass a draft with the target's "
                  "tokenizer to `run --draft`)")


def check_context(spec, ctx: int, rope_scaling: str | None) -> None:
    """Refuse a context beyond the model's (times the --rope-scaling factor), naming the
    factor that would stretch it. A model folder without max_position_embeddings is not checked."""
    if not spec.max_context:
        return
    limit = SimpleNamespace(max_position_embeddings=spec.max_context)
    factor = parse_rope_scaling(rope_scaling, limit)["factor"] if rope_scaling else 1
    if ctx <= spec.max_context * factor:
        return
    kind = rope_scaling.partition(":")[0] if rope_scaling else "linear"
    what = f"{spec.name}'s {spec.max_context} tokens"
    if rope_scaling:
        what += f" stretched by --rope-scaling {rope_scaling}"
    raise TriforceError(f"context {ctx} exceeds {what}; --rope-scaling "
                        f"{kind}:{math.ceil(ctx / spec.max_context)} would stretch it")


def run_command(p: pl.Plan, model_path: str, draft_path: str | None,
                rope_scaling: str | None = None) -> str:
    """The `run` invocation: triforce with the L0 draft model, else retrieval (L1 drafts)."""
    s = p.settings
    head = f"triforce-offload run --model {shlex.quote(str(model_path))} "
    if rope_scaling:
        head += f"--rope-scaling {shlex.quote(rope_scaling)} "
    mode = (f"--mode triforce --draft {shlex.quote(draft_path)} --gamma1 {s.gamma1} "
            if draft_path else "--mode retrieval ")
    if p.model.weights:
        head += f"--weights {p.model.weights} "
    return (head + mode + f"--budget {s.budget} --retrieval-chunk {s.retrieval_chunk} --gamma2 {s.gamma2} "
            f"--offload on --on-chip {s.on_chip} --transfer-chunk {s.transfer_chunk} "
            f"--tp {p.tp} --max-context {s.context}")


def serve_command(p: pl.Plan, run: str) -> str:
    """`serve` with the plan's settings for a batch (`run_command`'s flags and --max-batch),
    or `run`'s own line where serve cannot take them (it runs in one process: no --tp)."""
    if p.batch == 1 or p.tp > 1:
        return run
    return run.replace("triforce-offload run ", "triforce-offload serve ", 1).replace(" --tp 1 ", " ") \
        + f" --max-batch {p.batch}"


def plan_dict(p: pl.Plan) -> dict:
    s = p.settings
    m = p.model
    return {"gpus": p.hardware.gpus, "hardware": p.hardware.name, "model": m.name,
            "layers": m.layers, "global_layers": m.n_global, "window_layers": m.n_window,
            "window": m.window or None, "ring_depth": s.ring_depth if m.n_window else None,
            "on_chip_global": m.chip_globals(s.on_chip),
            "weights": p.model.weights or f"{8 * p.model.dtype_bytes}-bit",
            "weights_gb": p.model.weight_bytes / cm.GIB, "draft": s.draft.name if s.draft else None,
            "context": s.context, "tp": p.tp, "on_chip": s.on_chip, "budget": s.budget,
            "chunk": s.retrieval_chunk, "gamma1": s.gamma1 if s.draft is not None else 0,
            "gamma2": s.gamma2, "transfer_chunk": s.transfer_chunk, "alpha1": s.alpha1,
            "ms_per_token": p.ms_per_token, "baseline_ms": p.baseline_ms,
            "batch": p.batch, "tokens_per_s": p.tokens_per_s,
            "baseline_tokens_per_s": p.batch * 1e3 / p.baseline_ms,
            "gpu_gb": p.gpu_gb, "host_gb": p.host_gb,
            "on_chip_kv_gb": p.gpu_parts.get("on_chip_kv", 0.0), "rings_gb": p.gpu_parts.get("rings", 0.0)}


def plan_table(p: pl.Plan) -> Table:
    d = plan_dict(p)
    t = Table(title=f"plan: {d['model']} at {d['context']} tokens on {p.hardware.gpus} x "
                    f"{p.hardware.name.split('x')[-1]} (predicted by the cost model)",
              show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_row("layers", p.model.kinds)
    t.add_row("weights", f"{d['weights']}, {d['weights_gb']:.1f} GiB")
    t.add_row("L0 draft", d["draft"] or "none (L1 drafts)")
    t.add_row("tp", str(d["tp"]))
    t.add_row("on chip", f"{d['on_chip']} ({d['on_chip_global']} of {d['global_layers']} global layers' KV)")
    for k in ("budget", "chunk", "gamma1", "gamma2", "transfer_chunk"):
        t.add_row(k.replace("_", " "), str(d[k]))
    t.add_row("L1 acceptance at budget", f"{d['alpha1']:.3f}")
    t.add_row("GPU memory", f"{d['gpu_gb']:.1f} GiB per GPU")
    kv = f"{d['on_chip_kv_gb']:.1f} GiB global layers"
    if d["window_layers"]:
        kv += f" + {d['rings_gb']:.2f} GiB window rings ({d['window']} + {d['ring_depth']} tokens)"
    t.add_row("  of which KV", kv)
    t.add_row("host memory", f"{d['host_gb']:.1f} GiB (offloaded global layers' KV)")
    if p.batch > 1:
        t.add_row("batch", f"{p.batch} sequences of {d['context']} tokens")
    each = " each" if p.batch > 1 else ""
    t.add_row("predicted TriForce", f"{d['ms_per_token']:.0f} ms/token{each}"
              + (f", {d['tokens_per_s']:.1f} tok/s in all" if p.batch > 1 else ""))
    t.add_row("predicted autoregressive offload", f"{d['baseline_ms']:.0f} ms/token{each}"
              + (f", {d['baseline_tokens_per_s']:.1f} tok/s in all" if p.batch > 1 else ""))
    t.add_row("predicted speedup", f"{d['baseline_ms'] / d['ms_per_token']:.1f}x")
    return t


def plan_weights(name: str | None) -> str:
    """The cost model's precision for a loaded model's `quantized.weights_name`
    ("int4+int8" -> int4: most bytes are the int4 projections)."""
    name = name or ""
    if "int4" in name or "int8" in name:
        return "int4" if "int4" in name else "int8"
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, "")


def auto_plan(cfg, context: int, device: torch.device, weights: str | None = None) -> tuple[dict, str]:
    """`run --plan auto`: (RunOptions.of flat options updates, a note for stderr).

    The plan models GPUs with a PCIe link; on a machine without CUDA it leaves the
    defaults alone and says so."""
    if device.type != "cuda":
        return {}, ("--plan auto: the planner targets GPUs (PCIe-streamed KV); running on "
                    f"{device.type}, so the run keeps its defaults")
    from ..offload.tune import load_profile
    name = torch.cuda.get_device_name(device)
    prof = load_profile(device) or {}
    links = [r["link_gbps"] for r in prof.get("rows", []) if "link_gbps" in r]  # `tune` sweep
    hw = cm.Hardware.from_profile({"device": name, "link_gbps": links})
    hw = replace(hw, gpus=1, gpu_mem_gb=torch.cuda.get_device_properties(device).total_memory / cm.GIB)
    spec = cm.ModelSpec(name="model", layers=cfg.n_layers, heads=cfg.n_heads,
                        kv_heads=cfg.n_kv_heads, hidden=cfg.hidden_size,
                        intermediate=cfg.intermediate_size, vocab=cfg.vocab_size,
                        head_dim=cfg.head_dim, tied=cfg.tie_word_embeddings,
                        weights=plan_weights(weights), window=cfg.sliding_window or 0,
                        layer_types=tuple("full_attention" if w is None else "sliding_attention"
                                          for w in cfg.windows))  # the layers the runtime rings
    try:
        p = pl.search_plan(hw, spec, context, alpha0=0.6, alpha1=0.9, draft=None)
    except ValueError as e:
        raise TriforceError(f"--plan auto: {e}") from None
    s = p.settings
    extra = {"offload": "on", "on_chip": s.on_chip, "budget": s.budget, "gamma2": str(s.gamma2),
             "transfer_chunk": s.transfer_chunk}
    note = (f"--plan auto on {name}: " + ", ".join(f"{k} {v}" for k, v in extra.items())
            + f" (predicted {p.ms_per_token:.0f} ms/token)")
    return extra, note


def plan_settings(spec: str, loaded, context: int) -> dict:
    """`run --plan SPEC`: the RunOptions.of flat options updates (only `auto` exists)."""
    if spec != "auto":
        raise TriforceError(f"--plan {spec!r}: allowed is auto (see `triforce-offload plan` "
                            "for other machines)")
    extra, note = auto_plan(loaded.cfg, context, loaded.device, getattr(loaded, "weights", None))
    err.print(note, highlight=False)
    return extra


# ---- the command's strings ----

_GPU_NAMES = {"4090": "rtx4090", "rtx4090": "rtx4090", "a100-80g": "a100-80g",
              "a100-80gb": "a100-80g", "a10080g": "a100-80g", "a100_80g": "a100-80g"}


def parse_gpus(text: str) -> cm.Hardware:
    """'4090', '2x4090', 'a100-80g', '1xa100-80g' -> Hardware with that many GPUs."""
    t = str(text).strip().lower().replace(" ", "").replace("\u00d7", "x")
    m = re.fullmatch(r"(?:(\d+)x)?(.+)", t)
    key = _GPU_NAMES.get(m.group(2)) if m else None
    if key is None:
        raise ValueError(f"unknown GPU spec {text!r}: expected [Nx]NAME with NAME one of "
                         f"4090, a100-80g (e.g. 2x4090)")
    n = int(m.group(1) or 1)
    if not 1 <= n <= 16:
        raise ValueError(f"GPU count {n} in {text!r} is not in 1..16")
    hw = cm.HARDWARE[key]
    return replace(hw, gpus=n, name=key if n == 1 else f"{n}x{m.group(2)}")


def parse_context(text) -> int:
    """'131072', '128k', '32K', '1M' -> tokens (k = 1024, M = 1024**2)."""
    t = str(text).strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([km]?)", t)
    if not m:
        raise ValueError(f"bad context {text!r}: expected a token count like 131072, "
                         f"128k or 1M")
    n = round(float(m.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[m.group(2)])
    if n <= 0:
        raise ValueError(f"context must be positive, got {text!r}")
    return n


def parse_model(text: str) -> cm.ModelSpec:
    """A preset name (see costmodel.MODELS) or a HF model folder / config.json path."""
    key = str(text).strip().lower()
    if key in cm.MODELS:
        return cm.MODELS[key]
    p, name = Path(text), Path(text).name
    if not p.exists() and (hid := hub.parse(str(text))) is not None and not (hid.quant or hid.file):
        p, name = hub.resolve(hid), hid.repo  # an HF folder in the Hugging Face cache, by name
    cfg = p / "config.json" if p.is_dir() else p
    if cfg.is_file():
        try:
            hf = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg} is not valid JSON: {e.msg}") from None
        return cm.ModelSpec.from_hf_config(hf, name, *hf_layer_kinds(hf))
    raise ValueError(f"unknown model {text!r}: expected one of {', '.join(cm.MODELS)}, "
                     f"a folder with config.json or a model in the Hugging Face cache (org/name)")


def hf_layer_kinds(hf: dict) -> tuple[list[str], int | None]:
    """A config.json's per-layer attention kinds and window, as the runtime reads them
    (`runtime.config.layer_kinds`; a family it does not know reads as Llama: all global)."""
    archs = hf.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None) \
        or MODEL_TYPES.get(hf.get("model_type"), "llama")
    try:
        return layer_kinds(hf, arch)
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}") from None
