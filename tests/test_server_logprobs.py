"""What evaluation clients need from the server: logprobs (chat and completions, streaming too), echo with prompt
logprobs, several prompts and n > 1, penalties and logit_bias, the tokenizer endpoints, several model names, and a
400 for each bad combination.  A real server on 127.0.0.1 (BF16 cache, the real SmolLM2) and the `openai` client."""

import json

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from oscar_kv.server import BackgroundServer, ServeConfig  # noqa: E402

MODEL = "smollm2-135m"
NAMES = (MODEL, "gpt-3.5-turbo-instruct")
TIMEOUT = 120
TOL = 0.1  # BF16 K/V against the float32 forward (tests/test_logprobs.py: up to 0.045 measured)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server():
    from oscar_kv.models import load_model

    lm, tok = load_model(MODEL)
    config = ServeConfig(model=MODEL, served_model_name=",".join(NAMES), kv_cache_dtype="bf16", kv_cache_memory=0.05,
                         max_model_len=512, max_num_batched_tokens=24, port=0, log_level="warning")
    srv = BackgroundServer(config, lm, tok).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def reference(smol):
    """ids -> log_softmax of transformers' logits over them, [len(ids), vocab]."""
    lm = smol[0]

    def logprobs(ids):
        with torch.no_grad():
            return torch.log_softmax(lm(torch.tensor([ids])).logits[0].float(), -1)

    return logprobs


def tok(server):
    return server.engine.tokenizer


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT)


def sse(server, path, body) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_echo_scores_every_prompt_token_as_lm_eval_reads_them(server, reference):
    """lm-eval's loglikelihood request: token-id prompts in a batch, echo, logprobs 1, max_tokens 1.  Each choice
    has prompt + 1 entries, the first null; each entry is the model's own logprob of that token (BF16 cache, prompts
    longer than a prefill chunk), and the token is in its top_logprobs dict."""
    t = tok(server)
    prompts = [t("The capital of France is Paris, and the capital of Italy is Rome. The capital of Spain is "
                 "Madrid.").input_ids, t("One, two, three").input_ids]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": prompts, "echo": True, "logprobs": 1,
                                         "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts)) and body["usage"]["completion_tokens"] == 2
    worst = 0.0
    for ids, choice in zip(prompts, body["choices"]):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert choice["text"].startswith(t.decode(ids))
        ref = reference(ids)
        for p in range(1, len(ids) + 1):  # the last entry: the greedy token generated after the prompt
            value = lp["token_logprobs"][p]
            expected = ref[p - 1, ids[p]] if p < len(ids) else ref[-1].max()
            worst = max(worst, abs(value - expected.item()))
            assert lp["tokens"][p] in lp["top_logprobs"][p] and lp["top_logprobs"][p][lp["tokens"][p]] == value
            assert len(lp["top_logprobs"][p]) <= 2
        # lm-eval's greedy check: the token's logprob is the largest of its position's top_logprobs
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())  # temperature 0 took the argmax
        offsets = lp["text_offset"]
        assert offsets[0] == 0 and all(b - a == len(s) for a, b, s in zip(offsets, offsets[1:], lp["tokens"]))
    print(f"\necho logprobs vs transformers (BF16 cache, chunks of 24): max |diff| {worst:.2e}")
    assert worst < TOL


def test_echo_with_zero_max_tokens_gives_the_prompt_only(server):
    ids = tok(server)("Hello there, general").input_ids
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 0,
                                         "max_tokens": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == tok(server).decode(ids) and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert all(len(d) == 1 for d in choice["logprobs"]["top_logprobs"][1:])
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    # and streaming: one chunk with the prompt, then usage
    chunks = sse(server, "/v1/completions", {"model": MODEL, "prompt": ids, "echo": True, "max_tokens": 0,
                                             "stream": True, "logprobs": 0})
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert [e for c in chunks for e in c["choices"][0]["logprobs"]["token_logprobs"]] == \
        choice["logprobs"]["token_logprobs"]


def test_completion_logprobs_stream_as_they_come(server, client):
    kwargs = dict(model=MODEL, prompt="The first five prime numbers are", max_tokens=8, temperature=0, logprobs=3)
    full = client.completions.create(**kwargs).choices[0]
    lp = full.logprobs
    assert "".join(lp.tokens) == full.text and len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.tokens)
    assert all(len(d) == 3 and max(d.values()) == v for d, v in zip(lp.top_logprobs, lp.token_logprobs))
    chunks = list(client.completions.create(stream=True, **kwargs))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and values == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert offsets == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks) == full.text


def test_chat_logprobs_in_openai_format_streaming_too(server, client):
    msg = [{"role": "user", "content": "Name a colour."}]
    full = client.chat.completions.create(model=MODEL, messages=msg, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=4)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert "".join(e.token for e in content) == full.choices[0].message.content
    assert b"".join(bytes(e.bytes) for e in content).decode() == full.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 4 and e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert [x.logprob for x in e.top_logprobs] == sorted((x.logprob for x in e.top_logprobs), reverse=True)
    bare = client.chat.completions.create(model=MODEL, messages=msg, max_tokens=2, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)
    assert client.chat.completions.create(model=MODEL, messages=msg, max_tokens=2).choices[0].logprobs is None
    stream = client.chat.completions.create(model=MODEL, messages=msg, max_tokens=6, temperature=0, logprobs=True,
                                            top_logprobs=4, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    # the stream's prompt hits the prefix cache (two full pages): its split differs, and so does the BF16 rounding
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=TOL)


def test_bytes_of_a_token_holding_part_of_a_character(server, client):
    """A byte-level token may hold half a UTF-8 character: its string shows U+FFFD, its bytes are exact."""
    from oscar_kv.server.logprobs import TokenStrings

    t = tok(server)
    strings = TokenStrings(t)
    ids = t("日本 ✓").input_ids
    assert b"".join(bytes(strings.get(i)[1]) for i in ids).decode() == "日本 ✓"
    assert any("\ufffd" in strings.text(i) for i in ids)


def test_n_choices_and_several_prompts(server, client):
    """n samples per prompt, numbered prompt-major; a seed gives choice i the seed + i (so choice 1 of seed 7 is
    choice 0 of seed 8); greedy choices agree; usage counts each prompt once and every choice's tokens."""
    kwargs = dict(model=MODEL, max_tokens=5, temperature=0.9, seed=7)
    many = client.completions.create(prompt="Once upon a time", n=3, **kwargs)
    assert [c.index for c in many.choices] == [0, 1, 2]
    one = client.completions.create(prompt="Once upon a time", n=1, **{**kwargs, "seed": 8})
    assert many.choices[1].text == one.choices[0].text
    assert many.usage.prompt_tokens == len(tok(server)("Once upon a time").input_ids)
    assert many.usage.completion_tokens == 15
    batch = client.completions.create(model=MODEL, prompt=["Hello", "The sky is"], n=2, max_tokens=3, temperature=0)
    texts = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]
    alone = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0)
    assert texts[2] == alone.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=3, temperature=1.0, seed=1)
    assert [c.index for c in chat.choices] == [0, 1]
    chunks = list(client.completions.create(prompt="Once upon a time", n=3, stream=True, **kwargs))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)}
    assert streamed == {c.index: c.text for c in many.choices}


def test_penalties_and_logit_bias(server, client):
    t = tok(server)
    target = t(" banana").input_ids[0]
    prompt = "1, 1, 1, 1, 1, 1, 1,"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    biased = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                       logit_bias={str(target): 100})
    assert biased.choices[0].text == " banana banana"
    penalized = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                          frequency_penalty=2.0, extra_body={"repetition_penalty": 1.5})
    assert penalized.choices[0].text != plain.choices[0].text


def test_tokenizer_endpoints_in_vllms_shapes(server):
    t = tok(server)
    info = httpx.get(server.url + "/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == t.eos_token and info["bos_token"] == t.bos_token
    assert info["model_max_length"] == 512 and info["chat_template"] == t.chat_template
    r = post(server, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert r.json() == {"count": 2, "max_model_len": 512, "tokens": t("Hello world").input_ids, "token_strs": None}
    eos = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [t.eos_token_id]  # what lm-eval's remote tokenizer takes as the EOS id
    msgs = [{"role": "user", "content": "hi"}]
    chat = post(server, "/tokenize", {"model": MODEL, "messages": msgs, "return_token_strs": True}).json()
    expected = t.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert chat["tokens"] == list(expected) and chat["token_strs"] == t.convert_ids_to_tokens(expected)
    assert post(server, "/detokenize", {"tokens": chat["tokens"]}).json() == {"prompt": t.decode(expected)}
    for path, body, param in [("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")]:
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = post(server, "/tokenize", {"model": "other", "prompt": "a"})
    assert r.status_code == 404


def test_several_served_model_names(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == list(NAMES)
    assert all(m.model_extra["max_model_len"] == 512 for m in models)
    for name in NAMES:
        assert client.completions.create(model=name, prompt="Hi", max_tokens=1).model == name
    with pytest.raises(openai.NotFoundError, match="gpt-3.5-turbo-instruct"):
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)


HI = '"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize("path,body,fragment,param", [
    ("chat", '{"model": "%s", %s, "top_logprobs": 2}' % (MODEL, HI), "requires logprobs", "top_logprobs"),
    ("chat", '{"model": "%s", %s, "logprobs": true, "top_logprobs": 21}' % (MODEL, HI), "[0, 20]", "top_logprobs"),
    ("chat", '{"model": "%s", %s, "logprobs": true, "top_logprobs": -1}' % (MODEL, HI), "[0, 20]", "top_logprobs"),
    ("chat", '{"model": "%s", %s, "logprobs": 3}' % (MODEL, HI), "valid boolean", "logprobs"),
    ("chat", '{"model": "%s", %s, "echo": true}' % (MODEL, HI), "unknown field 'echo'", "echo"),
    ("chat", '{"model": "%s", %s, "max_tokens": 0}' % (MODEL, HI), "at least 1", "max_tokens"),
    ("chat", '{"model": "%s", %s, "n": 0}' % (MODEL, HI), "n must lie", "n"),
    ("chat", '{"model": "%s", %s, "n": 129}' % (MODEL, HI), "n must lie", "n"),
    ("chat", '{"model": "%s", %s, "presence_penalty": 2.5}' % (MODEL, HI), "[-2, 2]", "presence_penalty"),
    ("chat", '{"model": "%s", %s, "frequency_penalty": -3}' % (MODEL, HI), "[-2, 2]", "frequency_penalty"),
    ("chat", '{"model": "%s", %s, "repetition_penalty": 0}' % (MODEL, HI), "(0, 10]", "repetition_penalty"),
    ("chat", '{"model": "%s", %s, "logit_bias": {"abc": 1}}' % (MODEL, HI), "token ids", "logit_bias"),
    ("chat", '{"model": "%s", %s, "logit_bias": {"5": 101}}' % (MODEL, HI), "[-100, 100]", "logit_bias"),
    ("chat", '{"model": "%s", %s, "logit_bias": {"99999999": 1}}' % (MODEL, HI), "logit_bias token ids", "logit_bias"),
    ("chat", '{"model": "%s", %s, "logit_bias": {"5": NaN}}' % (MODEL, HI), "finite", "logit_bias.5"),
    ("completions", '{"model": "%s", "prompt": "hi", "logprobs": 21}' % MODEL, "[0, 20]", "logprobs"),
    ("completions", '{"model": "%s", "prompt": "hi", "logprobs": true}' % MODEL, "valid integer", "logprobs"),
    ("completions", '{"model": "%s", "prompt": "hi", "max_tokens": 0}' % MODEL, "only with echo", "max_tokens"),
    ("completions", '{"model": "%s", "prompt": "hi", "max_tokens": -1, "echo": true}' % MODEL, "at least 1",
     "max_tokens"),
    ("completions", '{"model": "%s", "prompt": [[1, 2], []]}' % MODEL, "the prompt is empty", "prompt"),
    ("completions", '{"model": "%s", "prompt": [[1, 2], [99999999]]}' % MODEL, "token ids", "prompt"),
    ("completions", '{"model": "%s", "prompt": [[1, 2], ["a"]]}' % MODEL, "valid integer", "prompt"),
    ("completions", '{"model": "%s", "prompt": ["a", "%s"]}' % (MODEL, "word " * 600), "maximum context length",
     "prompt"),
    ("completions", '{"model": "%s", "prompt": "hi", "best_of": 2}' % MODEL, "not supported", "best_of"),
    ("completions", '{"model": "%s", "prompt": "hi", "suffix": "x"}' % MODEL, "not supported", "suffix"),
    ("completions", '{"model": "%s", "prompt": "hi", "stop": %s}' % (MODEL, json.dumps(["s"] * 17)), "up to 16",
     "stop"),
])
def test_bad_input_gets_a_400_naming_the_field(server, path, body, fragment, param):
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    r = httpx.post(server.url + url, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["param"] == param, err
