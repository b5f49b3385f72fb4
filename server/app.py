"""The OpenAI-compatible HTTP API: request -> options -> the worker's queue -> response.

POST /v1/chat/completions and /v1/completions (streamed as OpenAI's SSE chunks ending
with `data: [DONE]`), GET /v1/models, /health and /metrics. Every response carries the
stats line's figures in a `triforce` field (the last chunk of a stream). Errors are
OpenAI's error body with a 4xx status (429 with Retry-After when the queue is full).
"""
from __future__ import annotations

import asyncio
import json
import queue
import secrets
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from ..runtime import api
from ..runtime.data import encode_chat
from ..runtime.errors import TriforceError
from .metrics import Metrics
from .schema import ApiError, ChatRequest, CompletionRequest, Request
from .worker import Job, Worker

ROUTES = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")
KINDS = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
         499: "cancelled", 503: "server_error", 504: "timeout", 500: "server_error"}


@dataclass
class Served:
    loaded: api.Loaded
    opts: api.RunOptions  # the server's options; requests set sampling and max tokens
    model_id: str  # the name /v1/models lists and requests may give
    worker: Worker
    metrics: Metrics
    api_key: str | None = None  # Bearer token the /v1 routes and /metrics require
    timeout: float = 600.0  # seconds from arrival a request may take
    created: int = 0  # unix time the server started

    @property
    def limit(self) -> int:
        """Context tokens: the model's, or --max-context."""
        n = self.loaded.cfg.max_position_embeddings
        return min(n, self.opts.max_context) if self.opts.max_context else n


def error(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    e = ApiError(status, message, param, code, KINDS.get(status, "invalid_request_error"), headers)
    return JSONResponse(e.body(), status, headers=e.headers)


def build(s: Served) -> FastAPI:
    app = FastAPI(title="triforce-offload", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(ApiError, lambda r, e: error(e.status, e.message, e.param, e.code, e.headers))
    app.add_exception_handler(RequestValidationError, lambda r, e: bad_body(e))
    app.add_exception_handler(HTTPException, lambda r, e: error(e.status_code, str(e.detail)))

    app.add_middleware(Guard, served=s)

    @app.get("/health")
    def health():
        if s.worker.closing:
            return error(503, "shutting down")
        return {"status": "ok", "model": s.model_id, "queue_depth": s.worker.depth()}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": s.model_id, "object": "model", "created": s.created,
                                            "owned_by": "triforce-offload", "max_model_len": s.limit}]}

    @app.get("/metrics")
    def metrics():
        store = s.loaded.prefix
        gauges = {"queue_depth": s.worker.depth(), "running": int(s.worker.current is not None),
                  "host_kv_bytes": store.nbytes() if store else 0,
                  "kv_entries": len(store.entries) if store else 0}
        return PlainTextResponse(s.metrics.render(gauges), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: HttpRequest):
        if not getattr(s.loaded.tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
        msgs = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                for m in req.messages]
        try:
            with s.worker.tokenizer_lock:
                ids = encode_chat(s.loaded.tokenizer, msgs)
        except Exception as e:  # a template that refuses the messages (e.g. roles out of turn)
            raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await respond(s, req, request, ids, max_tokens, chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: HttpRequest):
        p = req.single()
        with s.worker.tokenizer_lock:
            ids = s.loaded.tokenizer(p).input_ids if isinstance(p, str) else list(p)
        if any(not 0 <= t < s.loaded.cfg.vocab_size for t in ids):
            raise ApiError(400, f"token ids must be in [0, {s.loaded.cfg.vocab_size})", "prompt")
        return await respond(s, req, request, ids, req.max_tokens, chat=False)

    return app


class Guard:
    """ASGI middleware: the API key (every route but /health) and requests_total by status.
    Pure ASGI, so a streamed response and its hang-up pass through untouched."""

    def __init__(self, app, served: Served):
        self.app, self.s = app, served

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, key, status = scope["path"], self.s.api_key, [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        if key and path != "/health" and not secrets.compare_digest(
                Headers(scope=scope).get("authorization", ""), f"Bearer {key}"):
            await error(401, "missing or wrong API key (Authorization: Bearer ...)",
                        code="invalid_api_key")(scope, receive, send_status)
        else:
            await self.app(scope, receive, send_status)
        self.s.metrics.inc("requests_total", endpoint=path if path in ROUTES else "other",
                           status=str(status[0]))


def bad_body(e: RequestValidationError) -> JSONResponse:
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return error(400, "the body is not valid JSON", code="json_invalid")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    return error(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}",
                 ".".join(loc) or None, first.get("type"))


def make_job(s: Served, req: Request, ids: list[int], max_tokens: int | None) -> Job:
    """Check the request against the model and build its job (400 on anything wrong)."""
    if req.model is not None and req.model != s.model_id:
        raise ApiError(404, f"model {req.model!r} does not exist; this server serves {s.model_id!r}",
                       "model", "model_not_found")
    refused = req.refused()
    if refused:
        raise ApiError(400, refused[1], refused[0], "unsupported")
    n, limit = len(ids), s.limit
    if n >= limit:
        raise ApiError(400, f"the prompt has {n} tokens; the context is {limit} tokens",
                       "messages" if isinstance(req, ChatRequest) else "prompt", "context_length_exceeded")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens {max_tokens}: must be >= 1", "max_tokens")
    if max_tokens is not None and n + max_tokens > limit:
        raise ApiError(400, f"max_tokens {max_tokens} + the prompt's {n} tokens exceed the context "
                       f"of {limit} tokens", "max_tokens", "context_length_exceeded")
    try:  # unset fields (None) keep the server's defaults
        opts = s.opts.but(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                          max_new_tokens=min(max_tokens or s.opts.max_new_tokens, limit - n))
    except TriforceError as e:
        raise ApiError(400, str(e)) from None
    return Job(ids, opts, req.stops(), asyncio.get_running_loop(), time.monotonic() + s.timeout)


async def events(job: Job, request: HttpRequest):
    """The job's events until done or error; a client that hangs up cancels the job."""
    while True:
        try:
            kind, value = await asyncio.wait_for(job.events.get(), 0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                return
            continue
        if kind == "error":
            status, message = value
            raise ApiError(status, message, kind=KINDS.get(status, "invalid_request_error"))
        yield kind, value
        if kind == "done":
            return


async def respond(s: Served, req: Request, request: HttpRequest, ids, max_tokens, chat: bool):
    job = make_job(s, req, ids, max_tokens)
    try:
        s.worker.submit(job)
    except queue.Full:
        raise ApiError(429, f"{s.worker.queue.maxsize} requests are waiting already (--max-queue); "
                       "retry later", headers={"Retry-After": "5"}) from None
    stream = events(job, request)
    try:
        first = await anext(stream, None)  # errors before the first token keep their status
    except BaseException:
        job.cancel()
        raise
    if first is None:
        return Response(status_code=499)  # the client is gone
    shape = Shape(s.model_id, chat, "chatcmpl-" if chat else "cmpl-")
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(sse(job, first, stream, shape, usage), media_type="text/event-stream")
    kind, value = first
    while kind != "done":
        kind, value = await anext(stream, ("gone", None))
        if kind == "gone":
            return Response(status_code=499)
    return shape.full(value)


async def sse(job: Job, first, stream, shape: "Shape", usage: bool):
    """OpenAI's stream: a role chunk (chat), text chunks, a chunk with the finish reason
    and the figures, optionally a usage chunk, then [DONE]. A hang-up cancels the job."""
    data = lambda d: f"data: {json.dumps(d)}\n\n"
    try:
        if shape.chat:
            yield data(shape.chunk({"role": "assistant", "content": ""}))
        kind, value = first
        while True:
            if kind == "done":
                yield data(shape.chunk({}, value.finish_reason, triforce=value.figures))
                if usage:
                    yield data({**shape.chunk({}), "choices": [], "usage": shape.usage(value)})
                break
            yield data(shape.chunk({"content": value}))
            kind, value = await anext(stream, ("gone", None))
            if kind == "gone":
                return
        yield "data: [DONE]\n\n"
    except ApiError as e:  # the server stopping, a time limit before the first token
        yield data(e.body())
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # a no-op once the job is done


@dataclass
class Shape:
    """OpenAI's response objects for one request."""
    model: str
    chat: bool
    prefix: str

    def __post_init__(self):
        self.id, self.created = self.prefix + uuid.uuid4().hex[:24], int(time.time())

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, delta: dict, finish=None, **extra) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self.head("chat.completion.chunk"), "choices": [choice], **extra}
        choice = {"index": 0, "text": delta.get("content", ""), "logprobs": None, "finish_reason": finish}
        return {**self.head("text_completion"), "choices": [choice], **extra}

    @staticmethod
    def usage(r) -> dict:
        return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                "total_tokens": r.prompt_tokens + r.completion_tokens}

    def full(self, r) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": r.text},
                      "logprobs": None, "finish_reason": r.finish_reason}
            head = self.head("chat.completion")
        else:
            choice = {"index": 0, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}
            head = self.head("text_completion")
        return {**head, "choices": [choice], "usage": self.usage(r), "triforce": r.figures}
