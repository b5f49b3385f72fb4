"""`triforce-offload serve`: the OpenAI-compatible server (server/) over one loaded model.

Its model, generation, retrieval and offload options are `run`'s, built from the same
option types (runtime/options.py); the sampling ones are the defaults of requests that do
not set them.
"""
from __future__ import annotations

import signal
import socket
import sys
import time
from pathlib import Path

from ..runtime import api
from ..runtime.model import hub
from ..runtime.errors import TriforceError
from ..runtime.conflicts import refuse
from ..runtime.options import (GenerationOptions, ModelOptions, OffloadOptions, RetrievalOptions,
                               ReuseOptions, RunOptions, ServeOptions, parse_size)
from ..runtime.cache.prefix import prefix_store
from ..runtime.cache.shared import Shared
from .app import app
from .options import options
from .show import err


@app.command()
@options
def serve(
    model: ModelOptions,
    gen: GenerationOptions,
    retrieval: RetrievalOptions,
    offload: OffloadOptions,
    reuse: ReuseOptions,
    srv: ServeOptions,
):
    """Serve the OpenAI API (chat and completions, streamed or not) with KV reuse across
    requests; --max-new-tokens, --temperature, --top-p, --top-k and --seed are the defaults
    of requests that do not set them."""
    try:
        import uvicorn
        from ..server.app import Served, build
        from ..server.metrics import Metrics
        from ..server.worker import Worker
    except ImportError as e:
        raise TriforceError(f"serve needs fastapi and uvicorn ({e.name} is missing): "
                            "pip install 'triforce-offload[serve]'") from None
    if api.world_size() > 1:
        refuse("tp-serve")
    sock = listen(srv.host, srv.port)  # a taken port is an error before the model loads
    loaded = api.load(model, progress=lambda m: err.print(m))
    loaded.prefix = prefix_store(reuse, loaded, memory=True, save_later=True,
                                 note=lambda m: err.print(m, highlight=False))
    if loaded.prefix is not None:  # requests sharing a long prefix with a kept one hold it once
        loaded.shared = Shared(seed_bytes=parse_size(reuse.kv_cache_mem))
    opts, metrics = RunOptions(gen, retrieval, offload), Metrics()
    worker = Worker(loaded, srv.max_queue, metrics, srv.max_batch,
                    prefill_budget=srv.prefill_budget or opts.prefill_chunk, max_stall=srv.max_stall or None,
                    kv_memory=None if srv.kv_memory == "auto" else parse_size(srv.kv_memory),
                    host_reserve=parse_size(reuse.kv_cache_mem))
    name = srv.served_model_name or model_name(model.model)
    served = Served(loaded, opts, name, worker, metrics, srv.api_key, srv.request_timeout, int(time.time()),
                    None if srv.max_body == "auto" else parse_size(srv.max_body))
    config = uvicorn.Config(build(served), log_level="warning", timeout_graceful_shutdown=5)
    host, port = sock.getsockname()[:2]
    err.print(f"serving {name} ({opts.mode}, {loaded.dtype} on {loaded.device}) on "
              f"http://{host}:{port}/v1", highlight=False)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # uvicorn re-raises it once it stopped
    try:
        run_server(config, worker).run(sockets=[sock])
    finally:
        worker.shutdown()  # (uvicorn's exit handler did, unless it stopped another way)
        worker.join(SAVE_WAIT_S)


SAVE_WAIT_S = 60  # at exit: the running job ends within a verification, then its KV saves


def model_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    if not path.exists() and hub.parse(model) is not None:
        return model  # a hub id, as given
    return path.stem if path.suffix == ".gguf" else path.name


def listen(host: str, port: int) -> socket.socket:
    """A bound socket (before the model loads: a taken port is a one-line error at once)."""
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
