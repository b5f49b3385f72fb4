"""/metrics in Prometheus' text format: counters, summaries and histograms kept here, gauges
read at scrape time (queue depth, kept KV bytes, the batch's rounds)."""
from __future__ import annotations

import bisect
import threading
import time
from collections import defaultdict, deque

P = "triforce_"
SERIES = {  # name: (type, help)
    "requests_total": ("counter", "HTTP requests by endpoint and status code"),
    "cancelled_total": ("counter", "generations ended by a client hang-up or shutdown"),
    "timeouts_total": ("counter", "generations ended by --request-timeout"),
    "prompt_tokens_total": ("counter", "prompt tokens of finished generations"),
    "generation_tokens_total": ("counter", "tokens generated"),
    "reused_prefix_tokens_total": ("counter", "prompt tokens whose KV came from a kept cache"),
    "time_to_first_token_seconds": ("histogram", "arrival to first token, queueing included"),
    "inter_token_seconds": ("histogram", "time between a request's consecutive tokens"),
    "decode_ms_per_token": ("summary", "decode milliseconds per generated token, per request"),
    "draft_tokens_total": ("counter", "draft tokens each speculative level verified"),
    "accepted_tokens_total": ("counter", "draft tokens each speculative level accepted"),
    "acceptance": ("gauge", "accepted / drafted tokens per level since start"),
    "queue_depth": ("gauge", "requests waiting for the model"),
    "waiting": ("gauge", "requests waiting for a slot or for memory (queue_depth)"),
    "running": ("gauge", "generations running (at most --max-batch)"),
    "tokens_per_second": ("gauge", f"tokens generated per second over all requests, the last {10} s"),
    "kv_memory_used_bytes": ("gauge", "bytes the running requests' KV caches take (as priced)"),
    "kv_memory_budget_bytes": ("gauge", "bytes they may take together (--kv-memory)"),
    "host_kv_bytes": ("gauge", "bytes of the KV caches kept for reuse"),
    "kv_entries": ("gauge", "KV caches kept for reuse"),
    "batch_rounds": ("gauge", "rounds the worker ran (each: every running request's forwards)"),
    "batch_forwards_shared": ("gauge", "forwards that served several requests at once"),
    "batch_seqs_per_forward": ("gauge", "requests per shared forward, on average since start"),
    "batch_seqs_per_round": ("gauge", "requests computed per round, on average since start"),
    "batch_prefill_tokens": ("gauge", "prompt tokens prefilled in the last round (at most --prefill-budget)"),
    "batch_prefill_tokens_total": ("counter", "prompt tokens prefilled in rounds since start"),
    "batch_prefill_deferred_total": ("counter", "prefill chunks that waited a round for --prefill-budget"),
}
# histogram buckets, seconds (Prometheus' `le` bounds)
BUCKETS = {"time_to_first_token_seconds": (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
           "inter_token_seconds": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)}
WINDOW = 10.0  # seconds tokens_per_second counts over


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.values = defaultdict(float)  # (name, ((label, value), ...)) -> value
        self.tokens = deque()  # monotonic times of the tokens of the last WINDOW seconds
        for name, (kind, _) in SERIES.items():  # shown from the start, at 0
            if kind in ("summary", "histogram"):
                self.values[(name + "_sum", ())] = self.values[(name + "_count", ())] = 0.0
            if kind == "histogram":
                for le in BUCKETS[name]:
                    self.values[(name + "_bucket", (("le", str(le)),))] = 0.0
                self.values[(name + "_bucket", (("le", "+Inf"),))] = 0.0
            elif kind == "counter" and name not in ("requests_total", "draft_tokens_total",
                                                    "accepted_tokens_total"):
                self.values[(name, ())] = 0.0

    def inc(self, name: str, v: float = 1.0, **labels):
        with self.lock:
            self.values[(name, tuple(sorted(labels.items())))] += v

    def observe(self, name: str, v: float):
        self.inc(name + "_sum", v)
        self.inc(name + "_count")

    def histogram(self, name: str, v: float):
        """One observation: every bucket whose bound it is within, the sum and the count."""
        bounds = BUCKETS[name]
        with self.lock:
            for le in bounds[bisect.bisect_left(bounds, v):]:
                self.values[(name + "_bucket", (("le", str(le)),))] += 1
            self.values[(name + "_bucket", (("le", "+Inf"),))] += 1
            self.values[(name + "_sum", ())] += v
            self.values[(name + "_count", ())] += 1

    def token(self, now: float | None = None):
        """A token was generated (tokens_per_second)."""
        now = time.monotonic() if now is None else now
        with self.lock:
            self.tokens.append(now)
            while self.tokens and self.tokens[0] < now - WINDOW:
                self.tokens.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self.lock:
            return sum(1 for t in self.tokens if t >= now - WINDOW) / WINDOW

    def record(self, d: dict, figures: dict):
        """A finished generation: its Stats dict and response figures (its time to first
        token and its gaps between tokens were observed as they came)."""
        self.inc("prompt_tokens_total", d["prompt_tokens"])
        self.inc("generation_tokens_total", d["new_tokens"])
        self.inc("reused_prefix_tokens_total", d.get("reused_tokens", 0))
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
            items = sorted(vals.items())
            if kind == "histogram":  # buckets in increasing bound, +Inf last
                items.sort(key=lambda kv: (not kv[0][0].endswith("_bucket"), _bound(kv[0][1])))
            for (n, labels), v in items:
                base = (n.removesuffix("_sum").removesuffix("_count").removesuffix("_bucket")
                        if kind in ("summary", "histogram") else n)
                if base == name:
                    lab = ",".join(f'{k}="{x}"' for k, x in labels)
                    v = int(v) if float(v).is_integer() else round(v, 6)
                    lines.append(f"{P}{n}{{{lab}}} {v}" if lab else f"{P}{n} {v}")
        return "\n".join(lines) + "\n"


def _bound(labels) -> float:
    le = dict(labels).get("le")
    return float("inf") if le in (None, "+Inf") else float(le)
