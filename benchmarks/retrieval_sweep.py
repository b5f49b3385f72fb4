"""Middle-level (retrieval) acceptance over budget x chunk x rebuild policy, one prefill.

Usage:
    python benchmarks/retrieval_sweep.py --threads 1 --seeds 0 1 2 3 4 5   # 32K, T=0.6, 128 tokens
    python benchmarks/retrieval_sweep.py --context 8192 --budgets 1024 --chunks 8 --rebuilds never every:16

Prefills the speedup benchmark's essay prompt once (same prompt, model and RoPE stretch
as benchmarks/speedup.py), then runs `--modes retrieval` (target+retrieval -> target+full,
so the acceptance is the middle level's) for every configuration from that prefilled
cache. `--prefill-cache FILE` saves the prefilled KV, queries and logits (about 0.7 GB at
32K in bf16) and reuses them on the next invocation. Per configuration: acceptance,
rebuilds, ms/token, and how much each rebuild changed the selection (share of selected
chunks per layer and KV head that were not selected by the build before). Rows append to
`--out`; a table averaged over `--seeds` goes to stdout. Acceptance is deterministic for a
seed, but one 128-token sample per configuration is a noisy estimate (each configuration
samples a different text): compare averages over several seeds.
"""
from __future__ import annotations

import json
import sys
import time

import torch

from triforce_offload.bench.prefill import prefilled, retrieval_parser, start  # as speedup.py


def args_():
    ap = retrieval_parser(__doc__.splitlines()[0], ["never", "every:16", "every:64", "adaptive"], [0],
                "results/retrieval_sweep.jsonl")
    ap.add_argument("--gamma2", default="6")
    return ap.parse_args()


class Selections:
    """Records the chunk indices every build picks (wraps retrieval.top_chunks)."""

    def __init__(self):
        from triforce_offload.runtime.cache import retrieval
        self.mod, self.orig, self.calls = retrieval, retrieval.top_chunks, []
        retrieval.top_chunks = self.record

    def record(self, scores, n, keep_first=True):
        idx = self.orig(scores, n, keep_first)
        self.calls.append(idx)
        return idx

    def turnover(self, n_layers: int) -> list[float]:
        """Per rebuild: mean share of selected chunks (per layer, KV head) new since the last build."""
        builds = [self.calls[i: i + n_layers] for i in range(0, len(self.calls), n_layers)]
        out = []
        for prev, cur in zip(builds, builds[1:]):
            new = []
            for p, c in zip(prev, cur):
                hit = (c[..., :, None] == p[..., None, :]).any(-1)  # [B, Hkv, n]
                new.append(1 - hit.float().mean().item())
            out.append(round(sum(new) / len(new), 3))
        return out


def run(L, prompt, full, logits, qs, a, budget, chunk, rebuild):
    from triforce_offload.runtime.api import RunOptions
    from triforce_offload.runtime.sampling import SamplingParams
    from triforce_offload.runtime.spec.modes import speculate
    full.rollback(len(prompt))  # the shared prefill, as it was
    full.q = dict(qs)
    sel = Selections()
    try:
        sp = SamplingParams(temperature=a.temperature, top_p=a.top_p, seed=a.seed)
        extra = dict(budget=budget, retrieval_chunk=chunk, gamma2=a.gamma2, rebuild=rebuild)
        opts = RunOptions.of(mode="retrieval", sampling=sp, max_new_tokens=a.new_tokens, ignore_eos=True,
                          **extra)
        toks, st = speculate("retrieval", L, prompt, opts, full, logits)
    finally:
        sel.mod.top_chunks = sel.orig
    return toks, {"acceptance": st.extra["acceptance"]["retrieval"], "rebuilds": st.extra["rebuilds"],
                  "mean_accepted": st.extra["mean_accepted"],
                  "ms_per_token": round(1000 * st.decode_s / len(toks), 2),
                  "turnover": sel.turnover(L.cfg.n_layers)}


def main():
    a = args_()
    out = start(a)
    t0 = time.perf_counter()
    L, prompt, full, logits, qs = prefilled(a.context, a)[:5]
    print(f"ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    rows, ref = [], {}
    for a.seed in a.seeds:
        for budget in a.budgets:
            for chunk in a.chunks:
                for rebuild in a.rebuilds:
                    rows.append(one(L, prompt, full, logits, qs, a, budget, chunk, rebuild, ref, out))
    print(table(rows))


def one(L, prompt, full, logits, qs, a, budget, chunk, rebuild, ref, out):
    """Run one configuration, log and append its row."""
    toks, r = run(L, prompt, full, logits, qs, a, budget, chunk, rebuild)
    key = (a.seed, budget, chunk)
    ref.setdefault(key, toks)  # the first policy's output for this seed (never, by default)
    same = next((i for i, (x, y) in enumerate(zip(toks, ref[key])) if x != y), None)
    row = {"context": a.context, "prompt_tokens": len(prompt), "dtype": a.dtype,
           "temperature": a.temperature, "top_p": a.top_p, "seed": a.seed, "new_tokens": len(toks),
           "budget": budget, "chunk": chunk, "rebuild": rebuild, "gamma2": a.gamma2,
           **r, "first_diff_vs_first_policy": same}
    print(json.dumps(row), file=sys.stderr, flush=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def table(rows: list[dict]) -> str:
    """One line per configuration, averaged over seeds (min-max of the acceptance in brackets)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["budget"], r["chunk"], r["rebuild"]), []).append(r)
    mean = lambda xs: sum(xs) / len(xs)
    lines = ["| budget | chunk | rebuild | seeds | acceptance (min-max) | rebuilds | ms/token | turnover per rebuild |",
             "|---|---|---|---|---|---|---|---|"]
    for (budget, chunk, rebuild), g in groups.items():
        acc = [r["acceptance"] for r in g]
        t = [x for r in g for x in r["turnover"]]
        lines.append(f"| {budget} | {chunk} | {rebuild} | {len(g)} | {mean(acc):.3f} ({min(acc):.2f}-{max(acc):.2f}) "
                     f"| {mean([r['rebuilds'] for r in g]):.1f} | {mean([r['ms_per_token'] for r in g]):.1f} "
                     f"| {f'{mean(t):.2f}' if t else ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
