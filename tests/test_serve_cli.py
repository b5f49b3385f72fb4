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
    import threading
    from triforce_offload.server.worker import TextStream

    class Tok:  # one character per token id
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))
    ts = TextStream(Tok(), ["END"], threading.Lock())
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
