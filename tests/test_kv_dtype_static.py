"""The fixed-shape path (CUDA's default; TRIFORCE_OFFLOAD_STATIC=1 anywhere) with a KV dtype
other than the compute dtype (issue 39: `index_copy_` refused bf16 buffers for float32 k):
every mode runs and gives the eager path's tokens."""
import copy

import pytest
import torch

from triforce_offload.runtime.api import RunOptions, generate

from helpers_spec import repetitive_prompt, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

MODES = [("autoregressive", {}), ("triforce", {"budget": 32}), ("retrieval", {"budget": 32}),
         ("draft", {}), ("triforce", {"budget": 16, "retrieval_chunk": 4, "draft": "self", "draft_window": 8})]


@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode,extra", MODES)
def test_static_path_stores_the_kv_dtype(monkeypatch, kv, mode, extra):
    L = copy.copy(tiny(scale=3.0, seed=1, dim=64))
    L.kv_dtype = kv
    prompt = repetitive_prompt(90, L.cfg.vocab_size)
    opts = RunOptions.of(mode=mode, max_new_tokens=20, bypass=False, **extra)
    eager = generate(L, prompt, opts)[0]
    monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    assert generate(L, prompt, opts)[0] == eager
