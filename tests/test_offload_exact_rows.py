"""An offloaded cache's verification on a CPU: each row equals its one-token decode bit for
bit (the same key blocks merged in the same order: `OffloadedCache._attend_rows`), at int8
activations and a bf16 KV too, so the speculative modes over an offloaded cache give
autoregressive's greedy tokens (the options matrix had found a flip on the bundled GGUF)."""
import pytest
import torch

from helpers_spec import repetitive_prompt
from triforce_offload.runtime import api
from triforce_offload.runtime.cache.offloaded import OffloadedCache
from triforce_offload.runtime.generate import prefill
from triforce_offload.runtime.options import ModelOptions, RunOptions


@pytest.mark.parametrize("kv", ["bf16", "fp32"])
@pytest.mark.parametrize("n", [45, 48, 8])  # the rows cross a 16-token chunk; start on one; no whole chunk
def test_an_offloaded_verifications_rows_are_its_decodes_bit_for_bit(tiny_model_dir, kv, n):
    L = api.load(ModelOptions(model=str(tiny_model_dir), weights="int8", activations="int8", kv_dtype=kv))
    ids = torch.tensor([repetitive_prompt(n + 8, 500)])
    T = 7
    caches = [OffloadedCache(L.cfg, 128, dtype=L.kv_dtype, transfer_chunk=16) for _ in range(2)]
    try:
        with torch.inference_mode():
            for c in caches:
                prefill(L.model, c, ids[:, :n])
            ver = L.model(ids[:, n:n + T], n, caches[0])[0]  # [T, V]: one verification
            for i in range(T):  # the same tokens decoded one by one
                dec = L.model(ids[:, n + i:n + i + 1], n + i, caches[1])[0, -1]
                caches[1].commit(n + i + 1)
                assert torch.equal(ver[i], dec), (i, (ver[i] - dec).abs().max())
    finally:
        for c in caches:
            c.close()


@pytest.mark.slow
def test_offloaded_speculation_at_the_ggufs_precision_gives_autoregressives_tokens():
    """The combination the options matrix found flipping a token: the bundled GGUF stretched
    (--rope-scaling linear:2), int8 activations, bf16 KV, offloaded, draft and triforce."""
    L = api.load(ModelOptions(rope_scaling="linear:2", activations="int8", kv_dtype="bf16"))
    prompt = [(i * 7 + 3) % 97 + 10 for i in range(300)] + list(range(40, 60)) * 5
    o = RunOptions.of(mode="autoregressive", offload="on", max_new_tokens=16, ignore_eos=True)
    ref, _ = api.generate(L, prompt, o)
    for mode, draft in (("draft", "self"), ("triforce", "ngram")):
        toks, _ = api.generate(L, prompt, o.but(mode=mode, draft=draft))
        assert toks == ref, mode
