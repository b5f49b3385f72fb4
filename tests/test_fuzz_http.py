"""The HTTP API fuzzed from its own OpenAPI schema (issue 39, item 3), seeded and bounded.

Bodies for every POST route are drawn from the app's own OpenAPI schema (FastAPI's, from
the request models; the server does not publish it): each field of the right type with values at and past its bounds, or of a
wrong type, fields left out or added, whole bodies that are not JSON, not objects, nested
thousands deep; other methods on the same routes. Requests go four at a time, as clients
would. Every answer must be a 2xx or a 4xx with a JSON error body (a 200 stream ends in
[DONE]), never a 5xx or a hang; afterwards the server is alive and gives a plain request the
same greedy answer it gave before.

One server for the module (the tiny random model with SmolLM2's tokenizer), a subprocess on a
free port stopped by its own PID.
"""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("fastapi")
from test_serve import server  # noqa: E402
from triforce_offload.server.app import build  # noqa: E402

SEED, CASES = 39, 400
WORDS = ["", " ", "a", "Hello", "\u00e9t\u00e9", "\U0001f600", "\x00", "\ud7ff", "\n\n", "<|im_end|>", "{}",
         "x" * 3000]
ANY = [None, True, False, -1, 0, 1, 2.5, float("inf"), -1e308, 2 ** 63, -2 ** 64, 10 ** 30, "", "str",
       [], [1, 2], [[]], {}, {"k": "v"}]


def ints(s: dict) -> list:
    lo = s.get("minimum", s.get("exclusiveMinimum"))
    hi = s.get("maximum", s.get("exclusiveMaximum"))
    edges = [int(b) + d for b in (lo, hi) if b is not None for d in (-1, 0, 1)]
    return edges + [-1, 0, 1, 2, 3, 5, 8, 2 ** 31, 2 ** 63, 2 ** 64, 10 ** 30]


def floats(s: dict) -> list:
    edges = [b + d for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
             if (b := s.get(k)) is not None for d in (-1e-9, 0, 1e-9)]
    return edges + [0.0, 0.3, 0.7, 1.0, 1.5, -0.5, 1e300, 5e-324]


class Bodies:
    """Random values of the schema's types (mostly valid, often at the bounds; sometimes any
    JSON value at all)."""

    def __init__(self, spec: dict, rng: random.Random):
        self.defs, self.rng = spec.get("components", {}).get("schemas", {}), rng

    def value(self, s: dict, depth: int = 0):
        r = self.rng
        if "$ref" in s:
            return self.value(self.defs[s["$ref"].rsplit("/", 1)[1]], depth)
        if "default" in s and r.random() < 0.5:
            return s["default"]
        if r.random() < 0.03 or depth > 4:
            return r.choice(ANY)
        for key in ("anyOf", "oneOf"):
            if key in s:
                return self.value(r.choice(s[key]), depth)
        if "const" in s:
            return s["const"]
        if "enum" in s:
            return r.choice(s["enum"])
        kind = s.get("type")
        if kind == "object" or "properties" in s:
            props, need = s.get("properties", {}), set(s.get("required", ()))
            out = {k: self.value(v, depth + 1) for k, v in props.items()
                   if (k in need and r.random() < 0.95) or r.random() < 0.3}
            if r.random() < 0.1:
                out[r.choice(["extra", "", "\u00e9"])] = r.choice(ANY)
            return out
        if kind == "array":
            n = r.choice((0, 1, 1, 2, 3, 5))
            return [self.value(s.get("items", {}), depth + 1) for _ in range(n)]
        if kind == "integer":  # mostly within the bounds, else at or past them
            lo = int(s.get("minimum", s.get("exclusiveMinimum", -1) + 1))
            return r.randint(max(lo, 0), 50) if r.random() < 0.7 else r.choice(ints(s) + [r.randrange(-2 ** 40, 2 ** 40)])
        if kind == "number":
            lo, hi = s.get("minimum", s.get("exclusiveMinimum", 0)), s.get("maximum", s.get("exclusiveMaximum", 1))
            return r.uniform(lo, hi) if r.random() < 0.7 else r.choice(floats(s))
        if kind == "boolean":
            return r.random() < 0.5
        if kind == "string":
            return "".join(r.choice(WORDS) for _ in range(r.randint(0, 4)))
        if kind == "null":
            return None
        return r.choice(ANY)

    def body(self, schema: dict) -> tuple[bytes, str]:
        """(bytes, content type): mostly the schema's JSON; sometimes not JSON at all."""
        r, roll = self.rng, self.rng.random()
        if roll < 0.04:
            return b"[" * 100_000 + b"]" * 100_000, "application/json"  # nested past any parser's depth
        if roll < 0.08:
            return r.choice([b"", b"{", b"null", b"[1]", b'"x"', b"\xff\xfe", b'{"prompt": "a",}']), "application/json"
        if roll < 0.10:
            return b'{"prompt": "a"}', r.choice(["text/plain", "application/x-www-form-urlencoded", ""])
        body = self.value(schema)
        if isinstance(body, dict) and r.random() < 0.5:  # keep generations short mostly
            body.setdefault("max_tokens", r.choice((1, 2, 4)))
        return json.dumps(body, allow_nan=True).encode(), "application/json"


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_model_dir):
    with server(tmp_path_factory.mktemp("fuzz-http"), "--model", str(tiny_model_dir), "--mode", "triforce",
                "--budget", "64", "--max-new-tokens", "8", "--max-queue", "64", spec=()) as (b, _):
        yield b


def check(r: httpx.Response, what: str):
    assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        body = r.json()  # a JSON body, OpenAI-shaped on our routes
        assert isinstance(body, dict) and ("error" in body or "detail" in body), (what, body)
        if "error" in body:
            assert body["error"]["message"], (what, body)
    elif "text/event-stream" in r.headers.get("content-type", ""):
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "data: [DONE]" or '"error"' in r.text, (what, r.text[-300:])
    elif r.status_code == 200 and r.request.method == "POST":
        assert "choices" in r.json(), (what, r.text[:300])


def plain(base: str) -> str:
    r = httpx.post(base + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 6,
                                                   "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_fuzzed_requests_get_2xx_or_a_json_4xx_and_the_server_keeps_serving(base):
    spec = build(None).openapi()  # the app's own schema (the server does not publish it)
    posts = {path: op["post"]["requestBody"]["content"]["application/json"]["schema"]
             for path, op in spec["paths"].items() if "post" in op and "requestBody" in op["post"]}
    assert {"/v1/completions", "/v1/chat/completions"} <= set(posts), sorted(posts)
    before = plain(base)
    rng = random.Random(SEED)
    gen = Bodies(spec, rng)
    cases = []
    for i in range(CASES):
        path = rng.choice(sorted(posts) if rng.random() < 0.85 else sorted(spec["paths"]))
        if path in posts and rng.random() < 0.95:
            content, ctype = gen.body(posts[path])
            cases.append((i, "POST", path, content, ctype))
        else:
            cases.append((i, rng.choice(["GET", "PUT", "DELETE", "PATCH", "POST"]), path, b"", ""))

    def send(case):
        i, method, path, content, ctype = case
        headers = {"content-type": ctype} if ctype else {}
        r = httpx.request(method, base + path, content=content, headers=headers, timeout=120)
        check(r, f"case {i} {method} {path} {content[:200]!r}")
        if r.status_code >= 400 and "error" in r.json():
            reasons.append(f"{r.status_code} {r.json()['error']['param']}: {r.json()['error']['message'][:50]}")
        return r.status_code

    reasons = []
    with ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(send, cases))
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    print("statuses", counts)
    for why in sorted(set(reasons)):
        print(f"  {reasons.count(why)} x {why}")
    assert any(s == 200 for s in statuses) and any(400 <= s < 500 for s in statuses), counts
    assert httpx.get(base + "/health", timeout=30).status_code == 200
    assert plain(base) == before  # the same greedy answer after all of it
