"""`triforce-offload bench`: every mode and the outside references on one model and prompt."""
from __future__ import annotations

import json
import platform
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..bench.runner import (DEFAULT_MODES, EXTRA_BASELINES, BenchOptions, check_baselines, floors,
                            run_bench, summarize)
from ..bench.bandwidth import copy_bandwidth
from ..runtime import api
from ..runtime.data import check_builtin_prompt
from ..runtime.errors import TriforceError
from ..runtime.conflicts import refuse
from ..runtime.options import GenerationOptions, ModelOptions, RetrievalOptions
from .app import app
from .options import options, pick
from .show import err, out


def parse_list(text: str, kind, flag: str) -> list:
    try:
        vals = [kind(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise TriforceError(f"{flag} {text!r}: expected a comma-separated list of "
                            f"{kind.__name__} values, e.g. 2048,4096")
    if not vals:
        raise TriforceError(f"{flag} {text!r}: give at least one value")
    return vals


@app.command()
@options
def bench(
    model: ModelOptions,
    gen: Annotated[GenerationOptions, pick("draft", "gamma1", "gamma2")],
    retrieval: Annotated[RetrievalOptions, pick("budget", "retrieval_chunk")],
    gguf: Optional[str] = typer.Option(None, help="GGUF for the llama.cpp rows "
                                       "\\[default: --model if it is a .gguf, or the bundled one]"),
    contexts: str = typer.Option("2048", help="Contexts (prompt + new tokens), e.g. 2048,4096,8192."),
    new_tokens: int = typer.Option(64, help="Tokens generated per run (end-of-sequence ignored)."),
    temperatures: str = typer.Option("0", help="Temperatures, e.g. 0,0.6,1.0 (0 is greedy)."),
    repeats: int = typer.Option(1, help="Runs per cell; the median ms/token is reported, and the "
                                "median of each repeat's ratio to autoregressive."),
    modes: str = typer.Option(",".join(DEFAULT_MODES), help="Contenders to run (comma-separated)."),
    baseline: str = typer.Option("", help="Extra peer rows (comma-separated): "
                                 f"{', '.join(EXTRA_BASELINES)} (real DeepSpeed ZeRO-Inference; "
                                 "needs CUDA and `pip install triforce-offload\\[deepspeed]`)."),
    builtin_prompt: str = typer.Option("summary", help="Built-in prompt: summary (essays + a summary "
                                       "request) or continue (essay text to continue)."),
    fresh_prefill: bool = typer.Option(False, "--fresh-prefill", help="Prefill the prompt in every run "
                                       "\\[default: once per context for our in-memory modes and "
                                       "llama.cpp, each run decoding from that KV; with --batch once "
                                       "per prompt for our modes on the CPU]."),
    seed: int = typer.Option(0, help="Sampling seed."),
    lookup: int = typer.Option(10, help="Prompt-lookup draft length of transformers and llama.cpp."),
    threads: int = typer.Option(0, help="CPU threads of every contender (torch and llama.cpp) "
                                "\\[default: torch's]."),
    out_dir: Path = typer.Option(Path("results"), "--out", help="Folder for bench.jsonl and PNGs."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write the PNG plots."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
    batch: str = typer.Option("", help="Batch sizes, e.g. 1,4,8: that many sequences at once, each its "
                              "own prompt of the context less --new-tokens; aggregate decode tokens/s "
                              "of our modes (autoregressive, triforce, retrieval, draft among --modes) "
                              "against llama.cpp's batched decoding (llama-batched-bench)."),
    llama_batched_bench: Optional[str] = typer.Option(None, help="The llama-batched-bench binary for "
                                                      "--batch \\[default: $LLAMA_CPP_BIN/, else PATH]."),
    check: bool = typer.Option(True, "--check/--no-check", help="With --batch: run each sequence again "
                               "alone and compare its tokens (the identity the batch guarantees; "
                               "doubles the time)."),
    shared_prefix: int = typer.Option(0, help="With --batch: every prompt starts with one document of this "
                                      "many tokens (questions over one text); each mode runs with the "
                                      "document held per sequence and once for all (shared prefix)."),
):
    """Run the modes side by side; table, JSONL (appended) and PNG plots."""
    extra = check_baselines(parse_list(baseline, str, "--baseline") if baseline else [])
    names = parse_list(modes, str, "--modes")
    if batch:
        return bench_batch(model, gen, retrieval, parse_list(batch, int, "--batch"), names,
                           parse_list(contexts, int, "--contexts"), new_tokens, threads, gguf,
                           llama_batched_bench, out_dir, as_json, shared_prefix, check,
                           check_builtin_prompt(builtin_prompt), repeats, not fresh_prefill)
    o = BenchOptions(parse_list(contexts, int, "--contexts"), new_tokens,
                     parse_list(temperatures, float, "--temperatures"), repeats,
                     names + [b for b in extra if b not in names], seed, gguf=gguf,
                     spec=dict(draft=gen.draft, gamma1=gen.gamma1, gamma2=gen.gamma2,
                               budget=retrieval.budget, retrieval_chunk=retrieval.retrieval_chunk),
                     lookup=lookup, threads=threads, prompt=check_builtin_prompt(builtin_prompt),
                     reuse_prefill=not fresh_prefill)
    o.check()
    if threads:
        torch.set_num_threads(threads)  # the same CPU share for our modes and the peers
    loaded = api.load(model, progress=lambda m: err.print(m))
    meta = run_meta(loaded, o, model.model)
    meta["copy_gbps"] = round(copy_bandwidth("cpu", 256, reps=5) / 1e9, 2)  # measured in this run, for the floors
    with runs_bar() as progress:
        rows = run_bench(loaded, o, model.model, progress, row_writer(out_dir / "bench.jsonl", meta))
    summary = summarize(rows)
    floor = floors(loaded, o.contexts, meta["copy_gbps"] * 1e9)
    for s in summary:
        if "context" in s:
            s["floor_ms"] = floor[s["context"]]
    pngs = write_plots(summary, out_dir) if plots else []
    for s in summary:
        if "skipped" in s:
            err.print(skip_line(s), markup=False, highlight=False)
    if as_json:
        print(json.dumps({"meta": meta, "summary": summary, "plots": [str(p) for p in pngs]}))
        return
    show_summary(summary, o, meta["copy_gbps"])
    err.print(f"appended {len(rows)} rows to {out_dir / 'bench.jsonl'}"
              + "".join(f"; wrote {p}" for p in pngs), highlight=False)


def bench_batch(model: ModelOptions, gen, retrieval, sizes: list[int], names: list[str], contexts: list[int],
                new_tokens: int, threads: int, gguf, binary, out_dir: Path, as_json: bool, shared: int = 0,
                check: bool = True, kind: str = "continue", repeats: int = 1, reuse: bool = True):
    """`bench --batch`: our batched modes against llama-batched-bench, one table."""
    from ..bench.batch import OURS, run_batch_bench, summarize_batch
    from ..runtime.model.loader import default_model_path
    bad = [n for n in names if n not in OURS and n != "llama.cpp"]
    if bad:
        raise TriforceError(f"--modes {','.join(bad)}: with --batch allowed are "
                            f"{', '.join(OURS)}, llama.cpp")
    if len(contexts) != 1 or contexts[0] < new_tokens + 64 or min(sizes) < 1 or new_tokens < 2:
        raise TriforceError("--batch takes one --contexts value of at least --new-tokens + 64, "
                            "batch sizes >= 1 and --new-tokens >= 2")
    if repeats < 1:
        raise TriforceError(f"--repeats {repeats}: at least 1")
    if shared < 0 or (shared and shared > contexts[0] - new_tokens - 16):
        raise TriforceError(f"--shared-prefix {shared}: at least 0 and at most the prompt "
                            f"({contexts[0] - new_tokens} tokens) less 16 (each sequence's own question)")
    if threads:
        torch.set_num_threads(threads)
    loaded = api.load(model, progress=lambda m: err.print(m))
    gguf = gguf or (model.model if str(model.model or "").endswith(".gguf") else
                    None if model.model else default_model_path())
    if "llama.cpp" in names and gguf is None:
        refuse("batch-bench-llamacpp")
    spec = {k: v for k, v in dict(draft=gen.draft, gamma1=gen.gamma1, gamma2=gen.gamma2, budget=retrieval.budget,
                                  retrieval_chunk=retrieval.retrieval_chunk).items() if v is not None}
    meta = {**run_meta(loaded, BenchOptions(contexts, new_tokens, modes=["autoregressive"]), model.model),
            "bench": "batch", "gguf": str(gguf)}
    with runs_bar() as progress:
        rows = run_batch_bench(loaded, sizes, contexts[0], new_tokens, names, spec,
                               threads or torch.get_num_threads(), gguf, binary, check, progress=progress,
                               on_row=row_writer(out_dir / "bench.jsonl", meta), shared=shared, kind=kind,
                               repeats=repeats, reuse=reuse)
    summary = summarize_batch(rows)
    if as_json:
        print(json.dumps({"meta": meta, "summary": summary}))
        return
    t = Table(title=f"bench --batch: {contexts[0] - new_tokens}-token prompts"
              + (f" ({shared} of them one shared document)" if shared else "")
              + f", {new_tokens} new tokens per sequence, {meta['torch_threads']} threads"
              + (f", median of {repeats} repeats" if repeats > 1 else ""),
              caption=Text("S_TG: tokens produced after every sequence had its first one, over that time "
                           "(llama-batched-bench's S_TG); T_PP: until then (kept: the prompts' KV taken from "
                           "an earlier run's prefill; --fresh-prefill prefills every run)"
                           + ("; ratios: the median of each repeat's" if repeats > 1 else "")))
    for c in ("mode", "batch", "T_PP s", "T_TG s", "S_TG tok/s", "ms/token per seq", "vs batch 1",
              "vs autoregressive", "vs llama.cpp", "seqs/forward", "same as solo") + (
            ("S_TG vs own", "time vs own") if shared else ()):
        t.add_column(c, justify="left" if c == "mode" else "right")
    for s in summary:
        if "skipped" in s:
            err.print(skip_line(s), markup=False, highlight=False)
            continue
        same = {None: "-", True: "yes", False: "NO"}[s.get("same_as_solo")]
        ratio = lambda k: f"{s[k]:.2f}x" if k in s else "-"
        t.add_row(s["mode"], str(s["batch"]), f"{s['t_pp']:.2f}" + (" kept" if s.get("kept_prefill") else ""),
                  f"{s['t_tg']:.2f}", f"{s['speed_tg']:.1f}",
                  f"{s['per_seq_ms']:.1f}" if s.get("per_seq_ms") else "-", ratio("vs_batch1"),
                  ratio("vs_autoregressive"), ratio("vs_llama_cpp"),
                  f"{s['seqs_per_forward']:.2f}" if "seqs_per_forward" in s else "-", same,
                  *((ratio("vs_own"), ratio("vs_own_total")) if shared else ()))
    (out if out.is_terminal else Console(width=160)).print(t)
    err.print(f"appended {len(rows)} rows to {out_dir / 'bench.jsonl'}", highlight=False)


@contextmanager
def runs_bar():
    """Yields progress(done, total, label) driving a bar over the runs on stderr."""
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=err, transient=True) as p:
        task = p.add_task("bench", total=None)
        yield lambda done, total, label: p.update(task, completed=done, total=total,
                                                  description=label)


def run_meta(loaded, o: BenchOptions, model) -> dict:
    return {"bench": "bench", "time": time.time(), "model": model or "bundled SmolLM2-135M-Instruct",
            "dtype": str(loaded.dtype).replace("torch.", ""), "device": str(loaded.device),
            "kv_dtype": str(loaded.kv_dtype).replace("torch.", ""), "activations": loaded.activations,
            "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "new_tokens": o.new_tokens, "spec": o.spec, "prompt_kind": o.prompt,
            "reuse_prefill": o.reuse_prefill}


def row_writer(path: Path, meta: dict):
    """Appends each row to the JSONL as soon as it is measured."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(row: dict):
        with open(path, "a") as f:
            f.write(json.dumps({**meta, **row}) + "\n")
    return write


def write_plots(summary: list[dict], folder: Path) -> list[Path]:
    from ..bench.plots import plot_acceptance, plot_speed
    return [plot_speed(summary, folder / "bench_speed.png"),
            plot_acceptance(summary, folder / "bench_acceptance.png")]


def show_summary(summary: list[dict], o: BenchOptions, gbps: float):
    notes = "\n".join([f"floor: the weights and the KV of the context (at our KV dtype) a decode step "
                       f"reads, over the copy bandwidth measured in this run ({gbps:.1f} GB/s)"]
                      + [skip_line(s) for s in summary if "skipped" in s])
    t = Table(title=f"bench: {o.new_tokens} new tokens per run, median of {o.repeats}",
              caption=Text(notes))  # Text: "[bench]" is not markup
    peer = any("vs_llama_cpp" in s for s in summary)  # the column where llama.cpp ran
    for c in ("mode", "context", "T", "ms/token", "floor ms", "tok/s", "speedup", "vs AR+offload",
              *(["vs llama.cpp"] if peer else []), "acceptance", "mean acc.", "peak GB", "lossless"):
        t.add_column(c, justify="left" if c in ("mode", "acceptance") else "right")
    for s in summary:  # skipped contenders last, their reasons in the caption
        t.add_row(*([s["mode"], "-", "-", "skipped"] + ["-"] * (8 + peer) if "skipped" in s
                    else summary_cells(s, peer)))
    con = out if out.is_terminal else Console(width=160)  # files and pipes: no squeezed columns
    con.print(t)


def skip_line(s: dict) -> str:
    return f"{s['mode']}: skipped ({s['skipped']})"


def summary_cells(s: dict, peer: bool = False) -> list[str]:
    """A summary row's cells; `peer`: with the vs-llama.cpp column (llama.cpp's time over ours)."""
    acc = " ".join(f"{k} {v:.2f}" for k, v in s.get("acceptance", {}).items())
    lossless = {None: "-", True: "yes", False: "NO"}[s["lossless"]]
    if s.get("peer") and s["lossless"] is not None:  # a reference, not a lossless claim
        lossless = "same" if s["lossless"] else "differs"
    return [s["mode"], str(s["context"]), f"{s['temperature']:g}", f"{s['ms_per_token']:.1f}",
            f"{s['floor_ms']:.1f}" if "floor_ms" in s else "-", f"{s['tokens_per_s']:.1f}", f"{s['speedup']:.2f}x" if s["speedup"] else "-",
            f"{s['offload_speedup']:.2f}x" if "offload_speedup" in s else "-",
            *([f"{s['vs_llama_cpp']:.2f}x" if "vs_llama_cpp" in s else "-"] if peer else []), acc or "-",
            f"{s['mean_accepted']:.2f}" if "mean_accepted" in s else "-", f"{s['peak_gb']:.2f}",
            lossless]
