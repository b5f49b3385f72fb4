"""Offload through the user's entry points: `run --offload/--profile`, `tune`, the
zero-inference mode, and the real SmolLM2 (greedy tokens equal with and without offload,
autoregressive and TriForce with the offloaded verifier)."""
import json
import subprocess
import sys

import pytest

from triforce_offload.runtime import api
from triforce_offload.runtime.data import long_prompt
from triforce_offload.runtime.sampling import SamplingParams


def cli(*args, env=None):
    cmd = [sys.executable, "-m", "triforce_offload.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def last_json(r):
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_run_offload_profile_and_zero_inference(tiny_model_dir, tmp_path):
    base = ["run", "--model", tiny_model_dir, "--mode", "autoregressive", "--prompt",
            "Hello there, tell me a story", "--max-new-tokens", "6", "--dtype", "fp32", "--json"]
    want = last_json(cli(*base))
    trace = tmp_path / "trace.json"
    got = last_json(cli(*base, "--offload", "on", "--on-chip", "1", "--transfer-chunk", "3",
                        "--stage-depth", "5", "--profile", trace))
    assert got["text"] == want["text"] and got["offload"] is True and got["transfer_chunk"] == 3
    assert got["stage_depth"] == 5 and got["staging_mib"] > 0
    assert json.loads(trace.read_text())["traceEvents"]
    base[base.index("autoregressive")] = "zero-inference"
    assert last_json(cli(*base))["text"] == want["text"]


@pytest.mark.parametrize("flags,needle", [(["--offload", "maybe"], "--offload 'maybe'"),
                                          (["--offload", "on", "--on-chip", "7"], "--on-chip 7"),
                                          (["--offload", "on", "--stage-depth", "0"], "--stage-depth 0: must be >= 1"),
                                          (["--profile", "x.json"], "--profile")])
def test_run_offload_user_errors(tiny_model_dir, flags, needle):
    r = cli("run", "--model", tiny_model_dir, "--mode", "autoregressive", "--prompt", "Hi",
            "--max-new-tokens", "2", *flags)
    assert r.returncode == 2 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr


def test_tune_writes_profile_that_run_uses(tiny_model_dir, tmp_path):
    env = {**__import__("os").environ, "TRIFORCE_OFFLOAD_CACHE": str(tmp_path)}
    d = last_json(cli("tune", "--model", tiny_model_dir, "--context", "300", "--sizes", "16,64",
                      "--dtype", "fp32", "--repeats", "1", "--plot", tmp_path / "t.png", "--json",
                      env=env))
    assert d["transfer_chunk"] in (16, 64) and len(d["rows"]) == 2
    assert (tmp_path / "t.png").stat().st_size > 0
    r = last_json(cli("run", "--model", tiny_model_dir, "--mode", "autoregressive", "--prompt", "Hi",
                      "--max-new-tokens", "2", "--offload", "on", "--json", env=env))
    assert r["transfer_chunk"] == d["transfer_chunk"]


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["fp32", "auto"])
def test_smollm2_offloaded_greedy_equal(activations):
    """Float activations: offloaded decoding equals resident decoding, token for token.
    The default (int8 activations into the quantized linears on a VNNI CPU): --offload on
    runs float activations (streamed attention agrees with a verification's rows to float
    rounding only), and every mode equals offloaded autoregressive."""
    from triforce_offload.runtime.options import ModelOptions
    loaded = api.load(ModelOptions(None, "float32", "cpu", activations=activations))
    ids = long_prompt(loaded.tokenizer, 250)
    run = lambda mode, **extra: api.generate(
        loaded, ids, api.RunOptions.of(mode=mode, max_new_tokens=8, prefill_chunk=128,
                                    sampling=SamplingParams(), **extra))
    want, _ = run("autoregressive", offload="on", on_chip=4, transfer_chunk=100)
    if activations == "fp32":
        got, st = run("autoregressive")
        assert got == want
    tri, st = run("triforce", offload="on", transfer_chunk=256, budget=128)
    assert tri == want and st.extra["offload"] and st.extra["streamed_gb"] > 0
    assert st.extra.get("activations", "fp32") == "fp32"
