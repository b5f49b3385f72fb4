"""Expected middle-level acceptance along fixed texts: config comparisons without sampling noise.

Usage:
    python benchmarks/retrieval_expected.py --threads 1 --prefill-cache /tmp/p32k.pt   # 32K, T=0.6

benchmarks/retrieval_sweep.py runs the real engine, so every configuration samples its own
text and one 128-token run per seed moves the acceptance by +-0.1. Here each seed samples one
continuation from the full model (token by token, as autoregressive decoding), recording the
full model's distribution p and its queries at every position; every configuration then runs
the middle level (a RetrievalCache built as the engine builds it) over the same tokens, in
rounds of gamma2 tokens after which it absorbs the exact KV (as the engine does), rebuilding
per `every:N` with the verifier's query of the last verified token. Per position the chance
that speculative sampling accepts the middle level's token is alpha = sum_v min(p, q). Reported:
`alpha` (mean per token) and `round_acc`, the expected accepted / drafted of gamma2-token
rounds (sum over i of alpha_1...alpha_i, over gamma2): the quantity the engine's `acceptance`
estimates. Same prefill cache file and prompt as retrieval_sweep.py.
"""
from __future__ import annotations

import json
import sys
import time

import torch

from triforce_offload.bench.prefill import prefilled, retrieval_parser, start  # as retrieval_sweep.py


def args_():
    ap = retrieval_parser(__doc__.splitlines()[0], ["never", "every:16", "every:64"], [0, 1, 2, 3, 4, 5],
                                "results/retrieval_expected.jsonl")
    ap.add_argument("--gamma2", type=int, default=6)
    return ap.parse_args()


@torch.inference_mode()
def trajectory(L, full, logits, qs, n0, n, sp):
    """Tokens t_0..t_{n-1} (t_0 from the prefill logits); P[j]: the full model's distribution
    after t_j; Q[i]: its queries at position n0-1+i (Q[0]: the prompt's last token)."""
    from triforce_offload.runtime.sampling import probs, sample
    gen = sp.generator()
    full.rollback(n0)  # the shared prefill (an earlier seed decoded past it)
    toks, P, Q = [int(sample(probs(logits[0], sp), gen))], [], [dict(qs)]
    for j in range(n - 1):
        lg = L.model(torch.tensor([[toks[-1]]]), n0 + j, full)[0, -1]
        full.commit(n0 + j + 1)
        Q.append({layer: q.clone() for layer, q in full.q.items()})
        P.append(probs(lg, sp))
        toks.append(int(sample(P[-1], gen)))
    return toks, torch.stack(P), Q


@torch.inference_mode()
def expected(L, full, n0, toks, P, Q, sp, budget, retrieval_chunk, rebuild, gamma2):
    """(mean alpha, mean expected accepted/drafted per round, rebuilds) of one configuration."""
    from triforce_offload.runtime.spec.engine import Rebuild
    from triforce_offload.runtime.cache.retrieval import RetrievalCache
    from triforce_offload.runtime.sampling import probs
    policy = Rebuild.parse(rebuild)
    if policy.kind == "adaptive":
        raise SystemExit("--rebuilds: adaptive depends on sampled acceptances; use retrieval_sweep.py")
    n = len(toks)
    ret = RetrievalCache(L.cfg, budget, retrieval_chunk, n + 64, dtype=L.dtype)
    ret.build(full, Q[0], n0)
    alphas, rounds, builds, since, j = [], [], 0, 0, 0
    while j < n - 1:  # feed t_j.. at n0+j; row i predicts t_{j+i+1}, as P[j+i] does
        g = min(gamma2, n - 1 - j)
        q = probs(L.model(torch.tensor([toks[j: j + g]]), n0 + j, ret)[0], sp)
        a = torch.minimum(q, P[j: j + g]).sum(-1)
        alphas += a.tolist()
        rounds.append(float(a.cumprod(0).sum()) / g)
        ret.absorb(full, n0 + j, n0 + j + g)
        ret.commit(n0 + j + g)
        j, since = j + g, since + g
        if policy.due(since, 1.0):
            ret.build(full, Q[j], n0 + j)  # the verifier's query of the last verified token
            builds, since = builds + 1, 0
    return sum(alphas) / len(alphas), sum(rounds) / len(rounds), builds


def main():
    from triforce_offload.runtime.sampling import SamplingParams
    a = args_()
    out = start(a)
    L, prompt, full, logits, qs = prefilled(a.context, a)[:5]
    n0, rows = len(prompt), []
    for seed in a.seeds:
        sp = SamplingParams(temperature=a.temperature, top_p=a.top_p, seed=seed)
        t0 = time.perf_counter()
        toks, P, Q = trajectory(L, full, logits, qs, n0, a.new_tokens, sp)
        print(f"seed {seed}: text sampled in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        for budget in a.budgets:
            for chunk in a.chunks:
                for rebuild in a.rebuilds:
                    al, ra, nb = expected(L, full, n0, toks, P, Q, sp, budget, chunk, rebuild, a.gamma2)
                    row = {"context": a.context, "prompt_tokens": n0, "dtype": a.dtype, "temperature": a.temperature,
                           "top_p": a.top_p, "seed": seed, "new_tokens": a.new_tokens, "budget": budget,
                           "chunk": chunk, "rebuild": rebuild, "gamma2": a.gamma2, "alpha": round(al, 4),
                           "round_acc": round(ra, 4), "rebuilds": nb}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    with out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    groups = {}
    for r in rows:
        groups.setdefault((r["budget"], r["chunk"], r["rebuild"]), []).append(r)
    mean = lambda xs: sum(xs) / len(xs)
    print("| budget | chunk | rebuild | seeds | alpha per token | expected accepted/drafted | rebuilds |")
    print("|---|---|---|---|---|---|---|")
    for (budget, chunk, rebuild), g in groups.items():
        print(f"| {budget} | {chunk} | {rebuild} | {len(g)} | {mean([r['alpha'] for r in g]):.3f} "
              f"| {mean([r['round_acc'] for r in g]):.3f} | {mean([r['rebuilds'] for r in g]):.1f} |")


if __name__ == "__main__":
    main()
