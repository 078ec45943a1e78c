"""Long-context accuracy tooling: needle prompts, the stored-haystack path against the real cache, the
serving-semantics error that calibration fits clips on, and the held-back probe."""

import re
from dataclasses import replace

import pytest
import torch

from oscar_kv.activations import LayerSample, clip_candidate_errors, quantized_attention_error
from oscar_kv.cache import CacheSettings, unprepare_model
from oscar_kv.calibration_text import split_probe
from oscar_kv.corpus import DEFAULT_CORPUS
from oscar_kv.evaluate import needle, tasks
from oscar_kv.evaluate.schemes import standard_scheme
from oscar_kv.hf_compat import cache_kwargs
from oscar_kv.models import AttentionGeometry

FILLER = DEFAULT_CORPUS.read_text()[300_000:310_000]


def test_needle_prompts_know_where_their_needles_are(tokenizer):
    single = tasks.niah_prompt(tokenizer, FILLER, 600, 0.5, "4815162")
    (a, b), = single.spans
    assert "4815162" in tokenizer.decode(single.haystack[a:b])
    assert 500 < len(single.haystack) + len(single.question) <= 600
    assert single.question[-3:] == tokenizer(tasks.ANSWER_PREFIX, add_special_tokens=False).input_ids[-3:]

    multi = tasks.multikey_prompt(tokenizer, FILLER, 800, seed=7)
    assert len(multi.spans) == 4 and multi.spans == sorted(multi.spans)
    texts = [tokenizer.decode(multi.haystack[a:b]) for a, b in multi.spans]
    numbers = [re.search(r"\d{7}", t).group() for t in texts]
    assert multi.answer == numbers[multi.target]
    asked = re.search(r"magic number for ([a-z-]+)", tokenizer.decode(multi.question)).group(1)
    assert asked in texts[multi.target]


@torch.no_grad()
def test_stored_haystack_answers_as_the_cache_does(model, tokenizer, rotations):
    """The question's logits through the stored haystack (rotations undone, unprepared model) equal the
    logits through the scheme's real cache, for OSCAR (per-position centering, INT2 history) and KIVI-2."""
    geometry = AttentionGeometry.of(model.config)
    prompt = tasks.niah_prompt(tokenizer, FILLER, 700, 0.3, "2718281")
    kv = tasks.haystack_kv(model, prompt.haystack)
    base = CacheSettings("int2", sink_size=16, recent_size=64, page_size=16, window_dtype=torch.float32)
    for name in ("oscar", "kivi-2"):
        scheme = standard_scheme(name, geometry, rotations, base)
        cache = tasks.stored_cache(model, scheme, kv)
        assert cache.layers[0].history_len > 300
        ids = torch.tensor([prompt.question])
        real = model(ids, **cache_kwargs(model, cache)).logits[0].float()
        stored = needle.stored_haystack(model, scheme, kv, len(prompt.question))
        assert stored.history == (scheme.settings.sink_size, scheme.settings.sink_size + cache.layers[0].history_len)
        with needle.attention_override(model, needle.ANSWER_KEY, needle._stored_attention, stored, needle._active):
            mine = model(ids, **cache_kwargs(model, needle._stored_cache(model, stored))).logits[0].float()
        assert torch.allclose(real, mine, atol=2e-3, rtol=1e-3), (real - mine).abs().max()
    unprepare_model(model)


@torch.no_grad()
def test_head_report_and_answer_score(model, tokenizer, rotations):
    geometry = AttentionGeometry.of(model.config)
    prompt = tasks.niah_prompt(tokenizer, FILLER, 700, 0.5, "1414213")
    kv = tasks.haystack_kv(model, prompt.haystack)
    base = CacheSettings("int2", sink_size=16, recent_size=64, page_size=16)
    exact = needle.stored_haystack(model, standard_scheme("bf16", geometry, rotations, base), kv)
    oscar = needle.stored_haystack(model, standard_scheme("oscar", geometry, rotations, base), kv)
    queries = needle.answering_queries(model, prompt)
    same = needle.head_report(queries, exact, exact.mixed(oscar, values_from_other=False), prompt)
    assert torch.equal(same["needle_exact"], same["needle_stored"]) and float(same["out_error"].max()) == 0
    rep = needle.head_report(queries, exact, oscar, prompt)
    assert rep["needle_exact"].shape == (geometry.num_layers, geometry.num_attention_heads)
    assert float(rep["delta_std"].mean()) > 0 and float(rep["out_error"].mean()) > 0
    # keys from the exact store, values from OSCAR's: the logits are exact, the outputs are not
    values_only = needle.head_report(queries, exact, exact.mixed(oscar, values_from_other=True), prompt)
    assert float(values_only["delta_std"].abs().max()) == 0 and float(values_only["out_error"].mean()) > 0
    # a bias of -sigma^2/2 on the history logits lowers its mass
    biased = needle.head_report(queries, exact, replace(oscar, logit_bias=needle.variance_bias(rep, geometry.num_kv_heads)),
                                prompt)
    assert float(biased["history_stored"].mean()) < float(rep["history_stored"].mean())
    score = needle.answer_score(model, tokenizer, exact, prompt)
    assert score.hit and score.first_digit_correct and score.nll < 1.0


def _sample(t=300, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return LayerSample(torch.randn(hq, t, d, generator=g), torch.randn(hkv, t, d, generator=g) * 2,
                       torch.randn(hkv, t, d, generator=g))


def test_quantized_attention_error_follows_the_serving_windows():
    s = _sample()
    eye = torch.eye(16).expand(1, 16, 16)
    zeros = torch.zeros(2, 16)
    clip = torch.ones(2)

    def err(**kw):
        return quantized_attention_error(s, eye, eye, zeros, zeros, clip, clip, group_size=16, **kw)

    assert err(recent_size=400) < 1e-6  # every key inside the recent window: exact
    assert err(sink_size=400) < 1e-6
    full, windowed = err(sink_size=8), err(sink_size=8, recent_size=64)
    assert full > 0.05 and 0 < windowed < full  # fewer INT2 keys, smaller error
    assert err(sink_size=8, recent_size=64, queries=32) > 0  # the last queries only


def test_split_probe_holds_back_text_after_the_fitting_sequences(tokenizer):
    texts = [DEFAULT_CORPUS.read_text()[:60_000]]
    sequences, probe = split_probe(tokenizer, texts, 256, 4, 600)
    assert len(sequences) == 4 and all(s.shape == (1, 256) for s in sequences)
    assert probe.shape == (1, 600)
    joined = torch.cat(sequences, 1)[0].tolist()
    assert probe[0, :50].tolist() not in [joined[i:i + 50] for i in range(len(joined) - 50)]
    with pytest.raises(ValueError, match="too short"):  # one sequence: nothing left to hold back
        split_probe(tokenizer, [DEFAULT_CORPUS.read_text()[:1500]], 256, 4, 600)


@pytest.mark.parametrize("which", ["k", "v"])
def test_batched_clip_errors_rank_candidates_as_the_layer_error_does(which):
    """clip_candidate_errors (one head, all candidates at once) differs from the whole layer's squared error
    by the same constant for every candidate: the other heads do not depend on this head's clip."""
    s = _sample(t=400, hq=6, hkv=2, d=16, seed=3)
    g = torch.Generator().manual_seed(5)
    rk = torch.linalg.qr(torch.randn(2, 16, 16, generator=g, dtype=torch.float64))[0].float()
    rv = torch.linalg.qr(torch.randn(2, 16, 16, generator=g, dtype=torch.float64))[0].float()
    k_off, v_mean = torch.randn(2, 16, generator=g), torch.randn(2, 16, generator=g)
    candidates = torch.tensor([1.0, 0.95, 0.9, 0.8])
    kw = dict(group_size=8, sink_size=16, recent_size=64, queries=100)
    batched = clip_candidate_errors(s, 1, rk, rv, k_off, v_mean, which, candidates, 2, **kw)
    exact_norm2 = float((torch.softmax((torch.einsum("hqd,hkd->hqk", s.q[:, -100:], s.k.repeat_interleave(3, 0)) / 4)
                                       .masked_fill(torch.arange(400)[None, :] > torch.arange(300, 400)[:, None],
                                                    float("-inf")), -1) @ s.v.repeat_interleave(3, 0)).norm() ** 2)
    layer = []
    for c in candidates.tolist():
        clips = {"k_clip": torch.tensor([0.9, c]) if which == "k" else torch.ones(2),
                 "v_clip": torch.tensor([0.9, c]) if which == "v" else torch.ones(2)}
        e = quantized_attention_error(s, rk, rv, k_off, v_mean, bits=2, quantize_keys=which == "k",
                                      quantize_values=which == "v", **clips, **kw)
        layer.append(e ** 2 * exact_norm2)
    layer = torch.tensor(layer)
    assert torch.allclose(layer - layer[0], batched - batched[0], rtol=1e-3, atol=1e-4 * float(layer[0]))
    assert int(layer.argmin()) == int(batched.argmin())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_generate_cache_migrates_to_int2_on_cuda(smol, rotations):
    """On CUDA the cache quantizes with per-head clip ratios that live on the CPU (once a device-mismatch crash)."""
    from oscar_kv.cache import OscarCache

    lm, _ = smol
    lm.cuda()
    try:
        cache = OscarCache(lm, rotations, CacheSettings("int2", sink_size=16, recent_size=32, page_size=16))
        ids = torch.randint(0, 1000, (1, 120), device="cuda")
        out = lm(ids, **cache_kwargs(lm, cache)).logits
        out = lm(ids[:, :1], **cache_kwargs(lm, cache)).logits
        assert cache.layers[0].history_len > 0 and torch.isfinite(out).all()
    finally:
        unprepare_model(lm)
        lm.cpu()


def test_clip_candidates_in_chunks_equal_one_batch(monkeypatch):
    import oscar_kv.activations as act

    s = _sample(t=200, hq=4, hkv=2, d=16, seed=9)
    eye = torch.eye(16).expand(1, 16, 16)
    args = (s, 0, eye, eye, torch.zeros(2, 16), torch.zeros(2, 16), "k", torch.tensor([1.0, 0.9, 0.8]), 2, 8, 8)
    whole = clip_candidate_errors(*args)
    monkeypatch.setattr(act, "CANDIDATE_BATCH_ELEMENTS", 2 * 200 * 200)  # one candidate per chunk
    assert torch.allclose(clip_candidate_errors(*args), whole)
