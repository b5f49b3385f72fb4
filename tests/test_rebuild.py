"""Retrieval cache rebuilds during decoding: they happen, use the verifier's latest queries,
change the selection, and the speedup benchmark passes the policy through and reports them."""
import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

from helpers_spec import tiny
from triforce_offload.kernels import retrieval as kr
from triforce_offload.runtime.spec import engine as E
from triforce_offload.runtime.api import RunOptions
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.generate import prefill
from triforce_offload.runtime.cache.retrieval import Recorder
from triforce_offload.runtime.sampling import SamplingParams
from triforce_offload.runtime.spec.modes import speculate

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prefilled():
    """A tiny model with a 256-token prompt prefilled into a recorded full cache."""
    L = tiny(vocab=64, layers=2)
    prompt = torch.randint(0, 64, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    full = Recorder(FullCache(L.cfg, len(prompt) + 64 + 64))
    logits = prefill(L.model, full, torch.tensor([prompt]))
    return L, prompt, full, logits, dict(full.q)


def decode(prefilled, rebuild, n=48):
    L, prompt, full, logits, qs = prefilled
    full.rollback(len(prompt))
    full.q = dict(qs)
    opts = RunOptions.of(mode="retrieval", max_new_tokens=n, ignore_eos=True,
                      sampling=SamplingParams(temperature=0.6, seed=0),
                      **dict(budget=32, retrieval_chunk=8, gamma2="4", rebuild=rebuild))
    return speculate("retrieval", L, prompt, opts, full, logits)


def test_rebuilds_use_the_verifiers_latest_queries_and_reselect(prefilled, monkeypatch):
    L, prompt, full, logits, qs = prefilled
    seen = []  # (queries handed to build, length) per rebuild
    picks = []  # chunk indices of every build, layer by layer
    orig_build = E.Engine.rebuild_retrieval

    def spy(self):
        seen.append(({l: q.clone() for l, q in self.top.cache.q.items()}, self.top.held))
        assert self.top.cache is full  # the verifier's cache records its queries
        orig_build(self)

    orig_top = kr.top_chunks
    monkeypatch.setattr(E.Engine, "rebuild_retrieval", spy)
    monkeypatch.setattr("triforce_offload.runtime.cache.retrieval.top_chunks",
                        lambda s, n, keep_first=True: picks.append(orig_top(s, n, keep_first)) or picks[-1])
    toks, st = decode(prefilled, "every:8")
    assert st.extra["rebuilds"] == len(seen) >= 3
    lengths = [n for _, n in seen]
    assert lengths == sorted(set(lengths)) and lengths[0] > len(prompt)
    for q, _ in seen:  # each rebuild scores with a query newer than the prompt's last token
        assert not torch.equal(q[0], qs[0])
    assert not torch.equal(seen[0][0][0], seen[-1][0][0])
    builds = [picks[i: i + L.cfg.n_layers] for i in range(0, len(picks), L.cfg.n_layers)]
    assert len(builds) == 1 + len(seen)
    assert any(not torch.equal(a, b) for prev, cur in zip(builds, builds[1:]) for a, b in zip(prev, cur))
    _, st0 = decode(prefilled, "never")
    assert st0.extra["rebuilds"] == 0


def test_speedup_benchmark_passes_the_policy_and_reports_rebuilds(prefilled):
    spec = importlib.util.spec_from_file_location("speedup", ROOT / "benchmarks" / "speedup.py")
    speedup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(speedup)
    L, prompt, full, logits, qs = prefilled
    a = argparse.Namespace(new_tokens=48, budget=32, chunk=8, gamma1=4, gamma2="4", seed=0, rebuild="every:8",
                           top_p=0.9)
    _, r = speedup.run_mode("retrieval", L, prompt, full, logits, qs, a, 0.6)
    assert r["rebuild"] == "every:8" and r["rebuilds"] >= 3
    a.rebuild = "never"
    _, r = speedup.run_mode("retrieval", L, prompt, full, logits, qs, a, 0.6)
    assert r["rebuild"] == "never" and r["rebuilds"] == 0
