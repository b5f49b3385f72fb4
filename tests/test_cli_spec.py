"""`triforce-offload run` with the speculative modes and their flags (tiny model, SmolLM2 tokenizer)."""
import json

import pytest

from test_cli import assert_user_error, cli


LONGER = "Hello there, hello there, " * 6 + "hello"  # longer than a budget of 8 tokens


def run_json(model_dir, *args):
    prompt = () if "--prompt" in args else ("--prompt", "Hello there, hello there, hello")
    r = cli("run", "--model", model_dir, *prompt, "--no-chat",
            "--max-new-tokens", "12", "--dtype", "fp32", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_default_mode_is_triforce_with_ngram_and_lossless(tiny_model_dir):
    ar = run_json(tiny_model_dir, "--mode", "autoregressive", "--prompt", LONGER)
    d = run_json(tiny_model_dir, "--budget", "8", "--chunk", "4", "--prompt", LONGER)
    assert d["mode"] == "triforce" and set(d["acceptance"]) == {"ngram", "retrieval"}
    assert d["text"] == ar["text"] and "mean_accepted" in d


def test_draft_model_path_and_flags(tiny_model_dir):
    ar = run_json(tiny_model_dir, "--mode", "autoregressive", "--prompt", LONGER)
    d = run_json(tiny_model_dir, "--draft", tiny_model_dir, "--gamma1", "3", "--gamma2", "auto",
                 "--draft-sink", "2", "--draft-window", "8", "--rebuild", "every:4", "--budget", "8",
                 "--chunk", "4", "--prompt", LONGER)
    assert d["text"] == ar["text"] and set(d["acceptance"]) == {"draft", "retrieval"}
    assert d["rebuilds"] >= 1


@pytest.mark.parametrize("flag,value,needle", [
    ("--budget", "8", "--budget 8: must be at least 2 chunks"),
    ("--gamma1", "0", "--gamma1 0"),
    ("--gamma2", "x", "--gamma2 'x'"),
    ("--rebuild", "often", "--rebuild 'often'"),
])
def test_bad_speculative_flags(tiny_model_dir, flag, value, needle):
    assert_user_error(cli("run", "--model", tiny_model_dir, "--prompt", "hi", flag, value), needle)


def test_stats_line_shows_sized_drafts_and_only_drafters_that_drafted():
    from triforce_offload.cli.show import stats_line
    line = stats_line({"prompt_tokens": 5, "prefill_s": 0.1, "decode_ms_per_token": 2.0, "tokens_per_s": 500.0,
                       "new_tokens": 3, "peak_memory_gb": 0.1, "acceptance": {"ngram": 0.5, "retrieval": 0.0},
                       "acceptance_per_token": {"ngram": 0.6, "retrieval": 0.0},
                       "drafts": {"ngram": {"drafted": 4}, "retrieval": {"drafted": 0}},
                       "sized_drafts": {"matches": 5, "drafted": 4}, "bypassed_tokens": {"retrieval": 3}})
    assert "accept ngram 0.50 (0.60/judged tok)" in line and "accept retrieval" not in line
    assert "ngram drafted 4 tok from 5 matches" in line and "bypassed retrieval 3 tok" in line
