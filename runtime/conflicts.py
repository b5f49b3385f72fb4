"""Combinations of options that are refused, in one place (issue 39).

Each value of an option is checked where it is declared (`opt(check=...)`); what is left
are combinations: two options each fine alone that cannot run together. Each is here once,
with its words and the reason, and each place that meets one raises it with
`refuse(key, **values)` before loading more than the config. docs/design.md's table of
refusals is `table()` (tests/test_docs.py checks that it is current), and the options
matrix (tests/test_options_matrix.py) checks that every refusal it meets is one of these.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from .errors import TriforceError


@dataclass(frozen=True)
class Conflict:
    options: str  # the combination, as a user writes it
    commands: str  # where it can be given
    message: str  # the one line, formatted with the values
    why: str  # the reason, for the docs


CONFLICTS: dict[str, Conflict] = {
    "weights-dtype": Conflict(
        "`--weights fp32` or `bf16` with another `--dtype`", "run, serve, bench, tune",
        "--weights {weights} with --dtype {dtype}: dense weights run at the compute dtype; give one of the two",
        "dense weights are stored at the compute dtype: the two flags would name two dtypes for one tensor"),
    "budget-chunk": Conflict(
        "`--budget` below 2 x `--retrieval-chunk`", "run, serve, bench, tune",
        "--budget {budget}: must be at least 2 chunks (2 x --retrieval-chunk {chunk} = {least} tokens)",
        "the budget holds the incomplete last chunk (always kept) and at least one selected chunk"),
    "tp-quantized": Conflict(
        "`--tp` with `--weights int8` or `int4`", "run",
        "--tp: tensor parallelism shards dense weights only, not --weights {weights} (pass --weights fp32 or bf16)",
        "the quantized kernels are the CPU's; tensor parallelism is CUDA's and shards dense matrices"),
    "tp-kv-dir": Conflict(
        "`--tp` with `--kv-dir`", "run",
        "--kv-dir works in one process: each --tp rank holds another slice of the KV",
        "an entry holds one process's whole KV; each rank holds a slice of the heads"),
    "tp-batch": Conflict(
        "`--tp` with several prompts", "run",
        "several prompts run as one batch in one process; --tp runs one prompt",
        "the batched engine runs in one process; tensor-parallel ranks run one sequence in lockstep"),
    "tp-serve": Conflict(
        "`serve` under `--tp` or torchrun", "serve",
        "serve runs in one process; tensor parallelism (--tp, torchrun) is run's",
        "the server's batches run in one process"),
    "compare-batch": Conflict(
        "`--compare` with several prompts", "run",
        "--compare runs one prompt; give one --prompt",
        "the comparison times two modes on one sequence"),
    "batch-bench-llamacpp": Conflict(
        "`bench --batch` with `llama.cpp` and no GGUF", "bench",
        "--batch with llama.cpp needs a GGUF: give --gguf",
        "llama-batched-bench reads GGUF files only"),
}


class ConflictError(TriforceError):
    """A refused combination; `key` names it in CONFLICTS."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def refuse(key: str, **values) -> NoReturn:
    raise ConflictError(key, CONFLICTS[key].message.format(**values))


def table() -> str:
    """The markdown table of docs/design.md."""
    rows = ["| combination | where | refused because |", "|---|---|---|"]
    rows += [f"| {c.options} | {c.commands} | {c.why} |" for c in CONFLICTS.values()]
    return "\n".join(rows)
