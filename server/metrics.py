"""/metrics in Prometheus' text format: counters and summaries kept here, gauges read at
scrape time (queue depth, kept KV bytes)."""
from __future__ import annotations

import threading
from collections import defaultdict

P = "triforce_"
SERIES = {  # name: (type, help)
    "requests_total": ("counter", "HTTP requests by endpoint and status code"),
    "cancelled_total": ("counter", "generations ended by a client hang-up or shutdown"),
    "timeouts_total": ("counter", "generations ended by --request-timeout"),
    "prompt_tokens_total": ("counter", "prompt tokens of finished generations"),
    "generation_tokens_total": ("counter", "tokens generated"),
    "reused_prefix_tokens_total": ("counter", "prompt tokens whose KV came from a kept cache"),
    "time_to_first_token_seconds": ("summary", "arrival to first token, queueing included"),
    "decode_ms_per_token": ("summary", "decode milliseconds per generated token, per request"),
    "draft_tokens_total": ("counter", "draft tokens each speculative level verified"),
    "accepted_tokens_total": ("counter", "draft tokens each speculative level accepted"),
    "acceptance": ("gauge", "accepted / drafted tokens per level since start"),
    "queue_depth": ("gauge", "requests waiting for the model"),
    "running": ("gauge", "generations running (at most --max-batch)"),
    "host_kv_bytes": ("gauge", "bytes of the KV caches kept for reuse"),
    "kv_entries": ("gauge", "KV caches kept for reuse"),
    "batch_rounds": ("gauge", "rounds the worker ran (each: every running request's forwards)"),
    "batch_forwards_shared": ("gauge", "forwards that served several requests at once"),
    "batch_seqs_per_forward": ("gauge", "requests per shared forward, on average since start"),
}


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.values = defaultdict(float)  # (name, ((label, value), ...)) -> value
        for name, (kind, _) in SERIES.items():  # shown from the start, at 0
            if kind == "summary":
                self.values[(name + "_sum", ())] = self.values[(name + "_count", ())] = 0.0
            elif kind == "counter" and name not in ("requests_total", "draft_tokens_total",
                                                    "accepted_tokens_total"):
                self.values[(name, ())] = 0.0

    def inc(self, name: str, v: float = 1.0, **labels):
        with self.lock:
            self.values[(name, tuple(sorted(labels.items())))] += v

    def observe(self, name: str, v: float):
        self.inc(name + "_sum", v)
        self.inc(name + "_count")

    def record(self, d: dict, figures: dict):
        """A finished generation: its Stats dict and response figures."""
        self.inc("prompt_tokens_total", d["prompt_tokens"])
        self.inc("generation_tokens_total", d["new_tokens"])
        self.inc("reused_prefix_tokens_total", d.get("reused_tokens", 0))
        self.observe("time_to_first_token_seconds", figures["time_to_first_token_s"])
        self.observe("decode_ms_per_token", d["decode_ms_per_token"])
        for level, s in d.get("drafts", {}).items():  # by drafting level, whichever level verified
            self.inc("draft_tokens_total", s["drafted"], level=level)
            self.inc("accepted_tokens_total", s["accepted"], level=level)

    def render(self, gauges: dict) -> str:
        with self.lock:
            vals = dict(self.values)
        for (name, labels), v in list(vals.items()):
            if name == "draft_tokens_total" and v:
                vals[("acceptance", labels)] = vals.get(("accepted_tokens_total", labels), 0) / v
        vals.update({(k, ()): v for k, v in gauges.items()})
        lines = []
        for name, (kind, help_) in SERIES.items():
            lines += [f"# HELP {P}{name} {help_}", f"# TYPE {P}{name} {kind}"]
            for (n, labels), v in sorted(vals.items()):
                base = n.removesuffix("_sum").removesuffix("_count") if kind == "summary" else n
                if base == name:
                    lab = ",".join(f'{k}="{x}"' for k, x in labels)
                    v = int(v) if float(v).is_integer() else round(v, 6)
                    lines.append(f"{P}{n}{{{lab}}} {v}" if lab else f"{P}{n} {v}")
        return "\n".join(lines) + "\n"
