"""A real `oscar-kv serve` process on loopback: a bounded soak (hundreds of short requests with mixed lengths,
disconnects, cancellations, bad bodies, preemption in a small pool), then a SIGTERM with requests in flight.

OSCAR_KV_SOAK_REQUESTS sets the soak's size (default 200, about 30-60 s on 2 CPU cores)."""

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import pytest

openai = pytest.importorskip("openai")

from server_utils import metric, read_metrics  # noqa: E402

MODEL = "smollm2-135m"
REQUESTS = int(os.environ.get("OSCAR_KV_SOAK_REQUESTS", "200"))
CONCURRENCY = 12
GRACE = 6  # --shutdown-timeout
GROW = 6


class ServerProcess:
    def __init__(self, args: list[str]):
        # one torch thread: small decode steps run faster so, most of all when the test's client shares the cores
        env = {**os.environ, "OSCAR_KV_API_KEY": "", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "oscar_kv.cli", "serve", *args], env=env, text=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.log: list[str] = []
        self._reader = threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 300
        while not (found := [m for line in list(self.log) if (m := re.search(r"on (http://\S+)/v1", line))]):
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.log)
            time.sleep(0.1)
        self.url = found[0].group(1)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code


@pytest.fixture(scope="module")
def server(smol, tmp_path_factory):
    """int2 in a pool of 22 window + 15 INT2 pages (one 512-token sequence): a dozen concurrent sequences do not fit,
    so some are preempted."""
    from oscar_kv.artifacts import Rotations
    from oscar_kv.models import AttentionGeometry

    rot_dir = tmp_path_factory.mktemp("soak-rotations")
    Rotations.data_free(AttentionGeometry.of(smol[0].config), "hadamard", k_clip=0.96, v_clip=0.92).save(rot_dir)
    srv = ServerProcess(["--rotations", str(rot_dir), "--kv-cache-memory", "0.009", "--max-model-len", "512",
                         "--max-num-seqs", str(CONCURRENCY), "--port", "0", "--shutdown-timeout", str(GRACE)])
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.wait(30)


def wait_idle(url: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        values = read_metrics(url)
        if metric(values, "num_requests_running") == 0 and metric(values, "num_requests_waiting") == 0:
            return values
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.1)


def plan(rng: random.Random, tokenizer, ids: list[int]) -> list[dict]:
    """What each request does; drawn up front so that a run is reproducible."""
    kinds = ["chat", "stream", "completion", "leave_stream", "leave_request", "leave_body", "cancel", "bad"]
    # first a burst of 40-token prompts (3 pages) growing to 6 pages each: at most 5 are admitted together, and
    # 5 x 6 pages outgrow the 22 window pages
    out = [{"kind": "grow", "prompt": tokenizer.decode(ids[i * 40:(i + 1) * 40]), "max_tokens": 42, "temperature": 0.0,
            "seed": 0, "delay": 0.0} for i in range(GROW)]
    for _ in range(REQUESTS - GROW):
        length = rng.choice([4, 12, 40, 80]) if rng.random() < 0.96 else rng.randint(340, 400)  # some reach INT2
        start = rng.randrange(len(ids) - length)
        out.append({"kind": rng.choices(kinds, weights=[4, 4, 3, 2, 2, 1, 2, 1])[0],
                    "prompt": tokenizer.decode(ids[start:start + length]), "max_tokens": rng.randint(1, 8),
                    "temperature": rng.choice([0.0, 0.7]), "seed": rng.randrange(2**31), "delay": rng.random() * 0.6})
    return out


BAD = ['{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\\ud800"}]}',
       '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "seed": 1e23}',
       '{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 100000}', '{"model": "smollm2-135m", "prompt": [',
       '{"model": "other", "prompt": "hi"}']


async def one(job: dict, url: str, client, http: httpx.AsyncClient, outcomes: Counter, failures: list) -> None:
    kind, body = job["kind"], {"model": MODEL, "max_tokens": job["max_tokens"], "temperature": job["temperature"],
                               "seed": job["seed"]}
    chat = {**body, "messages": [{"role": "user", "content": job["prompt"]}]}
    try:
        if kind == "chat":
            out = await client.chat.completions.create(**chat)
            assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
        elif kind == "stream":
            chunks = [c async for c in await client.chat.completions.create(**chat, stream=True)]
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
        elif kind in ("completion", "grow"):
            out = await client.completions.create(**body, prompt=job["prompt"], extra_body={"ignore_eos": kind == "grow"})
            assert out.choices[0].finish_reason in ("stop", "length")
        elif kind == "leave_stream":  # read the first event, then close the connection
            async with http.stream("POST", url + "/v1/completions", json={**body, "prompt": job["prompt"],
                                   "max_tokens": 40, "ignore_eos": True, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break
        elif kind == "leave_request":  # a non-streaming request whose client gives up
            try:
                r = await http.post(url + "/v1/chat/completions", json={**chat, "max_tokens": 40, "ignore_eos": True},
                                    timeout=0.1 + job["delay"])
                assert r.status_code == 200, r.text
            except httpx.TimeoutException:
                pass
        elif kind == "leave_body":  # the client goes away while sending its body
            host, port = url.removeprefix("http://").split(":")
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + json.dumps(body).encode()[:-1])
            await writer.drain()
            writer.close()
            await writer.wait_closed()
        elif kind == "cancel":  # the official client's request cancelled mid-flight
            try:
                await asyncio.wait_for(client.chat.completions.create(**chat), timeout=0.1 + job["delay"])
            except asyncio.TimeoutError:
                pass
        else:
            r = await http.post(url + "/v1/completions", content=BAD[job["seed"] % len(BAD)])
            assert 400 <= r.status_code < 500 and r.json()["error"]["message"], r.text
        outcomes[kind] += 1
    except Exception as exc:  # every failure is reported at the end, 5xx or not
        failures.append(f"{kind}: {type(exc).__name__}: {exc}")


def test_soak_leaks_no_page_and_answers_no_5xx(server, tokenizer):
    from oscar_kv.corpus import DEFAULT_CORPUS

    jobs = plan(random.Random(21), tokenizer, tokenizer(DEFAULT_CORPUS.read_text()[:100_000]).input_ids)
    outcomes, failures = Counter(), []

    async def run():
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(timeout=120) as http:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

            async def gated(job):
                async with gate:
                    await one(job, server.url, client, http, outcomes, failures)

            await asyncio.gather(*(gated(job) for job in jobs[:GROW]))  # alone, so that they surely preempt
            await asyncio.gather(*(gated(job) for job in jobs[GROW:]))
            await client.close()

    started = time.perf_counter()
    asyncio.run(run())
    values = wait_idle(server.url)
    seconds = time.perf_counter() - started
    used = {pool: metric(values, "kv_pages", pool=pool, state="used") for pool in ("window", "quantized")}
    print(f"\nsoak: {REQUESTS} requests in {seconds:.1f} s, {dict(outcomes)}; preemptions "
          f"{metric(values, 'num_preemptions_total'):.0f}, aborts {metric(values, 'request_failure_total', reason='abort'):.0f}, "
          f"generated {metric(values, 'generation_tokens_total'):.0f} tokens; pages in use {used}")
    assert not failures, failures[:10]
    assert "Traceback" not in "".join(server.log), "".join(server.log)[-3000:]
    assert sum(outcomes.values()) == REQUESTS
    assert used == {"window": 0, "quantized": 0} and metric(values, "kv_pool_used_tokens") == 0
    assert metric(values, "num_preemptions_total") > 0, "the pool was never short: make it smaller"
    assert metric(values, "request_failure_total", reason="abort") > 0
    assert metric(values, "request_failure_total", reason="error") == 0


def test_sigterm_lets_requests_in_flight_finish_then_ends_the_rest(server):
    """Runs after the soak on the same process: SIGTERM with two long streams, a long and a short request in flight."""
    long = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 450, "ignore_eos": True,
            "temperature": 0}

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            async def stream():
                async with http.stream("POST", server.url + "/v1/completions", json={**long, "stream": True}) as r:
                    return [line async for line in r.aiter_lines() if line]

            short = asyncio.create_task(http.post(server.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "ignore_eos": True}))
            tasks = [asyncio.create_task(stream()), asyncio.create_task(stream()),
                     asyncio.create_task(http.post(server.url + "/v1/completions", json=long))]
            while metric(await asyncio.to_thread(read_metrics, server.url), "num_requests_running") < 4:
                assert not short.done(), "the short request ended before the SIGTERM; make it longer"
                await asyncio.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            signalled, refused = time.monotonic(), None
            while refused is None and time.monotonic() < signalled + GRACE / 2:
                try:  # a new connection each time: the listening socket closes at once
                    await http.get(server.url + "/health", timeout=1, headers={"Connection": "close"})
                    await asyncio.sleep(0.05)
                except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                    # refused, or taken into the backlog just before the socket closed and then dropped unanswered
                    refused = time.monotonic() - signalled
            assert refused is not None and not any(t.done() for t in tasks), "".join(server.log)[-3000:]
            return await short, await asyncio.gather(*tasks)

    started = time.monotonic()
    short, (first, second, plain) = asyncio.run(run())
    code = server.wait(GRACE + 30)
    print(f"\nSIGTERM: exit {code} after {time.monotonic() - started:.1f} s")
    log = "".join(server.log)
    assert short.status_code == 200 and short.json()["choices"][0]["finish_reason"] == "length"
    for lines in (first, second):  # each stream ends with an error event, then [DONE]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down" and "--shutdown-timeout" in error["message"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "server_shutting_down"
    assert code == 0, log[-3000:]
    assert "KV pages still referenced: 0 window + 0 quantized" in log
    assert "Traceback" not in log, log[-3000:]
