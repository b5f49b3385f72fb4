"""Greedy losslessness of every speculative mode on the real SmolLM2 (fp32, ~4K-token prompt).

The prompt is prefilled once; each mode decodes from that full cache (rolled back, its
recorded queries restored), as benchmarks/speedup.py does.
"""
import pytest
import torch

from triforce_offload.runtime import api
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.data import long_prompt
from triforce_offload.runtime.generate import decode, prefill
from triforce_offload.runtime.cache.retrieval import Recorder
from triforce_offload.runtime.sampling import SamplingParams
from triforce_offload.runtime.spec.modes import speculate

pytestmark = pytest.mark.slow

N_NEW = 128
MODES = [
    ("triforce", {"budget": 1024}),  # n-gram -> target+retrieval -> target+full
    ("triforce", {"budget": 512, "draft": "self", "gamma2": "auto", "rebuild": "every:48"}),
    ("retrieval", {"budget": 1024}),
    ("draft", {}),
    ("draft", {"draft": "self", "draft_window": 64}),
]


@pytest.fixture(scope="module")
def setup():
    L = api.load(None, "float32", "cpu")
    prompt = long_prompt(L.tokenizer, 4000)
    full = Recorder(FullCache(L.cfg, len(prompt) + N_NEW + 64))
    logits = prefill(L.model, full, torch.tensor([prompt]))
    qs = dict(full.q)
    ref = decode(L.model, full, logits, len(prompt), SamplingParams(), N_NEW, set())
    return L, prompt, full, logits, qs, ref


@pytest.mark.parametrize("mode,extra", MODES)
def test_smollm2_greedy_equals_autoregressive(setup, mode, extra):
    L, prompt, full, logits, qs, ref = setup
    full.rollback(len(prompt))
    full.q = dict(qs)
    # every level runs (no bypass): the identity must hold where each level drafts and verifies
    opts = api.RunOptions.of(mode=mode, max_new_tokens=N_NEW, ignore_eos=True, bypass=False,
                             **dict(extra), sampling=SamplingParams())
    out, st = speculate(mode, L, prompt, opts, full, logits)
    assert len(ref) == N_NEW
    assert out == ref, f"diverges at {next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)}"
    assert st.extra["mean_accepted"] > 1.05  # speculation does accept tokens on real text
