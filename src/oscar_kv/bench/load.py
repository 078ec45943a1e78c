"""Load test for ``oscar-kv serve``: bounded in requests and time, loopback only.

    python -m oscar_kv.bench.load --url http://127.0.0.1:30000 --requests 64 --concurrency 16 --max-tokens 32

Sends streaming chat completions from ``--concurrency`` workers until ``--requests`` have finished or
``--time-limit`` seconds have passed, and reports requests/s, generated tokens/s, and p50/p99 of the
end-to-end latency and of the time to first token (TTFT).  Usage counts come from the server
(``stream_options.include_usage``).  ``--json FILE`` writes the numbers.  The client is plain httpx so it
runs wherever the server does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

from ..errors import ConfigError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}

PROMPTS = [
    "Explain in two sentences what a key-value cache is in a transformer.",
    "Write a haiku about memory bandwidth.",
    "List three uses of the Python standard library module itertools.",
    "Why does quantizing to 2 bits need care with outlier channels? Answer briefly.",
]


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float = 0.0
    completion_tokens: int = 0
    error: str = ""


@dataclass
class LoadReport:
    requests: int
    failed: int
    seconds: float
    requests_per_s: float
    generated_tokens_per_s: float
    latency_p50: float
    latency_p99: float
    ttft_p50: float
    ttft_p99: float
    concurrency: int
    max_tokens: int
    errors: list[str] = field(default_factory=list)

    def table(self) -> str:
        return (f"requests {self.requests} ({self.failed} failed) in {self.seconds:.1f} s at concurrency "
                f"{self.concurrency}, max_tokens {self.max_tokens}\n"
                f"  requests/s      {self.requests_per_s:8.2f}\n"
                f"  generated tok/s {self.generated_tokens_per_s:8.1f}\n"
                f"  latency p50/p99 {self.latency_p50:8.3f} / {self.latency_p99:.3f} s\n"
                f"  TTFT    p50/p99 {self.ttft_p50:8.3f} / {self.ttft_p99:.3f} s")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int,
                      ignore_eos: bool = False) -> RequestResult:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return RequestResult(False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    latency = time.perf_counter() - start
    return RequestResult(True, latency, latency if ttft is None else ttft, tokens)


async def run_load(url: str, model: str, requests: int, concurrency: int, max_tokens: int, time_limit: float,
                   api_key: str | None = None, ignore_eos: bool = False) -> LoadReport:
    import httpx

    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise ConfigError(f"the load test only targets loopback servers, not {host!r}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[RequestResult] = []
    counter = iter(range(requests))
    deadline = time.perf_counter() + time_limit

    async def worker(client):
        for i in counter:
            if time.perf_counter() > deadline:
                return
            results.append(await one_request(client, url, model, PROMPTS[i % len(PROMPTS)], max_tokens, ignore_eos))

    start = time.perf_counter()
    timeout = httpx.Timeout(time_limit + 30)
    async with httpx.AsyncClient(headers=headers, timeout=timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    lat, ttft = [r.latency for r in ok], [r.ttft for r in ok]
    return LoadReport(len(results), len(results) - len(ok), seconds, len(ok) / seconds,
                      sum(r.completion_tokens for r in ok) / seconds, percentile(lat, 50), percentile(lat, 99),
                      percentile(ttft, 50), percentile(ttft, 99), concurrency, max_tokens,
                      sorted({r.error for r in results if not r.ok})[:5])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="oscar-kv bench load", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000", help="Server base URL (loopback only).")
    ap.add_argument("--model", default="smollm2-135m", help="Model name the server serves.")
    ap.add_argument("--requests", type=int, default=64, help="Requests to send in all.")
    ap.add_argument("--concurrency", type=int, default=16, help="Requests in flight at once.")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request.")
    ap.add_argument("--time-limit", type=float, default=300.0, help="Stop sending new requests after this many s.")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--ignore-eos", action="store_true", help="Always generate max_tokens (fixed-length load).")
    ap.add_argument("--json", default=None, help="Write the report to this file.")
    args = ap.parse_args(argv)
    if min(args.requests, args.concurrency, args.max_tokens) < 1 or args.time_limit <= 0:
        ap.error("--requests, --concurrency, --max-tokens and --time-limit must be positive")
    try:
        report = asyncio.run(run_load(args.url, args.model, args.requests, args.concurrency, args.max_tokens,
                                      args.time_limit, args.api_key, args.ignore_eos))
    except ValueError as exc:
        ap.error(str(exc))
    print(report.table())
    for err in report.errors:
        print("  error:", err)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
