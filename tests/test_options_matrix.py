"""Every option that changes what runs, pairwise (issue 39): each combination runs and every
speculative mode gives autoregressive's tokens at the same settings, or it is refused in one
line. The options come from the option dataclasses themselves: an option added there without
a place here (values to try, or why it changes nothing that runs) fails
`test_every_option_has_a_place_in_the_matrix`.

Pairwise (all-pairs) coverage: every pair of values of two options appears in some row;
the rows come from a small greedy generator with a fixed seed, and the covered pairs are
printed. The CUDA dry run covers the combinations that reach CUDA code
(tests/test_cuda_dryrun.py); --tp runs in processes (tests/test_tp.py), --plan auto is a
CPU no-op (it keeps the defaults there) and --compile is CUDA's, so on this path they are
values that must run or be refused like the others. A refusal must be one of the combinations
runtime/conflicts.py lists (docs/design.md's table).
"""
from __future__ import annotations

import itertools
import random
from dataclasses import fields

import pytest

from triforce_offload.offload.errors import OffloadError
from triforce_offload.runtime import api
from triforce_offload.runtime.conflicts import ConflictError
from triforce_offload.runtime.errors import TriforceError
from triforce_offload.runtime.options import (GenerationOptions, ModelOptions, OffloadOptions,
                                              ParallelOptions, RetrievalOptions, RunOptions,
                                              SamplingParams)

# option -> the values the matrix tries (the first: the default or the plain choice)
MATRIX = {
    # the model and its numbers
    "dtype": ["float32", "bfloat16"],
    "weights": ["auto", "int8", "int4", "bf16"],  # bf16 at --dtype float32: refused
    "activations": ["auto", "fp32", "int8"],
    "kv_dtype": ["auto", "fp32", "bf16", "fp16"],
    "rope_scaling": [None, "linear:2"],
    # generation
    "mode": ["triforce", "retrieval", "draft"],
    "draft": ["ngram", "self"],
    "gamma2": ["6", "auto", "2"],
    "bypass": [True, False],
    "graphs": [True, False],
    "compile": [False, True],
    "temperature": [0.0, 0.8],  # greedy, sampled
    # the retrieval level
    "budget": [None, 32, 12],  # 12 at --retrieval-chunk 8: refused
    "retrieval_chunk": [8, 4],
    "rebuild": ["never", "every:8", "adaptive"],
    # offloading
    "offload": ["off", "on"],
    "on_chip": [0, 1],
    # the fixed-shape path (TRIFORCE_OFFLOAD_STATIC=1; CUDA's default)
    "static": [False, True],
}
# options that change nothing of what runs here, each with where it is tested
EXEMPT = {
    "model": "the matrix's model (tiny random Llama); the bundled GGUF in test_lossless_smollm2",
    "device": "CPU here; CUDA through tests/test_cuda_dryrun.py",
    "chat_template": "the prompt's text only (test_chat_template)",
    "max_new_tokens": "how many tokens (every test)",
    "prefill_chunk": "prefill chunking (test_prefill_chunks)",
    "max_context": "a capacity cap (test_cli)",
    "ignore_eos": "set by the matrix: every row generates its tokens",
    "gamma1": "draft width, exercised by every draft mode row (test_speculative)",
    "draft_sink": "the self-drafter's window (test_speculative)",
    "draft_window": "the self-drafter's window (test_speculative)",
    "ngram": "the n-gram drafter's n (test_speculative)",
    "top_p": "sampling filter (test_sampling)",
    "top_k": "sampling filter (test_sampling)",
    "seed": "set by the matrix for sampled rows",
    "transfer_chunk": "copy sizes (test_offload)",
    "stage_depth": "staging slots (test_offload)",
    "profile": "a trace file (test_offload_timing)",
    "overlap": "the serialized reference (test_offload)",
    "tp": "tensor parallelism runs in processes (test_tp)",
}
GROUPS = (ModelOptions, SamplingParams, GenerationOptions, RetrievalOptions, OffloadOptions, ParallelOptions)
MODEL_KEYS = {"dtype", "weights", "activations", "kv_dtype", "rope_scaling"}
SEED = 7


def option_names() -> set[str]:
    return {f.name for g in GROUPS for f in fields(g)}


def test_every_option_has_a_place_in_the_matrix():
    names = option_names()
    missing = sorted(names - set(MATRIX) - set(EXEMPT))
    assert not missing, f"options without a place in the matrix (values or a reason): {missing}"
    stale = sorted((set(MATRIX) | set(EXEMPT)) - names - {"static"})
    assert not stale, f"matrix entries that are no option: {stale}"
    assert not set(MATRIX) & set(EXEMPT)


def test_the_matrix_meets_refused_combinations():
    """The matrix's values include combinations that are refused (so the refusal path is
    covered): bf16 weights at --dtype float32, a budget below two retrieval chunks."""
    refused = {r["weights"] == "bf16" and r["dtype"] == "float32" or
               r["budget"] is not None and r["budget"] < 2 * r["retrieval_chunk"] for r in ROWS}
    assert refused == {True, False}


def all_pairs(factors: dict[str, list], seed: int = SEED, tries: int = 30) -> list[dict]:
    """Rows covering every pair of values of two factors (greedy, seeded)."""
    rng = random.Random(seed)
    names = list(factors)
    pos = {n: i for i, n in enumerate(names)}

    def key(a, va, b, vb):
        return (a, va, b, vb) if pos[a] < pos[b] else (b, vb, a, va)
    left = {key(a, va, b, vb) for a, b in itertools.combinations(names, 2)
            for va in factors[a] for vb in factors[b]}
    rows = []
    while left:
        best = None
        for _ in range(tries):
            row, order = {}, names[:]
            rng.shuffle(order)
            for n in order:
                row[n] = max(factors[n], key=lambda v: (sum(key(a, row[a], n, v) in left for a in row), rng.random()))
            got = {p for p in left if row[p[0]] == p[1] and row[p[2]] == p[3]}
            if best is None or len(got) > len(best[1]):
                best = (row, got)
        rows.append(best[0])
        left -= best[1]
    return rows


def test_all_pairs_covers_every_pair():
    f = {"a": [1, 2, 3], "b": ["x", "y"], "c": [True, False], "d": [0, 1, 2]}
    rows = all_pairs(f)
    for a, b in itertools.combinations(f, 2):
        assert {(r[a], r[b]) for r in rows} == set(itertools.product(f[a], f[b]))
    assert len(rows) < len(list(itertools.product(*f.values())))  # pairs, not the product


ROWS = all_pairs(MATRIX)
# past the auto budget's floor (256): every row with a retrieval level builds one; repeats
# give the n-gram drafter matches
PROMPT = [(i * 7 + 3) % 97 + 10 for i in range(300)] + list(range(40, 60)) * 5


def one_line(e: BaseException) -> bool:
    """A refusal in one line, of a combination runtime/conflicts.py lists (docs/design.md's
    table): a refusal of anything else in the matrix is a gap."""
    return isinstance(e, ConflictError) and bool(str(e).strip()) and "\n" not in str(e).strip()


@pytest.fixture(scope="module")
def loads(tiny_model_dir):
    """ModelOptions fields -> Loaded (or the refusal), loaded once per combination; `model`:
    the tiny random Llama, or None for the bundled SmolLM2 GGUF."""
    cache = {}

    def get(row, model=str(tiny_model_dir)):
        k = tuple((n, row[n]) for n in sorted(MODEL_KEYS))
        if (model, k) not in cache:
            try:
                cache[model, k] = api.load(ModelOptions(model=model, **dict(k)))
            except (TriforceError, OffloadError) as e:
                cache[model, k] = e
        return cache[model, k]
    return get


# the bundled GGUF (30 layers) takes ~20 s a row: a seeded sample of the rows keeps CI's time
# (and the offloaded rows at int8 activations: where the bundled GGUF had shown a verification
# leaving autoregressive's tokens, before OffloadedCache._attend_rows)
BUNDLED = sorted(set(random.Random(SEED).sample(range(len(ROWS)), 6))
                 | {i for i, r in enumerate(ROWS) if r["offload"] == "on" and r["activations"] == "int8"})
CASES = [pytest.param(r, "tiny", id=f"tiny-row{i}") for i, r in enumerate(ROWS)] + [
    pytest.param(ROWS[i], "bundled", id=f"bundled-row{i}", marks=pytest.mark.slow) for i in BUNDLED]


def exact(row) -> bool:
    """Where the runtime promises greedy equality on a CPU: float32 compute (dense fp32
    weights, or a GGUF's own precision with int8 activations and any KV dtype). A bfloat16
    compute dtype on a CPU has no row-exact kernels (docs/batching.md): its verification rows
    may round otherwise than its decodes, so a near tie may flip (the bundled GGUF does, at
    --dtype bfloat16 offloaded); those rows must run, not match."""
    return row["dtype"] == "float32"


@pytest.mark.parametrize("row,model", CASES)
def test_pairwise_combination_runs_lossless_or_is_refused_in_one_line(row, model, loads, monkeypatch):
    print("covered:", row)
    if row["static"]:
        monkeypatch.setenv("TRIFORCE_OFFLOAD_STATIC", "1")
    else:
        monkeypatch.delenv("TRIFORCE_OFFLOAD_STATIC", raising=False)
    loaded = loads(row) if model == "tiny" else loads(row, None)
    if isinstance(loaded, BaseException):
        print("refused at load:", loaded)
        assert one_line(loaded), repr(loaded)
        return
    flat = {k: v for k, v in row.items() if k not in MODEL_KEYS and k != "static"}
    sampled = flat["temperature"] > 0
    try:
        opts = RunOptions.of(**flat, max_new_tokens=16, ignore_eos=True, seed=11 if sampled else None)
        toks, st = api.generate(loaded, PROMPT, opts)
    except (TriforceError, OffloadError) as e:
        print("refused:", e)
        assert one_line(e), repr(e)
        return
    print("ran:", st.as_dict().get("notes") or "")
    assert len(toks) == 16
    ref, _ = api.generate(loaded, PROMPT, opts.but(mode="autoregressive"))
    assert len(ref) == 16
    if not sampled and exact(row):  # greedy: the speculative mode's tokens are the target's own
        assert toks == ref, (row, st.as_dict().get("notes"))


@pytest.mark.parametrize("row", ROWS, ids=[f"row{i}" for i in range(len(ROWS))])
def test_pairwise_combination_on_the_cuda_dry_run(row, loads, tiny_model_dir, monkeypatch):
    """The same rows on the fake CUDA device (tests/cuda_dry: the fixed-shape path and graphs
    are CUDA's defaults there): each runs clean of the dry run's findings and its speculative
    mode gives the dry autoregressive run's tokens, or it is refused in one line."""
    from cuda_dry import DryRun
    monkeypatch.delenv("TRIFORCE_OFFLOAD_STATIC", raising=False)  # on CUDA the fixed shapes are the default
    if isinstance(loads(row), BaseException):
        return  # refused at load: the CPU test checked its line
    # a model of its own: the CPU rows' runs leave kept steps (compiled ones too) on theirs
    loaded = api.load(ModelOptions(model=str(tiny_model_dir), **{n: row[n] for n in MODEL_KEYS}))
    flat = {k: v for k, v in row.items() if k not in MODEL_KEYS and k != "static"}
    sampled = flat["temperature"] > 0
    out = []
    for mode in (flat["mode"], "autoregressive"):
        try:
            opts = RunOptions.of(**{**flat, "mode": mode}, max_new_tokens=8, ignore_eos=True,
                                 seed=11 if sampled else None)
            with DryRun("sdpa") as dry:
                toks, _ = dry.generate(dry.cuda(loaded), PROMPT, opts)
        except (TriforceError, OffloadError) as e:
            print("refused:", e)
            assert one_line(e), repr(e)
            return
        dry.check()
        out.append(toks)
    print("ran on the dry device")
    assert len(out[0]) == len(out[1]) == 8
    if not sampled and exact(row):
        assert out[0] == out[1], row
