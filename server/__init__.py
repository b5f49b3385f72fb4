"""triforce_offload.server: the OpenAI-compatible HTTP server of `triforce-offload serve`.

schema (request bodies, errors) -> app (routes, SSE) -> worker (queue, the model's thread);
metrics renders /metrics. Imported only by `serve` (fastapi and uvicorn are an extra).
"""
