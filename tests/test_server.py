"""The OpenAI-compatible server on 127.0.0.1 with the official `openai` client (real SmolLM2, INT2 cache)."""

import json
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from oscar_kv.artifacts import Rotations  # noqa: E402
from oscar_kv.models import AttentionGeometry  # noqa: E402
from oscar_kv.server import BackgroundServer, ServeConfig, ServeError  # noqa: E402
from oscar_kv.server.main import build_engine, free_port  # noqa: E402

KEY = "test-key"
MODEL = "smollm2-135m"
TIMEOUT = 120


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: one torch thread for small steps


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from oscar_kv.models import load_model

    lm, tok = load_model(MODEL)  # the server's own copy: the engine folds rotations into it
    rot_dir = tmp_path_factory.mktemp("rotations")
    Rotations.data_free(AttentionGeometry.of(lm.config), "hadamard", k_clip=0.96, v_clip=0.92).save(rot_dir)
    config = ServeConfig(model=MODEL, rotations=str(rot_dir), kv_cache_dtype="int2", kv_cache_memory=0.1,
                         max_model_len=1024, max_num_seqs=16, port=free_port(), api_key=KEY, log_level="warning")
    srv = BackgroundServer(config, lm, tok).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


def wait_idle(server, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = server.engine_thread.stats()
        if s.running == 0 and s.waiting == 0:
            return s
        time.sleep(0.1)
    raise AssertionError("the engine did not become idle")


def chat_ids(server, content):
    tok = server.engine.tokenizer
    return tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                   return_dict=True)["input_ids"]


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("oscar_kv_num_requests_running", "oscar_kv_num_requests_waiting", "oscar_kv_kv_pool_used_tokens",
                 "oscar_kv_kv_pool_capacity_bytes", "oscar_kv_prefix_cache_hit_rate",
                 "oscar_kv_generation_tokens_per_second"):
        assert name in text


def test_chat_streaming_equals_non_streaming(server, client):
    msg = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=MODEL, messages=msg, max_tokens=8, temperature=0)
    assert "Paris" in full.choices[0].message.content
    assert full.usage.prompt_tokens == len(chat_ids(server, msg[0]["content"]))
    assert full.usage.completion_tokens <= 8 and full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    stream = client.chat.completions.create(model=MODEL, messages=msg, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_completions_streaming_and_not_with_stop_and_seed(client):
    a = client.completions.create(model=MODEL, prompt="The first three prime numbers are", max_tokens=6,
                                  temperature=0.8, top_p=0.9, seed=7)
    b = client.completions.create(model=MODEL, prompt="The first three prime numbers are", max_tokens=6,
                                  temperature=0.8, top_p=0.9, seed=7, stream=True)
    assert a.choices[0].text == "".join(c.choices[0].text for c in b)  # same seed, same sample
    assert a.choices[0].finish_reason in ("length", "stop") and a.usage.completion_tokens <= 6
    greedy = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=["7"])
    assert "7" in greedy.choices[0].text
    assert cut.choices[0].text == greedy.choices[0].text.split("7")[0] and cut.choices[0].finish_reason == "stop"


def test_greedy_server_output_equals_generate(server, client, smol, tmp_path):
    """A prompt past the 320 BF16 tokens: INT2 history in play; same text as `oscar-kv generate`."""
    from oscar_kv.cache import CacheSettings, unprepare_model
    from oscar_kv.corpus import DEFAULT_CORPUS
    from oscar_kv.generation import generate

    prompt = DEFAULT_CORPUS.read_text()[3000:4500] + "\n\nWhat is this about?"
    lm, tok = smol
    rot = Rotations.load(server.config.rotations)
    ref = generate(lm, tok, prompt, rot, CacheSettings("int2"), max_new_tokens=8)
    unprepare_model(lm)
    assert ref.prompt_tokens > 330
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=8, temperature=0)
    assert out.choices[0].message.content.strip() == ref.text
    assert out.usage.prompt_tokens == ref.prompt_tokens


def test_16_concurrent_streams_finish_with_correct_usage_and_free_the_pool(server, client):
    results, errors = {}, []

    def one(i):
        try:
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Say a word about the number {i}."}],
                max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True})
            chunks = list(stream)
            results[i] = chunks
        except Exception as exc:  # surfaced below
            errors.append(exc)

    started = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    elapsed = time.perf_counter() - started
    assert not errors and len(results) == 16
    total = 0
    for i, chunks in results.items():
        usage = chunks[-1].usage
        assert usage.prompt_tokens == len(chat_ids(server, f"Say a word about the number {i}."))
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert usage.completion_tokens == 6 or finish == "stop"
        total += usage.completion_tokens
    print(f"\n16 concurrent streams: {total} tokens in {elapsed:.1f} s ({total / elapsed:.1f} tok/s)")
    stats = wait_idle(server)
    assert stats.pool_used_tokens == 0 and server.engine.pool.all_free()


def test_client_disconnect_mid_stream_frees_the_pages(server):
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 200, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    stats = wait_idle(server)  # aborted long before 200 tokens
    assert stats.finished.get("abort", 0) >= 1
    assert server.engine.pool.all_free()


def test_prefix_reuse_gives_the_same_output_and_a_hit_rate(server, client):
    prompt = "Here is a list of fruits: apple, banana, cherry, date, elderberry, fig, grape. The third one is"
    before = server.engine_thread.stats().prefix_hit_tokens
    a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    b = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert server.engine_thread.stats().prefix_hit_tokens > before
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    rate = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("oscar_kv_prefix_cache_hit_rate")]
    assert rate and rate[0] > 0


def post(server, path, content, key=KEY):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(server.url + path, content=content, headers=headers, timeout=30)


@pytest.mark.parametrize("body,status,fragment", [
    ('{"model": "smollm2-135m", "messages": [', 400, "malformed JSON"),
    ('{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400,
     "temperature"),
    ('{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "colour": 1}', 400,
     "unknown field 'colour'"),
    ('{"model": "smollm2-135m", "messages": "hi"}', 400, "messages"),
    ('{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400,
     "max_tokens must be at least 1"),
    ('{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}', 400,
     "max_tokens"),
    ('{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "temperature"),
    ('{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', 400,
     "temperature"),
    ('{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, "n=1"),
    ('{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}', 400,
     "maximum context length"),
    ('{"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}', 404, "does not exist"),
])
def test_bad_chat_input_gets_an_openai_error(server, body, status, fragment):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"]


def test_prompt_longer_than_max_model_len_and_auth(server, client):
    r = post(server, "/v1/completions", json.dumps({"model": MODEL, "prompt": "word " * 1100, "max_tokens": 4}))
    assert r.status_code == 400 and "maximum context length is 1024" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = post(server, "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi"}), key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = post(server, "/v1/models", "", key=None)
    assert r.status_code in (401, 405)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=5)
    # and it keeps serving
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1
    assert server.engine.pool.all_free() or wait_idle(server)


def test_int2_without_rotations_refuses_to_start_with_advice(smol):
    lm, tok = smol
    with pytest.raises(ServeError, match="oscar-kv calibrate"):
        build_engine(ServeConfig(kv_cache_dtype="int2"), lm, tok)
    with pytest.raises(ServeError, match="kv-cache-dtype"):
        ServeConfig(kv_cache_dtype="int3").validate()


def test_load_test_reports_throughput_and_latency_percentiles(server, tmp_path):
    from oscar_kv.bench.load import main as load_main

    out = tmp_path / "load.json"
    code = load_main(["--url", server.url, "--model", MODEL, "--api-key", KEY, "--requests", "8", "--concurrency", "4",
                      "--max-tokens", "4", "--time-limit", "120", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["requests"] == 8 and report["failed"] == 0, report
    assert report["requests_per_s"] > 0 and report["generated_tokens_per_s"] > 0
    assert 0 < report["ttft_p50"] <= report["latency_p50"] <= report["latency_p99"]
    assert wait_idle(server).pool_used_tokens == 0


def test_load_test_refuses_other_hosts():
    from oscar_kv.bench.load import main as load_main

    with pytest.raises(SystemExit):
        load_main(["--url", "http://example.com:30000", "--requests", "1"])
