"""`triforce-offload run`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..bench import zero_inference  # noqa: F401  (registers --mode zero-inference)
from ..runtime import api
from ..runtime import tp as tensor_parallel
from ..runtime.data import encode_prompt, long_prompt
from ..runtime.sampling import SamplingParams
from .app import app, read_prompt
from .launch import join, launch_ranks
from .plan import plan_settings
from .progress import bar, print_stream
from .show import err, stats_line

DEFAULT_PROMPT_TOKENS = 4000


@app.command()
def run(
    model: Optional[str] = typer.Option(None, help="HF model directory or .gguf file "
                                        "[default: bundled SmolLM2-135M-Instruct]"),
    prompt: Optional[str] = typer.Option(None, help="Prompt text ('-' reads stdin) "
                                         "[default: ~4K tokens of essays + a summary request]"),
    prompt_file: Optional[Path] = typer.Option(None, help="Read the prompt from a file ('-' for stdin)."),
    prompt_tokens: int = typer.Option(DEFAULT_PROMPT_TOKENS, help="Length of the built-in essay prompt."),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Wrap the prompt in the chat template."),
    mode: str = typer.Option("triforce", help="triforce|retrieval|draft|autoregressive "
                             "(and other registered modes)."),
    max_new_tokens: int = typer.Option(256, help="Stop after this many new tokens."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens (0: all)."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    dtype: Optional[str] = typer.Option(None, help="float32|bfloat16|float16 (fp32/bf16/fp16) "
                                        "[default: float32 on CPU, bfloat16 on GPUs (float16 without bf16)]"),
    device: str = typer.Option("auto", help="auto|cpu|cuda"),
    rope_scaling: Optional[str] = typer.Option(None, help="Stretch the context, e.g. linear:4 "
                                               "(kinds: linear, dynamic, yarn, llama3)."),
    prefill_chunk: int = typer.Option(512, help="Tokens per prefill forward."),
    max_context: Optional[int] = typer.Option(None, help="Cap the cache capacity (tokens)."),
    draft: str = typer.Option("ngram", help="Bottom drafter: ngram (prompt lookup), self (the "
                              "target over a streaming cache) or a draft model path (same tokenizer)."),
    budget: int = typer.Option(4096, help="Retrieval cache tokens per layer and KV head."),
    chunk: int = typer.Option(8, help="Tokens per retrieval chunk."),
    gamma1: int = typer.Option(4, help="Tokens the drafter proposes per check."),
    gamma2: str = typer.Option("6", help="Tokens the retrieval level proposes per verification, "
                               "or 'auto' (adapt to acceptance and cost)."),
    draft_sink: int = typer.Option(16, help="Streaming draft cache: first tokens kept."),
    draft_window: int = typer.Option(240, help="Streaming draft cache: recent tokens kept."),
    rebuild: str = typer.Option("never", help="Retrieval cache rebuild: never|every:N|adaptive."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks: split heads and MLP over N "
                           "processes (gloo on CPU, NCCL one GPU each); also works under torchrun."),
    offload: str = typer.Option("auto", help="auto|on|off: keep the full KV in host memory and "
                                "stream it (auto: on when it does not fit the device; off on CPU)."),
    on_chip: int = typer.Option(0, help="With --offload: the first N layers keep their KV on the device."),
    transfer_chunk: Optional[int] = typer.Option(None, help="Tokens per host->device copy "
                                                 "[default: from `triforce-offload tune`, else >= 4 MB per copy]."),
    stage_depth: int = typer.Option(2, help="With --offload: staging ring slots of one transfer "
                                    "chunk each; also how far copies run ahead while the draft "
                                    "levels run (2: double-buffered)."),
    profile: Optional[Path] = typer.Option(None, help="With --offload: write a Chrome trace JSON "
                                           "of the last verification (copy/compute/wait per layer)."),
    plan: Optional[str] = typer.Option(None, "--plan", help="auto: choose --budget, --gamma2, "
                                       "--on-chip, --transfer-chunk with the cost model for this "
                                       "GPU (overrides them; on a CPU the defaults stay)."),
    graphs: bool = typer.Option(True, "--graphs/--no-graphs", help="Replay fixed-shape decode and "
                                "verification steps as CUDA graphs (GPU only; prefill stays eager)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text + figures) last."),
):
    """Generate from a prompt; ends with a stats line (or a JSON object with --json)."""
    params = dict(locals())
    text = read_prompt(prompt, prompt_file)  # here: ranks have no stdin
    if launch_ranks(run, tp, model, rope_scaling, device,
                    {**params, "prompt": text, "prompt_file": None}):
        return  # the ranks ran this command; rank 0 printed
    device = join(tp, device, model, draft)
    loaded = api.load(model, dtype, device, rope_scaling, progress=lambda m: err.print(m),
                      shard=tensor_parallel.shard_fn())
    ids = (long_prompt(loaded.tokenizer, prompt_tokens, chat=chat) if text is None
           else encode_prompt(loaded.tokenizer, text, chat))
    flat = dict(offload=offload, on_chip=on_chip, transfer_chunk=transfer_chunk, stage_depth=stage_depth,
                profile=str(profile) if profile else None,
                draft=draft, budget=budget, chunk=chunk, gamma1=gamma1, gamma2=gamma2,
                draft_sink=draft_sink, draft_window=draft_window, rebuild=rebuild)
    if plan is not None:
        flat.update(plan_settings(plan, loaded, len(ids) + max_new_tokens))
    opts = api.RunOptions(mode=mode, max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk,
                          max_context=max_context, graphs=graphs, extra=flat,
                          sampling=SamplingParams(temperature, top_p, top_k, seed))
    err.print(f"model {loaded.cfg.arch} {loaded.cfg.n_layers} layers, {loaded.dtype} on "
              f"{loaded.device}; mode {mode}; prompt {len(ids)} tokens", highlight=False)
    stream = None if as_json else print_stream(loaded.tokenizer)
    with bar("prefill", enabled=len(ids) > prefill_chunk) as progress:
        toks, st = api.generate(loaded, ids, opts, on_token=stream, progress=progress)
    d = st.as_dict()
    if as_json:
        print(json.dumps({"text": loaded.tokenizer.decode(toks, skip_special_tokens=True), **d}))
    else:
        print(flush=True)
        err.print(stats_line(d), highlight=False)
