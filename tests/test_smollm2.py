"""Integration on the real bundled model (SmolLM2-135M-Instruct, dequantized from GGUF)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from triforce_offload.runtime import api
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.data import long_prompt
from triforce_offload.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol():
    return api.load(None, "float32", "cpu", weights="fp32")  # transformers runs the dequantized GGUF


@pytest.fixture(scope="module")
def hf(smol_dir):
    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


def test_logits_match_transformers(smol, hf):
    ids = torch.tensor([long_prompt(smol.tokenizer, 300)])
    T = ids.shape[1]
    with torch.no_grad():
        ref = hf(ids).logits
        cache = FullCache(smol.cfg, T + 8)
        pre = smol.model(ids[:, :-4], 0, cache)
        cache.commit(T - 4)
        dec = smol.model(ids[:, -4:], T - 4, cache)  # a multi-token step
    torch.testing.assert_close(pre, ref[:, :-4], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(dec, ref[:, -4:], rtol=1e-3, atol=1e-3)


def test_greedy_run_equals_transformers_generate(smol, hf):
    prompt = long_prompt(smol.tokenizer, 1000)
    opts = api.RunOptions.of(mode="autoregressive", max_new_tokens=32, prefill_chunk=256,
                          sampling=SamplingParams())
    ours, st = api.generate(smol, prompt, opts)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                          eos_token_id=list(smol.eos))
    ref = out[0, len(prompt):].tolist()
    assert ours == ref
    assert st.prompt_tokens == len(prompt) > 1000 and st.new_tokens == len(ref)
