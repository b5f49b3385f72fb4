"""`bench` on windowed models (issue 28): the zero-inference contender attends a sliding
layer to its band (it had attended every layer to the whole context), and the floor of a
decode step counts a window layer's window, not the whole context."""
from __future__ import annotations

import pytest
import torch

from test_windows import hf_greedy, loaded_from, tiny_mistral

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_zero_inference_equals_transformers_past_the_window(tmp_path):
    from helpers_spec import repetitive_prompt
    from triforce_offload.bench import zero_inference  # noqa: F401  (registers the mode)
    from triforce_offload.runtime.api import RunOptions, generate
    hf = tiny_mistral(seed=3)
    L = loaded_from(hf, tmp_path)
    prompt = repetitive_prompt(70, 97, seed=4)  # almost 6 windows
    toks, _ = generate(L, prompt, RunOptions.of(mode="zero-inference", max_new_tokens=16, ignore_eos=True))
    assert toks == hf_greedy(hf, prompt, 16)


def test_floor_reads_a_window_layer_s_window_only(tmp_path):
    from triforce_offload.bench.runner import floors
    from triforce_offload.runtime.model.quantized import token_weight_bytes
    L = loaded_from(tiny_mistral(window=12, layers=2), tmp_path)
    L.cfg.layer_types = ["sliding_attention", "full_attention"]
    w = token_weight_bytes(L.model)
    per_layer = 2 * L.cfg.n_kv_heads * L.cfg.head_dim * 4  # fp32 K and V of one token
    got = floors(L, [1000], 1e9)[1000]
    assert got == pytest.approx(1000 * (w + (1000 + 12) * per_layer) / 1e9)
