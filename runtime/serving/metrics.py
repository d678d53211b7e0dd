"""The server's Prometheus metrics (prometheus-client), served at /metrics.

Each request is counted once, when it ends, by outcome: "stop" or "length" (finished), "error"
(the engine failed or the server ended it), "timeout" (past --request-timeout), "aborted" (its
client left), "rejected" (refused before admission: a 4xx, or a 503). Latencies are observed
once a request too (time to first token, time per output token after it, the whole request),
so the cost stays off the per-token path. The engine's slots and queue, and its prefix cache's
counts, are read when scraped.

Under `mambastep serve` every HTTP server process counts its own requests into files under
PROMETHEUS_MULTIPROC_DIR (set before prometheus_client is imported: it picks its value store
then), and a scrape of any one sums them all.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE", "Metrics", "OUTCOMES"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
OUTCOMES = ("stop", "length", "error", "timeout", "aborted", "rejected")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_PER_TOKEN = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    """The metrics of one app over ``loop`` (each app its own registry)."""

    def __init__(self, loop):
        self.loop = loop
        self.registry = CollectorRegistry()
        self.multiprocess = os.path.isdir(os.environ.get("PROMETHEUS_MULTIPROC_DIR", ""))
        reg = self.registry
        self.requests = Counter("mambastep_requests", "Requests by how they ended", ["outcome"], registry=reg)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("mambastep_prompt_tokens", "Prompt tokens of admitted requests", registry=reg)
        self.generation_tokens = Counter("mambastep_generation_tokens", "Tokens generated", registry=reg)
        self.ttft = Histogram("mambastep_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=_LATENCY, registry=reg)
        self.per_token = Histogram("mambastep_time_per_output_token_seconds",
                                   "A request's mean time per output token after its first", buckets=_PER_TOKEN,
                                   registry=reg)
        self.latency = Histogram("mambastep_request_latency_seconds", "From arrival to the last token",
                                 buckets=_LATENCY, registry=reg)
        self.open = Gauge("mambastep_requests_open", "Requests admitted and not ended (queued or running)",
                          multiprocess_mode="livesum", registry=reg)
        # the engine's own figures, the same in every process: the latest one's
        engine = dict(multiprocess_mode="livemostrecent", registry=reg)
        self.running = Gauge("mambastep_requests_running", "Requests holding an engine slot", **engine)
        self.waiting = Gauge("mambastep_requests_waiting", "Requests queued for an engine slot", **engine)
        self.free_slots = Gauge("mambastep_slots_free", "Engine slots free", **engine)
        self.steps = Gauge("mambastep_engine_steps", "Engine steps so far", **engine)
        self.cache = {name: Gauge(f"mambastep_prefix_cache_{name}", text, **engine) for name, text in (
            ("lookups", "Prompts looked up in the prefix cache so far"),
            ("hits", "Prompts that restored a cached prefix so far"),
            ("tokens_restored", "Prompt tokens restored rather than prefilled so far"),
            ("snapshots", "Snapshots taken so far"), ("evictions", "Snapshots evicted so far"),
            ("bytes", "Device memory the snapshots held now use, in bytes"))}

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.open.inc()

    def ended(self, outcome: str, tokens: int, arrived: float, first: float | None, now: float) -> None:
        """An admitted request ended: its outcome, tokens, and its arrival, first token and end
        times (``time.monotonic()``)."""
        self.open.dec()
        self.requests.labels(outcome).inc()
        self.generation_tokens.inc(tokens)
        if first is not None:
            self.ttft.observe(first - arrived)
            if tokens > 1:
                self.per_token.observe((now - first) / (tokens - 1))
        if outcome in ("stop", "length"):
            self.latency.observe(now - arrived)

    def rejected(self) -> None:
        self.requests.labels("rejected").inc()

    def render(self) -> bytes:
        """The text exposition of every metric (every process's, under `mambastep serve`)."""
        free, running, waiting, cache = self.loop.counts()
        for name, value in (cache or {}).items():
            self.cache[name].set(value)
        self.free_slots.set(free)
        self.running.set(running)
        self.waiting.set(waiting)
        self.steps.set(self.loop.steps)
        if not self.multiprocess:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        return generate_latest(merged)
