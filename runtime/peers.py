"""Outside references for `bench`: transformers' `generate` and llama.cpp (llama-cpp-python).

Each runner takes the prompt ids and returns a `PeerRun` with the new ids and decode
timing measured the way our modes are: from the first new token (the one the prefill's
logits give) to the last, so prefill is excluded everywhere.

transformers runs on the same weights as our runtime (the HF directory we load, at our
dtype); llama.cpp runs on the GGUF file itself, quantized matmuls included, so its greedy
text may differ from ours by rounding. llama-cpp-python is optional (the `bench` extra):
`llama_cpp_missing()` says why it cannot run, and bench skips those rows with that note.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field

import torch


@dataclass
class PeerRun:
    tokens: list[int]  # new token ids
    decode_s: float  # first new token to last
    extra: dict = field(default_factory=dict)  # peer-specific figures

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.decode_s / max(len(self.tokens) - 1, 1)


class Clock:
    """A transformers streamer that timestamps each put (the first put is the prompt)."""

    def __init__(self):
        self.marks: list[tuple[float, int]] = []  # (time, tokens in this put)

    def put(self, value):
        self.marks.append((time.perf_counter(), int(value.numel())))

    def end(self):
        pass


def load_hf(model_dir, dtype: torch.dtype):
    """The transformers model on the same weights our loader read."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def hf_generate(hf, prompt: list[int], n: int, temperature: float, seed: int,
                lookup: int = 0) -> PeerRun:
    """transformers `generate`; lookup > 0 turns on prompt-lookup assisted decoding."""
    clock = Clock()
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    else:
        kw.update(do_sample=False)
    ids = torch.tensor([prompt], device=hf.device)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, streamer=clock, pad_token_id=0, **kw)
    marks = clock.marks[1:]  # the first put is the prompt
    return PeerRun(out[0, len(prompt):].tolist(), marks[-1][0] - marks[0][0])


def llama_cpp_missing() -> str | None:
    """Why llama.cpp rows cannot run here, or None when llama-cpp-python is installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python not installed (pip install 'triforce-offload[bench]'; "
                "see README for the build flags)")
    return None


def load_llama_cpp(gguf, n_ctx: int, threads: int, lookup: int = 0, seed: int = 0):
    """A llama.cpp context on the GGUF; prompt lookup needs logits for every position."""
    from llama_cpp import Llama
    draft = None
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
    return Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_batch=512,
                 logits_all=bool(lookup), draft_model=draft, seed=seed, verbose=False)


def llama_cpp_generate(llm, prompt: list[int], n: int, temperature: float, seed: int) -> PeerRun:
    """llama.cpp's raw token generator (it does not stop at end-of-sequence, like
    ignore_eos); sampling filters off so temperature alone shapes the distribution."""
    llm.reset()  # no prefix reuse between runs: every run prefills the same way
    llm.set_seed(seed)
    toks, times = [], []
    gen = llm.generate(prompt, temp=temperature, top_k=0, top_p=1.0, min_p=0.0,
                       repeat_penalty=1.0, reset=True)
    for t in gen:
        times.append(time.perf_counter())
        toks.append(int(t))
        if len(toks) == n:
            break
    gen.close()
    return PeerRun(toks, times[-1] - times[0])
