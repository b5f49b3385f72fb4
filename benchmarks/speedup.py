"""Speculative speedup on the bundled SmolLM2: autoregressive vs draft vs retrieval vs triforce.

Usage:
    python benchmarks/speedup.py                                  # 8K and 32K, greedy and T=0.6, bf16
    python benchmarks/speedup.py --contexts 8192 --temperatures 0 --new-tokens 64 --dtype fp32

Per context the prompt (essays + a summary request, filling the context minus the new
tokens) is prefilled once; every mode then decodes from that same prefilled full cache
(rolled back and with its recorded queries restored), so only decoding is compared.
Contexts above the model's 8K use `--rope-scaling linear:F`. `draft` is classic
speculative decoding with the n-gram (prompt lookup) drafter; `retrieval` the two-level
ablation; `triforce` n-gram -> target+retrieval -> target+full. Greedy runs also record
where the output first differs from autoregressive and the autoregressive top-1/top-2
logit margin there (bf16 near-ties). Rows append to results/speedup.jsonl; a table of
ms/token, acceptance per level and speedups goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import platform
import math
import sys
import time
from pathlib import Path

import torch

from triforce_offload.bench.prefill import prefilled, start

MODES = ("autoregressive", "draft", "retrieval", "triforce")


def args_():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6])
    ap.add_argument("--top-p", type=float, default=0.9,
                    help="nucleus sampling for T > 0 (0.9: TriForce's own setting with T=0.6; 1 turns it off)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--prompt", default="summary", choices=("summary", "continue"),
                    help="the built-in prompt: essays + a summary request, or essay text to continue")
    ap.add_argument("--budget", nargs="+", default=["auto"],
                    help="retrieval budgets to compare: tokens (4096), a fraction of the prompt (1/8), "
                         "or auto (the runtime's default); retrieval and triforce run once per budget")
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--gamma1", type=int, default=4)
    ap.add_argument("--gamma2", default="6")
    ap.add_argument("--rebuild", default="never", help="retrieval cache rebuild policy (never, every:N, adaptive)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--prefill-cache", default=None,
                    help="save the prefill to this file, or load it from there; '{context}' in the "
                         "name is replaced by the context (one file per context)")
    ap.add_argument("--out", default="results/speedup.jsonl")
    return ap.parse_args()


@torch.inference_mode()
def autoregressive(L, full, logits, n0, sp, n):
    """Plain decode from the prefilled cache, recording the top-1/top-2 logit margin per step."""
    from triforce_offload.runtime.sampling import probs, sample
    gen, out, margins, pos = sp.generator(), [], [], n0
    t0 = time.perf_counter()
    for i in range(n):
        top2 = logits[0].float().topk(2).values
        margins.append(float(top2[0] - top2[1]))
        tok = sample(probs(logits, sp), gen)
        out.append(int(tok[0]))
        if i + 1 < n:
            logits = L.model(tok[:, None], pos, full)[:, -1]
            pos += 1
            full.commit(pos)
    return out, time.perf_counter() - t0, margins


def top_p(a, temp: float) -> float:
    """Nucleus mass for a run at `temp`: `--top-p` when sampling, 1 (unused) for greedy."""
    return a.top_p if temp > 0 else 1.0


def cpu_name() -> str:
    """The CPU model (from /proc/cpuinfo), for the rows' record of where they ran."""
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def budget_tokens(spec: str, n_prompt: int, chunk: int) -> int | None:
    """--budget value -> tokens (None: the runtime's auto default)."""
    if spec == "auto":
        return None
    if "/" in spec:
        num, den = (float(x) for x in spec.split("/"))
        return max(2 * chunk, math.ceil(n_prompt * num / den / chunk) * chunk)
    return int(spec)


def run_mode(mode, L, prompt, full, logits, qs, a, temp, budget=None):
    from triforce_offload.runtime.api import RunOptions
    from triforce_offload.runtime.sampling import SamplingParams
    from triforce_offload.runtime.spec.modes import speculate
    full.rollback(len(prompt))  # the shared prefill, as it was
    full.q = dict(qs)
    sp = SamplingParams(temperature=temp, top_p=top_p(a, temp), seed=a.seed)
    if mode == "autoregressive":
        toks, dt, margins = autoregressive(L, full, logits, len(prompt), sp, a.new_tokens)
        return toks, {"decode_s": dt, "margins": margins}
    extra = dict(budget=budget, retrieval_chunk=a.chunk, gamma1=a.gamma1, gamma2=a.gamma2, rebuild=a.rebuild)
    opts = RunOptions.of(mode=mode, sampling=sp, max_new_tokens=a.new_tokens, ignore_eos=True, **extra)
    toks, st = speculate(mode, L, prompt, opts, full, logits)
    b = opts.retrieval.budget_for(len(prompt)) if mode != "draft" else None
    return toks, {"decode_s": st.decode_s, "rebuild": a.rebuild, "budget": b, **{k: st.extra[k] for k in
                  ("acceptance", "acceptance_per_token", "mean_accepted", "gammas", "rebuilds", "build_s",
                   "level_time_s")}}


def divergence(toks, ref, margins):
    i = next((i for i, (x, y) in enumerate(zip(toks, ref)) if x != y), None)
    return {"matches_ar": i is None, "first_divergence": i,
            "ar_margin_at_divergence": None if i is None else round(margins[i], 4)}


def bench_context(ctx, a, out: Path) -> list[dict]:
    from triforce_offload.runtime.sampling import SamplingParams
    L, prompt, full, logits, qs, pre_s = prefilled(ctx, a)
    autoregressive(L, full, logits, len(prompt), SamplingParams(), 4)  # warm-up
    rows = []
    for temp in a.temperatures:
        ref = None
        runs = [(m, b) for m in a.modes for b in (a.budget if m in ("retrieval", "triforce") else [None])]
        for mode, b in runs:
            toks, r = run_mode(mode, L, prompt, full, logits, qs, a, temp,
                               budget_tokens(b, len(prompt), a.chunk) if b else None)
            row = {"context": ctx, "prompt_tokens": len(prompt), "prompt": a.prompt, "dtype": a.dtype,
                   "temperature": temp, "time": round(time.time()), "cpu": cpu_name(),
                   "budget_spec": b,
                   "top_p": top_p(a, temp),
                   "mode": mode, "new_tokens": len(toks), "prefill_s": round(pre_s, 2),
                   "ms_per_token": round(1000 * r.pop("decode_s") / len(toks), 2), **r}
            if mode == "autoregressive":
                ref, margins = toks, row.pop("margins")
            elif temp == 0 and ref is not None:
                row.update(divergence(toks, ref, margins))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "level_time_s"}), file=sys.stderr,
                  flush=True)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


def table(rows: list[dict]) -> str:
    base = {(r["context"], r["temperature"]): r["ms_per_token"] for r in rows if r["mode"] == "autoregressive"}
    lines = ["| context | T | mode | budget | ms/token | speedup | acceptance | mean accepted | = AR (greedy) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base.get((r["context"], r["temperature"]))
        acc = ", ".join(f"{k} {v:.2f}" for k, v in r.get("acceptance", {}).items())
        ma = f"{r['mean_accepted']:.2f}" if "mean_accepted" in r else ""
        same = {True: "yes", False: f"no (at {r.get('first_divergence')})"}.get(r.get("matches_ar"), "")
        sp = f"{b / r['ms_per_token']:.2f}x" if b else ""
        t = r["temperature"] if r.get("top_p", 1.0) == 1.0 else f"{r['temperature']}, top-p {r['top_p']}"
        bud = "" if r.get("budget") is None else f"{r['budget']} ({r.get('budget_spec')})"
        lines.append(f"| {r['prompt_tokens']} | {t} | {r['mode']} | {bud} | {r['ms_per_token']:.1f} "
                     f"| {sp} | {acc} | {ma} | {same} |")
    return "\n".join(lines)


def main():
    a = args_()
    out = start(a)
    rows = []
    for ctx in a.contexts:
        rows += bench_context(ctx, a, out)
    print(table(rows))


if __name__ == "__main__":
    main()
