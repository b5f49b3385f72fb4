"""Outside references for `bench`: transformers' `generate`, llama.cpp (llama-cpp-python)
and DeepSpeed ZeRO-Inference.

Each runner takes the prompt ids and returns a `PeerRun` with the new ids and decode
timing measured the way our modes are: from the first new token (the one the prefill's
logits give) to the last, so prefill is excluded everywhere.

transformers runs on the same weights as our runtime (the HF directory we load, at our
dtype); llama.cpp runs on the GGUF file itself, quantized matmuls included, so its greedy
text may differ from ours by rounding. llama-cpp-python is optional (the `bench` extra):
`llama_cpp_missing()` says why it cannot run, and bench skips those rows with that note.

DeepSpeed ZeRO-Inference (the `deepspeed` extra) runs the same HF weights under ZeRO
stage 3 with the parameters offloaded to pinned host memory and streamed to the GPU layer
by layer; transformers' `generate` drives it, so it is timed like the transformers row.
It needs CUDA: `deepspeed_missing()` says why it cannot run, and bench skips that row.
"""
from __future__ import annotations

import importlib.util
import os
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
                lookup: int = 0, device=None) -> PeerRun:
    """transformers `generate`; lookup > 0 turns on prompt-lookup assisted decoding.
    device: where the prompt goes [default: the model's]."""
    clock = Clock()
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    else:
        kw.update(do_sample=False)
    ids = torch.tensor([prompt], device=device or hf.device)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, streamer=clock, pad_token_id=0, **kw)
    marks = clock.marks[1:]  # the first put is the prompt
    return PeerRun(out[0, len(prompt):].tolist(), marks[-1][0] - marks[0][0])


def llama_cpp_missing() -> str | None:
    """Why llama.cpp rows cannot run here, or None when llama-cpp-python is installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python not installed (pip install 'triforce-offload[bench]'; "
                "see docs/benchmarks.md for the build flags)")
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


def llama_cpp_generate(llm, prompt: list[int], n: int, temperature: float, seed: int,
                       reuse: bool = False) -> PeerRun:
    """llama.cpp's raw token generator (it does not stop at end-of-sequence, like
    ignore_eos); sampling filters off so temperature alone shapes the distribution.
    `reuse`: the context keeps the KV of an earlier run's prompt (llama-cpp-python's prefix
    match evaluates the last prompt token again); else every run prefills all of it."""
    if not reuse:
        llm.reset()
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


def deepspeed_missing() -> str | None:
    """Why the DeepSpeed ZeRO-Inference row cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "deepspeed ZeRO-Inference needs CUDA; this machine has none"
    try:
        import deepspeed  # noqa: F401  (only ever imported on a CUDA machine)
    except Exception as e:  # not installed, or its CUDA ops fail to load
        return (f"deepspeed not importable ({e}); "
                "pip install 'triforce-offload[deepspeed]'")
    return None


def zero_inference_config(dtype: torch.dtype, hidden: int) -> dict:
    """ZeRO stage 3 with the parameters offloaded to pinned host memory (the ZeRO-Inference
    recipe of DeepSpeedExamples' inference/huggingface/zero_inference/run_model.py)."""
    return {
        "fp16": {"enabled": dtype == torch.float16},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            # run_model.py's sizes: prefetch / keep live ~2 h^2 weights (a few projections),
            # and keep tensors of at most h elements (norms, biases) resident on the GPU
            "stage3_prefetch_bucket_size": 2 * hidden * hidden,
            "stage3_param_persistence_threshold": hidden,
            "stage3_max_live_parameters": 2 * hidden * hidden,
        },
        "train_micro_batch_size_per_gpu": 1,  # required by initialize; no training happens
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _single_process_env():
    """deepspeed.initialize wants a process group; outside its launcher, make one of one
    process (without these variables DeepSpeed falls back to MPI discovery). Called only
    when the DeepSpeed peer loads; the variables stay set, as the process group they
    describe lives as long as the engine (and the process)."""
    if "MASTER_PORT" not in os.environ:
        from ..runtime.model.distributed import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)


@dataclass
class DeepSpeedPeer:
    model: object  # the HF model inside the DeepSpeed engine (engine.module)
    device: torch.device  # the GPU it computes on
    engine: object  # keeps the engine (and its offload buffers) alive


def load_deepspeed(model_dir, dtype: torch.dtype) -> DeepSpeedPeer:
    """The HF model under ZeRO-3 parameter offload. HfDeepSpeedConfig must exist while
    from_pretrained runs, so the weights are partitioned and offloaded as they load instead
    of materialising on the GPU; it is unset afterwards so later HF loads stay plain."""
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    _single_process_env()
    hidden = AutoConfig.from_pretrained(model_dir).hidden_size
    cfg = zero_inference_config(dtype, hidden)
    dschf = HfDeepSpeedConfig(cfg)  # noqa: F841  (weakly referenced by from_pretrained)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        engine = deepspeed.initialize(model=model, config=cfg)[0]
    finally:
        unset_hf_deepspeed_config()
    engine.module.eval()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return DeepSpeedPeer(engine.module, device, engine)


def deepspeed_generate(peer: DeepSpeedPeer, prompt: list[int], n: int, temperature: float,
                       seed: int) -> PeerRun:
    """transformers `generate` on the ZeRO-Inference model: every forward gathers each
    layer's weights from pinned host memory to the GPU; the KV cache is HF's, on the GPU."""
    torch.cuda.reset_peak_memory_stats(peer.device)
    r = hf_generate(peer.model, prompt, n, temperature, seed, device=peer.device)
    r.extra["gpu_peak_gb"] = torch.cuda.max_memory_allocated(peer.device) / 2**30
    return r
