"""Concurrent clients against `triforce-offload serve --max-batch N` and `llama-server
--parallel N`, side by side: aggregate tokens/s and mean time to first token.

Usage:
    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin python benchmarks/serve_clients.py
    python benchmarks/serve_clients.py --clients 8 --words 300 --new-tokens 96 --threads 2 \\
        --ours "autoregressive:1,autoregressive:8,triforce:8" --gguf model.gguf

Each client sends one streamed chat request (greedy, its own stretch of the essays of
`--words` words, "Continue this text." after it) at the same moment. A server's aggregate
tokens/s is every completion token over the time from the requests' start to the last
one's end; time to first token is measured by each client (request sent to first
streamed text), then averaged. Each contender is a fresh server on a free port, on the
same GGUF and threads, stopped by its PID. Rows append to results/serve_clients.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx


def args_():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--words", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gguf", default=None, help="default: the bundled SmolLM2 GGUF")
    ap.add_argument("--ours", default="autoregressive:1,autoregressive:8,triforce:8",
                    help="our servers as mode:max-batch, comma-separated")
    ap.add_argument("--no-llama", action="store_true", help="skip llama-server")
    ap.add_argument("--chat-template", default=None,
                    help="both servers' chat template by name (gemma, chatml, ...), for a GGUF without one")
    ap.add_argument("--slot-context", type=int, default=4096,
                    help="llama-server's context per slot (-c is this times --clients)")
    ap.add_argument("--out", default="results/serve_clients.jsonl")
    return ap.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def started(cmd: list[str], env: dict, ready: str, log: Path, timeout: float = 300):
    """A server process; yields its base URL once `ready` (a regex giving the URL, or a
    fixed URL whose /health answers 200) holds; SIGTERM then SIGKILL by its PID."""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        deadline, base = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            assert p.poll() is None, log.read_text()[-2000:]
            m = re.search(ready, log.read_text()) if not ready.startswith("http") else None
            base = m[1] if m else (ready if ready.startswith("http") else None)
            try:
                if base and httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("server did not start: " + log.read_text()[-2000:])
        yield base
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def prompts(n: int, words: int) -> list[str]:
    from triforce_offload.runtime.data import essays
    w = essays().split()
    return [" ".join(w[i * words: (i + 1) * words]) + "\n\nContinue this text." for i in range(n)]


def events(base: str, route: str, body: dict, timeout: float = 900):
    """The JSON events of a streamed request (an error status ends the script in one line)."""
    with httpx.stream("POST", base + route, json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise SystemExit(f"{base}: {r.status_code} {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def one(base: str, text: str, new: int) -> tuple[float, int, str]:
    """(time to first token, completion tokens, text) of one streamed chat request."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": new, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, first, out, usage = time.perf_counter(), None, [], None
    for d in events(base, "/v1/chat/completions", body):
        if d.get("usage"):
            usage = d["usage"]["completion_tokens"]
        for c in d.get("choices", []):
            piece = (c.get("delta") or {}).get("content") or ""
            if piece and first is None:
                first = time.perf_counter() - t0
            out.append(piece)
    return first or 0.0, usage or 0, "".join(out)


def measure(base: str, texts: list[str], new: int) -> dict:
    one(base, "Warm up.", 4)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as ex:
        res = list(ex.map(lambda t: one(base, t, new), texts))
    wall = time.perf_counter() - t0
    toks = sum(r[1] for r in res)
    return {"wall_s": round(wall, 2), "completion_tokens": toks, "tokens_per_s": round(toks / wall, 2),
            "mean_ttft_s": round(sum(r[0] for r in res) / len(res), 3), "texts": [r[2] for r in res]}


def main():
    a = args_()
    from triforce_offload.runtime.model.loader import default_model_path
    gguf = a.gguf or str(default_model_path())
    texts = prompts(a.clients, a.words)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    tmp = Path(tempfile.mkdtemp())
    rows = []
    meta = {"time": time.time(), "gguf": gguf, "clients": a.clients, "words": a.words, "new_tokens": a.new_tokens,
            "threads": a.threads, "cpu": platform.processor() or platform.machine()}
    for spec in a.ours.split(","):
        mode, batch = spec.split(":")
        cmd = [sys.executable, "-m", "triforce_offload.cli", "serve", "--model", gguf, "--port", "0", "--mode", mode,
               "--max-batch", batch, "--max-queue", str(max(16, a.clients)), "--kv-cache-mem", "0"]
        cmd += ["--chat-template", a.chat_template] if a.chat_template else []
        with started(cmd, env, r"on (http://127\.0\.0\.1:\d+)/v1", tmp / f"ours-{mode}-{batch}.log") as base:
            rows.append({"server": f"triforce-offload serve --mode {mode} --max-batch {batch}", **measure(base, texts, a.new_tokens)})
    exe = os.path.join(os.environ.get("LLAMA_CPP_BIN", ""), "llama-server")
    if not a.no_llama and os.path.isfile(exe):
        port = free_port()
        cmd = [exe, "-m", gguf, "--port", str(port), "-t", str(a.threads), "--parallel", str(a.clients),
               "-c", str(a.clients * a.slot_context), "--no-webui"]
        if a.chat_template:  # the same Jinja text as ours (llama-server takes a bare name as a template)
            from triforce_offload.runtime.data import chat_template_source
            (tmp / "template.jinja").write_text(chat_template_source(a.chat_template))
            cmd += ["--chat-template-file", str(tmp / "template.jinja")]
        with started(cmd, env, f"http://127.0.0.1:{port}", tmp / "llama-server.log") as base:
            rows.append({"server": f"llama-server --parallel {a.clients}", **measure(base, texts, a.new_tokens)})
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "a") as f:
        for r in rows:
            f.write(json.dumps({**meta, **{k: v for k, v in r.items() if k != "texts"}}) + "\n")
    ref = rows[0]["texts"]
    print(f"{a.clients} clients, {a.words}-word prompts, {a.new_tokens} new tokens, {a.threads} threads, {gguf}")
    print(f"{'server':58} {'tok/s':>8} {'TTFT s':>8} {'wall s':>8}  same text as the first row")
    for r in rows:
        print(f"{r['server']:58} {r['tokens_per_s']:8.1f} {r['mean_ttft_s']:8.2f} {r['wall_s']:8.1f}  "
              f"{sum(x == y for x, y in zip(r['texts'], ref))}/{len(ref)}")


if __name__ == "__main__":
    main()
