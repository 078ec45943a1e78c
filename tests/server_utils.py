"""Shared by the server tests: /metrics read through prometheus_client's own parser."""

import httpx
from prometheus_client.parser import text_string_to_metric_families


def read_metrics(url: str) -> dict:
    """{(sample name, ((label, value), ...) without model_name): value}; histogram buckets left out."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if "le" not in s.labels}


def metric(values: dict, name: str, **labels) -> float:
    return values[("oscar_kv_" + name, tuple(sorted(labels.items())))]
