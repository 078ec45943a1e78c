"""Prometheus metrics, read from the engine at scrape time (one registry per server)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine import EngineThread

PREFIX = "oscar_kv_"


class EngineCollector:
    def __init__(self, engine: EngineThread, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s = self.engine.stats()
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name, doc, v):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.waiting)
        yield gauge("kv_pool_used_tokens", "Token slots of referenced KV pages.", s.pool_used_tokens)
        yield gauge("kv_pool_capacity_tokens", "Token slots of the whole KV pool.", s.pool_capacity_tokens)
        yield gauge("kv_pool_used_bytes", "Bytes of referenced KV pages (codes, scale/min and BF16 windows).",
                    s.pool_used_bytes)
        yield gauge("kv_pool_capacity_bytes", "Bytes of the whole KV pool.", s.pool_capacity_bytes)
        yield gauge("kv_pool_usage_ratio", "Referenced share of the KV pool's bytes.",
                    s.pool_used_bytes / s.pool_capacity_bytes if s.pool_capacity_bytes else 0.0)
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
        yield counter("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", s.prefix_hit_tokens)
        yield counter("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_queried_tokens)
        yield counter("prompt_tokens", "Prompt tokens received.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("num_preemptions", "Sequences preempted (recomputed) for lack of KV pages.", s.preemptions)
        yield gauge("generation_tokens_per_second", "Generated tokens per second over the last 10 s.",
                    s.tokens_per_second)
        done = CounterMetricFamily(PREFIX + "request_success", "Finished requests by reason.",
                                   labels=labels + ["finished_reason"])
        for reason, n in sorted(s.finished.items()):
            done.add_metric(value + [reason], n)
        yield done


def make_registry(engine: EngineThread, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
