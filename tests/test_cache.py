"""The INT2 cache on the real SmolLM2 model: equivalences, storage, accuracy against baselines."""

import copy

import pytest
import torch
from transformers import DynamicCache

from oscar_kv.artifacts import ArtifactError, Rotations
from oscar_kv.cache import CacheSettings, OscarCache, unprepare_model
from oscar_kv.calibrate import error_table, format_error_table
from oscar_kv.activations import capture_samples
from oscar_kv.folding import fold_values
from oscar_kv.hf_compat import cache_kwargs
from oscar_kv.memory import bits_per_element
from oscar_kv.models import AttentionGeometry

FP32 = dict(window_dtype=torch.float32)


def chunked_logits(model, cache, ids, prefill, step=1):
    """Prefill ``prefill`` tokens, then feed the rest ``step`` tokens at a time (decode semantics)."""
    outs = [model(ids[:, :prefill], **cache_kwargs(model, cache)).logits]
    for i in range(prefill, ids.shape[1], step):
        outs.append(model(ids[:, i:i + step], **cache_kwargs(model, cache)).logits)
    return torch.cat(outs, 1)


def kl_and_top1(ref, out):
    lp, lq = torch.log_softmax(ref.float(), -1), torch.log_softmax(out.float(), -1)
    kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
    return kl, float((ref.argmax(-1) == out.argmax(-1)).float().mean())


@torch.no_grad()
def test_bf16_mode_reproduces_dynamic_cache(model, held_out_ids):
    ids = held_out_ids[:, :400]
    ref = chunked_logits(model, DynamicCache(config=model.config), ids, 380)
    out = chunked_logits(model, OscarCache(model, None, CacheSettings("bf16", **FP32)), ids, 380)
    assert (out - ref).abs().max() < 1e-3
    assert torch.allclose(torch.softmax(out, -1), torch.softmax(ref, -1), atol=1e-4)


@torch.no_grad()
def test_int2_with_windows_covering_everything_equals_bf16(model, rotations, held_out_ids):
    ids = held_out_ids[:, :300]
    ref = chunked_logits(model, OscarCache(model, None, CacheSettings("bf16", **FP32)), ids, 280)
    unprepare_model(model)
    cache = OscarCache(model, rotations, CacheSettings("int2", sink_size=64, recent_size=512, **FP32))
    out = chunked_logits(model, cache, ids, 280)
    assert cache.layers[0].history_len == 0
    assert torch.allclose(torch.softmax(out, -1), torch.softmax(ref, -1), atol=1e-4)


@torch.no_grad()
def test_folding_the_value_rotation_leaves_logits_unchanged(model, rotations, held_out_ids):
    ids = held_out_ids[:, :64]
    before = model(ids).logits
    fold_values(model, rotations.v_rotation, rotations.v_mean)
    assert not torch.allclose(model.model.layers[0].self_attn.v_proj.weight, model._oscar_original_weights[0][0])
    after = model(ids).logits  # plain SDPA over the folded model
    assert (after - before).abs().max() < 1e-3
    unprepare_model(model)
    assert torch.equal(model(ids).logits, before)


@torch.no_grad()
def test_int2_storage_holds_codes_not_a_hidden_copy(model, rotations, held_out_ids):
    ids = held_out_ids[:, :700]
    cache = OscarCache(model, rotations)  # BF16 windows, INT2 history
    model(ids, **cache_kwargs(model, cache))
    for _ in range(20):
        model(ids[:, :1], **cache_kwargs(model, cache))
    layer = cache.layers[5]
    s = cache.settings
    assert layer.sink_k.shape[2] == s.sink_size and layer.sink_k.dtype == torch.bfloat16
    assert s.recent_size <= layer.recent_k.shape[2] < s.recent_size + s.page_size
    assert layer.history_len + layer.sink_k.shape[2] + layer.recent_k.shape[2] == 720
    assert layer.history_len % s.page_size == 0
    # each side's codes at the layer's own width (the calibration's key widths, values at 2 bits)
    k_bits, v_bits = rotations.side_bits(5)
    assert layer.hist_k.codes.dtype == torch.uint8 and layer.hist_k.codes.shape[-1] == 64 * k_bits // 8
    assert layer.hist_v.codes.shape[-1] == 64 * v_bits // 8
    assert layer.chunk is None  # the forward's exact K/V are dropped after attention
    g = AttentionGeometry.of(model.config)
    expected = bits_per_element(720, g.head_dim, rotations.group_size, recent_size=layer.recent_k.shape[2],
                                k_bits=rotations.k_bits.tolist(), v_bits=rotations.v_bits.tolist())
    assert cache.footprint().bits_per_element == pytest.approx(expected, rel=1e-6)


@torch.no_grad()
def test_five_bit_keys_store_five_eighths_of_a_row(model, rotations, held_out_ids):
    """Keys at 5 bits (allocation.KEY_WIDTHS): 5D/8 code bytes a row in the history, codes up to 31 (an INT4 plane and
    a high-bit plane, quant.py), and logits nearer BF16's than with every key at 2 bits."""
    from oscar_kv.quant import unpack_codes

    ids = held_out_ids[:, :400]
    settings = dict(sink_size=32, recent_size=64)
    ref = model(ids).logits[:, 340:]
    kl = {}
    for k_bits in (2, 5):
        rot = copy.deepcopy(rotations)
        rot.set_bits(k_bits, 2)
        cache = OscarCache(model, rot, CacheSettings("int2", **settings))
        kl[k_bits] = kl_and_top1(ref, chunked_logits(model, cache, ids, 340, step=4)[:, 340:])[0]
        layer = cache.layers[3]
        assert layer.hist_k.codes.shape[-1] == 64 * k_bits // 8 and layer.hist_v.codes.shape[-1] == 16
        assert int(unpack_codes(layer.hist_k.codes, k_bits).max()) == (1 << k_bits) - 1
        unprepare_model(model)
    print("\nKL vs BF16, every key at 2 and at 5 bits:", kl)
    assert kl[5] < kl[2] / 4, kl


@torch.no_grad()
def test_oscar_cache_beats_hadamard_and_naive_int2(model, rotations, held_out_ids):
    """Teacher-forced next-token KL vs BF16 over positions 512..1087, real cache, 16-token steps."""
    ids = held_out_ids
    ref = model(ids).logits[:, 511:]
    g = AttentionGeometry.of(model.config)
    schemes = {"naive": Rotations.data_free(g, "identity"), "quarot": Rotations.data_free(g, "hadamard"),
               "oscar": rotations}
    results = {}
    for name, rot in schemes.items():
        out = chunked_logits(model, OscarCache(model, rot), ids, 512, step=16)[:, 511:]
        results[name] = kl_and_top1(ref, out)
        unprepare_model(model)
    print("\nKL / top-1 vs BF16 at 1088 tokens:", {k: (round(a, 4), round(b, 3)) for k, (a, b) in results.items()})
    kl = {k: v[0] for k, v in results.items()}
    assert kl["oscar"] * 3 < kl["quarot"]
    assert kl["oscar"] * 20 < kl["naive"]
    assert results["oscar"][1] >= 0.9


@torch.no_grad()
def test_per_layer_attention_error_is_lowest_with_oscar(model, rotations, held_out_ids):
    probe = capture_samples(model, held_out_ids[:, :1024])
    table = error_table(rotations, probe)
    print("\nINT2 attention relative error per layer (held-out 1024 tokens):\n" + format_error_table(table))
    mean = {k: sum(v) / len(v) for k, v in table.items()}
    assert mean["oscar"] < mean["hadamard"] < mean["identity"]
    wins = sum(o < h for o, h in zip(table["oscar"], table["hadamard"]))
    assert wins >= 0.9 * len(table["oscar"])


@torch.no_grad()
def test_generate_through_the_cache(model, tokenizer, rotations):
    from oscar_kv.generation import build_prompt

    ids = build_prompt(tokenizer, "What is the capital of France?")
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    mine = model.generate(ids, **cache_kwargs(model, OscarCache(model, None, CacheSettings("bf16", **FP32))),
                          max_new_tokens=12, do_sample=False)
    assert torch.equal(plain, mine)
    unprepare_model(model)
    out = model.generate(ids, **cache_kwargs(model, OscarCache(model, rotations)), max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_artifact_for_another_model_is_refused(model):
    other = AttentionGeometry("llama", num_layers=30, num_attention_heads=9, num_kv_heads=3, head_dim=128)
    with pytest.raises(ArtifactError, match="another model"):
        OscarCache(model, Rotations.data_free(other, "hadamard"))


def test_bad_settings_are_refused(model):
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'bf16', 'int2', 'int4' or 'int8', got 'int3'"):
        CacheSettings("int3")
    with pytest.raises(ValueError, match="page_size must be at least 1"):
        CacheSettings(page_size=0)
    with pytest.raises(ValueError, match="key_axis must be 'token' or 'channel'"):
        CacheSettings(key_axis="row")


def test_the_cache_quantizes_in_the_group_size_it_is_given(model, rotations):
    """group_size is a CacheConfig field: the generate() cache honours it as the engine does."""
    from oscar_kv.errors import ConfigError

    cache = OscarCache(model, rotations, CacheSettings(group_size=32))
    assert {layer.codec.group_size for layer in cache.layers} == {32}
    assert {layer.codec.group_size for layer in OscarCache(model, rotations).layers} == {rotations.group_size}
    with pytest.raises(ConfigError) as info:
        OscarCache(model, rotations, CacheSettings(group_size=48))
    assert info.value.fields == ("group_size",) and "must divide the head dim 64" in str(info.value)


def test_codecs_hold_contiguous_key_rotations(model, rotations):
    """An artifact built in memory may hold column-major rotations (linalg.qr's Q): the codecs keep them
    contiguous, or the write kernel would copy R_K per layer and decode step (benchmarks/NOTES.md, run E11)."""
    from dataclasses import replace

    from oscar_kv.codec import layer_codecs

    strided = replace(rotations, k_rotation=rotations.k_rotation.transpose(-1, -2).contiguous().transpose(-1, -2))
    assert not strided.k_rotation[0].is_contiguous()
    for codec, want in zip(layer_codecs(model, strided, "int2"), rotations.k_rotation):
        assert codec.k_rotation.is_contiguous() and torch.equal(codec.k_rotation, want.float())


@pytest.mark.parametrize("key_axis", ["token", "channel"])
def test_a_range_of_positions_reads_only_its_rows(key_axis):
    """``segments(lo, end)``, what a sliding-window layer reads, is ``segments_before(end)`` from position lo on:
    across the sink, the INT2 history (whole key pages per channel for KIVI-style keys) and the recent window."""
    from oscar_kv.cache import OscarCacheLayer
    from oscar_kv.codec import LayerCodec

    g = torch.Generator().manual_seed(0)
    hkv, d = 2, 16
    settings = CacheSettings("int2", sink_size=8, recent_size=16, page_size=8, key_axis=key_axis, **FP32)
    codec = LayerCodec(2, 8, torch.eye(d).expand(hkv, d, d), torch.zeros(hkv, d), torch.full((hkv,), 0.9),
                       torch.full((hkv,), 0.9), key_page=8 if key_axis == "channel" else None)
    layer = OscarCacheLayer(settings, codec, window=20)
    for _ in range(9):
        layer.update(torch.randn(1, hkv, 7, d, generator=g), torch.randn(1, hkv, 7, d, generator=g))
    assert layer.history_len >= 32 and layer.seq_len == 63
    whole = [torch.cat(parts, 2) for parts in layer.segments_before(60)]
    for lo, end in ((0, 60), (5, 60), (8, 41), (13, 19), (37, 60), (50, 63), (60, 60)):
        ks, vs = layer.segments(lo, end)
        assert sum(k.shape[2] for k in ks) == end - lo
        if end > lo and end <= 60:
            assert torch.equal(torch.cat(ks, 2), whole[0][:, :, lo:end])
            assert torch.equal(torch.cat(vs, 2), whole[1][:, :, lo:end])
