"""Servers as benchmark contenders: ours and llama-server started as processes on free
ports and stopped by their PIDs, and the events of a streamed request
(benchmarks/serve_clients.py, benchmarks/serve_gap.py)."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


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
        stop(p, 20)


def stop(p: subprocess.Popen, grace: float):
    """A server process still running gets SIGTERM, and SIGKILL after `grace` seconds."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def events(base: str, route: str, body: dict, timeout: float = 900):
    """The JSON events of a streamed request (an error status ends the script in one line)."""
    with httpx.stream("POST", base + route, json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise SystemExit(f"{base}: {r.status_code} {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])
