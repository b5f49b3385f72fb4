"""`run --plan auto`: settings for this machine's GPU from the cost model's plan search.

Kept apart from cli/plan.py (the `plan` command) so `run` can import it without
importing the typer app.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..offload import costmodel as cm
from ..offload import plan as pl
from ..runtime.errors import TriforceError
from .show import err


def auto_plan(cfg, context: int, device: torch.device) -> tuple[dict, str]:
    """`run --plan auto`: (RunOptions.extra updates, a note for stderr).

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
                        head_dim=cfg.head_dim, tied=cfg.tie_word_embeddings)
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
    """`run --plan SPEC`: the RunOptions.extra updates (only `auto` exists)."""
    if spec != "auto":
        raise TriforceError(f"--plan {spec!r}: allowed is auto (see `triforce-offload plan` "
                            "for other machines)")
    extra, note = auto_plan(loaded.cfg, context, loaded.device)
    err.print(note, highlight=False)
    return extra
