"""Prefill chunk sizes do not change the output (issue 12: a 4096-token prefill chunk once
crashed the native CPU attention kernel with a negative-size memset).

Real SmolLM2, fp32, the native kernel forced on (it is the default only on AVX-512
machines): every prefill chunk size gives the greedy tokens of the default chunk, in the
autoregressive and the ZeRO-Inference modes, on prompts of 1K to 8K tokens.
"""
import os
import subprocess
import sys

import pytest

from triforce_offload.bench import zero_inference  # noqa: F401  (registers the zero-inference mode)
from triforce_offload.runtime import api
from triforce_offload.runtime.data import long_prompt
from triforce_offload.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow

N_NEW = 8
# (mode, prompt tokens, prefill chunks compared with the default 512). The kernel slices a
# chunk's rows once they exceed its scratch (~2,600 rows of SmolLM2's 3 KV heads at 4K
# keys): the 4096-token chunks are the ones that crashed.
CASES = [
    ("autoregressive", 1000, (4096,)),
    ("autoregressive", 4100, (1024, 4096)),
    ("autoregressive", 7000, (4096,)),
    ("zero-inference", 3000, (4096,)),
]


@pytest.fixture(scope="module")
def smol():
    return api.load(None, "float32", "cpu")


def _greedy(L, prompt, mode, chunk):
    opts = api.RunOptions.of(mode=mode, max_new_tokens=N_NEW, ignore_eos=True, prefill_chunk=chunk,
                          sampling=SamplingParams())
    return api.generate(L, prompt, opts)[0]


@pytest.mark.parametrize("mode,n,chunks", CASES)
def test_prefill_chunk_does_not_change_greedy_tokens(smol, monkeypatch, mode, n, chunks):
    monkeypatch.setenv("TRIFORCE_OFFLOAD_NATIVE", "1")
    prompt = long_prompt(smol.tokenizer, n)
    ref = _greedy(smol, prompt, mode, 512)
    assert len(ref) == N_NEW
    for chunk in chunks:
        assert _greedy(smol, prompt, mode, chunk) == ref, f"--prefill-chunk {chunk}"


def test_cli_large_prefill_chunk_runs():
    """The command of the report, as a user types it."""
    env = dict(os.environ, TRIFORCE_OFFLOAD_NATIVE="1")
    r = subprocess.run([sys.executable, "-m", "triforce_offload.cli", "run", "--mode", "autoregressive",
                        "--prefill-chunk", "4096", "--prompt-tokens", "4000", "--max-new-tokens", "4",
                        "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"new_tokens": 4' in r.stdout.splitlines()[-1]
