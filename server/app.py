"""The OpenAI-compatible HTTP API: request -> options -> the worker's queue -> response.

POST /v1/chat/completions and /v1/completions (streamed as OpenAI's SSE chunks ending
with `data: [DONE]`), GET /v1/models, /health and /metrics. Every response carries the
stats line's figures in a `triforce` field (the last chunk of a stream). Errors are
OpenAI's error body with a 4xx status (429 with Retry-After when the queue is full, 413
beyond --max-body).
"""
from __future__ import annotations

import asyncio
import copy
import json
import queue
import secrets
import threading
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from ..runtime import api
from ..runtime.data import PLAIN, encode_chat
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
    max_body: int | None = None  # bytes a request body may have (413 beyond); None: auto_body

    def __post_init__(self):
        # prompts are encoded in threads, on a copy of the tokenizer with its own lock: an
        # encode never waits for the generation's decoding, nor that for a long encode
        self.encoder, self.encode_lock = copy.deepcopy(self.loaded.tokenizer), threading.Lock()
        self.token_bytes = token_bytes(self.loaded.tokenizer)
        if self.max_body is None:
            self.max_body = auto_body(self.limit, self.token_bytes)

    @property
    def limit(self) -> int:
        """Context tokens: the model's, or --max-context."""
        n = self.loaded.cfg.max_position_embeddings
        return min(n, self.opts.max_context) if self.opts.max_context else n


def token_bytes(tokenizer) -> int | None:
    """Input bytes one token covers at most: the longest token of the vocabulary in UTF-8
    as stored (a byte-level BPE stores a byte as 1-2 bytes, SentencePiece a space as 3, a
    byte fallback `<0x0A>` as 6: never fewer than it covers), times 3 per normalizer that may
    shrink text (NFC, NFKC, lowercase: e.g. the Kelvin sign, 3 bytes, to k). None when no
    such bound holds: a pre-tokenizer or normalizer that drops text (whitespace splitting,
    strip), unknown characters fused into one token, a tokenizer not in the `tokenizers` format."""
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
    except Exception:  # a slow (Python) tokenizer
        return None
    factor = 1

    def safe(node, nested: str, ok: set, shrink=()) -> bool:
        nonlocal factor
        if node is None:
            return True
        if node["type"] == "Sequence":
            return all(safe(n, nested, ok, shrink) for n in node[nested])
        if node["type"] == "Replace":  # only a literal replaced by as many bytes or more
            pat = node["pattern"].get("String")
            return pat is not None and len(node["content"].encode()) >= len(pat.encode())
        factor *= 3 if node["type"] in shrink else 1
        return node["type"] in ok and node.get("behavior") != "Removed"

    model = spec.get("model") or {}
    if not (safe(spec.get("normalizer"), "normalizers", {"Prepend", "NFD", "NFKD", "NFC", "NFKC", "Lowercase"},
                 {"NFC", "NFKC", "Lowercase"})
            and safe(spec.get("pre_tokenizer"), "pretokenizers",
                     {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"})
            and (model.get("type") == "BPE" and not (model.get("fuse_unk") and not model.get("byte_fallback"))
                 or model.get("type") == "Unigram" and model.get("byte_fallback"))):
        return None
    return factor * max(len(t.encode()) for t in tokenizer.get_vocab())


def auto_body(limit: int, token_bytes: int | None) -> int:
    """The default --max-body: twice the most bytes a prompt that fits the context can have
    (room for JSON's escapes), plus 1 MiB; 256 bytes a token where no bound is known."""
    return 2 * limit * (token_bytes or 256) + 2 ** 20


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
        w = s.worker
        gauges = {"queue_depth": w.depth(), "waiting": w.depth(), "running": w.running_count(),
                  "host_kv_bytes": store.nbytes() if store else 0,
                  "kv_entries": len(store.entries) if store else 0,
                  "tokens_per_second": s.metrics.tokens_per_second(),
                  "kv_memory_used_bytes": sum(w.budget.used), "kv_memory_budget_bytes": w.budget.device}
        b, r = w.batch.batcher.figures(), w.batch.batcher
        gauges.update(batch_rounds=b["batch_rounds"], batch_forwards_shared=b["batch_forwards_shared"],
                      batch_seqs_per_forward=b["batch_seqs_per_forward"],
                      batch_seqs_per_round=b["batch_seqs_per_round"], batch_prefill_tokens=r.last_prefill,
                      batch_prefill_tokens_total=r.prefill_tokens, batch_prefill_deferred_total=r.deferred)
        return PlainTextResponse(s.metrics.render(gauges), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: HttpRequest):
        template = getattr(s.loaded.tokenizer, "chat_template", None)
        if not template:
            raise ApiError(400, "the server runs with --chat-template none: use /v1/completions"
                           if template == PLAIN else "this model has no chat template: use "
                           "/v1/completions, or start the server with --chat-template", "messages")
        msgs = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                for m in req.messages]
        # (stripped: templates may trim the content)
        too_long(s, sum(len(m["content"].strip().encode()) for m in msgs), "messages")
        try:
            ids = await encode(s, encode_chat, s.encoder, msgs)
        except Exception as e:  # a template that refuses the messages (e.g. roles out of turn)
            raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await respond(s, req, request, ids, max_tokens, chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: HttpRequest):
        p = req.single()
        if isinstance(p, str):
            too_long(s, len(p.encode()), "prompt")
            ids = await encode(s, lambda: s.encoder(p).input_ids)
        else:
            ids = list(p)
        if any(not 0 <= t < s.loaded.cfg.vocab_size for t in ids):
            raise ApiError(400, f"token ids must be in [0, {s.loaded.cfg.vocab_size})", "prompt")
        return await respond(s, req, request, ids, req.max_tokens, chat=False)

    return app


async def encode(s: Served, fn, *args):
    """fn(*args) (an encode) in a thread, one at a time: the event loop keeps answering, and
    the generation decodes with its own tokenizer meanwhile."""
    def locked():
        with s.encode_lock:
            return fn(*args)
    return await asyncio.to_thread(locked)


def too_long(s: Served, nbytes: int, param: str):
    """Refuse, before encoding it, a prompt of more bytes than `limit` tokens can cover."""
    if s.token_bytes and nbytes > s.limit * s.token_bytes:
        raise ApiError(400, f"the prompt has {nbytes} bytes, more than a context of {s.limit} tokens "
                       f"can hold (a token covers at most {s.token_bytes} bytes)", param,
                       "context_length_exceeded")


class Guard:
    """ASGI middleware: the API key (every route but /health), the body size (--max-body)
    and requests_total by status. Pure ASGI, so a streamed response and its hang-up pass
    through untouched."""

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

        headers, limit, seen = Headers(scope=scope), self.s.max_body, 0
        too_large = f"the request body is larger than {limit} bytes (--max-body)"

        async def receive_limited():  # a body without a (true) Content-Length
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:  # FastAPI answers this one as it is, before parsing
                raise HTTPException(413, too_large)
            return message

        if key and path != "/health" and not secrets.compare_digest(
                headers.get("authorization", ""), f"Bearer {key}"):
            await error(401, "missing or wrong API key (Authorization: Bearer ...)",
                        code="invalid_api_key")(scope, receive, send_status)
        elif headers.get("content-length", "").isdigit() and int(headers["content-length"]) > limit:
            await error(413, too_large)(scope, receive, send_status)  # without reading the body
        else:
            await self.app(scope, receive_limited, send_status)
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
    job = Job(ids, opts, req.stops(), asyncio.get_running_loop(), time.monotonic() + s.timeout)
    never = s.worker.price(job)  # a request that could never fit is told so, not queued
    if never:
        raise ApiError(400, f"{never} (--kv-memory); shorten the prompt or max_tokens",
                       "messages" if isinstance(req, ChatRequest) else "prompt", "kv_memory_exceeded")
    return job


async def events(job: Job, request: HttpRequest, every: float = 0.5):
    """The job's events until done or error; a client that hangs up (checked every `every`
    seconds, text arriving or not) cancels the job."""
    checked = time.monotonic()
    while True:
        try:
            kind, value = await asyncio.wait_for(job.events.get(), every)
        except asyncio.TimeoutError:
            kind = None
        if time.monotonic() - checked >= every:
            checked = time.monotonic()
            if await request.is_disconnected():
                job.cancel()
                return
        if kind == "error":
            status, message = value
            raise ApiError(status, message, kind=KINDS.get(status, "invalid_request_error"))
        if kind is not None:
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
