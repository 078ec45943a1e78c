"""The OpenAI-compatible server on 127.0.0.1 with the official `openai` client (real SmolLM2, INT2 cache)."""

import json
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from oscar_kv.artifacts import Rotations, model_fingerprint  # noqa: E402
from oscar_kv.errors import ConfigError  # noqa: E402
from oscar_kv.models import AttentionGeometry  # noqa: E402
from oscar_kv.server import BackgroundServer, ServeConfig, ServeError  # noqa: E402
from oscar_kv.server.main import build_engine, load_rotations  # noqa: E402
from server_utils import metric, read_metrics  # noqa: E402

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
                         max_model_len=1024, max_num_seqs=16, port=0, api_key=KEY, max_body_mb=4,
                         log_level="warning")
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


def metrics(server) -> dict:
    return read_metrics(server.url)


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    names = {name for name, _ in metrics(server)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_pool_used_tokens",
                 "kv_pool_capacity_bytes", "prefix_cache_hit_rate", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "generation_tokens_per_second",
                 "request_success_total", "request_failure_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count"):
        assert "oscar_kv_" + name in names, name


def test_router_facing_load_and_vllm_named_gauges(server):
    """What routers poll: /get_load and vLLM's gauge names, equal to ours (tests/test_router.py: under load)."""
    wait_idle(server)
    load = httpx.get(server.url + "/get_load", timeout=10).json()
    assert load["load"] == load["num_requests_running"] + load["num_requests_waiting"] == 0
    values = read_metrics(server.url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert values[("vllm:" + name, ())] == metric(values, name), name
    page = server.engine.pool.geometry.page_size
    blocks = int(metric(values, "kv_pool_capacity_tokens")) // page
    assert values[("vllm:cache_config_info", (("block_size", str(page)), ("num_gpu_blocks", str(blocks))))] == 1


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


def leave_a_stream_after_its_first_chunk(server, max_tokens=200):
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while not next(lines).startswith("data: {"):
            pass


def test_client_disconnect_mid_stream_frees_the_pages(server):
    leave_a_stream_after_its_first_chunk(server)
    stats = wait_idle(server, timeout=10)  # aborted long before 200 tokens
    assert stats.finished.get("abort", 0) >= 1
    assert server.engine.pool.all_free()


def test_client_gone_mid_request_frees_the_pages_without_streaming(server, client):
    """Tokens keep flowing to a non-streaming request; its client's disconnect must still end it at once."""
    aborts = server.engine_thread.stats().finished.get("abort", 0)
    with pytest.raises(openai.APITimeoutError):  # the client closes the connection after 1.5 s
        client.with_options(timeout=1.5).completions.create(
            model=MODEL, prompt="Tell me a very long story.", max_tokens=1000, temperature=0,
            extra_body={"ignore_eos": True})
    gone = time.monotonic()
    stats = wait_idle(server, timeout=5)  # 1000 tokens would take a minute or more
    print(f"\nnon-streaming request ended {time.monotonic() - gone:.2f} s after its client left")
    assert stats.finished.get("abort", 0) == aborts + 1 and stats.pool_used_tokens == 0
    assert server.engine.pool.all_free()


def test_metrics_count_outcomes_latencies_and_an_idle_rate_of_zero(server, client, monkeypatch):
    import oscar_kv.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "RATE_WINDOW_S", 2.0)  # the tokens/s window (10 s in service)
    wait_idle(server)
    before = metrics(server)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    client.completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=8, temperature=0,
                              extra_body={"ignore_eos": True})
    busy = metric(metrics(server), "generation_tokens_per_second")
    leave_a_stream_after_its_first_chunk(server)
    wait_idle(server, timeout=10)
    after = metrics(server)
    assert delta("request_success_total", finished_reason="length") == 1
    assert delta("request_success_total", finished_reason="stop") == 0  # aborts are no success
    assert delta("request_failure_total", reason="abort") == 1
    assert delta("e2e_request_latency_seconds_count") == 1  # the request that finished
    assert delta("time_to_first_token_seconds_count") == 2  # both got a first token
    assert delta("inter_token_latency_seconds_count") >= 7
    assert delta("generation_tokens_total") >= 9 and delta("prompt_tokens_total") > 0
    assert busy > 0
    time.sleep(2.2)
    assert metric(metrics(server), "generation_tokens_per_second") == 0


def test_shutdown_grace_ends_streams_on_time_even_inside_a_long_step():
    """A step cannot be interrupted. When the grace ends inside one (a 900-token prefill takes seconds on a CPU), the
    stream still gets its error event and [DONE] at once; stop() returns after the step, with no page referenced."""
    from oscar_kv.corpus import DEFAULT_CORPUS
    from oscar_kv.models import load_model

    lm, tok = load_model(MODEL)
    srv = BackgroundServer(ServeConfig(model=MODEL, kv_cache_dtype="bf16", kv_cache_memory=0.05, max_model_len=1024,
                                       port=0, shutdown_timeout=0.2, log_level="warning"), lm, tok).start()
    ids = tok(DEFAULT_CORPUS.read_text()[300_000:310_000]).input_ids[:900]
    lines, heard = [], {}

    def stream():
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=TIMEOUT,
                          json={"model": MODEL, "prompt": ids, "max_tokens": 4, "stream": True}) as r:
            lines.extend(line for line in r.iter_lines() if line)
        heard["at"] = time.monotonic()

    thread = threading.Thread(target=stream)
    thread.start()
    while not srv.engine.requests:  # submitted: the step that prefills it starts now
        time.sleep(0.01)
    time.sleep(0.1)
    signalled = time.monotonic()
    srv.stop()
    stopped = time.monotonic()
    thread.join()
    print(f"\nstream ended {heard['at'] - signalled:.2f} s after stop(); stop() took {stopped - signalled:.2f} s")
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "server_shutting_down"
    assert heard["at"] - signalled < 2.0  # the grace (0.2 s), not the step
    assert srv.engine.pool.all_free()


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


HI = '"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize("body,status,fragment,param", [
    ('{"model": "smollm2-135m", "messages": [', 400, "malformed JSON", None),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "malformed JSON",
     None),
    ('[' * 100_000, 400, "nested too deeply", None),
    ('[]', 400, "valid dictionary", None),
    ('{"model": "smollm2-135m", %s, "temperature": "hot"}' % HI, 400, "temperature", "temperature"),
    ('{"model": "smollm2-135m", %s, "colour": 1}' % HI, 400, "unknown field 'colour'", "colour"),
    ('{"model": "smollm2-135m", "messages": "hi"}', 400, "messages", "messages"),
    ('{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "surrogate",
     "messages[0].content"),
    ('{"model": "smollm2-135m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}',
     400, "surrogate", "messages[0].content[0].text"),
    ('{"model": "smollm2-135m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400,
     "'text'", "messages[0].content"),
    ('{"model": "smollm2-135m", "messages": [{"role": "tool", "content": "hi"}]}', 400, "'user'",
     "messages[0].role"),
    ('{"model": "smollm2-135m", %s, "seed": 1e23}' % HI, 400, "seed", "seed"),
    ('{"model": "smollm2-135m", %s, "seed": 1%s}' % (HI, "0" * 5000), 400, "malformed JSON", None),
    ('{"model": "smollm2-135m", %s, "max_tokens": 0}' % HI, 400, "max_tokens must be at least 1", "max_tokens"),
    ('{"model": "smollm2-135m", %s, "max_tokens": -3}' % HI, 400, "max_tokens", "max_tokens"),
    ('{"model": "smollm2-135m", %s, "temperature": NaN}' % HI, 400, "temperature", "temperature"),
    ('{"model": "smollm2-135m", %s, "temperature": Infinity}' % HI, 400, "temperature", "temperature"),
    ('{"model": "smollm2-135m", %s, "top_p": 0}' % HI, 400, "top_p", "top_p"),
    ('{"model": "smollm2-135m", %s, "n": 0}' % HI, 400, "n must lie in [1, 128]", "n"),
    ('{"model": "smollm2-135m", %s, "stop": %s}' % (HI, json.dumps(["s"] * 17)), 400, "stop", "stop"),
    ('{"model": "smollm2-135m", %s, "stream_options": {"include_usage": true}}' % HI, 400, "stream=true",
     "stream_options"),
    ('{"model": "smollm2-135m", %s, "top_logprobs": 2}' % HI, 400, "requires logprobs", "top_logprobs"),
    ('{"model": "smollm2-135m", %s, "presence_penalty": 2.5}' % HI, 400, "[-2, 2]", "presence_penalty"),
    ('{"model": "smollm2-135m", %s, "max_tokens": 5000}' % HI, 400, "maximum context length", "max_tokens"),
    ('{"model": "smollm2-135m", %s, "max_completion_tokens": 5000}' % HI, 400, "maximum context length",
     "max_completion_tokens"),
    ('{"model": "gpt-4", %s}' % HI, 404, "does not exist", "model"),
    # JSON types are taken as written: no bool read as 1, no string as a bool
    ('{"model": "smollm2-135m", %s, "max_tokens": true}' % HI, 400, "valid integer", "max_tokens"),
    ('{"model": "smollm2-135m", %s, "stream": "yes"}' % HI, 400, "valid boolean", "stream"),
    ('{"model": "smollm2-135m", "messages": [{"role": "user"}], "max_tokens": 2}', 400, "content is required",
     "messages[0].content"),
    ('{"model": "smollm2-135m", %s, "\\ud800": 1}' % HI, 400, "surrogate", None),  # a key, not a value
])
def test_bad_chat_input_gets_an_openai_error(server, body, status, fragment, param):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] and err["param"] == param, err


@pytest.mark.parametrize("body,fragment,param", [
    ('{"model": "smollm2-135m", "prompt": [1, 2, 99999999]}', "token ids", "prompt"),
    ('{"model": "smollm2-135m", "prompt": [1, -2]}', "token ids", "prompt"),
    ('{"model": "smollm2-135m", "prompt": ["a", 2]}', "valid string", "prompt"),
    ('{"model": "smollm2-135m", "prompt": ""}', "at least 1", "prompt"),
    ('{"model": "smollm2-135m", "prompt": "\\udbff tail"}', "surrogate", "prompt"),
    ('{"model": "smollm2-135m", "prompt": "hi", "stop": "\\ud800"}', "surrogate", "stop"),
    ('{"model": "smollm2-135m", "prompt": "hi", "echo": true, "logprobs": 21}', "[0, 20]", "logprobs"),
    ('{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 1e400}', "max_tokens", "max_tokens"),
    ('{"model": "smollm2-135m", "prompt": [true, 2]}', "valid integer", "prompt"),
])
def test_bad_completion_input_gets_an_openai_error(server, body, fragment, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["param"] == param, err


def test_auth_is_checked_before_the_body(server):
    for key in (None, "wrong"):
        r = post(server, "/v1/chat/completions", '{"model": "smollm2-135m", "messages": [', key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = post(server, "/v1/completions", b"x" * (5 * 2**20), key=None)  # over the 4 MB limit, and no key
    assert r.status_code == 401


def test_a_body_over_the_limit_gets_413(server):
    r = post(server, "/v1/completions", json.dumps({"model": MODEL, "prompt": "a" * (4 * 2**20)}))
    assert r.status_code == 413, r.text
    assert "4 MB" in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"

    def chunks():  # no Content-Length: the limit applies while the body arrives
        yield b'{"model": "smollm2-135m", "prompt": "'
        for _ in range(5):
            yield b"a" * 2**20
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 413, r.text


def test_health_answers_while_a_huge_body_is_tokenized(server):
    """Parsing and tokenizing a 3.5 MB prompt take seconds, in a worker thread: /health must not wait for them."""
    body = json.dumps({"model": MODEL, "prompt": "All work and no play makes Jack a dull boy. " * 80_000})
    result = {}

    def big():
        started = time.perf_counter()
        result["response"] = post(server, "/v1/completions", body)
        result["seconds"] = time.perf_counter() - started

    thread = threading.Thread(target=big)
    thread.start()
    latencies = []
    while thread.is_alive():
        started = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        latencies.append(time.perf_counter() - started)
        time.sleep(0.02)
    thread.join()
    r = result["response"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert result["seconds"] > 0.5, "the body was handled too fast to show anything; make it larger"
    # were the loop blocked, one /health would wait for most of the tokenization
    assert len(latencies) >= 3 and max(latencies) < result["seconds"] / 4, (latencies, result["seconds"])


def test_a_tiny_temperature_is_greedy_not_nan(client):
    greedy = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0)
    tiny = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=1e-300)
    assert tiny.choices[0].text == greedy.choices[0].text


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
    with pytest.raises(ServeError, match="oscar-kv calibrate"):  # a model with no artifact in the package
        build_engine(ServeConfig(model="my-finetune", kv_cache_dtype="int2"), lm, tok)
    rot = load_rotations(ServeConfig(kv_cache_dtype="int2"), lm, tok)  # the embedded model's comes with the package
    assert rot is not None and rot.manifest["fingerprint"] == model_fingerprint(lm)
    with pytest.raises(ConfigError, match="kv_cache_dtype must be 'bf16' or 'int2'"):
        ServeConfig(kv_cache_dtype="int3")


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
