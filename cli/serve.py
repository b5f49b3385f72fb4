"""`triforce-offload serve`: the OpenAI-compatible server (server/) over one loaded model.

Its generation, retrieval and offload options are `run`'s own (taken from run's signature,
so the two cannot drift); `run_options` turns them into the engine's options.
"""
from __future__ import annotations

import inspect
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from ..runtime import api
from ..runtime.errors import TriforceError
from ..runtime.prefix_cache import PrefixCache
from ..runtime.sampling import SamplingParams
from .app import app
from .run import run
from .show import err

# run's options that serve takes as they are (sampling ones are defaults for requests)
SHARED = ("model", "mode", "max_new_tokens", "temperature", "top_p", "top_k", "dtype", "device",
          "rope_scaling", "prefill_chunk", "max_context", "draft", "budget", "chunk", "gamma1",
          "gamma2", "draft_sink", "draft_window", "rebuild", "offload", "on_chip",
          "transfer_chunk", "stage_depth", "graphs")
SPEC_OFFLOAD = ("offload", "on_chip", "transfer_chunk", "stage_depth", "draft", "budget", "chunk",
                "gamma1", "gamma2", "draft_sink", "draft_window", "rebuild")


def run_options(p: dict) -> api.RunOptions:
    """The engine's options from run's flat CLI values (checked here, before the model loads)."""
    return api.RunOptions(mode=p["mode"], max_new_tokens=p["max_new_tokens"],
                          prefill_chunk=p["prefill_chunk"], max_context=p["max_context"],
                          graphs=p["graphs"], extra={k: p[k] for k in SPEC_OFFLOAD},
                          sampling=SamplingParams(p["temperature"], p["top_p"], p["top_k"]))


def parse_bytes(text: str, what: str) -> int:
    """'4G', '512M', '1.5GiB', '100000' -> bytes (powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    try:
        return int(float(m[1]) * 1024 ** " kmgt".index(m[2] or " "))
    except (TypeError, ValueError):
        raise TriforceError(f"{what} {text!r}: give a size such as 4G, 512M or a byte count") from None


def _own(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, help="Port to listen on (0: a free one, printed at start)."),
    served_model_name: Optional[str] = typer.Option(None, help="Model id in /v1/models and requests "
                                                    "[default: the model's file or folder name]."),
    api_key: Optional[str] = typer.Option(None, help="Require 'Authorization: Bearer KEY' (401 without)."),
    max_queue: int = typer.Option(16, help="Requests that may wait for the model; more get 429."),
    request_timeout: float = typer.Option(600.0, help="Seconds a request may take from arrival; "
                                          "generation then stops (finish_reason length)."),
    kv_cache_mem: str = typer.Option("4G", help="Host memory for the KV of finished requests, kept "
                                     "for prompts that share their prefix (0: no reuse)."),
):
    """serve's own options (the signature typer reads; see `serve`)."""


def serve(**p):
    """Serve the OpenAI API (chat and completions, streamed or not) with KV reuse across requests."""
    try:
        from ..server.app import Served, build
        from ..server.metrics import Metrics
        from ..server.worker import Worker
        import uvicorn
    except ImportError as e:
        raise TriforceError(f"serve needs fastapi and uvicorn ({e.name} is missing): "
                            "pip install 'triforce-offload[serve]'") from None
    opts = run_options(p)
    if p["max_queue"] < 1 or p["request_timeout"] <= 0:
        raise TriforceError("--max-queue must be >= 1 and --request-timeout > 0")
    if api.world_size() > 1:
        raise TriforceError("serve runs on one process; tensor parallelism (--tp, torchrun) is run's")
    sock = listen(p["host"], p["port"])
    loaded = api.load(p["model"], p["dtype"], p["device"], p["rope_scaling"], progress=lambda m: err.print(m))
    loaded.prefix = PrefixCache(parse_bytes(p["kv_cache_mem"], "--kv-cache-mem"))
    metrics = Metrics()
    worker = Worker(loaded, p["max_queue"], metrics)
    name = p["served_model_name"] or model_name(p["model"])
    served = Served(loaded, opts, name, worker, metrics, p["api_key"], p["request_timeout"], int(time.time()))
    config = uvicorn.Config(build(served), log_level="warning", timeout_graceful_shutdown=5)
    host, port = sock.getsockname()[:2]
    err.print(f"serving {name} ({opts.mode}, {loaded.dtype} on {loaded.device}) on "
              f"http://{host}:{port}/v1", highlight=False)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # uvicorn re-raises it once it stopped
    run_server(config, worker).run(sockets=[sock])


def model_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def listen(host: str, port: int) -> socket.socket:
    """A bound socket (before the model loads: a taken port is a one-line error at once)."""
    if not 0 <= port <= 65535:
        raise TriforceError(f"--port {port}: must be 0..65535")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise TriforceError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run_server(config, worker):
    """uvicorn, whose SIGTERM/SIGINT first cancel the generation (it ends within one
    verification) and the queued requests (503), so shutdown never waits on them."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            worker.shutdown()
            super().handle_exit(sig, frame)

    return Server(config)


_params = [*inspect.signature(run, eval_str=True).parameters.values()]
serve.__signature__ = inspect.Signature(
    [p for p in _params if p.name in SHARED] + list(inspect.signature(_own, eval_str=True).parameters.values()))
app.command()(serve)
