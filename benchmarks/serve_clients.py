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
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from triforce_offload.bench.servers import events, free_port, started


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


def prompts(n: int, words: int) -> list[str]:
    from triforce_offload.runtime.data import essays
    w = essays().split()
    return [" ".join(w[i * words: (i + 1) * words]) + "\n\nContinue this text." for i in range(n)]


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
