"""The accuracy harness: the simulated decode path against the real cache, and a quick real run."""

import json

import pytest
import torch

from oscar_kv.artifacts import Rotations
from oscar_kv.cache import CacheSettings, OscarCache, OscarCacheLayer, oscar_attention, unprepare_model
from oscar_kv.codec import LayerCodec
from oscar_kv.evaluate.harness import EvalConfig, run_eval
from oscar_kv.evaluate.schemes import KIVI_GROUP, standard_scheme
from oscar_kv.evaluate import simulate
from oscar_kv.evaluate.simulate import simulated_attention_from_forms, simulated_logits, stored_forms
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


@torch.no_grad()
def test_simulated_logits_match_real_decoding_on_the_model(model, rotations, held_out_ids):
    ids = held_out_ids[:, :160]
    settings = CacheSettings("int2", sink_size=16, recent_size=32, page_size=8, window_dtype=torch.float32)
    cache = OscarCache(model, rotations, settings)
    outs = [model(ids[:, :40], past_key_values=cache).logits]
    for i in range(40, 160):
        outs.append(model(ids[:, i:i + 1], past_key_values=cache).logits)
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
    # keys: 2 + 32/32 bits, values: 2 + 32/128 bits
    assert kivi.bits_per_element(long, geometry) == pytest.approx((3 + 2.25) / 2, abs=1e-3)
    assert kivi.settings.page_size == KIVI_GROUP and kivi.settings.sink_size == 0
    assert standard_scheme("oscar", geometry, oscar, CacheSettings()).bits_per_element(131072, geometry) == pytest.approx(2.2836, abs=1e-4)
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
    assert (tmp_path / "results.md").is_file() and (tmp_path / "kl_vs_context.png").is_file()
    assert results["methods"]["oscar"]["bits_per_element"]["1024"] == pytest.approx(6.7188, abs=1e-3)


def test_eval_rejects_bad_config():
    with pytest.raises(ValueError, match="unknown tasks"):
        EvalConfig(tasks=["kl", "mmlu"])
    with pytest.raises(ValueError, match="at least 64"):
        EvalConfig(context_lengths=[16])


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


def test_served_answers_refuse_a_scheme_the_engine_does_not_serve(model, tokenizer, rotations):
    from oscar_kv.evaluate.served import served_answers

    with pytest.raises(ValueError, match="the engine serves"):
        served_answers(model, tokenizer, rotations, "kivi-2", [])
