"""The `triforce-offload` command as a user runs it: outputs, JSON, and one-line errors."""
import json
import re
import subprocess
import sys

import pytest


def cli(*args, stdin=None):
    cmd = [sys.executable, "-m", "triforce_offload.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, input=stdin, timeout=300)


def assert_user_error(r, *needles):
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_run_json_on_tiny_model(tiny_model_dir):
    r = cli("run", "--model", tiny_model_dir, "--mode", "autoregressive", "--prompt", "Hello there",
            "--max-new-tokens", "5", "--dtype", "fp32", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout.strip().splitlines()[-1])
    for k in ("text", "prompt_tokens", "prefill_s", "decode_ms_per_token", "tokens_per_s",
              "peak_memory_gb"):
        assert k in d
    assert d["new_tokens"] <= 5 and d["prompt_tokens"] > 2


def test_prompt_from_stdin_and_stats_line(tiny_model_dir):
    r = cli("run", "--model", tiny_model_dir, "--mode", "autoregressive", "--prompt", "-",
            "--max-new-tokens", "3", "--no-chat", stdin="one two three")
    assert r.returncode == 0, r.stderr
    assert "prompt 4 tok" in r.stderr.replace("\n", " ") or "prompt 3 tok" in r.stderr
    assert "ms/tok" in r.stderr


def test_missing_model_path():
    assert_user_error(cli("run", "--model", "/no/such/model"), "/no/such/model", "does not exist")


def test_folder_that_is_not_a_model(tmp_path):
    assert_user_error(cli("run", "--model", tmp_path), "config.json")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                       "model_type": "gpt2"}))
    assert_user_error(cli("run", "--model", tmp_path), "GPT2LMHeadModel", "LlamaForCausalLM")


def test_prompt_longer_than_context(tiny_model_dir):
    r = cli("run", "--model", tiny_model_dir, "--mode", "autoregressive", "--max-context", "50",
            "--prompt", "word " * 80)
    assert_user_error(r, "of 50 tokens", "--max-context")
    assert re.search(r"prompt of \d{3} tokens", r.stderr)  # both lengths are named


@pytest.mark.parametrize("flag,value,needle", [("--temperature", "-1", "temperature"),
                                               ("--top-p", "0", "top-p"),
                                               ("--temperature", "nan", "must be a finite number"),
                                               ("--top-p", "inf", "must be a finite number"),
                                               ("--seed", str(2 ** 70), "[0, 2**64)"),
                                               ("--seed", "-1", "[0, 2**64)"),
                                               ("--dtype", "int3", "float32"),
                                               ("--device", "tpu", "auto, cpu, cuda"),
                                               ("--mode", "magic", "autoregressive")])
def test_invalid_values(tiny_model_dir, flag, value, needle):
    assert_user_error(cli("run", "--model", tiny_model_dir, "--prompt", "hi", flag, value), needle)


def test_info_json():
    r = cli("info", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["torch"] and d["ram_total_gb"] > 0 and d["pinned_memory"] in (True, False)
    k = d["cpu_kernels"]
    assert k["attention"].startswith(("native (", "torch ("))
    assert k["float32_linear"] in ("oneDNN", "F.linear")
    assert k["layers"].startswith(("every layer of a step in one native call", "a native call per op",
                                   "torch and native calls per op"))
    gpu = d["gpu_attention"]  # which decode/verify kernel runs on the GPU, and why
    assert gpu.startswith("decode/verify (graphs): ") if d["cuda_available"] else gpu.startswith("none (")
    lin = d["gpu_linear"]  # which kernel a step's projections run on there
    assert lin.startswith(("row-exact Triton", "cuBLAS (")) if d["cuda_available"] else lin.startswith("none (")
    compile_ = d["gpu_compile"]  # what --compile does there
    assert compile_.startswith(("--compile: torch.compile", "unavailable: ")) if d["cuda_available"] \
        else compile_.startswith("not applied (no CUDA device)")


def test_run_several_prompts_as_one_batch_equals_each_alone(tiny_model_dir, tmp_path):
    """`run --prompt A --prompt B ...`: one batch, each sequence's text equal to its run alone
    (greedy, a speculative mode), JSON with a result per prompt and the batch's rate."""
    prompts = ["Hello there", "The quick brown fox jumps over the lazy dog and then", "1 2 3"]
    common = ["--model", tiny_model_dir, "--mode", "retrieval", "--budget", "16",
              "--max-new-tokens", "6", "--dtype", "fp32", "--json"]
    r = cli("run", *common, *[a for p in prompts for a in ("--prompt", p)])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(d["results"]) == 3 and d["batch"]["sequences"] == 3
    assert d["batch"]["new_tokens"] == sum(x["new_tokens"] for x in d["results"]) > 0
    assert d["batch"]["tokens_per_s"] > 0
    for p, got in zip(prompts, d["results"]):
        alone = cli("run", *common, "--prompt", p)
        assert alone.returncode == 0, alone.stderr
        solo = json.loads(alone.stdout.strip().splitlines()[-1])
        assert (got["text"], got["new_tokens"]) == (solo["text"], solo["new_tokens"])
    files = []
    for i, p in enumerate(prompts[:2]):
        files += ["--prompt-file", tmp_path / f"p{i}.txt"]
        (tmp_path / f"p{i}.txt").write_text(p)
    r = cli("run", *common[:-1], *files)  # text output: a block per sequence
    assert r.returncode == 0, r.stderr
    assert "sequence 2 of 2" in r.stderr and "2 prompts of" in r.stderr and "tok/s in all" in r.stderr
    for x in d["results"][:2]:
        assert x["text"].strip() in r.stdout


@pytest.mark.parametrize("extra,needle", [(["--compare", "autoregressive"], "--compare runs one prompt"),
                                          (["--tp", "2"], "--tp runs one prompt"),
                                          (["--prompt", "-", "--prompt", "-"], "stdin ('-') can be read once")])
def test_run_several_prompts_refuses_what_a_batch_cannot_do(tiny_model_dir, extra, needle):
    assert_user_error(cli("run", "--model", tiny_model_dir, "--prompt", "a", "--prompt", "b", *extra), needle)
