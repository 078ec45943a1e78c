"""Prometheus metrics (one registry per server): engine state read at scrape time, and per-request latency
histograms observed as outputs arrive.  Names follow vLLM's where vLLM has the metric (``vllm:X`` is
``oscar_kv_X`` here), so existing dashboards need only the prefix changed.

The gauges that routers and gateways poll by name (Gateway API Inference Extension / llm-d's endpoint picker:
queue, running batch, KV-cache use, block size) are also given under vLLM's exact names (``vllm:...``, same
meaning), so that a router set up for vLLM replicas reads ours unchanged."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine import EngineThread, RequestOutput

PREFIX = "oscar_kv_"
VLLM = "vllm:"
SUCCESS = ("stop", "length")
FAILURE = ("abort", "error")  # abort: the client went away or cancelled; error: the engine or a shutdown ended it
# seconds; from a GPU's milliseconds to a busy CPU's minutes
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                   160.0, 320.0)


class EngineCollector:
    def __init__(self, engine: EngineThread, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s = self.engine.stats()
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name, doc, v, prefix=PREFIX):
            g = GaugeMetricFamily(prefix + name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        def by_reason(name, doc, label, reasons):
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels + [label])
            for reason in reasons:
                c.add_metric(value + [reason], s.finished.get(reason, 0))
            return c

        usage = s.pool_used_bytes / s.pool_capacity_bytes if s.pool_capacity_bytes else 0.0
        for prefix in (PREFIX, VLLM):  # the router-facing gauges under both names (see the module's docstring)
            yield gauge("num_requests_running", "Requests in the running batch.", s.running, prefix)
            yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.waiting, prefix)
            yield gauge("kv_cache_usage_perc", "Referenced share of the KV pool's bytes (0-1).", usage, prefix)
        page_size = self.engine.engine.pool.geometry.page_size
        info = GaugeMetricFamily(VLLM + "cache_config_info", "The KV cache's configuration (vLLM's labels that "
                                 "routers read); value 1.", labels=labels + ["block_size", "num_gpu_blocks"])
        info.add_metric(value + [str(page_size), str(s.pool_capacity_tokens // page_size)], 1)
        yield info
        yield gauge("kv_pool_used_tokens", "Token slots of referenced KV pages.", s.pool_used_tokens)
        yield gauge("kv_pool_capacity_tokens", "Token slots of the whole KV pool.", s.pool_capacity_tokens)
        yield gauge("kv_pool_used_bytes", "Bytes of referenced KV pages (codes, scales and zero points, BF16 windows).",
                    s.pool_used_bytes)
        yield gauge("kv_pool_capacity_bytes", "Bytes of the whole KV pool.", s.pool_capacity_bytes)
        pages = GaugeMetricFamily(PREFIX + "kv_pages", "KV pages by pool and state.", labels=labels + ["pool", "state"])
        pages.add_metric(value + ["window", "used"], s.window_pages_used)
        pages.add_metric(value + ["window", "total"], s.window_pages)
        pages.add_metric(value + ["quantized", "used"], s.quant_pages_used)
        pages.add_metric(value + ["quantized", "total"], s.quant_pages)
        yield pages
        yield gauge("prefix_cache_cached_pages", "Unreferenced pages kept for prefix reuse (evictable).",
                    s.cached_pages)
        yield gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens admitted.",
                    s.prefix_hit_rate)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queried_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_hit_tokens)
        yield counter("prompt_tokens", "Prompt tokens received.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("num_preemptions", "Sequences preempted (recomputed) for lack of KV pages.", s.preemptions)
        yield gauge("generation_tokens_per_second", "Generated tokens per second over the last 10 s (0 when idle).",
                    s.tokens_per_second)
        yield by_reason("request_success", "Requests that finished normally, by finish reason.", "finished_reason",
                        SUCCESS)
        yield by_reason("request_failure", "Requests that did not finish: 'abort' (the client disconnected or "
                        "cancelled), 'error' (the engine failed them, or the server shut down).", "reason", FAILURE)


class ServerMetrics:
    """The server's registry: the engine's state and the TTFT / inter-token / end-to-end latency histograms."""

    def __init__(self, engine: EngineThread, model_name: str):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine, model_name))

        def histogram(name, doc):
            return Histogram(PREFIX + name, doc, ["model_name"], registry=self.registry,
                             buckets=LATENCY_BUCKETS).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "From the request's arrival to its first token.")
        self.itl = histogram("inter_token_latency_seconds", "Between successive tokens of a request.")
        self.e2e = histogram("e2e_request_latency_seconds",
                             "From the request's arrival to its last token (requests that finished normally).")

    def timer(self, arrival: float) -> "RequestTimer":
        return RequestTimer(self, arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's latencies; ``observe`` every output (time.monotonic() clock, as ``arrival``)."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.metrics, self.arrival, self.last = metrics, arrival, None

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.token_ids:
            if self.last is None:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                self.metrics.itl.observe(now - self.last)
            self.last = now
        if out.finished and out.finish_reason in SUCCESS:
            self.metrics.e2e.observe(now - self.arrival)
