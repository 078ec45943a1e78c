"""The accuracy harness: the simulated decode path against the real cache, and a quick real run."""

import json

import pytest
import torch

from oscar_kv.artifacts import Rotations
from oscar_kv.cache import CacheSettings, OscarCache, OscarCacheLayer, oscar_attention, unprepare_model
from oscar_kv.codec import LayerCodec
from oscar_kv.evaluate.generation import greedy_continuation, prefill_prompt, step_scores, teacher_forced_scores
from oscar_kv.evaluate.harness import EvalConfig, run_eval
from oscar_kv.evaluate.schemes import KIVI_GROUP, standard_scheme
from oscar_kv.evaluate import simulate
from oscar_kv.evaluate.simulate import simulated_attention_from_forms, simulated_logits, stored_forms
from oscar_kv.evaluate.tasks import stored_cache
from oscar_kv.hf_compat import cache_kwargs
from oscar_kv.models import AttentionGeometry


class FakeAttention(torch.nn.Module):
    layer_idx = 0


@pytest.mark.parametrize("key_axis,block,windows", [("token", 256, (8, 16)), ("channel", 256, (8, 16)),
                                                    ("token", 7, (8, 16)), ("token", 32, (8, 16)),
                                                    ("token", 13, (0, 0)), ("channel", 5, (8, 0))])
def test_simulated_attention_equals_the_cache_layer(key_axis, block, windows, monkeypatch):
    """Same inputs, one token at a time through the real layer vs one simulated pass, with query blocks
    that do and do not align with pages, and without windows (the band then reaches the diagonal)."""
    monkeypatch.setattr(simulate, "QUERY_BLOCK", block)
    g = torch.Generator().manual_seed(3)
    hq, hkv, t, d = 4, 2, 90, 16
    q = torch.randn(1, hq, t, d, generator=g)
    k = torch.randn(1, hkv, t, d, generator=g) * torch.linspace(0.2, 4, d)
    v = torch.randn(1, hkv, t, d, generator=g)
    rot = torch.linalg.qr(torch.randn(hkv, d, d, generator=g, dtype=torch.float64))[0].float()
    settings = CacheSettings("int2", sink_size=windows[0], recent_size=windows[1], page_size=8,
                             window_dtype=torch.float32, key_axis=key_axis)

    def new_layer():
        codec = LayerCodec(2, 8, rot, torch.randn(hkv, d, generator=torch.Generator().manual_seed(1)),
                           torch.full((hkv,), 0.9), torch.full((hkv,), 0.9),
                           key_page=settings.page_size if key_axis == "channel" else None)
        return OscarCacheLayer(settings, codec)

    layer = new_layer()
    outs = []
    for i in range(t):
        layer.update(k[:, :, i:i + 1], v[:, :, i:i + 1])
        outs.append(oscar_attention(FakeAttention(), q[:, :, i:i + 1], layer, layer, None)[0])
    real = torch.cat(outs, 1).transpose(1, 2)
    assert layer.history_len > 0
    sim_layer = new_layer()
    sim = simulated_attention_from_forms(sim_layer, q, stored_forms(sim_layer, k, v))
    assert torch.allclose(real, sim, atol=1e-5), (real - sim).abs().max()


@pytest.mark.parametrize("window", [None, 20])
def test_simulated_attention_keeps_the_layers_window_and_scale(window):
    """A sliding-window layer (Gemma 3) reads only its window, at the model's softmax scale (Gemma's is not D^-0.5):
    the one-pass simulation does the same as the cache stepped token by token."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, t, d = 2, 1, 70, 16
    q = torch.randn(1, hq, t, d, generator=g)
    k = torch.randn(1, hkv, t, d, generator=g) * 2
    v = torch.randn(1, hkv, t, d, generator=g)
    settings = CacheSettings("int2", sink_size=8, recent_size=8, page_size=8, window_dtype=torch.float32)

    def new_layer():
        codec = LayerCodec(3, 8, torch.eye(d)[None], torch.zeros(hkv, d), torch.full((hkv,), 0.95),
                           torch.full((hkv,), 0.95), v_bits=2)
        return OscarCacheLayer(settings, codec, window)

    layer = new_layer()
    outs = []
    for i in range(t):
        layer.update(k[:, :, i:i + 1], v[:, :, i:i + 1])
        outs.append(oscar_attention(FakeAttention(), q[:, :, i:i + 1], layer, layer, None, scaling=0.6)[0])
    real = torch.cat(outs, 1).transpose(1, 2)
    sim_layer = new_layer()
    sim = simulated_attention_from_forms(sim_layer, q, stored_forms(sim_layer, k, v), scaling=0.6)
    assert torch.allclose(real, sim, atol=1e-5), (real - sim).abs().max()
    unscaled = simulated_attention_from_forms(sim_layer, q, stored_forms(sim_layer, k, v))
    assert not torch.allclose(real, unscaled, atol=1e-3)


@torch.no_grad()
def test_simulated_logits_match_real_decoding_on_the_model(model, rotations, held_out_ids):
    ids = held_out_ids[:, :160]
    settings = CacheSettings("int2", sink_size=16, recent_size=32, page_size=8, window_dtype=torch.float32)
    cache = OscarCache(model, rotations, settings)
    outs = [model(ids[:, :40], **cache_kwargs(model, cache)).logits]
    for i in range(40, 160):
        outs.append(model(ids[:, i:i + 1], **cache_kwargs(model, cache)).logits)
    real = torch.cat(outs, 1)
    sim = simulated_logits(model, OscarCache(model, rotations, settings), ids)
    unprepare_model(model)
    exact = model(ids).logits
    # Equal up to float rounding of the model's own matmuls at different batch shapes, which can
    # flip an INT2 code at a rounding boundary now and then (the layer-level test above is exact):
    # the two paths differ by far less than either differs from BF16.
    def kl(p, q):
        lp, lq = torch.log_softmax(p[:, 40:], -1), torch.log_softmax(q[:, 40:], -1)
        return float((lp.exp() * (lp - lq)).sum(-1).mean())

    assert kl(real, sim) < 0.05 * kl(exact, real)
    assert (real.argmax(-1) == sim.argmax(-1)).float().mean() >= 0.98


def test_kivi_accounting_counts_per_channel_metadata():
    geometry = AttentionGeometry("llama", 2, 4, 2, 128)
    oscar = Rotations.data_free(geometry, "hadamard")
    kivi = standard_scheme("kivi-2", geometry, oscar, CacheSettings())
    long = 10**7
    # KIVI's own format, a float16 scale and zero point a group: keys 2 + 32/32 bits, values 2 + 32/128 bits
    assert kivi.bits_per_element(long, geometry) == pytest.approx((3 + 2.25) / 2, abs=1e-3)
    assert kivi.settings.page_size == KIVI_GROUP and kivi.settings.sink_size == 0
    # ours: a float16 scale and an 8-bit zero point, 2 + 24/128 bits
    assert standard_scheme("oscar", geometry, oscar, CacheSettings()).bits_per_element(131072, geometry) == pytest.approx(2.2212, abs=1e-4)
    # the equal-windows comparison: KIVI's 128 BF16 tokens, fewer bits than kivi-2 at every length
    equal = standard_scheme("oscar-w128", geometry, oscar, CacheSettings())
    assert equal.settings.sink_size + equal.settings.recent_size == 128
    for n in (1024, 4096, 131072):
        assert equal.bits_per_element(n, geometry) < kivi.bits_per_element(n, geometry)


def test_quick_eval_on_real_text(model, tokenizer, rotations, tmp_path):
    results = run_eval(model, tokenizer, rotations, EvalConfig.quick(), tmp_path, progress=False)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["context_lengths"] == [1024]
    m = saved["methods"]
    assert set(m) == {"bf16", "naive-int2", "quarot-int2", "oscar"}
    for name in m:
        assert set(m[name]) >= {"bits_per_element", "kl", "ppl", "top1_agreement", "niah"}
        assert list(m[name]["kl"]) == ["1024"]
    print("\nquick eval:", {n: (round(v["kl"]["1024"], 4), v["niah"]["1024"]) for n, v in m.items()})
    assert m["oscar"]["kl"]["1024"] < m["naive-int2"]["kl"]["1024"]
    assert m["oscar"]["kl"]["1024"] < m["quarot-int2"]["kl"]["1024"]
    assert m["bf16"]["niah"]["1024"] == 1.0
    # KL by position bin: positions [512, 1024) are scored, so one bin, equal to the mean
    for name in m:
        assert m[name]["kl_by_position"]["1024"] == pytest.approx({"1024": m[name]["kl"]["1024"]}, rel=1e-6)
    assert (tmp_path / "results.md").is_file() and (tmp_path / "kl_vs_context.png").is_file()
    # (320 * 16 + 704 * mean stored bits of the artifact's widths) / 1024: every side at its own width
    from oscar_kv.memory import bits_per_element

    widths = dict(k_bits=rotations.k_bits.tolist(), v_bits=rotations.v_bits.tolist())
    assert results["methods"]["oscar"]["bits_per_element"]["1024"] == pytest.approx(
        bits_per_element(1024, 64, 64, **widths), abs=1e-3)
    # naive INT2: (320 * 16 + 704 * (2 + 24 / 64)) / 1024
    assert results["methods"]["naive-int2"]["bits_per_element"]["1024"] == pytest.approx(6.6328, abs=1e-3)


def test_eval_rejects_bad_config():
    with pytest.raises(ValueError, match="unknown tasks"):
        EvalConfig(tasks=["kl", "mmlu"])
    with pytest.raises(ValueError, match="at least 64"):
        EvalConfig(context_lengths=[16])


def test_a_text_shorter_than_the_context_names_the_longer_source(model, tokenizer, rotations, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("A few hundred words of text. " * 60)
    config = EvalConfig(methods=["bf16"], tasks=["kl"], context_lengths=[1024], text=str(short), ablations=False)
    with pytest.raises(ValueError, match="fewer than the context length 1024; --text stdlib:"):
        run_eval(model, tokenizer, rotations, config, tmp_path / "out", progress=False)


def test_needles_through_the_serving_engine_agree_with_the_reference_path(model, tokenizer, rotations, tmp_path):
    """`eval --served`: the same needle prompts through LLMEngine (one-chunk haystack, then the question as a
    prefix-cache hit) for bf16 and oscar, rows <name>@engine beside the reference rows."""
    config = EvalConfig(methods=["bf16", "oscar"], tasks=["niah"], context_lengths=[1024], niah_samples=2,
                        ablations=False, served=True)
    results = run_eval(model, tokenizer, rotations, config, tmp_path, progress=False)
    m = results["methods"]
    assert set(m) == {"bf16", "oscar", "bf16@engine", "oscar@engine"}
    answers = {n: m[f"{n}@engine"]["niah_answers"]["1024"] for n in ("bf16", "oscar")}
    print("\nserved answers:", answers, {n: v["niah"]["1024"] for n, v in m.items()})
    assert all(len(a) == 2 for a in answers.values())
    assert m["bf16@engine"]["niah"]["1024"] == m["bf16"]["niah"]["1024"] == 1.0
    assert m["oscar@engine"]["niah"]["1024"] == m["oscar"]["niah"]["1024"]
    assert "oscar@engine" in (tmp_path / "results.md").read_text()


def test_needle_answer_scores_beside_the_greedy_answers(model, tokenizer, rotations, tmp_path):
    """NIAH's teacher-forced answer scores (tasks.answer_log_probs): where BF16's greedy answer is the needle, the
    expected answer's tokens are its argmax at every teacher-forced position; BF16 against itself has answer KL 0;
    INT2 without rotation moves the answer more than OSCAR; the harness reports both scores for both tasks."""
    from oscar_kv.evaluate import tasks
    from oscar_kv.evaluate.harness import evaluation_text

    geometry = AttentionGeometry.of(model.config)
    prompt = tasks.niah_prompt(tokenizer, evaluation_text(None)[:40000], 1024, 0.3, "4827361")
    kv = tasks.haystack_kv(model, prompt.haystack)
    bf16 = standard_scheme("bf16", geometry, rotations, CacheSettings())
    answer = tokenizer(" " + prompt.answer, add_special_tokens=False).input_ids
    assert "4827361" in tasks.niah_answer(model, tokenizer, bf16, kv, prompt.question)
    log_probs = tasks.answer_log_probs(model, bf16, kv, prompt.question, answer)
    assert log_probs.shape == (len(answer), model.config.vocab_size)
    assert log_probs.argmax(-1).tolist() == answer
    assert tasks.needle_scores(log_probs, answer, log_probs) == {
        "answer_nll": pytest.approx(float(-log_probs.gather(-1, torch.tensor(answer)[:, None]).sum())),
        "answer_kl": pytest.approx(0.0, abs=1e-6)}

    config = EvalConfig(methods=["bf16", "naive-int2", "oscar"], tasks=["niah", "niah_multikey"],
                        context_lengths=[1024], niah_samples=2, ablations=False)
    m = run_eval(model, tokenizer, rotations, config, tmp_path, progress=False)["methods"]
    print("\nanswer KL / NLL:", {n: (round(r["niah_multikey_answer_kl"]["1024"], 4),
                                   round(r["niah_multikey_answer_nll"]["1024"], 3)) for n, r in m.items()})
    for row in m.values():
        assert {"niah_answer_kl", "niah_answer_nll", "niah_multikey_answer_kl", "niah_multikey_answer_nll"} <= set(row)
    assert m["bf16"]["niah_multikey_answer_kl"]["1024"] == pytest.approx(0.0, abs=1e-6)
    assert m["naive-int2"]["niah_multikey_answer_kl"]["1024"] > m["oscar"]["niah_multikey_answer_kl"]["1024"] > 0
    assert "multi-key answer KL" in (tmp_path / "results.md").read_text()


def test_served_answers_refuse_a_scheme_the_engine_does_not_serve(model, tokenizer, rotations):
    from oscar_kv.evaluate.served import served_answers

    with pytest.raises(ValueError, match="the engine serves"):
        served_answers(model, tokenizer, rotations, "kivi-2", [])


# ---- long generation (eval --tasks longgen) --------------------------------------------------------
# These run last in the module: one_torch_thread keeps a single thread until the module ends.
def test_long_generation_in_the_harness(model, tokenizer, rotations, tmp_path, one_torch_thread):
    """`eval --tasks longgen`: BF16 against itself is exact (KL ~ 0, every token agrees), INT2 without rotation
    is not, and every row has the four scores and the report shows them."""
    gen = 16
    config = EvalConfig(methods=["bf16", "naive-int2", "oscar"], tasks=["longgen"], context_lengths=[512],
                        gen_tokens=gen, ablations=False)
    results = run_eval(model, tokenizer, rotations, config, tmp_path, progress=False)
    m = json.loads((tmp_path / "results.json").read_text())["methods"]
    assert m == json.loads(json.dumps(results["methods"]))
    print("\nlonggen:", {n: (round(v["gen_kl"]["512"], 5), v["gen_first_divergence"]["512"]) for n, v in m.items()})
    for name, row in m.items():
        assert set(row) >= {"gen_kl", "gen_top1", "gen_first_divergence", "gen_agreement"}
        assert 1 <= row["gen_first_divergence"]["512"] <= gen  # the first token is the exact prefill's
        assert row["gen_agreement"]["512"] == row["gen_first_divergence"]["512"] / gen
    assert m["bf16"]["gen_kl"]["512"] < 1e-4  # the simulation against the real BF16 cache it stands for
    assert m["bf16"]["gen_first_divergence"]["512"] == gen and m["bf16"]["gen_top1"]["512"] == 1.0
    assert m["naive-int2"]["gen_kl"]["512"] > 0.01
    assert m["oscar"]["gen_kl"]["512"] < m["naive-int2"]["gen_kl"]["512"]
    assert "gen KL vs bf16" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "gen_kl_vs_context.png").is_file()


@torch.no_grad()
def test_teacher_forced_continuation_matches_stepping_the_cache(model, rotations, held_out_ids, one_torch_thread):
    """gen_kl's shortcut, proven: one simulated forward of BF16's continuation over the stored prompt gives the
    per-step KL that feeding the same tokens one at a time through the real cache gives.  540 prompt tokens put
    a page migration 4 steps into the continuation for both the OSCAR-style windows and KIVI-2's."""
    geometry = AttentionGeometry.of(model.config)
    base = CacheSettings("int2", 64, 256, 16)
    prompt = prefill_prompt(model, held_out_ids[:, :540])
    reference = greedy_continuation(model, standard_scheme("bf16", geometry, rotations, base), prompt, 10)
    assert len(reference.tokens) == 10 and reference.hidden.shape[0] == 9
    for name in ("naive-int2", "kivi-2"):
        scheme = standard_scheme(name, geometry, rotations, base)
        simulated, simulated_top1 = teacher_forced_scores(model, scheme, prompt, reference)
        cache = stored_cache(model, scheme, prompt.kv)
        stepped = torch.stack([model.model(torch.tensor([[t]]), **cache_kwargs(model.model, cache))
                               .last_hidden_state[0, -1] for t in reference.tokens[:-1]])
        real, real_top1 = step_scores(model, reference.hidden, stepped)
        print(f"\n{name} per-step KL, simulated / stepped:", [(round(float(a), 4), round(float(b), 4))
                                                            for a, b in zip(simulated, real)])
        assert cache.layers[0].history_len > 0 and float(real.mean()) > 0.01
        # equal up to float rounding that can flip an INT2 code now and then (see the test on the model above)
        assert torch.allclose(simulated, real, rtol=0.1, atol=2e-4)
        assert abs(float(simulated.mean() - real.mean())) < 0.03 * float(real.mean())
        assert int((simulated_top1 != real_top1).sum()) <= 1  # a near-tie may fall either way


def test_kl_by_position_bins_are_powers_of_two():
    from oscar_kv.evaluate.tasks import _add_to_bins

    bins: dict = {}
    _add_to_bins(bins, torch.arange(10.0), 1)  # positions 1..10
    _add_to_bins(bins, torch.ones(3), 11)  # positions 11..13, a second chunk
    assert bins == {2: [0.0, 1], 4: [3.0, 2], 8: [18.0, 4], 16: [24.0 + 3.0, 6]}
