"""`triforce-offload run`."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from ..bench import zero_inference  # noqa: F401  (registers --mode zero-inference)
from ..runtime import api
from ..runtime.model import tp as tensor_parallel
from ..runtime.data import builtin_prompt, check_builtin_prompt, encode_prompt
from ..runtime.errors import TriforceError
from ..runtime.conflicts import refuse
from ..runtime.options import (GenerationOptions, ModelOptions, OffloadOptions, ParallelOptions,
                               RetrievalOptions, ReuseOptions, RunOptions)
from ..runtime.cache.prefix import prefix_store
from .app import app, read_prompts
from .launch import join, launch_ranks
from .options import options, pick
from .plan import plan_settings
from .progress import bar, print_stream
from .show import compare_table, err, stats_line

DEFAULT_PROMPT_TOKENS = 4000


@app.command()
@options
def run(
    model: ModelOptions,
    gen: GenerationOptions,
    retrieval: RetrievalOptions,
    offload: OffloadOptions,
    parallel: ParallelOptions,
    reuse: Annotated[ReuseOptions, pick("kv_dir", "kv_dir_limit")],
    prompt: Optional[List[str]] = typer.Option(None, help="Prompt text ('-' reads stdin); repeat it for "
                                               "a batch, each prompt its own sequence "
                                               "\\[default: ~4K tokens of essays + a summary request]"),
    prompt_file: Optional[List[Path]] = typer.Option(None, help="Read the prompt from a file ('-' for "
                                                     "stdin); repeat it for a batch."),
    prompt_tokens: int = typer.Option(DEFAULT_PROMPT_TOKENS, help="Length of the built-in essay prompt."),
    builtin_prompt: str = typer.Option("summary", help="Built-in prompt without --prompt: summary "
                                       "(essays + a summary request) or continue (essay text to continue)."),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Wrap the prompt in the chat template."),
    plan: Optional[str] = typer.Option(None, "--plan", help="auto: choose --budget, --gamma2, "
                                       "--on-chip, --transfer-chunk with the cost model for this "
                                       "GPU (overrides them; on a CPU the defaults stay)."),
    compare: Optional[str] = typer.Option(None, help="Then run this mode (e.g. autoregressive) on "
                                          "the same prompt and print both side by side."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text + figures) last."),
):
    """Generate from a prompt; ends with a stats line (or a JSON object with --json). Several
    prompts run as one batch, each token for token as it would alone."""
    if prompt_tokens < 1:
        raise TriforceError(f"--prompt-tokens {prompt_tokens}: must be >= 1")
    check_builtin_prompt(builtin_prompt)  # before any loading
    if compare is not None:
        gen.but(mode=compare)  # checks the name before any loading
    if reuse.kv_dir and parallel.tp > 1:
        refuse("tp-kv-dir")
    texts = read_prompts(prompt, prompt_file)  # here: ranks have no stdin
    if len(texts) > 1 and compare is not None:
        refuse("compare-batch")
    if len(texts) > 1 and parallel.tp > 1:
        refuse("tp-batch")
    job = Job(model, RunOptions(gen, retrieval, offload), texts, (builtin_prompt, prompt_tokens),
              chat, plan, compare, as_json, reuse)
    if not launch_ranks(run_job, parallel.tp, model, gen.draft, dict(job=job, tp=parallel.tp)):
        run_job(job, parallel.tp)  # else the ranks ran it; rank 0 printed


class Job:
    """One `run` invocation, as the ranks of `--tp` receive it (picklable)."""

    def __init__(self, model, opts, texts, builtin, chat, plan, compare, as_json, reuse=None):
        self.model, self.opts, self.texts, self.builtin = model, opts, texts, builtin  # (kind, tokens)
        self.chat, self.plan, self.compare, self.as_json = chat, plan, compare, as_json
        self.reuse = reuse  # ReuseOptions: --kv-dir


def run_job(job: Job, tp: int):
    model = job.model.but(device=join(tp, job.model.device, job.model.model, job.opts.generation.draft))
    loaded = api.load(model, progress=lambda m: err.print(m), shard=tensor_parallel.shard_fn())
    if job.reuse is not None and job.reuse.kv_dir:
        if api.world_size() > 1:
            refuse("tp-kv-dir")
        loaded.prefix = prefix_store(job.reuse, loaded, memory=False,
                                     note=lambda m: err.print(m, highlight=False))
    prompts = ([builtin_prompt(loaded.tokenizer, *job.builtin, chat=job.chat)] if not job.texts
               else [encode_prompt(loaded.tokenizer, t, job.chat) for t in job.texts])
    opts = job.opts
    if job.plan is not None:
        opts = opts.but(**plan_settings(job.plan, loaded, max(map(len, prompts)) + opts.max_new_tokens))
    lengths = sorted(map(len, prompts))
    what = (f"prompt {lengths[0]} tokens" if len(prompts) == 1 else
            f"{len(prompts)} prompts of {lengths[0]}..{lengths[-1]} tokens in one batch")
    err.print(f"model {loaded.cfg.arch} {loaded.cfg.n_layers} layers, weights {loaded.weights} "
              f"({loaded.load_info}), "
              f"activations {str(loaded.dtype).removeprefix('torch.')}"
              f"{' (int8 into quantized linears)' if loaded.activations == 'int8' else ''}, "
              f"KV {str(loaded.kv_dtype).removeprefix('torch.')} on "
              f"{loaded.device}; mode {opts.mode}; {what}", highlight=False)
    if len(prompts) > 1:
        return run_batch(loaded, prompts, opts, job.as_json)
    ids = prompts[0]
    text, d = generate(loaded, ids, opts, stream=not job.as_json)
    if job.compare is None:
        if job.as_json:
            print(json.dumps({"text": text, **d}))
        return
    err.print(f"now {job.compare} on the same prompt:", highlight=False)
    loaded.prefix = None  # the compared mode prefills too
    text2, d2 = generate(loaded, ids, opts.but(mode=job.compare), stream=False)
    if job.as_json:
        print(json.dumps({"text": text, **d, "compare": {"text": text2, **d2}}))
    else:
        err.print(compare_table(d, d2, text == text2, opts.sampling.greedy))


def generate(loaded, ids, opts: RunOptions, stream: bool):
    """Run one mode on ids, streaming the text to stdout; (text, figures)."""
    on_token = print_stream(loaded.tokenizer) if stream else None
    with bar("prefill", enabled=len(ids) > opts.prefill_chunk) as progress:
        toks, st = api.generate(loaded, ids, opts, on_token=on_token, progress=progress)
    d = st.as_dict()
    if stream:
        print(flush=True)
        err.print(stats_line(d), highlight=False)
    return loaded.tokenizer.decode(toks, skip_special_tokens=True), d


def run_batch(loaded, prompts: list[list[int]], opts: RunOptions, as_json: bool):
    """Several prompts as one batch (runtime/batch): each sequence's text and stats line in
    the order given, then the batch's aggregate rate; or one JSON object."""
    made = [0]
    total = len(prompts) * opts.max_new_tokens

    with bar(f"batch of {len(prompts)}", enabled=not as_json) as progress:
        def on_token(i, t):  # from the sequences' threads: one counter, read by the bar
            made[0] += 1
            if progress is not None:
                progress(made[0], total)

        started = time.perf_counter()
        results = api.generate_batch(loaded, prompts, opts, on_token=on_token)
        wall = time.perf_counter() - started
    out = [{"text": loaded.tokenizer.decode(toks, skip_special_tokens=True), **st.as_dict()}
           for toks, st in results]
    new = sum(d["new_tokens"] for d in out)
    summary = {"sequences": len(out), "new_tokens": new, "wall_s": wall, "tokens_per_s": new / wall}
    if as_json:
        print(json.dumps({"results": out, "batch": summary}))
        return
    for i, d in enumerate(out):
        err.print(f"── sequence {i + 1} of {len(out)} ──", highlight=False)
        print(d["text"], flush=True)
        err.print(stats_line(d), highlight=False)
    err.print(f"batch of {len(out)}: {new} new tokens in {wall:.2f} s, {new / wall:.1f} tok/s in all",
              highlight=False)
