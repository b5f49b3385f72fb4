"""`triforce-offload plan`: choose TriForce settings for GPUs with the cost model; `run --plan auto`."""
from __future__ import annotations

import json
import math
import shlex
from types import SimpleNamespace
from typing import Optional

import typer
from rich.table import Table

from ..offload import costmodel as cm
from ..offload import plan as pl
from ..runtime.config import parse_rope_scaling
from ..runtime.errors import TriforceError
from .app import app
from .show import err, out


def _value(fn, *args):
    """Parser/search ValueErrors are user mistakes: one line, exit 2."""
    try:
        return fn(*args)
    except ValueError as e:
        raise TriforceError(str(e)) from None


@app.command()
def plan(
    gpus: str = typer.Option("2x4090", help="[N x]GPU: 4090, 2x4090, a100-80g ..."),
    model: str = typer.Option("llama2-7b-128k", help=f"Preset ({', '.join(cm.MODELS)}) "
                              "or a HF model folder / config.json."),
    context: str = typer.Option("128k", help="Context in tokens: 131072, 128k, 1M (at most "
                                "the model's, unless --rope-scaling stretches it)."),
    rope_scaling: Optional[str] = typer.Option(None, help="Stretch the model's context, e.g. "
                                               "linear:8 (passed on to the printed command)."),
    gpu_mem: Optional[float] = typer.Option(None, help="GiB per GPU [default: the card's]."),
    host_mem: Optional[float] = typer.Option(None, help="GiB of host RAM [default: 256]."),
    alpha0: float = typer.Option(0.6, help="Acceptance of L0 drafts by L1 (measured by bench)."),
    alpha1: float = typer.Option(0.9, help="Acceptance of L1 tokens by L2 at a 4K budget."),
    draft_model: bool = typer.Option(True, "--draft-model/--no-draft-model",
                                     help="Plan with a llama-68m L0 draft (else L1 drafts alone)."),
    model_path: Optional[str] = typer.Option(None, help="Model path for the printed command "
                                             "[default: --model]."),
    draft_path: str = typer.Option("path/to/llama-68m", help="L0 draft model path for the "
                                   "printed command (same tokenizer as the target)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Search on-chip layers, budget, gamma2 and transfer chunk for the lowest predicted
    ms/token that fits memory; print the plan and the command line to run it."""
    hw = _value(pl.parse_gpus, gpus)
    spec = _value(pl.parse_model, model)
    ctx = _value(pl.parse_context, context)
    check_context(spec, ctx, rope_scaling)
    for a, flag in ((alpha0, "--alpha0"), (alpha1, "--alpha1")):
        if not 0 <= a <= 1:
            raise TriforceError(f"{flag} {a}: must be in [0, 1]")
    p = _value(lambda: pl.search_plan(hw, spec, ctx, gpu_mem, host_mem, alpha0, alpha1,
                                      draft=cm.LLAMA_68M if draft_model else None))
    cmd = run_command(p, model_path or model, draft_path if draft_model else None, rope_scaling)
    if as_json:
        print(json.dumps({**plan_dict(p), "rope_scaling": rope_scaling, "command": cmd}))
        return
    out.print(plan_table(p))
    out.print(cmd, highlight=False, soft_wrap=True)


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
    return (head + mode + f"--budget {s.budget} --chunk {s.chunk} --gamma2 {s.gamma2} "
            f"--offload on --on-chip {s.on_chip} --transfer-chunk {s.transfer_chunk} "
            f"--tp {p.tp} --max-context {s.context}")


def plan_dict(p: pl.Plan) -> dict:
    s = p.settings
    return {"gpus": p.hardware.gpus, "hardware": p.hardware.name, "model": p.model.name,
            "context": s.context, "tp": p.tp, "on_chip": s.on_chip, "budget": s.budget,
            "chunk": s.chunk, "gamma1": s.gamma1 if s.draft is not None else 0,
            "gamma2": s.gamma2, "transfer_chunk": s.transfer_chunk, "alpha1": s.alpha1,
            "ms_per_token": p.ms_per_token, "baseline_ms": p.baseline_ms,
            "gpu_gb": p.gpu_gb, "host_gb": p.host_gb}


def plan_table(p: pl.Plan) -> Table:
    d = plan_dict(p)
    t = Table(title=f"plan: {d['model']} at {d['context']} tokens on {p.hardware.gpus} x "
                    f"{p.hardware.name.split('x')[-1]} (predicted by the cost model)",
              show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    for k in ("tp", "on_chip", "budget", "chunk", "gamma1", "gamma2", "transfer_chunk"):
        t.add_row(k.replace("_", " "), str(d[k]))
    t.add_row("L1 acceptance at budget", f"{d['alpha1']:.3f}")
    t.add_row("GPU memory", f"{d['gpu_gb']:.1f} GiB per GPU")
    t.add_row("host memory", f"{d['host_gb']:.1f} GiB")
    t.add_row("predicted TriForce", f"{d['ms_per_token']:.0f} ms/token")
    t.add_row("predicted autoregressive offload", f"{d['baseline_ms']:.0f} ms/token")
    t.add_row("predicted speedup", f"{d['baseline_ms'] / d['ms_per_token']:.1f}x")
    return t
