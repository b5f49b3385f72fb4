"""`triforce-offload serve` as clients use it: the real SmolLM2 behind the OpenAI API.

Each server is a subprocess on a free localhost port (`--port 0`; it prints the port),
stopped by its own PID. Driven with the official `openai` client and raw HTTP: greedy text
equals `run --json`; a follow-up on the same document reaches its first token >= 5x
sooner; concurrent clients get their lone answers; bad requests get OpenAI-shaped 4xx; a
hang-up, a full queue, a time limit and SIGTERM leave the server answering or exit 0.
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from triforce_offload.bench.servers import stop

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # 2 shared cores: OpenMP teams of 2 spin each other out
SPEC = ("--mode", "triforce", "--budget", "256")  # a retrieval level from 256+ tokens on
MODEL = "SmolLM2-135M-Instruct"


@contextmanager
def server(tmp_path, *args, spec=SPEC):
    """A running `serve`: yields (base URL, Popen); SIGTERM then SIGKILL by PID at the end."""
    log = tmp_path / f"serve-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "triforce_offload.cli", "serve", "--port", "0", *spec, *args]
    with open(log, "w") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=ENV)
    try:
        base = wait_ready(p, log)
        yield base, p
    finally:
        stop(p, 15)


def wait_ready(p, log, timeout=180) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if m:
            if httpx.get(m[1] + "/health", timeout=10).status_code == 200:
                return m[1]
        assert p.poll() is None, log.read_text()
        time.sleep(0.3)
    raise AssertionError("server did not start: " + log.read_text())


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with server(tmp_path_factory.mktemp("serve"), "--max-queue", "8") as (base, p):
        yield base, p


def client(base, **kw):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300, **kw)


def chat(base, text, n=16, **kw):
    r = client(base).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                             max_tokens=n, temperature=0, **kw)
    return r


def run_json(*args):
    r = subprocess.run([sys.executable, "-m", "triforce_offload.cli", "run", *SPEC, "--json", *args],
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


QUESTION = "Name three colors of the rainbow."


def test_chat_and_completion_equal_run(srv):
    base, _ = srv
    r = chat(base, QUESTION)
    ref = run_json("--prompt", QUESTION, "--max-new-tokens", "16")
    assert r.choices[0].message.content == ref["text"]
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == ref["prompt_tokens"] and r.usage.completion_tokens == ref["new_tokens"]
    figures = r.model_extra["triforce"]  # the stats line's figures
    assert figures["mode"] == "triforce" and figures["decode_ms_per_token"] > 0
    assert "acceptance" in figures and "reused_tokens" in figures

    c = client(base).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                        temperature=0)
    ref = run_json("--prompt", "The capital of France is", "--no-chat", "--max-new-tokens", "8")
    assert c.choices[0].text == ref["text"] and c.usage.completion_tokens == ref["new_tokens"]


def test_streams_equal_whole_responses(srv):
    base, _ = srv
    whole = chat(base, QUESTION).choices[0].message.content
    chunks = list(chat(base, QUESTION, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    streamed = client(base).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                               temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in streamed)
    alone = client(base).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                            temperature=0)
    assert text == alone.choices[0].text and text


def test_raw_sse_ends_with_done(srv):
    base, _ = srv
    body = {"prompt": "One, two, three,", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert all(e["object"] == "text_completion" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "decode_ms_per_token" in events[-1]["triforce"]


def ttft(base, messages, n=8):
    """(seconds to the first content chunk, text, figures) of a streamed chat request."""
    t0, first, text, figures = time.perf_counter(), None, "", None
    body = {"model": MODEL, "messages": messages, "max_tokens": n, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
        for ln in r.iter_lines():
            if not ln.startswith("data: {"):
                continue
            e = json.loads(ln[6:])
            piece = e["choices"][0]["delta"].get("content")
            if piece and first is None:
                first = time.perf_counter() - t0
            text += piece or ""
            figures = e.get("triforce", figures)
    return first, text, figures


def test_follow_up_on_a_document_is_5x_sooner(srv, tmp_path):
    base, _ = srv
    from triforce_offload.runtime.data import essays
    doc = " ".join(essays().split()[:2300])  # ~3K tokens
    first_q = [{"role": "user", "content": doc + "\n\nWhat is the first essay about?"}]
    t_cold, _, f_cold = ttft(base, first_q)
    second = doc + "\n\nWho is the author?"
    t_warm, text, f_warm = ttft(base, [{"role": "user", "content": second}])
    assert f_cold["prompt_tokens"] > 2800 and f_warm["reused_tokens"] > 2800, (f_cold, f_warm)
    assert t_cold >= 5 * t_warm, (t_cold, t_warm)
    (tmp_path / "p.txt").write_text(second)
    assert text == run_json("--prompt-file", str(tmp_path / "p.txt"), "--max-new-tokens", "8")["text"]


def test_four_concurrent_clients_get_their_lone_answers(srv):
    base, _ = srv
    asks = ["Count to five.", "Say hello in French.", "What is 2+2?", "Name a fruit."]
    alone = [chat(base, a, 10).choices[0].message.content for a in asks]
    with ThreadPoolExecutor(4) as ex:
        together = list(ex.map(lambda a: chat(base, a, 10).choices[0].message.content, asks))
    assert together == alone


def test_batched_clients_get_their_lone_answers_while_one_hangs_up(srv, tmp_path):
    """--max-batch 4: concurrent requests (streamed or not, one cut short by a stop string,
    one whose client hangs up) share forwards, and each answer equals its answer alone."""
    base, _ = srv  # one request at a time: the answers alone
    asks = ["Count to five.", "Say hello in French.", "What is 2+2?", "Name a fruit.", "Spell cat."]
    alone = [chat(base, a, 12).choices[0].message.content for a in asks]
    stop_alone = chat(base, asks[0], 12, stop=[","]).choices[0].message.content

    def sampled(b):  # a seeded sampled request: the same draws alone or in a batch
        r = client(b).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": asks[2]}],
                                              max_tokens=12, temperature=0.9, seed=5)
        return r.choices[0].message.content
    sampled_alone = sampled(base)
    with server(tmp_path, "--max-batch", "4", "--max-queue", "8") as (bbase, _):
        def streamed(a):
            parts = client(bbase).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": a}], max_tokens=12, temperature=0, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)

        def hang_up():
            try:
                httpx.post(bbase + "/v1/chat/completions", timeout=0.5,
                           json={"messages": [{"role": "user", "content": "word " * 800}], "max_tokens": 64})
            except httpx.TimeoutException:
                pass
        with ThreadPoolExecutor(8) as ex:
            gone = ex.submit(hang_up)
            plain = [ex.submit(lambda a=a: chat(bbase, a, 12).choices[0].message.content) for a in asks[:3]]
            stream = [ex.submit(streamed, a) for a in asks[3:]]
            stop = ex.submit(lambda: chat(bbase, asks[0], 12, stop=[","]).choices[0].message.content)
            drawn = ex.submit(sampled, bbase)
            got = [f.result() for f in plain + stream]
            assert stop.result() == stop_alone
            assert drawn.result() == sampled_alone
            gone.result()
        assert got == alone
        m = httpx.get(bbase + "/metrics", timeout=30).text
        shared = float(re.search(r"^triforce_batch_forwards_shared (\S+)", m, re.M)[1])
        per = float(re.search(r"^triforce_batch_seqs_per_forward (\S+)", m, re.M)[1])
        assert shared > 0 and per > 1.0, m
        assert chat(bbase, asks[1], 12).choices[0].message.content == alone[1]  # it keeps serving


def test_memory_admission_queues_what_does_not_fit_and_refuses_what_never_will(tmp_path):
    """--kv-memory 4M holds one short request's caches (~2.5 MB of bf16 KV) but not two: four
    concurrent requests under --max-batch 4 run one after another, each its answer alone; a
    prompt whose caches alone exceed it is a 400 at once; the server keeps serving."""
    asks = ["Count to five.", "Say hello in French.", "What is 2+2?", "Name a fruit."]
    with server(tmp_path, "--max-batch", "4", "--kv-memory", "4M") as (base, _):
        alone = [chat(base, a, 12).choices[0].message.content for a in asks]
        with ThreadPoolExecutor(4) as ex:
            together = list(ex.map(lambda a: chat(base, a, 12).choices[0].message.content, asks))
        assert together == alone
        m = httpx.get(base + "/metrics", timeout=30).text
        assert metric(base, "triforce_kv_memory_budget_bytes") == 4 * 2 ** 20
        assert metric(base, "triforce_batch_forwards_shared") == 0, m  # never two at once: memory
        deadline = time.monotonic() + 30  # every price given back (a job leaves after its answer)
        while metric(base, "triforce_kv_memory_used_bytes") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric(base, "triforce_kv_memory_used_bytes") == 0
        r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Summarize: " + "word " * 400}], "max_tokens": 8})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "kv_memory_exceeded" and "GB of KV caches" in err["message"], err
        assert chat(base, asks[1], 12).choices[0].message.content == alone[1]


def test_prompts_arriving_together_prefill_within_the_round_budget(tmp_path):
    """--prefill-chunk 32 (the per-round budget): two long prompts arriving together take
    turns chunk by chunk (a chunk waits for the next round), a short request streams beside
    them, every answer equals its answer alone; the rounds' and tokens' figures are scraped."""
    longs = ["Summarize this: " + " ".join(f"item{i}" for i in range(k, k + 120)) for k in (0, 500)]
    short = "Count to five."
    with server(tmp_path, "--max-batch", "4", "--prefill-chunk", "32", "--kv-cache-mem", "0") as (base, _):
        alone = [chat(base, a, 8).choices[0].message.content for a in longs + [short]]
        before = metric(base, "triforce_batch_prefill_deferred_total")
        with ThreadPoolExecutor(3) as ex:
            together = list(ex.map(lambda a: chat(base, a, 8).choices[0].message.content, longs + [short]))
        assert together == alone
        m = httpx.get(base + "/metrics", timeout=30).text
        assert metric(base, "triforce_batch_prefill_deferred_total") > before, m
        assert 0 < metric(base, "triforce_batch_prefill_tokens_total")
        assert metric(base, "triforce_batch_seqs_per_round") >= 1
        n_itl = metric(base, "triforce_inter_token_seconds_count")
        assert n_itl > 0 and metric(base, re.escape('triforce_inter_token_seconds_bucket{le="+Inf"}')) == n_itl
        buckets = [float(v) for v in re.findall(r'^triforce_time_to_first_token_seconds_bucket\{le="[^"]+"\} (\S+)$', m, re.M)]
        assert len(buckets) > 3 and buckets == sorted(buckets) and buckets[-1] == 6  # cumulative, one per request
        assert metric(base, "triforce_tokens_per_second") > 0


GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD = [
    ("malformed JSON", b"{not json", 400, None),
    ("no messages", {"max_tokens": 2}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("unknown model", {**GOOD, "model": "gpt-9"}, 404, "model"),
    ("n > 1", {**GOOD, "n": 2}, 400, "n"),
    ("negative max_tokens", {**GOOD, "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens past the context", {**GOOD, "max_tokens": 10 ** 6}, 400, "max_tokens"),
    ("prompt past the context", {"messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages"),
    ("temperature", {**GOOD, "temperature": 7}, 400, "temperature"),
    ("top_p", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("top_k", {**GOOD, "top_k": -1}, 400, "top_k"),
    ("stop list", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("role", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ("logprobs", {**GOOD, "logprobs": True}, 400, "logprobs"),
]


def test_bad_requests_get_openai_errors(srv):
    base, _ = srv
    for what, body, status, param in BAD:
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        r = httpx.post(base + "/v1/chat/completions", timeout=60, **kw)
        assert r.status_code == status, (what, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], what
        assert err["param"] == param, (what, err)
    r = httpx.post(base + "/v1/completions", json={"prompt": [10 ** 9]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert httpx.get(base + "/v1/nothing").json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError):
        client(base).chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert chat(base, "Say yes.", 2).choices[0].message.content  # still serving


@pytest.mark.parametrize("stream", [True, False])
def test_hang_up_cancels_and_the_next_request_runs(srv, stream):
    base, _ = srv
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0, "stream": stream}
    before = metric(base, "triforce_cancelled_total")
    if stream:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 6:
                    break  # hang up mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):  # gives up waiting and closes the connection
            httpx.post(base + "/v1/completions", json=body, timeout=3)
    t0 = time.perf_counter()
    r = client(base).completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0)
    assert r.choices[0].text and time.perf_counter() - t0 < 30  # not behind 3000 tokens
    assert metric(base, "triforce_cancelled_total") == before + 1


def metric(base, name: str, headers=None) -> float:
    text = httpx.get(base + "/metrics", headers=headers, timeout=30).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M)[1])


def test_metrics_are_prometheus_text(srv):
    base, _ = srv
    chat(base, QUESTION, 4)
    text = httpx.get(base + "/metrics").text
    for name in ("requests_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "decode_ms_per_token_sum", "queue_depth",
                 "reused_prefix_tokens_total", "host_kv_bytes", "draft_tokens_total"):
        assert re.search(rf"^triforce_{name}[{{ ]", text, re.M), name
    assert metric(base, "triforce_host_kv_bytes") > 0
    # the acceptance gauge where a level drafted (the bypass starts plain: a short request
    # may draft nothing), none where it did not
    drafted = float(re.search(r'^triforce_draft_tokens_total\{level="ngram"\} (\S+)$', text, re.M)[1])
    gauge = re.search(r'^triforce_acceptance\{level="ngram"\} ([0-9.]+)$', text, re.M)
    assert (gauge is not None) == (drafted > 0)


def test_acceptance_gauge_is_accepted_over_drafted():
    from triforce_offload.server.metrics import Metrics
    m = Metrics()
    for drafted, accepted in ((10, 5), (6, 1)):
        m.record({"prompt_tokens": 3, "new_tokens": 4, "decode_ms_per_token": 1.0,
                  "drafts": {"ngram": {"drafted": drafted, "accepted": accepted, "rejected": 1},
                             "retrieval": {"drafted": 0, "accepted": 0, "rejected": 0}}},
                 {"time_to_first_token_s": 0.1})
    text = m.render({})
    assert re.search(r'^triforce_acceptance\{level="ngram"\} 0.375$', text, re.M)  # 6 / 16
    assert re.search(r'^triforce_draft_tokens_total\{level="retrieval"\} 0(\.0)?$', text, re.M)
    assert not re.search(r'^triforce_acceptance\{level="retrieval"\}', text, re.M)  # drafted nothing


def test_key_queue_limit_time_limit_and_sigterm(tmp_path):
    with server(tmp_path, "--api-key", "sesame", "--max-queue", "1", "--max-batch", "1",
                "--request-timeout", "6") as (base, p):
        assert httpx.get(base + "/v1/models").status_code == 401
        assert httpx.get(base + "/v1/models", headers={"authorization": "Bearer nope"}).status_code == 401
        c = client(base).with_options(api_key="sesame")
        assert c.models.list().data[0].id == MODEL
        with pytest.raises(openai.AuthenticationError):
            client(base).models.list()

        long = {"prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0}
        auth = {"authorization": "Bearer sesame"}
        started, results = threading.Event(), {}

        def running():  # runs until the 6 s time limit
            with httpx.stream("POST", base + "/v1/completions", json={**long, "stream": True},
                              headers=auth, timeout=60) as r:
                last = None
                for ln in r.iter_lines():
                    started.set()
                    if ln.startswith("data: {"):
                        last = json.loads(ln[6:])
                results["running"] = last

        def queued():
            results["queued"] = httpx.post(base + "/v1/completions", headers=auth, timeout=60,
                                           json={"prompt": "Hi", "max_tokens": 2})
        threads = [threading.Thread(target=running)]
        threads[0].start()
        assert started.wait(60)
        threads.append(threading.Thread(target=queued))
        threads[1].start()
        deadline = time.monotonic() + 10
        while metric(base, "triforce_queue_depth", auth) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        full = httpx.post(base + "/v1/completions", headers=auth, json=long, timeout=60)
        assert full.status_code == 429 and int(full.headers["retry-after"]) > 0
        assert full.json()["error"]["type"] == "rate_limit_error"
        for t in threads:
            t.join(60)
        last = results["running"]
        assert last["choices"][0]["finish_reason"] == "length" and last["triforce"]["timed_out"]
        assert last["triforce"]["new_tokens"] < 3000
        assert results["queued"].status_code == 200

        # SIGTERM while a stream runs: the stream ends with an error event, exit 0 within 10 s
        lines = []

        def doomed():
            with httpx.stream("POST", base + "/v1/completions", json={**long, "stream": True},
                              headers=auth, timeout=60) as r:
                for ln in r.iter_lines():
                    lines.append(ln)
        t = threading.Thread(target=doomed)
        t.start()
        while not lines and t.is_alive():
            time.sleep(0.05)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
        assert time.monotonic() - t0 < 10
        t.join(10)
        assert [ln for ln in lines if ln][-1] == "data: [DONE]"
        assert any("shutting down" in ln for ln in lines)


def test_kv_dir_outlives_the_server(tmp_path):
    """A request's KV saved by one server is loaded by the next one on the same --kv-dir."""
    from triforce_offload.runtime.data import essays
    ask = [{"role": "user", "content": " ".join(essays().split()[:1200]) + "\n\nSummarize."}]
    kv = ("--kv-dir", str(tmp_path / "kv"))
    with server(tmp_path, *kv) as (base, p):
        _, cold_text, cold = ttft(base, ask)
    assert p.returncode == 0 and list((tmp_path / "kv").glob("*.kv"))
    with server(tmp_path, *kv) as (base, p):
        _, text, warm = ttft(base, ask)
    assert cold["reused_tokens"] == 0 and warm["reused_from"] == "disk"
    assert warm["reused_tokens"] == cold["prompt_tokens"] - 1 and text == cold_text
    assert cold["prefill_s"] >= 5 * warm["prefill_s"], (cold["prefill_s"], warm["prefill_s"])


def mixed_requests(n: int = 16, seed: int = 37) -> list[dict]:
    """`n` requests as a server's clients send them: prompts of 3 to ~900 tokens, 6 to 40 new
    tokens, greedy or seeded sampling (temperature, top-p, top-k), some streamed, some with
    a stop string, chat or completion; each with its arrival delay (seconds)."""
    import random
    from triforce_offload.runtime.data import essays
    rng, words = random.Random(seed), essays().split()
    out = []
    for i in range(n):
        k = rng.choice((2, 12, 60, 250, 700))
        at = rng.randrange(0, len(words) - k)
        text = " ".join(words[at:at + k])
        body = {"max_tokens": rng.choice((6, 16, 40)), "temperature": 0}
        if rng.random() < 0.4:
            body.update(temperature=rng.choice((0.7, 1.0)), seed=rng.randrange(1 << 30))
            body.update(rng.choice(({}, {"top_p": 0.9}, {"top_k": 20})))
        if rng.random() < 0.25:
            body["stop"] = rng.choice(([".", "\n"], ","))
        if rng.random() < 0.5:
            route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text + "\nContinue."}]
        else:
            route, body["prompt"] = "/v1/completions", text
        out.append({"route": route, "body": body, "stream": rng.random() < 0.5, "delay": rng.uniform(0, 2.0)})
    return out


def answer(base: str, req: dict) -> str:
    """The request's text, streamed or whole."""
    body = {**req["body"], "stream": req["stream"]}
    if not req["stream"]:
        r = httpx.post(base + req["route"], json=body, timeout=300)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["message"]["content"] if "message" in c else c["text"]
    parts = []
    with httpx.stream("POST", base + req["route"], json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for ln in r.iter_lines():
            if ln.startswith("data: {"):
                for c in json.loads(ln[6:]).get("choices", []):
                    parts.append((c.get("delta") or {}).get("content") or c.get("text") or "")
    return "".join(parts)


def test_sixteen_mixed_clients_each_get_their_answer_alone(tmp_path):
    """16 clients arriving over 2 s with mixed prompt lengths, lengths, sampling settings,
    stop strings, routes and streaming, under --max-batch 6 and a --kv-memory that holds
    only some of them (the others wait, then run), while one more client hangs up
    mid-stream: each greedy answer equals the request alone, each seeded sampled answer the
    same seed alone; every slot and every byte of the memory budget is given back; then
    SIGTERM with three streams running closes each with [DONE] and exits 0."""
    reqs = mixed_requests()
    with server(tmp_path, "--max-batch", "6", "--max-queue", "32", "--kv-memory", "64M",
                "--kv-cache-mem", "0") as (base, p):
        alone = [answer(base, r) for r in reqs]

        def late(r):
            time.sleep(r["delay"])
            return answer(base, r)

        def hang_up():  # reads three chunks of a long stream, then closes the connection
            body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i >= 3:
                        break
        with ThreadPoolExecutor(len(reqs) + 1) as ex:
            gone = ex.submit(hang_up)
            together = [f.result() for f in [ex.submit(late, r) for r in reqs]]
            gone.result()
        assert together == alone
        deadline = time.monotonic() + 30  # the hung-up slot and every price come back
        while (metric(base, "triforce_running") or metric(base, "triforce_kv_memory_used_bytes")) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric(base, "triforce_running") == 0 and metric(base, "triforce_kv_memory_used_bytes") == 0
        assert metric(base, "triforce_batch_seqs_per_round") > 1  # they did share rounds

        lines = [[], [], []]

        def doomed(i):
            body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 600, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                for ln in r.iter_lines():
                    lines[i].append(ln)
        threads = [threading.Thread(target=doomed, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not all(lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        assert p.wait(15) == 0
        for t in threads:
            t.join(10)
        for got in lines:
            assert [ln for ln in got if ln][-1] == "data: [DONE]"
