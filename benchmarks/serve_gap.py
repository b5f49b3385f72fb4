"""A running stream's gaps between tokens while another client's long prompt prefills, for
`triforce-offload serve` (at each --max-stall given) and `llama-server`, side by side.

Usage:
    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin python benchmarks/serve_gap.py
    python benchmarks/serve_gap.py --long-words 6000 --stream-tokens 256 --stalls 0,3 --threads 2

Client A streams a continuation (greedy, `--stream-tokens` tokens). After A's
`--after`-th token, client B sends a `--long-words`-word prompt (about 1.25 tokens a word on
SmolLM2's tokenizer) for 4 tokens. Printed per server: A's median and longest gap between
two streamed chunks (ms), their ratio, the longest gap while B prefilled, B's time to first
token and A's tokens/s. Each server is a fresh process on a free port, the same GGUF and
threads, stopped by its PID. Rows append to results/serve_gap.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from triforce_offload.bench.servers import events, free_port, started


def args_():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="default: the bundled SmolLM2 GGUF")
    ap.add_argument("--long-words", type=int, default=6000)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--after", type=int, default=16, help="A's tokens before B's prompt is sent")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="autoregressive", help="our server's --mode")
    ap.add_argument("--stalls", default="0,3", help="our servers' --max-stall values, comma-separated")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--out", default="results/serve_gap.jsonl")
    return ap.parse_args()


def texts(long_words: int) -> tuple[str, str]:
    from triforce_offload.runtime.data import essays
    w = essays().split()
    return " ".join(w[:300]), " ".join(w[300:300 + long_words]) + "\n\nSummarize the text above."


def stream(base: str, prompt: str, n: int, arrivals: list, started_at: threading.Event | None = None,
           after: int = 0):
    """Stream a completion; (time, pieces) per chunk into `arrivals`; set `started_at` at the
    `after`-th chunk."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    for d in events(base, "/v1/completions", body):
        if any(c.get("text") for c in d.get("choices", [])):
            arrivals.append(time.perf_counter())
            if started_at is not None and len(arrivals) == after:
                started_at.set()


def measure(base: str, a: args_, short: str, long: str) -> dict:
    warm = []
    stream(base, "Warm up.", 4, warm)
    got_a, got_b, go = [], [], threading.Event()
    ta = threading.Thread(target=stream, args=(base, short, a.stream_tokens, got_a, go, a.after))
    ta.start()
    go.wait(600)
    sent = time.perf_counter()
    stream(base, long, 4, got_b)
    ta.join()
    gaps = [y - x for x, y in zip(got_a, got_a[1:])]
    first_b = got_b[0] if got_b else sent
    during = [y - x for x, y in zip(got_a, got_a[1:]) if y > sent and x < first_b]
    med = statistics.median(gaps)
    return {"a_chunks": len(got_a), "median_gap_ms": round(1e3 * med, 2), "max_gap_ms": round(1e3 * max(gaps), 1),
            "max_over_median": round(max(gaps) / med, 2),
            "max_gap_during_prefill_ms": round(1e3 * max(during), 1) if during else None,
            "b_ttft_s": round(first_b - sent, 2),
            "a_tokens_per_s": round(len(got_a) / (got_a[-1] - got_a[0]), 1) if len(got_a) > 1 else None}


def main():
    a = args_()
    from triforce_offload.runtime.model.loader import default_model_path
    gguf = a.gguf or str(default_model_path())
    short, long = texts(a.long_words)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    tmp = Path(tempfile.mkdtemp())
    rows = []
    meta = {"time": time.time(), "gguf": gguf, "long_words": a.long_words, "stream_tokens": a.stream_tokens,
            "threads": a.threads, "cpu": platform.processor() or platform.machine()}
    for stall in a.stalls.split(","):
        cmd = [sys.executable, "-m", "triforce_offload.cli", "serve", "--model", gguf, "--port", "0",
               "--mode", a.mode, "--max-batch", "4", "--kv-cache-mem", "0", "--max-stall", stall]
        with started(cmd, env, r"on (http://127\.0\.0\.1:\d+)/v1", tmp / f"ours-{stall}.log") as base:
            rows.append({"server": f"serve --mode {a.mode} --max-stall {stall}", **measure(base, a, short, long)})
    exe = os.path.join(os.environ.get("LLAMA_CPP_BIN", ""), "llama-server")
    if not a.no_llama and os.path.isfile(exe):
        port = free_port()
        cmd = [exe, "-m", gguf, "--port", str(port), "-t", str(a.threads), "--parallel", "2", "-c", "20480",
               "--no-webui"]
        with started(cmd, env, f"http://127.0.0.1:{port}", tmp / "llama-server.log") as base:
            rows.append({"server": "llama-server --parallel 2", **measure(base, a, short, long)})
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "a") as f:
        for r in rows:
            f.write(json.dumps({**meta, **r}) + "\n")
    print(f"stream of {a.stream_tokens} tokens; a {a.long_words}-word prompt sent after its {a.after}th; "
          f"{a.threads} threads; {gguf}")
    print(f"{'server':40} {'median ms':>9} {'max ms':>8} {'max/med':>7} {'max in prefill':>14} "
          f"{'B TTFT s':>8} {'A tok/s':>7}")
    for r in rows:
        print(f"{r['server']:40} {r['median_gap_ms']:9.1f} {r['max_gap_ms']:8.1f} {r['max_over_median']:7.2f} "
              f"{r['max_gap_during_prefill_ms'] or 0:14.1f} {r['b_ttft_s']:8.2f} {r['a_tokens_per_s'] or 0:7.1f}")


if __name__ == "__main__":
    main()
