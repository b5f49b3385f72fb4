"""Rich rendering for the CLI: tables and the stats line."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

out = Console()
err = Console(stderr=True, soft_wrap=True)


def show_info(d: dict):
    t = Table(title="triforce-offload info", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    for k in ("torch", "cuda", "cuda_available", "cpu", "cpu_cores", "cpu_threads",
              "torch_threads", "pinned_memory"):
        t.add_row(k, str(d[k]))
    t.add_row("ram", f"{d['ram_available_gb']:.1f} GB available of {d['ram_total_gb']:.1f} GB")
    for k, v in d.get("cpu_kernels", {}).items():
        t.add_row(f"cpu {k.replace('_', ' ')}", v)
    t.add_row("gpu attention", d["gpu_attention"])
    t.add_row("gpu compile", d["gpu_compile"])
    t.add_row("gpu quantized linear", d["gpu_quantized_linear"])
    t.add_row("gpu linear", d.get("gpu_linear", ""))
    for g in d["gpus"] or [{"name": "none"}]:
        link = (f"PCIe gen {g['pcie_gen']} x{g['pcie_width']}" if "pcie_gen" in g
                else g.get("pcie", ""))
        mem = f"{g['memory_gb']:.1f} GB" if "memory_gb" in g else ""
        t.add_row(f"gpu {g.get('index', '')}".strip(), f"{g['name']} {mem} {link}".strip())
    out.print(t)


def stats_line(d: dict) -> str:
    parts = [f"prompt {d['prompt_tokens']} tok", f"prefill {d['prefill_s']:.2f} s",
             f"decode {d['decode_ms_per_token']:.1f} ms/tok ({d['tokens_per_s']:.1f} tok/s)",
             f"{d['new_tokens']} new", f"peak {d['peak_memory_gb']:.2f} GB"]
    per_token = d.get("acceptance_per_token", {})
    for k, v in d.get("acceptance", {}).items():  # no [brackets]: rich would read them as markup
        if d.get("drafts", {}).get(k, {}).get("drafted") == 0:
            continue  # drafted nothing (sized to none, or bypassed): no acceptance to show
        parts.append(f"accept {k} {v:.2f}" + (f" ({per_token[k]:.2f}/judged tok)" if k in per_token else ""))
    if "mean_accepted" in d:
        parts.append(f"mean accepted {d['mean_accepted']:.2f}")
    sized = d.get("sized_drafts")
    if sized:  # the n-gram drafter drafts where its matches are expected to pay
        parts.append(f"ngram drafted {sized['drafted']} tok from {sized['matches']} matches")
    skipped = {k: v for k, v in d.get("bypassed_tokens", {}).items() if v}
    if skipped:  # levels that did not pay, skipped for that many of the new tokens
        parts.append("bypassed " + ", ".join(f"{k} {v} tok" for k, v in skipped.items()))
    if d.get("rebuilds"):
        parts.append(f"rebuilds {d['rebuilds']}")
    if d.get("graph_captures"):
        parts.append(f"{d['graph_captures']} CUDA graphs ({d['capture_s']:.2f} s to capture)")
    parts += d.get("notes", [])
    if "overlap" in d:
        parts.append(f"overlap {d['overlap']:.2f}")
    return " | ".join(parts)


def compare_table(a: dict, b: dict, same_text: bool, greedy: bool) -> Table:
    """`run --compare`: the two modes side by side, the speedup, whether the texts agree."""
    t = Table(title="side by side, same prompt", title_justify="left")
    for col in ("", a["mode"], b["mode"]):
        t.add_column(col, justify="right" if col else "left")
    rows = [("decode ms/token", lambda d: f"{d['decode_ms_per_token']:.1f}"),
            ("new tokens", lambda d: str(d["new_tokens"])),
            ("prefill s", lambda d: f"{d['prefill_s']:.2f}"),
            ("acceptance per level", lambda d: ", ".join(f"{k} {v:.2f}" for k, v in
                                                         d.get("acceptance", {}).items()) or "-"),
            ("mean tokens per verification", lambda d: f"{d['mean_accepted']:.2f}" if "mean_accepted" in d else "-")]
    for name, f in rows:
        t.add_row(name, f(a), f(b))
    t.add_row("speedup", f"{b['decode_ms_per_token'] / a['decode_ms_per_token']:.2f}x", "1.00x")
    if greedy:
        t.add_row("texts identical", "yes" if same_text else "NO", "")
    else:
        t.add_row("texts identical", "(sampled: equal in distribution, not token for token)", "")
    return t
