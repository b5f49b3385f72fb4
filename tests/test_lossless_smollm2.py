"""Greedy losslessness of every speculative mode on the real SmolLM2 (fp32, ~4K-token prompt)."""
import pytest

from triforce_offload.runtime import api
from triforce_offload.runtime.data import long_prompt
from triforce_offload.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow

N_NEW = 128
MODES = [
    ("triforce", {"budget": 1024}),  # n-gram -> target+retrieval -> target+full
    ("triforce", {"budget": 512, "draft": "self", "gamma2": "auto", "rebuild": "every:48"}),
    ("retrieval", {"budget": 1024}),
    ("draft", {}),
]


@pytest.fixture(scope="module")
def setup():
    L = api.load(None, "float32", "cpu")
    prompt = long_prompt(L.tokenizer, 4000)
    return L, prompt, gen(L, prompt, "autoregressive", {})[0]


def gen(L, prompt, mode, extra):
    opts = api.RunOptions(mode=mode, max_new_tokens=N_NEW, ignore_eos=True, extra=dict(extra),
                          sampling=SamplingParams())
    return api.generate(L, prompt, opts)


@pytest.mark.parametrize("mode,extra", MODES)
def test_smollm2_greedy_equals_autoregressive(setup, mode, extra):
    L, prompt, ref = setup
    out, st = gen(L, prompt, mode, extra)
    assert len(ref) == N_NEW and out == ref, f"diverges at {next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)}"
    assert st.extra["mean_accepted"] > 1.2  # speculation does accept tokens on real text
