"""The results tables of README.md and docs/*.md, rendered from the committed results/*.jsonl.

Usage:
    python benchmarks/tables.py                  # rewrite every table region in README.md and docs/*.md
    python benchmarks/tables.py --check          # exit 1 naming each region that is out of date
    python benchmarks/tables.py --print speedup  # one table on stdout
    python benchmarks/tables.py --list           # the table names, their sources and devices

A region is the text between the lines `<!-- table:NAME -->` and `<!-- /table:NAME -->`;
it is replaced by the table NAME of `TABLES` rendered: one line with the device and the
command that produced the rows, then the markdown table. Nothing outside the markers
changes. The JSONL rows are what the benchmarks appended (results/ is git-ignored: the
files the docs use were added with `git add -f`); `costmodel` and `plan` are predictions
that offload/costmodel.py computes, so they are rendered from the model itself. The rows
say little about the machine (`bench` records "x86_64"), so each table's device is
written here, next to the command that made it.

To add a measurement to the docs: run the benchmark, `git add -f` its JSONL, add an entry
to `TABLES`, put the two marker lines where the table belongs, run this script.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
MARK = re.compile(r"^<!-- (/?)table:([\w.-]+) -->$")

AVX512_VM = "shared 2-core x86_64 VM with AVX-512, no GPU"
AVX2_VM = "2-core AMD EPYC VM with AVX2 (no AVX-512), no GPU, quiet, torch's 2 threads"


def read_rows(name: str) -> list[dict]:
    path = RESULTS / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rows_between(name: str, t0: float, t1: float | None = None) -> list[dict]:
    """Rows whose `time` lies in [t0, t1]: one `bench` invocation shares its start time
    (t1 None: exactly t0); niah.py stamps each row as it is written."""
    picked = [r for r in read_rows(name) if t0 <= r["time"] <= (t0 if t1 is None else t1)]
    if not picked:
        raise SystemExit(f"results/{name}: no rows with time in [{t0}, {t1 or t0}]")
    return picked


def speedup_runs(name: str = "speedup.jsonl") -> list[list[dict]]:
    """speedup.py's rows split into invocations (its rows carry no time): a row whose
    (context, temperature, top-p, mode, budget) the current invocation has already seen
    starts the next."""
    runs, seen = [], set()
    for r in read_rows(name):
        key = (r["context"], r["temperature"], r["top_p"], r["mode"], r.get("budget_spec"))
        if not runs or key in seen:
            runs.append([])
            seen = set()
        runs[-1].append(r)
        seen.add(key)
    return runs


# ---- rendering ----

def markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(r) + " |" for r in rows]


def acceptance(acc: dict | None) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in (acc or {}).items()) or "-"


def bench_summary(rows: list[dict]) -> list[dict]:
    """`triforce-offload bench`'s own summary (median over repeats, speedups, lossless)."""
    from triforce_offload.bench.runner import summarize
    return [s for s in summarize(rows) if "skipped" not in s]


def lossless_cell(s: dict) -> str:
    if s.get("peer") and s["lossless"] is not None:  # a reference, not a lossless claim
        return "same" if s["lossless"] else "differs"
    return {None: "-", True: "yes", False: "NO"}[s["lossless"]]


def bench_table(rows: list[dict]) -> list[str]:
    """The bench summary as `bench` prints it; `vs AR+offload` where offloaded contenders ran;
    skipped contenders are listed under the table with their reason."""
    summary = bench_summary(rows)
    offload = any("offload_speedup" in s for s in summary)
    header = (["mode", "context", "T", "ms/token", "tok/s", "speedup"] + ["vs AR+offload"] * offload
              + ["acceptance", "mean accepted", "peak GB", "lossless"])
    body = []
    for s in summary:
        cells = [s["mode"], str(s["context"]), f"{s['temperature']:g}", f"{s['ms_per_token']:.1f}",
                 f"{s['tokens_per_s']:.1f}", f"{s['speedup']:.2f}x" if s["speedup"] else "-"]
        if offload:
            cells.append(f"{s['offload_speedup']:.2f}x" if "offload_speedup" in s else "-")
        body.append(cells + [acceptance(s.get("acceptance")),
                             f"{s['mean_accepted']:.2f}" if "mean_accepted" in s else "-",
                             f"{s['peak_gb']:.2f}", lossless_cell(s)])
    skipped = [f"- `{r['mode']}`: skipped ({r['skipped']})" for r in rows if "skipped" in r]
    return markdown(header, body) + ([""] + skipped if skipped else [])


def speedup_table(rows: list[dict], contexts: tuple = ()) -> list[str]:
    """speedup.py's rows: speedup over autoregressive at the same context and sampling; a
    budget column where the rows record their budget (speedup.py compares several)."""
    base = {(r["context"], r["temperature"], r["top_p"]): r["ms_per_token"]
            for r in rows if r["mode"] == "autoregressive"}
    budgets = any("budget" in r for r in rows)
    body = []
    for r in rows:
        if contexts and r["context"] not in contexts:
            continue
        key = (r["context"], r["temperature"], r["top_p"])
        t = f"{r['temperature']:g}" + (f", top-p {r['top_p']:g}" if r["top_p"] < 1 else "")
        same = ""
        if "matches_ar" in r:
            same = "yes" if r["matches_ar"] else (f"no (at token {r['first_divergence']}, "
                                                  f"margin {r['ar_margin_at_divergence']:g})")
        budget = [] if not budgets else [f"{r['budget']} ({r['budget_spec']})" if r.get("budget") else "-"]
        body.append([f"{r['context']} ({r['prompt_tokens']})", t, r["mode"]] + budget +
                    [f"{r['ms_per_token']:.1f}", f"{base[key] / r['ms_per_token']:.2f}x",
                     acceptance(r.get("acceptance")),
                     f"{r['mean_accepted']:.2f}" if "mean_accepted" in r else "-", same])
    return markdown(["context (prompt)", "T", "mode"] + ["budget"] * budgets +
                    ["ms/token", "speedup", "acceptance", "mean accepted", "= autoregressive (greedy)"], body)


def retrieval_expected_table() -> list[str]:
    """Mean over seeds per configuration."""
    groups = {}
    for r in read_rows("retrieval_expected.jsonl"):
        groups.setdefault((-r["top_p"], r["budget"], r["chunk"], r["rebuild"]), []).append(r)
    body = []
    for (top_p, budget, chunk, rebuild), g in sorted(groups.items(), key=lambda kv: _rebuild_key(kv[0])):
        body.append([f"{-top_p:g}", str(budget), str(chunk), rebuild, str(len(g)),
                     f"{statistics.mean(r['alpha'] for r in g):.3f}",
                     f"{statistics.mean(r['round_acc'] for r in g):.3f}"])
    return markdown(["top-p", "budget", "retrieval chunk", "rebuild", "seeds", "alpha per token",
                     "expected accepted/drafted"], body)


def _rebuild_key(key):
    top_p, budget, chunk, rebuild = key
    return top_p, budget, chunk, 0 if rebuild == "never" else int(rebuild.split(":")[1])


def niah_table(rows: list[dict]) -> list[str]:
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    body = [[str(r["length"]), f"{r['depth']:g}%", yes(r["found"]), yes(r["found_triforce"]),
             yes(r["identical"])] for r in rows]
    return markdown(["haystack", "depth", "autoregressive found", "triforce found", "identical"], body)


def costmodel_table() -> list[str]:
    from triforce_offload.offload import costmodel as cm
    rows = cm.paper_table()
    body = [[setup, mode, f"{pred:.0f}", f"{paper:.0f}", f"{pred / paper:.2f}"]
            for setup, mode, pred, paper in rows]
    pred = {(s, m): p for s, m, p, _ in rows}
    paper = {(s, m): p for s, m, _, p in rows}
    lines = markdown(["setup", "mode", "predicted ms/token", "paper ms/token", "predicted / paper"], body)
    lines.append("")
    for s in dict.fromkeys(s for s, _ in pred):
        base = "autoregressive" if (s, "autoregressive") in pred else "deepspeed"
        speed = lambda d: d[(s, base)] / d[(s, "triforce")]  # noqa: E731
        lines.append(f"- {s}: TriForce over {base}: predicted {speed(pred):.1f}x, paper {speed(paper):.1f}x")
    return lines


PLAN = ("2x4090", "llama2-7b-128k", 131072)  # --gpus, --model, --context of the plan shown


def plan_table() -> list[str]:
    """What `triforce-offload plan --gpus 2x4090 --model llama2-7b-128k --context 128k` prints:
    the cost model's plan search (offload/plan.py) and the `run` command the CLI builds from it."""
    from triforce_offload.cli.plan import run_command
    from triforce_offload.offload import costmodel as cm
    from triforce_offload.offload.plan import search_plan
    gpus, model, context = PLAN
    p = search_plan(cm.HARDWARE[gpus], cm.MODELS[model], context, draft=cm.LLAMA_68M)
    s = p.settings
    body = [["tensor-parallel ranks", str(p.tp)], ["on-chip layers", str(s.on_chip)],
            ["budget", str(s.budget)], ["retrieval chunk", str(s.retrieval_chunk)],
            ["gamma1", str(s.gamma1)], ["gamma2", str(s.gamma2)],
            ["transfer chunk", str(s.transfer_chunk)], ["L1 acceptance at budget", f"{s.alpha1:.3f}"],
            ["GPU memory", f"{p.gpu_gb:.1f} GiB per GPU"], ["host memory", f"{p.host_gb:.1f} GiB"],
            ["predicted TriForce", f"{p.ms_per_token:.0f} ms/token"],
            ["predicted autoregressive offload", f"{p.baseline_ms:.0f} ms/token"],
            ["predicted speedup", f"{p.baseline_ms / p.ms_per_token:.1f}x"]]
    return markdown(["setting", "value"], body) + ["", "The `run` command it prints:", "",
                                                   "```", run_command(p, model, "path/to/llama-68m"), "```"]


# ---- the tables ----

@dataclass(frozen=True)
class Table:
    source: str  # where the rows come from (for --list and the caption)
    device: str  # the machine the rows were measured on, or "predicted"
    commands: tuple[str, ...]  # the command(s) that produced the rows
    render: Callable[[], list[str]]  # markdown lines

    def lines(self) -> list[str]:
        made = " and ".join(f"`{c}`" for c in self.commands)
        if self.device == "generated":
            head = f"Generated from `{self.source}` by {made}."
        elif self.device == "predicted":
            head = f"Predicted by the cost model (`{self.source}`), not measured; printed by {made}."
        else:
            head = f"Rows from `{self.source}`, measured on a {self.device}; made with {made}."
        return [head, ""] + self.render()


# The runs the docs show, by their rows' `time`: a file may hold older and newer runs, and
# appending one must not change a table whose caption names the run's device and command.
BENCH_MAIN = 1795326338.958677  # results/bench.jsonl
BENCH_OFFLOAD = 1795405511.8065646  # results/bench.jsonl
BENCH_TEMPERATURE = 1795316029.9072285  # results/temperature/bench.jsonl
NIAH = (1795316652.0, 1795316653.0)  # results/niah.jsonl, one row per cell
# Commands as they reproduce the rows with today's scripts (speedup.py's budget default was 4096 then).
SPEEDUP = "python benchmarks/speedup.py --prefill-cache '/tmp/speedup-{context}.pt'"
EXPECTED = "python benchmarks/retrieval_expected.py --prefill-cache /tmp/p32k.pt"

BUDGET_FRACTION_RUN = (1795520500, 1795520900)  # results/speedup_budget.jsonl
LOADED_VM = ("2-core AMD EPYC VM, no GPU, loaded by other jobs (load average 4-7): the "
             "ms/token are not comparable between rows, the acceptance is")

TABLES = {
    "budget-fraction": Table(
        "results/speedup_budget.jsonl", LOADED_VM,
        ("python benchmarks/speedup.py --contexts 4096 --prompt continue --temperatures 0 "
         "--new-tokens 128 --dtype fp32 --modes autoregressive draft triforce --budget 1/16 1/8 1/4 "
         "--out results/speedup_budget.jsonl",),
        lambda: speedup_table(rows_between("speedup_budget.jsonl", *BUDGET_FRACTION_RUN))),
    "speedup-32k": Table("results/speedup.jsonl", AVX2_VM, (SPEEDUP + " --budget 4096",),
                         lambda: speedup_table(speedup_runs()[0], contexts=(32768,))),
    "speedup": Table("results/speedup.jsonl", AVX2_VM, (SPEEDUP + " --budget 4096",),
                     lambda: speedup_table(speedup_runs()[0])),
    "speedup-budget": Table(
        "results/speedup.jsonl", AVX2_VM,
        (SPEEDUP + " --contexts 32768 --temperatures 0.6 --budget 8192 "
         "--modes autoregressive retrieval triforce",),
        lambda: speedup_table(speedup_runs()[1])),
    "retrieval-expected": Table(  # the whole file: more seeds of a configuration average in
        "results/retrieval_expected.jsonl", "2-core AMD EPYC VM with AVX2 (acceptance, not time)",
        (EXPECTED + " --seeds 0 1 --budgets 4096 8192",
         EXPECTED + " --top-p 0.9 --seeds 0 1 2 3 --budgets 4096 8192 --chunks 8 "
         "--rebuilds never every:16"),
        retrieval_expected_table),
    "bench": Table(
        "results/bench.jsonl", AVX512_VM + ", quiet, one thread per contender",
        ("triforce-offload bench --contexts 2048,8192 --new-tokens 64 --threads 1 --budget 512 "
         "--modes autoregressive,autoregressive+offload,zero-inference,draft,retrieval,triforce,"
         "hf,llama.cpp --baseline deepspeed",),
        lambda: bench_table(rows_between("bench.jsonl", BENCH_MAIN))),
    "bench-offload": Table(
        "results/bench.jsonl", AVX512_VM + ", quiet, torch's 2 threads",
        ("triforce-offload bench --contexts 8192 --new-tokens 64 --budget 1024 --modes "
         "autoregressive,autoregressive+offload,zero-inference,draft+offload,retrieval+offload,"
         "triforce+offload",),
        lambda: bench_table(rows_between("bench.jsonl", BENCH_OFFLOAD))),
    "bench-temperature": Table(
        "results/temperature/bench.jsonl", AVX512_VM + ", loaded by other jobs, before the CPU kernels",
        ("triforce-offload bench --contexts 2048 --new-tokens 48 --temperatures 0,0.5,1.0 --modes "
         "autoregressive,draft,retrieval,triforce --threads 1 --budget 512 --out results/temperature",),
        lambda: bench_table(rows_between("temperature/bench.jsonl", BENCH_TEMPERATURE))),
    "niah": Table("results/niah.jsonl", AVX512_VM + ", OMP_NUM_THREADS=1",
                  ("python benchmarks/niah.py --lengths 2048 4096 8000 --depths 0 50 100 "
                   "--new-tokens 24 --budget 512",),
                  lambda: niah_table(rows_between("niah.jsonl", *NIAH))),
    "costmodel": Table("offload/costmodel.py", "predicted",
                       ("python benchmarks/tables.py --print costmodel",), costmodel_table),
    "refusals": Table("runtime/conflicts.py", "generated", ("python benchmarks/tables.py --print refusals",),
                      lambda: __import__("triforce_offload.runtime.conflicts", fromlist=["table"]).table().splitlines()),
    "plan": Table("offload/costmodel.py", "predicted",
                  ("triforce-offload plan --gpus 2x4090 --model llama2-7b-128k --context 128k",), plan_table),
}


# ---- regions ----

def doc_files() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def rewrite(text: str, where: str, cache: dict) -> tuple[str, list[str]]:
    """(text with every region re-rendered, names of the regions that changed)."""
    out, changed, lines, i = [], [], text.split("\n"), 0
    seen = set()
    while i < len(lines):
        m = MARK.match(lines[i].strip())
        out.append(lines[i])
        i += 1
        if not m:
            continue
        closing, name = m.groups()
        if closing or name not in TABLES or name in seen:
            why = ("closes no open region" if closing else
                   "is not a table (see --list)" if name not in TABLES else "appears twice")
            raise SystemExit(f"{where}:{i}: table:{name} {why}")
        seen.add(name)
        end = next((j for j in range(i, len(lines)) if lines[j].strip() == f"<!-- /table:{name} -->"), None)
        if end is None:
            raise SystemExit(f"{where}:{i}: table:{name} has no closing <!-- /table:{name} -->")
        if name not in cache:
            cache[name] = TABLES[name].lines()
        if lines[i:end] != cache[name]:
            changed.append(name)
        out += cache[name] + [lines[end]]
        i = end + 1
    return "\n".join(out), changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is out of date")
    ap.add_argument("--print", dest="name", choices=sorted(TABLES), help="print one table")
    ap.add_argument("--list", action="store_true", help="list the tables")
    a = ap.parse_args()
    if a.list:
        for name, t in TABLES.items():
            print(f"{name}: {t.source} ({t.device})")
        return 0
    if a.name:
        print("\n".join(TABLES[a.name].lines()))
        return 0
    cache, stale = {}, []
    for path in doc_files():
        where = str(path.relative_to(ROOT))
        text = path.read_text()
        new, changed = rewrite(text, where, cache)
        stale += [f"{where}: table:{n}" for n in changed]
        if changed and not a.check:
            path.write_text(new)
    for s in stale:
        print(f"{s} {'is out of date' if a.check else 'rewritten'}", file=sys.stderr)
    if a.check and stale:
        print("run: python benchmarks/tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
