"""`serve`'s own options: a bad value is one line and exit 2 before any model loads; the
request schema and the text stream, without a server."""
import socket

import pytest

from test_cli import assert_user_error, cli

pytest.importorskip("fastapi")


@pytest.mark.parametrize("args,needle", [
    (("--port", "70000"), "--port 70000"),
    (("--max-queue", "0"), "--max-queue"),
    (("--request-timeout", "0"), "--request-timeout"),
    (("--kv-cache-mem", "lots"), "--kv-cache-mem 'lots'"),
    (("--kv-dir-limit", "-1G"), "--kv-dir-limit"),
    (("--mode", "magic"), "--mode 'magic'"),
    (("--temperature", "-1"), "--temperature"),
])
def test_bad_serve_options(tiny_model_dir, args, needle):
    assert_user_error(cli("serve", "--model", tiny_model_dir, *args), needle)


def test_taken_port_is_one_line(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert_user_error(cli("serve", "--model", tiny_model_dir, "--port", port), f"127.0.0.1:{port}")


def test_run_kv_dir_refuses_tp(tiny_model_dir, tmp_path):
    assert_user_error(cli("run", "--model", tiny_model_dir, "--kv-dir", tmp_path, "--tp", "2",
                          "--prompt", "hi"), "--kv-dir")


def test_text_stream_holds_back_a_stop_string_prefix():
    from triforce_offload.server.worker import TextStream

    class Tok:  # one character per token id
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))
    ts = TextStream(Tok(), ["END"])
    out = [ts.add(ord(c)) for c in "abcEN"]
    assert "".join(out) == "abc" and not ts.stopped  # "EN" may begin "END"
    assert ts.add(ord("X")) == "ENX"  # it did not
    assert ts.add(ord("E")) + ts.add(ord("N")) + ts.add(ord("D")) == "" and ts.stopped
    assert ts.text == "abcENX" and ts.finish() == ""


def test_request_schema_refuses_what_it_does_not_do():
    from triforce_offload.server.schema import ApiError, ChatRequest, CompletionRequest
    msg = [{"role": "user", "content": "hi"}]
    assert ChatRequest(messages=msg, n=2).refused()[0] == "n"
    assert ChatRequest(messages=msg, logprobs=True).refused()[0] == "logprobs"
    assert ChatRequest(messages=msg, frequency_penalty=0.5).refused()[0] == "presence_penalty"
    assert CompletionRequest(prompt=["a", "b"]).refused()[0] == "prompt"
    assert CompletionRequest(prompt=["a"]).single() == "a"
    assert CompletionRequest(prompt=[1, 2]).single() == [1, 2]
    with pytest.raises(ApiError):
        ChatRequest(messages=msg, stop=list("abcde")).stops()
    with pytest.raises(ApiError):
        ChatRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}]).messages[0].text()


def test_request_schema_bounds_seed_and_names_nan():
    from pydantic import ValidationError
    from triforce_offload.server.schema import CompletionRequest
    for kw, needle in [({"seed": 2 ** 64}, "less than"), ({"seed": -1}, "greater than"),
                       ({"temperature": float("nan")}, "finite number"), ({"top_p": float("nan")}, "finite number")]:
        with pytest.raises(ValidationError, match=needle):
            CompletionRequest(prompt="hi", **kw)
    assert CompletionRequest(prompt="hi", seed=2 ** 64 - 1).seed == 2 ** 64 - 1


def test_token_bytes_bound_only_what_cannot_shrink(smol_dir):
    """The longest token as stored bounds the input bytes of a token, unless text may be
    dropped (no bound) or shrunk (3x per such normalizer)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from triforce_offload.runtime.model.loader import load_tokenizer
    from triforce_offload.server.app import auto_body, token_bytes

    assert token_bytes(load_tokenizer(smol_dir)) == 162  # "\n" and 80 spaces, 2 bytes each as stored
    assert auto_body(4096, 162) == 2 * 4096 * 162 + 2 ** 20

    def tok(pre=None, norm=None, **bpe):
        t = Tokenizer(models.BPE({"a": 0, "bb": 1, "<unk>": 2}, [], unk_token="<unk>", **bpe))
        t.pre_tokenizer, t.normalizer = pre, norm
        return PreTrainedTokenizerFast(tokenizer_object=t)
    assert token_bytes(tok(pre_tokenizers.ByteLevel())) == 5  # "<unk>"
    assert token_bytes(tok(pre_tokenizers.Metaspace(), normalizers.NFC())) == 15
    assert token_bytes(tok(pre_tokenizers.Whitespace())) is None  # drops spaces
    assert token_bytes(tok(norm=normalizers.Strip())) is None
    assert token_bytes(tok(norm=normalizers.Replace("ab", "c"))) is None
    assert token_bytes(tok(fuse_unk=True)) is None  # a run of unknown characters is one token
