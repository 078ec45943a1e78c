"""Split key widths (quant.SplitWidth, ``calibrate --key-formats split``): the quantizer, the rotation, the artifact,
the bit count, the widening paths, the generate() cache, calibration, the serving engine (torch and Triton paths)."""

import dataclasses
import os

import pytest
import torch

from oscar_kv.allocation import WidthChoice, allocate_key_widths, split_widths, stored_bits, widening_paths
from oscar_kv.artifacts import ArtifactError, Rotations
from oscar_kv.cache import OscarCacheLayer, CacheSettings, oscar_attention
from oscar_kv.calibration_settings import CalibrationSettings
from oscar_kv.codec import LayerCodec
from oscar_kv.errors import ConfigError
from oscar_kv.evaluate.simulate import simulated_attention_from_forms, stored_forms
from oscar_kv.memory import bits_per_element
from oscar_kv.quant import (SplitRows, SplitWidth, cat_rows, dequantize_split, fake_quantize, quantize_rows,
                            quantize_split)
from oscar_kv.rotation import compose_split, orthogonality_error, spread_hadamard
from oscar_kv.width_choice import cheapest_meeting


def test_a_split_row_is_its_two_parts_quantized_each_as_one_group():
    x = torch.randn(3, 2, 5, 64, generator=torch.Generator().manual_seed(0)) * torch.linspace(3, 0.2, 64)
    w = SplitWidth(2, 16, 4)
    q = quantize_split(x, w, 0.95, 0.5)
    assert isinstance(q, SplitRows) and q.width == w
    assert q.hi.codes.shape[-1] == 16 * 4 // 8 and q.lo.codes.shape[-1] == 48 * 2 // 8
    assert q.hi.scale.shape[-1] == 1 and q.lo.scale.shape[-1] == 1
    expect = torch.cat([fake_quantize(x[..., :16], 4, 16, 0.95, 0.5), fake_quantize(x[..., 16:], 2, 48, 0.95, 0.5)], -1)
    assert torch.equal(dequantize_split(q), expect)
    # the wide part is the more exact one, the whole row closer than at the narrow width alone
    err = (dequantize_split(q) - x).pow(2)
    assert err[..., :16].mean() < err[..., 16:].mean()
    assert q.nbytes() == quantize_rows(x[..., :16], 4, 16).nbytes() + quantize_rows(x[..., 16:], 2, 48).nbytes()


def test_split_rows_select_and_join_along_tokens():
    x = torch.randn(1, 2, 10, 32, generator=torch.Generator().manual_seed(1))
    w = SplitWidth(3, 8, 5)
    whole = quantize_split(x, w)
    joined = cat_rows(quantize_split(x[:, :, :4], w), quantize_split(x[:, :, 4:], w), 2)
    assert torch.equal(dequantize_split(joined), dequantize_split(whole))
    index = (slice(None), slice(None), slice(2, 7))
    assert torch.equal(dequantize_split(whole.select(index)), dequantize_split(whole)[:, :, 2:7])


@pytest.mark.parametrize("bad", [SplitWidth(2, 0, 4), SplitWidth(2, 64, 4), SplitWidth(4, 16, 4),
                                 SplitWidth(2, 16, 4).__class__(3, 12, 5)])
def test_a_split_that_cannot_be_stored_is_refused(bad):
    with pytest.raises(ConfigError):
        bad.check(64)


def test_the_split_menu_packs_at_every_supported_head_dim():
    for d in (64, 128, 256):
        menu = split_widths(d)
        assert menu and {w.hi_dims for w in menu} == {d // 8, d // 4, d // 2}
        for w in menu:
            w.check(d)


def test_the_split_rotation_keeps_the_top_directions_in_the_first_channels():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(64, 64, generator=g, dtype=torch.float64)
    cov = a @ a.T
    r, lam = compose_split(cov, 64, 16)
    assert orthogonality_error(r) < 1e-12
    # C_Q in the rotated basis: no weight between the parts, and the first part holds the top 16 eigenvalues
    c = r.T @ cov @ r
    assert c[:16, 16:].abs().max() < 1e-8 * c.abs().max()
    assert torch.allclose(torch.diagonal(c)[:16].sum(), lam[:16].sum())
    # within a part every channel carries about the same energy (spread, not sorted)
    for n in (16, 48, 56, 112):
        m = spread_hadamard(n)
        assert orthogonality_error(m) < 1e-12
        share = m.pow(2)[: n // 2].sum(0)  # the upper half of the ranks' weight on each channel
        assert torch.allclose(share, torch.full_like(share, 0.5), atol=0.15)


def test_split_bits_count_both_groups():
    w = SplitWidth(2, 32, 5)
    assert w.code_bits(128) == (32 * 5 + 96 * 2) / 128
    assert stored_bits(w, 128, 128) == w.code_bits(128) + 48 / 128
    long = bits_per_element(10 ** 9, 128, 128, 2, k_bits=[w], v_bits=[2])
    assert long == pytest.approx((w.code_bits(128) + 48 / 128 + 2 + 24 / 128) / 2, abs=1e-5)
    # a wider cache precision stores every channel at it
    assert bits_per_element(4096, 128, 128, 4, k_bits=[w], v_bits=[2]) == bits_per_element(4096, 128, 128, 4,
                                                                                            k_bits=[4], v_bits=[4])


def test_each_layer_widens_along_its_own_front():
    a, b = SplitWidth(2, 16, 4), SplitWidth(2, 32, 4)
    table = {2: [1.0, 1.0], a: [0.5, 1.2], b: [0.3, 0.2], 3: [0.4, 0.25], 4: [0.1, 0.05]}
    paths = widening_paths(table, 2, 128, 128)
    assert paths[0] == [2, a, b, 4]  # 3 costs more than b and is noisier: off layer 0's front
    assert paths[1] == [2, b, 4]  # a is noisier than 2 on layer 1
    assert widening_paths({2: [1.0], 3: [2.0], 4: [0.1]}, 1, 128, 128) == [[2, 3, 4]]  # plain widths: as before
    choice = allocate_key_widths(table, [2, 2], 0.35, None, 32768, 128, 128)
    assert choice.k_bits == [b, b] and choice.noise == [0.3, 0.2]


def _rotations(layers=2, heads=2, d=32, splits=None):
    g = torch.Generator().manual_seed(4)
    from oscar_kv.models import AttentionGeometry

    geometry = AttentionGeometry(num_layers=layers, num_attention_heads=2 * heads, num_kv_heads=heads, head_dim=d,
                                 model_type="llama")
    rot = Rotations.data_free(geometry, "hadamard")
    rot.k_rotation = torch.linalg.qr(torch.randn(layers, heads, d, d, generator=g, dtype=torch.float64))[0].float()
    rot.k_eigenvalues = torch.zeros(layers, heads, d)
    if splits:
        rot.set_bits(splits)
    return rot


def test_an_artifact_with_split_keys_saves_loads_and_says_so(tmp_path):
    w = SplitWidth(2, 8, 4)
    rot = _rotations(splits=[w, 3])
    assert rot.key_widths() == [w, 3] and rot.width_summary() == "K3V3 x 1, K4x8+2V2 x 1"
    rot.save(tmp_path / "a")
    back = Rotations.load(tmp_path / "a")
    assert back.key_widths() == [w, 3] and back.has_split_keys
    plain = _rotations()
    plain.save(tmp_path / "b")  # no split: the file holds no split tensors, as before they existed
    from safetensors.torch import load_file

    assert "k_hi_dims" not in load_file(str(tmp_path / "b" / "rotations.safetensors"))
    assert Rotations.load(tmp_path / "b").key_widths() == [2, 2]


@pytest.mark.parametrize("hi_dims,hi_bits,message", [(8, 2, "hi_bits > bits"), (8, 16, "bits must be one of"),
                                                     (32, 4, "0 < hi_dims"), (6, 4, "multiple")])
def test_an_artifact_with_a_bad_split_is_refused(hi_dims, hi_bits, message):
    rot = _rotations(splits=[SplitWidth(2, 8, 4), 2])
    rot.k_hi_dims[0], rot.k_hi_bits[0] = hi_dims, hi_bits
    with pytest.raises(ArtifactError, match=message):
        rot.validate()


def test_split_keys_through_the_cache_equal_the_simulation():
    """One token at a time through the generate() cache's layer vs the one-pass simulation the evaluation runs."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, t, d = 4, 2, 90, 32
    q = torch.randn(1, hq, t, d, generator=g)
    k = torch.randn(1, hkv, t, d, generator=g) * torch.linspace(4, 0.2, d)
    v = torch.randn(1, hkv, t, d, generator=g)
    rot = torch.linalg.qr(torch.randn(hkv, d, d, generator=g, dtype=torch.float64))[0].float()
    settings = CacheSettings("int2", sink_size=8, recent_size=16, page_size=8, window_dtype=torch.float32)

    def new_layer():
        return OscarCacheLayer(settings, LayerCodec(2, d, rot, torch.zeros(hkv, d), torch.full((hkv,), 0.95),
                                                    torch.full((hkv,), 0.9), 0.5, k_split=SplitWidth(2, 8, 4)))

    class Attention(torch.nn.Module):
        layer_idx = 0

    layer = new_layer()
    outs = []
    for i in range(t):
        layer.update(k[:, :, i:i + 1], v[:, :, i:i + 1])
        outs.append(oscar_attention(Attention(), q[:, :, i:i + 1], layer, layer, None)[0])
    assert isinstance(layer.hist_k, SplitRows) and layer.history_len > 0
    real = torch.cat(outs, 1).transpose(1, 2)
    sim_layer = new_layer()
    sim = simulated_attention_from_forms(sim_layer, q, stored_forms(sim_layer, k, v))
    assert torch.allclose(real, sim, atol=1e-5), (real - sim).abs().max()
    plain = dataclasses.replace(sim_layer.codec, k_split=None)
    assert not torch.equal(plain.dequantize_keys(plain.quantize_keys(k)), sim_layer.codec.dequantize_keys(
        sim_layer.codec.quantize_keys(k)))


def test_split_keys_need_the_allocation():
    with pytest.raises(ConfigError, match="key bits 'auto'"):
        CalibrationSettings(key_formats="split", key_bits=4)
    with pytest.raises(ConfigError, match="key formats"):
        CalibrationSettings(key_formats="mixed")
    # "auto" without a KL check keeps plain widths (the key noise does not rank the two families)
    assert CalibrationSettings(key_formats="auto", max_kl=None, max_answer_kl=None).key_formats == "auto"


def test_auto_keeps_the_fewest_bits_that_meet_the_kl_check():
    def path(bits, steps, kl):
        return WidthChoice([2], [0.1], bits, "", steps), {steps: {"kl": kl, "bits_per_element": bits}}

    targets = {"kl": 0.01}
    assert cheapest_meeting({"plain": path(3.3, 5, 0.008), "split": path(2.8, 7, 0.009)}, targets) == "split"
    assert cheapest_meeting({"plain": path(3.3, 5, 0.008), "split": path(2.8, 7, 0.02)}, targets) == "plain"
    assert cheapest_meeting({"plain": path(3.3, 5, 0.02), "split": path(3.5, 7, 0.009)}, targets) == "split"
    assert cheapest_meeting({"plain": path(3.3, 5, 0.02), "split": path(2.8, 7, 0.03)}, targets) == "plain"
    # within one widening's bits (the search's resolution) plain widths win: they decode faster
    close = {"plain": path(3.468, 5, 0.009), "split": path(3.462, 7, 0.009)}
    assert cheapest_meeting(close, targets, tie_bits=0.016) == "plain"
    assert cheapest_meeting(close, targets) == "split"
    assert cheapest_meeting({"plain": path(3.295, 5, 0.009), "split": path(2.771, 7, 0.009)}, targets,
                            tie_bits=0.018) == "split"


@pytest.fixture(scope="module")
def split_artifact(smol, tmp_path_factory):
    """SmolLM2 calibrated with split key widths (the tolerance alone), saved and reloaded."""
    from oscar_kv.cache import unprepare_model
    from oscar_kv.calibrate import calibrate

    lm, tok = smol
    settings = CalibrationSettings(calib_tokens=2048, key_formats="split", max_kl=None, max_answer_kl=None)
    rot = calibrate(lm, tok, settings, progress=False)
    unprepare_model(lm)
    directory = tmp_path_factory.mktemp("split")
    rot.save(directory)
    return Rotations.load(directory)


def test_calibration_splits_keys_where_that_costs_fewer_bits_for_the_noise(split_artifact):
    rot = split_artifact
    widths = rot.manifest["calibration"]["widths"]
    assert rot.has_split_keys and widths["k_widths"] == [str(w) for w in rot.key_widths()]
    assert all(n <= 0.3 for n in widths["key_noise"])
    # the same tolerance over the plain widths alone, from the same measured noise, costs more
    g = rot.geometry
    plain = {int(w): n for w, n in widths["key_noise_by_width"].items()}
    values = {int(w): n for w, n in widths["value_noise_by_width"].items()}
    alone = allocate_key_widths(plain, [2] * g.num_layers, 0.3, None, widths["seq_len"], g.head_dim,
                                rot.group_size, value_noise=values)
    assert widths["bits_per_element"] < alone.bits_per_element - 0.1
    assert orthogonality_error(rot.k_rotation) < 1e-5


def test_generate_reads_split_keys(smol, split_artifact, tokenizer):
    from oscar_kv.cache import OscarCache, unprepare_model
    from oscar_kv.hf_compat import cache_kwargs

    lm, _ = smol
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    cache = OscarCache(lm, split_artifact, CacheSettings("int2", sink_size=4, recent_size=8, page_size=4))
    out = lm.generate(ids, max_new_tokens=24, do_sample=False, **cache_kwargs(lm, cache))
    layer = cache.layers[0]
    assert out.shape[1] == ids.shape[1] + 24 and layer.history_len > 0
    assert any(isinstance(l.hist_k, SplitRows) for l in cache.layers)
    unprepare_model(lm)


@pytest.mark.skipif(torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"),
                    reason="the CPU engine's Triton kernels run under TRITON_INTERPRET=1 only")
def test_the_engine_serves_split_keys_with_the_torch_paths_tokens(smol, split_artifact, tokenizer):
    """The split artifact in the serving engine: the pool stores each split layer's rows with their tail
    (kernels/split_keys.py) and counts those bytes; the Triton engine (interpreted: write_kv, migrate_pages, the
    materialized and extend prefill paths, decode) gives the torch reference engine's greedy tokens, and start-up
    names the widths.  A 95-token prompt in chunks of 64 and 31 over a 16 + 32 window leaves quantized pages and
    migrates one while decoding."""
    pytest.importorskip("triton")
    from oscar_kv.cache import unprepare_model
    from oscar_kv.config import EngineConfig
    from oscar_kv.corpus import DEFAULT_CORPUS
    from oscar_kv.engine.engine import LLMEngine
    from oscar_kv.engine.sequence import SamplingParams
    from oscar_kv.kernels.split_keys import row_bytes

    lm, _ = smol
    rot = split_artifact
    ids = tokenizer(DEFAULT_CORPUS.read_text()[1000:2600]).input_ids[:95]
    tokens = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(lm, tokenizer, rot, EngineConfig(kv_cache_memory=0.1, max_model_len=1024, sink_size=16,
                                                            recent_size=32, max_num_batched_tokens=64,
                                                            attention_backend=backend))
        g = engine.pool.geometry
        assert g.key_widths() == rot.key_widths() and g.has_split_keys
        for i, width in enumerate(g.key_widths()):
            want = row_bytes(width, g.head_dim) if isinstance(width, SplitWidth) else g.head_dim * width // 8
            assert engine.pool.k_codes[i].shape[-1] == want == g.code_bytes(i)[0]
        if backend == "triton":
            assert engine.kernel_status is None and engine.runner.kernels is not None
            assert f"layer widths {g.width_summary()}" in "\n".join(engine.describe())
            assert "x" in g.width_summary()  # e.g. K4x16+2V2
        engine.add_request("r", ids, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))
        outputs = []
        while engine.has_work():
            outputs += [t for out in engine.step() for t in out.token_ids]
        tokens[backend] = outputs
        assert engine.pool.all_free() and engine.pool.quant.cached > 0  # quantized pages were written and kept
        unprepare_model(lm)
    assert len(tokens["torch"]) == 3 and tokens["triton"] == tokens["torch"], tokens


def test_calibrate_auto_walks_both_formats_through_the_kl_check(smol):
    """--key-formats auto: the plain and the split paths each meet the KL target at their fewest widenings, the
    artifact keeps the cheaper, the manifest and inspect say both."""
    from oscar_kv.artifact_report import width_map
    from oscar_kv.cache import unprepare_model
    from oscar_kv.calibrate import calibrate

    lm, tok = smol
    settings = CalibrationSettings(calib_tokens=2048, key_formats="auto", max_kl=0.02, max_answer_kl=None,
                                   kl_probe_tokens=1024)
    rot = calibrate(lm, tok, settings, progress=False)
    unprepare_model(lm)
    widths = rot.manifest["calibration"]["widths"]
    formats = widths["key_formats"]
    assert set(formats["paths"]) == {"plain", "split"}
    meeting = {n: p["bits_per_element"] for n, p in formats["paths"].items() if p["kl"] <= 0.02}
    cheapest = min(meeting, key=meeting.get)
    plain_ties = "plain" in meeting and meeting["plain"] - meeting[cheapest] <= formats["tie_bits"]
    assert formats["chosen"] == ("plain" if plain_ties else cheapest)
    assert 0.01 < formats["tie_bits"] < 0.02  # one of SmolLM2's 30 layers' keys a bit wider, at 8K
    assert widths["bits_per_element"] == formats["paths"][formats["chosen"]]["bits_per_element"]
    assert rot.has_split_keys == (formats["chosen"] == "split")
    assert "key formats auto: " + formats["chosen"] in width_map(widths)


def test_the_benchmarks_take_split_keys(split_artifact):
    """bench attention / decode time an artifact's split layers as the engine stores them (a pair per width, the
    pool's bytes counted), and --key-bits takes a split width for the synthetic artifact."""
    import argparse

    from oscar_kv.bench.floors import read_bytes
    from oscar_kv.bench.synthetic import add_width_arguments, layer_geometry, load_rotations, width_pairs, \
        widths_record
    from oscar_kv.kernels.split_keys import row_bytes

    rot = load_rotations(split_artifact.source, split_artifact.geometry)
    pairs = width_pairs(rot.key_widths(), rot.v_bits.tolist())
    assert sum(len(layers) for layers in pairs.values()) == rot.geometry.num_layers
    assert any(isinstance(k, SplitWidth) for k, _ in pairs)
    record = widths_record(rot, 8192, 64, 256)
    assert "(" in record["label"] and record["k_bits"] == [str(w) if isinstance(w, SplitWidth) else w
                                                         for w in rot.key_widths()]
    width = SplitWidth(2, 16, 4)
    geom = layer_geometry(width, 2)
    assert geom.k_split == (width,) and geom.code_bytes(0) == (row_bytes(width, 128), 32)
    read = read_bytes(geom, 1, 32768)
    plain = read_bytes(layer_geometry(2, 2), 1, 32768)
    tokens = geom.int2_pages_for(32768) * geom.page_size * geom.num_kv_heads
    assert read["codes"] - plain["codes"] == tokens * 16 * 2 // 8  # the upper bits of 16 channels
    assert read["metadata"] - plain["metadata"] == tokens * 3  # the second group's scale and zero point
    ap = argparse.ArgumentParser()
    add_width_arguments(ap)
    assert ap.parse_args(["--key-bits", "4x16+2"]).key_bits == width
    with pytest.raises(SystemExit):
        ap.parse_args(["--key-bits", "4x16+9"])
