"""PNG plots for `bench` and the needle-in-a-haystack benchmark (matplotlib, Agg backend)."""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt
    return plt


def plot_speed(summary: list[dict], path: Path) -> Path:
    """ms/token against context, one line per mode (greedy runs)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = [s for s in summary if "skipped" not in s and s["temperature"] == 0]
    for mode in dict.fromkeys(s["mode"] for s in rows):
        pts = sorted((s["context"], s["ms_per_token"]) for s in rows if s["mode"] == mode)
        ax.plot(*zip(*pts), "o-", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # peers span two orders of magnitude
    ctxs = sorted({s["context"] for s in rows})
    ax.set_xticks(ctxs, [str(c) for c in ctxs])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode ms / token (log; lower is better)")
    ax.set_title("greedy decode speed per mode")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return _save(fig, path)


def plot_acceptance(summary: list[dict], path: Path) -> Path:
    """Acceptance per level against temperature, at the largest context."""
    plt = _plt()
    rows = [s for s in summary if "acceptance" in s]
    fig, ax = plt.subplots(figsize=(6, 4))
    if rows:
        ctx = max(s["context"] for s in rows)
        rows = [s for s in rows if s["context"] == ctx]
        ax.set_title(f"acceptance per level, context {ctx}")
    keys = dict.fromkeys((s["mode"], lv) for s in rows for lv in s["acceptance"])
    for mode, lv in keys:
        pts = sorted((s["temperature"], s["acceptance"][lv]) for s in rows
                     if s["mode"] == mode and lv in s["acceptance"])
        ax.plot(*zip(*pts), "o-", label=f"{mode}: {lv}")
    ax.set_xlabel("temperature")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if keys:
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_niah(grid: list[dict], path: Path, key: str = "found") -> Path:
    """Heat map of haystack length x needle depth; green where `key` holds for the cell."""
    plt = _plt()
    lengths = sorted({c["length"] for c in grid})
    depths = sorted({c["depth"] for c in grid})
    val = {(c["length"], c["depth"]): float(bool(c[key])) for c in grid}
    m = [[val.get((n, d), float("nan")) for n in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.45 * len(depths)))
    ax.imshow(m, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
    ax.set_xlabel("haystack tokens")
    ax.set_ylabel("needle depth")
    ax.set_title(f"needle in a haystack: {key}")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path
