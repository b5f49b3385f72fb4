"""`serve`'s limits on a tiny random model (SmolLM2's tokenizer, a 4K context): out-of-range
values are 400s, the `triforce` figures have the same keys in every response, and long
prompts neither stall the event loop nor the running generation: they are encoded in a
thread (or refused by their byte length before), and a body beyond --max-body is a 413.

One server for the module, a subprocess on a free port stopped by its own PID.
"""
import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
from test_serve import server  # noqa: E402

# greedy, so the random model's long stream is the same every run; no KV reuse (--kv-cache-mem 0)
ARGS = ("--mode", "autoregressive", "--kv-cache-mem", "0", "--rope-scaling", "linear:2",
        "--max-body", "12M")
CONTEXT, TOKEN_BYTES = 4096, 162  # SmolLM2's longest token: "\n" and 80 spaces, 2 bytes each as stored
FIGURES = {"mode", "prompt_tokens", "new_tokens", "reused_tokens", "reused_from", "prefill_s",
           "decode_ms_per_token", "tokens_per_s", "acceptance", "acceptance_per_token",
           "mean_accepted", "rebuilds", "notes", "overlap", "time_to_first_token_s", "timed_out"}


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_model_dir):
    with server(tmp_path_factory.mktemp("limits"), "--model", str(tiny_model_dir), *ARGS, spec=()) as (b, _):
        yield b


def post(base, body, route="/v1/completions"):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    return httpx.post(base + route, timeout=120, **kw)


def refused(r, status, param, needle):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_out_of_range_values_are_400s(base):
    hi = {"prompt": "Hi", "max_tokens": 2}
    refused(post(base, {**hi, "seed": 2 ** 70, "temperature": 0}), 400, "seed", "less than")
    refused(post(base, {**hi, "seed": -1, "temperature": 1}), 400, "seed", "greater than")
    assert post(base, {**hi, "seed": 2 ** 64 - 1, "temperature": 1}).status_code == 200
    for field in ("temperature", "top_p"):  # JSON has no NaN; Python's parser takes it
        refused(post(base, f'{{"prompt": "Hi", "{field}": NaN}}'.encode()), 400, field, "finite number")


def test_figures_have_the_same_keys_without_reuse(base):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    figures = post(base, chat, "/v1/chat/completions").json()["triforce"]
    assert set(figures) == FIGURES and figures["reused_tokens"] == 0 and figures["reused_from"] is None
    assert set(post(base, {"prompt": "Hi", "max_tokens": 2}).json()["triforce"]) == FIGURES


def test_long_prompts_stall_neither_health_nor_a_running_stream(base):
    stream_times, health_s, stop = [], [], threading.Event()

    def streaming():  # the running generation; hangs up once the checks are done
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for ln in r.iter_lines():
                stream_times.append(time.monotonic())
                if stop.is_set() or ln == "data: [DONE]":
                    return

    def polling():
        while not stop.is_set():
            t0 = time.monotonic()
            assert httpx.get(base + "/health", timeout=30).status_code == 200
            health_s.append(time.monotonic() - t0)
            time.sleep(0.05)

    threads = [threading.Thread(target=streaming), threading.Thread(target=polling)]
    threads[0].start()
    deadline = time.monotonic() + 60
    while len(stream_times) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    threads[1].start()
    t0 = time.monotonic()
    try:
        # under the byte bound, over the context: encoded (a second or more) in a thread
        fits = "x9" * (CONTEXT * TOKEN_BYTES // 2 - 10)
        refused(post(base, {"prompt": fits}), 400, "prompt", "tokens")
        # 10 MB: refused by its byte length, before encoding
        big = {"messages": [{"role": "user", "content": "x" * 10 ** 7}]}
        refused(post(base, big, "/v1/chat/completions"), 400, "messages", "bytes")
        # beyond --max-body (12M): by its Content-Length, or counted when sent in chunks
        huge = json.dumps({"prompt": "x" * 13 * 2 ** 20}).encode()
        refused(post(base, huge), 413, None, "--max-body")
        chunks = (huge[i:i + 2 ** 20] for i in range(0, len(huge), 2 ** 20))
        r = httpx.post(base + "/v1/completions", content=chunks, timeout=60,
                       headers={"content-type": "application/json"})
        refused(r, 413, None, "--max-body")
    finally:
        t1 = time.monotonic()
        stop.set()
        for t in threads:
            t.join(60)
    during = [t for t in stream_times if t0 <= t <= t1]
    gaps = [b - a for a, b in zip([t0] + during, during + [t1])]
    assert health_s and max(health_s) < 0.5, health_s
    assert len(during) > 10 and max(gaps) < 0.5, (len(during), max(gaps), t1 - t0)
