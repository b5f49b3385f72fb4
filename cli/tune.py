"""`triforce-offload tune`: sweep transfer chunk sizes, save this device's profile."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..bench.offload_timing import tune_rows
from ..offload.errors import OffloadError
from ..offload.tune import save_profile
from ..runtime import api
from ..runtime.options import ModelOptions
from .app import app
from .options import options
from .show import err, out


def parse_sizes(spec: str) -> list[int]:
    """'64,256,1024' or '64-16384' (powers of two in between) -> chunk sizes."""
    try:
        if "-" in spec:
            lo, hi = (int(x) for x in spec.split("-"))
            sizes = [s for s in (2 ** i for i in range(31)) if lo <= s <= hi]
        else:
            sizes = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise OffloadError(f"--sizes {spec!r}: give sizes like 64,256,1024 or a range 64-16384")
    if not sizes or min(sizes) < 1:
        raise OffloadError(f"--sizes {spec!r}: need at least one size >= 1 token")
    return sizes


@app.command()
@options
def tune(
    model: ModelOptions,
    context: int = typer.Option(8192, help="Context (tokens) of the timed verification."),
    tokens: int = typer.Option(6, help="Tokens per verification forward (gamma2)."),
    sizes: str = typer.Option("64-16384", help="Chunk sizes: 64,256,1024 or a range 64-16384."),
    repeats: int = typer.Option(2, help="Timed verifications per size (best is kept)."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG of GB/s and latency per chunk."),
    save: bool = typer.Option(True, "--save/--no-save", help="Write the device profile `run` reads."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Measure link GB/s and verify latency per transfer chunk; pick the fastest."""
    chunks = parse_sizes(sizes)
    loaded = api.load(model, progress=lambda m: err.print(m))
    rows, best = tune_rows(loaded, context, tokens, chunks, repeats,
                           progress=lambda r: err.print(f"chunk {r['chunk']}: "
                                                        f"{r['verify_ms']:.1f} ms", highlight=False))
    meta = {"context": context, "tokens": tokens, "dtype": str(loaded.dtype),
            "bytes_per_token": rows[0]["copy_bytes"] // rows[0]["chunk"]}  # K + V, one layer
    path = save_profile(loaded.device, rows, best, meta) if save else None
    if plot:
        plot_rows(rows, plot)
    if as_json:
        print(json.dumps({"transfer_chunk": best, "profile": str(path) if path else None,
                          "rows": rows, **meta}))
        return
    show_rows(rows, best)
    err.print(f"best transfer chunk {best}" + (f"; saved {path}" if path else ""), highlight=False)


def show_rows(rows: list[dict], best: int):
    t = Table(title="transfer chunk sweep")
    for c in ("chunk", "link GB/s", "verify ms", "overlap"):
        t.add_column(c, justify="right")
    for r in rows:
        mark = " *" if r["chunk"] == best else ""
        t.add_row(f"{r['chunk']}{mark}", f"{r['link_gbps']:.2f}", f"{r['verify_ms']:.1f}",
                  f"{r['overlap']:.2f}")
    out.print(t)


def plot_rows(rows: list[dict], path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = [r["chunk"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(x, [r["link_gbps"] for r in rows], "o-", label="link GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("transfer chunk (tokens)")
    ax.set_ylabel("GB/s")
    ax2 = ax.twinx()
    ax2.plot(x, [r["verify_ms"] for r in rows], "s--", color="C1", label="verify ms")
    ax2.set_ylabel("verify latency (ms)")
    fig.legend(loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
