"""Serving: time to first token cold, from a kept prefix and from --kv-dir; decode ms/token
through the server beside `run`; requests per second with 4 concurrent clients.

Usage:
    python benchmarks/serve.py                                   # 4K and 16K-token documents
    python benchmarks/serve.py --contexts 4096 --new-tokens 32 --threads 1

Per context a server (`triforce-offload serve --port 0`) continues a document + ending A
(cold; /v1/completions, no chat template), then the same document + ending B (the
document's KV is kept in host memory). `run --json --kv-dir DIR` then runs prompt A (its
decode ms/token is set beside the server's; it saves the KV), and a new server on
--kv-dir DIR continues ending B (the document's KV loads from disk). Time to first token
is measured by the client (request sent to first streamed text). Then `--clients` clients
send `--requests` short requests each at once: requests per second (one generation at a
time: it measures the queue and the per-request overhead). Contexts above the model's 8K use --rope-scaling
linear:F. Rows append to results/serve.jsonl; a summary goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
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
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--mode", default="triforce")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of server and run (0: torch's default)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--extra", default="", help="more serve/run options, e.g. '--offload on'")
    ap.add_argument("--out", default="results/serve.jsonl")
    return ap.parse_args()


def cpu_name() -> str:
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def env(a) -> dict:
    return {**os.environ, **({"OMP_NUM_THREADS": str(a.threads)} if a.threads else {})}


def common(a, context: int) -> list[str]:
    scale = math.ceil(context / 8192)  # SmolLM2's context is 8K
    rope = ["--rope-scaling", f"linear:{scale}"] if scale > 1 else []
    return ["--mode", a.mode, "--dtype", a.dtype, *rope, *a.extra.split()]


@contextmanager
def server(a, args: list[str], log: Path):
    """A `serve` subprocess on a free port; yields its base URL; SIGTERM by PID at the end."""
    cmd = [sys.executable, "-m", "triforce_offload.cli", "serve", "--port", "0", *args]
    with open(log, "w") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env(a))
    try:
        while not (m := re.search(r"on (http://[\d.]+:\d+)/v1", log.read_text())):
            if p.poll() is not None:
                raise SystemExit(f"serve exited: {log.read_text()}")
            time.sleep(0.2)
        yield m[1]
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)


def ask(base: str, text: str, n: int) -> dict:
    """Stream one completion: client-side TTFT and ms/token, text, the server's figures."""
    body = {"prompt": text, "max_tokens": n, "temperature": 0, "stream": True}
    t0, stamps, out, figures = time.perf_counter(), [], "", {}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for ln in r.iter_lines():
            if ln.startswith("data: {"):
                e = json.loads(ln[6:])
                if "error" in e:
                    raise SystemExit(f"the server answered: {e['error']}")
                piece = e["choices"][0]["text"] if e.get("choices") else None
                if piece:
                    stamps.append(time.perf_counter() - t0)
                    out += piece
                figures = e.get("triforce", figures)
    if not stamps:
        raise SystemExit(f"no text came back: {figures}")
    gaps = len(stamps) - 1
    return {"ttft_s": stamps[0], "client_ms_per_token": 1000 * (stamps[-1] - stamps[0]) / gaps if gaps else None,
            "text": out, **figures}


def document(tokens: int) -> str:
    from triforce_offload.runtime.data import essay_tokens
    from triforce_offload.runtime.model.loader import load_tokenizer, resolve
    tok = load_tokenizer(resolve(None))
    return tok.decode(essay_tokens(tok, tokens))


def run_json(a, context: int, prompt: str, kv_dir: Path) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt)
        f.flush()
        cmd = [sys.executable, "-m", "triforce_offload.cli", "run", "--json", "--no-chat",
               "--prompt-file", f.name, "--max-new-tokens", str(a.new_tokens),
               "--kv-dir", str(kv_dir), *common(a, context)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env(a))
    if r.returncode:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def one_context(a, context: int, tmp: Path) -> dict:
    doc = document(context - a.new_tokens - 64)  # essays to continue (no chat template: a chat
    qa, qb = doc + "\n\nIn short,", doc + "\n\nThe main point is"  # answer may end at once)
    with server(a, common(a, context), tmp / f"serve-{context}-a.log") as base:
        cold = ask(base, qa, a.new_tokens)
        kept = ask(base, qb, a.new_tokens)  # the document's KV is kept in host memory
    kv = tmp / f"kv-{context}"
    ref = run_json(a, context, qa, kv)  # cold too; saves its KV to --kv-dir
    with server(a, ["--kv-dir", str(kv), *common(a, context)], tmp / f"serve-{context}-b.log") as base:
        disk = ask(base, qb, a.new_tokens)  # a new server: the document's KV from disk
    return {"context": context, "prompt_tokens": cold["prompt_tokens"], "mode": a.mode,
            "dtype": a.dtype, "new_tokens": a.new_tokens,
            "ttft_cold_s": round(cold["ttft_s"], 3), "ttft_kept_s": round(kept["ttft_s"], 3),
            "ttft_disk_s": round(disk["ttft_s"], 3), "kept_tokens": kept["reused_tokens"],
            "disk_tokens": disk["reused_tokens"] if disk.get("reused_from") == "disk" else 0,
            "server_ms_per_token": round(cold["decode_ms_per_token"], 2),
            "client_ms_per_token": round(cold["client_ms_per_token"] or 0, 2),
            "run_ms_per_token": round(ref["decode_ms_per_token"], 2),
            "run_prefill_s": round(ref["prefill_s"], 3), "same_text_as_run": cold["text"] == ref["text"],
            "kept_text_as_disk": kept["text"] == disk["text"], "acceptance": cold.get("acceptance")}


def throughput(a, tmp: Path) -> dict:
    """Requests per second with `clients` clients sending `requests` short requests each."""
    prompts = [f"Question {i}: name a city and one thing it is known for." for i in range(a.clients)]
    with server(a, ["--max-queue", str(4 * a.clients), *common(a, 2048)], tmp / "serve-rps.log") as base:
        ask(base, "Warm up.", 4)

        def client(p):
            return [ask(base, p, a.new_tokens)["new_tokens"] for _ in range(a.requests)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.clients) as ex:
            tokens = sum(sum(t) for t in ex.map(client, prompts))
        wall = time.perf_counter() - t0
    n = a.clients * a.requests
    return {"measure": "rps", "clients": a.clients, "requests": n, "new_tokens": a.new_tokens,
            "mode": a.mode, "dtype": a.dtype, "wall_s": round(wall, 2),
            "requests_per_s": round(n / wall, 3), "tokens_per_s": round(tokens / wall, 2)}


def main():
    a = args_()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = {"time": round(time.time()), "cpu": cpu_name(), "threads": a.threads,
             "command": "python " + " ".join(sys.argv)}
    with tempfile.TemporaryDirectory() as d:
        rows = [one_context(a, c, Path(d)) for c in a.contexts] + [throughput(a, Path(d))]
    with out.open("a") as f:
        for row in rows:
            f.write(json.dumps({**row, **stamp}) + "\n")
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
