"""Position-aware key centering (rope.py) on the real SmolLM2: the tables are the model's own RoPE, the
calibrated pre-RoPE mean is what the keys hold, and a QKV-bias model is where it pays off."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from oscar_kv.activations import capture_samples
from oscar_kv.calibrate import Statistics, calibrate
from oscar_kv.calibration_settings import CalibrationSettings
from oscar_kv.models import AttentionGeometry
from oscar_kv.rope import RopeTable, apply_rope, keep_pairs, kernel_pairs, key_offsets, mean_phase, remove_rope

SMALL = dict(calib_tokens=512, seq_len=256, probe_tokens=128, max_kl=None, max_answer_kl=None)


def test_rope_table_is_the_models_rope(model):
    table = RopeTable(model, 64)
    pos = torch.tensor([0, 5, 1500, 3, 5000])  # grows past its first size
    cos, sin = table(pos)
    ref_cos, ref_sin = model.model.rotary_emb(torch.zeros(1, 1), pos[None])
    # float64 angles here, float32 in the model: equal up to the model's angle rounding (~ulp(p * theta))
    assert torch.allclose(cos, ref_cos[0], atol=2e-3) and torch.allclose(sin, ref_sin[0], atol=2e-3)
    assert torch.allclose(cos[:2], ref_cos[0, :2], atol=1e-6)
    # the kernels' tables hold the same numbers: per position, at multiples of 16, and the 16 steps between
    kr = table.kernel_rope(torch.zeros(3, 64), 5000)
    assert torch.equal(kr.table[pos], torch.cat([cos[:, :32], sin[:, :32]], 1))
    assert torch.equal(kr.base[312], kr.table[312 * 16])
    v = 5
    assert torch.allclose(kr.steps[0::2, v], kr.table[v, :32], atol=1e-7)
    assert torch.allclose(kr.steps[1::2, v], -kr.table[v, 32:], atol=1e-7)
    x = torch.randn(2, 5, 64)  # [heads, positions, D]
    _, k_ref = apply_rotary_pos_emb(x[None], x[None], cos[None], sin[None])
    assert torch.allclose(apply_rope(x, cos, sin), k_ref[0], atol=1e-6)
    assert torch.allclose(remove_rope(apply_rope(x, cos, sin), cos, sin), x, atol=1e-5)
    assert torch.allclose(key_offsets(x[0], cos, sin), apply_rope(x[0][:, None], cos, sin))


def test_statistics_hold_the_mean_pre_rope_key(model, tokenizer, held_out_ids):
    ids = held_out_ids[:, :200]
    samples = capture_samples(model, ids)
    stats = Statistics(AttentionGeometry.of(model.config), RopeTable(model, 64))
    for i, s in enumerate(samples):
        stats.add(i, s.q[None], s.k[None], s.v[None], torch.zeros_like(s.q[None]))
    mu_k, mu_pre = stats.key_means("rope")
    cos, sin = s.rope
    for i in (0, 17):
        k = samples[i].k.double()
        expect_pre = remove_rope(k, cos.double(), sin.double()).mean(1)
        assert torch.allclose(mu_pre[i], expect_pre, atol=1e-6)
        # the constant rest is the mean of what position-aware centering leaves
        rest = (k - key_offsets(expect_pre, cos.double(), sin.double())).mean(1)
        assert torch.allclose(mu_k[i], rest, atol=1e-6)
    assert torch.allclose(stats.key_means("constant")[0][0], samples[0].k.double().mean(1), atol=1e-6)
    # kept to 5 channel pairs per head (what the kernels visit): those pairs unchanged, the rest in mu_K
    mu_k5, mu_pre5 = stats.key_means("rope", pairs=5)
    live = (mu_pre5[..., :32] != 0) | (mu_pre5[..., 32:] != 0)
    assert (live.sum(-1) == 5).all()
    assert torch.equal(mu_pre5, keep_pairs(mu_pre, live))
    k = samples[17].k.double()
    assert torch.allclose(mu_k5[17], (k - key_offsets(mu_pre5[17], cos.double(), sin.double())).mean(1), atol=1e-6)
    pairs = kernel_pairs(mu_pre5[17].float())  # 5 live pairs, padded to the kernels' minimum of 8
    assert pairs.shape == (3, 8)
    for h in range(3):
        assert set(torch.nonzero(live[17, h]).flatten().tolist()) <= set(pairs[h].tolist())


@pytest.fixture
def biased_model(model):
    """SmolLM2 with a Qwen2.5-like k_proj bias (large, pre-RoPE) in every layer; removed afterwards."""
    g = torch.Generator().manual_seed(0)
    for layer in model.model.layers:
        k_proj = layer.self_attn.k_proj
        k_proj.bias = torch.nn.Parameter(torch.randn(k_proj.out_features, generator=g) * 20)
    yield model
    for layer in model.model.layers:
        layer.self_attn.k_proj.bias = None


def test_rope_centering_rescues_a_key_bias_and_auto_picks_it(biased_model, tokenizer):
    const = calibrate(biased_model, tokenizer, CalibrationSettings(key_centering="constant", **SMALL), progress=False)
    auto = calibrate(biased_model, tokenizer, CalibrationSettings(**SMALL), progress=False)
    choice = auto.manifest["calibration"]["key_centering_choice"]
    assert choice["chosen"] == "rope" and auto.key_centering == "rope" and const.key_centering == "constant"
    # a constant post-RoPE mean leaves the rotating bias in the INT2 range; per position it is gone
    assert choice["probe_error"]["rope"] < 0.6 * choice["probe_error"]["constant"], choice


def _split16(x):
    hi = x.half().float()
    return hi, (x - hi).half().float()


def test_cuda_rope_term_scheme_is_exact_enough_with_a_large_bias():
    """The CUDA kernel's position-aware term (int2_decode.cu, rope_terms), emulated in torch: per 16 keys at p0 + v,
    W = (a - ib) e^{i p0 t} in float32 from KernelRope.phases, then W . [cos vt, -sin vt] (KernelRope.tile) with both
    operands as float16 hi + lo parts and three products.  With |mu_pre| ~ 900 (a k_proj bias) the term is
    hundreds of logit units: one float16 product would err by ~0.1, the split must stay below 1e-3."""
    from oscar_kv.kernels.common import rope_query_terms
    from oscar_kv.rope import KernelRope, kernel_pairs, keep_pairs, random_pairs

    gen = torch.Generator().manual_seed(3)
    d, n = 128, 70000
    inv_freq = 1e6 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    mu = keep_pairs(torch.randn(1, d, generator=gen) * 900, random_pairs(1, d // 2, 32, gen))
    rope = KernelRope.build(mu, inv_freq, 1.0, n)
    assert torch.equal(rope.phases[5], torch.stack([rope.table[80, :64], rope.table[80, 64:]], -1))
    q = torch.randn(1, d, generator=gen)
    scale = 1.4426950408889634 / d ** 0.5
    ab = rope_query_terms(q, mu, scale, kernel_pairs(mu))[0].double()  # [2R]: a | b
    r = ab.shape[0] // 2
    a, b = ab[:r], ab[r:]
    pairs = kernel_pairs(mu)[0].long()
    pos = torch.arange(n - 4000, n, dtype=torch.float64)
    ang = pos[:, None] * inv_freq[pairs][None, :]
    exact = (a * ang.cos() + b * ang.sin()).sum(-1)
    p0 = (pos.long() // 16) * 16
    v = pos.long() - p0
    ph = rope.phases[p0 // 16][:, pairs].float()  # [N, R, 2]
    af, bf = a.float(), b.float()
    w_re, w_im = af * ph[..., 0] + bf * ph[..., 1], af * ph[..., 1] - bf * ph[..., 0]
    t = rope.tile[v][:, pairs]  # [N, R, 2] (cos, sin)
    c, s = t[..., 0], -t[..., 1]
    (wrh, wrl), (wih, wil), (ch, cl), (sh, sl) = _split16(w_re), _split16(w_im), _split16(c), _split16(s)
    three = (wrh * ch + wih * sh) + (wrl * ch + wil * sh) + (wrh * cl + wih * sl)
    one = wrh * ch + wih * sh
    assert exact.abs().max() > 100  # the term is large here
    assert (three.sum(-1).double() - exact).abs().max() < 1e-3
    assert (one.sum(-1).double() - exact).abs().max() > 1e-2


def test_mean_phase_is_the_mean_over_positions():
    inv_freq = torch.tensor([0.0, 1e-6, 3e-4, 0.02, 1.0, 2.5], dtype=torch.float64)
    for n in (1, 7, 1000, 40000):
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq
        m_cos, m_sin = mean_phase(inv_freq, n)
        assert torch.allclose(m_cos, ang.cos().mean(0), atol=1e-12)
        assert torch.allclose(m_sin, ang.sin().mean(0), atol=1e-12)


def test_pairs_are_scored_over_the_horizon(model, tokenizer, held_out_ids):
    """Scored over the calibration's own positions, a pair that turns less than half a radian within them
    looks free to drop; scored over the model's context it is not (it turns radians by then)."""
    t = 200
    samples = capture_samples(model, held_out_ids[:, :t])
    rope = RopeTable(model, 64)
    stats = Statistics(AttentionGeometry.of(model.config), rope)
    for i, s in enumerate(samples):
        stats.add(i, s.q[None], s.k[None], s.v[None], torch.zeros_like(s.q[None]))
    mu_pre = torch.ones_like(stats.k_pre_sum)  # the same amplitude in every pair: the score is the phases'
    own = stats.rope_pair_mask(mu_pre, 8)
    stats.horizon = t  # the calibration's own positions, in closed form: the same pairs
    assert torch.equal(stats.rope_pair_mask(mu_pre, 8), own)
    stats.horizon = 8192
    long = stats.rope_pair_mask(mu_pre, 8)
    theta = rope.inv_freq
    slow = (theta * t < 0.5) & (theta * 8192 > 2)  # still within a sequence, radians apart by 8K
    assert slow.any()
    assert not own[..., slow].any()
    assert long[..., slow].any()


# ------------------------------------------------------------------------------------------ partial rotary
def _partial_model(model_type: str):
    """A tiny random model with RoPE on the first half of each head (head dim 16): Phi-3 rotates the pairs
    (j, j + 4) of channels 0..7, GLM-4 the interleaved pairs (2j, 2j + 1); channels 8..15 pass through."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, intermediate_size=64, head_dim=16,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                  max_position_embeddings=4096, partial_rotary_factor=0.5)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type,interleaved", [("phi3", False), ("glm4", True)])
def test_partial_rotary_offsets_are_transformers_rope(model_type, interleaved):
    """The layout is probed from the model's own apply_rotary_pos_emb; RoPE_p(mu_pre) in it (the torch path),
    from the kernels' pair tables (reference.with_rope_offsets) and as the kernels' per-pair terms
    (common.rope_query_terms) all equal transformers' RoPE of mu_pre, identity on the pass-through channels."""
    import sys

    from oscar_kv.kernels.common import rope_query_terms
    from oscar_kv.kernels.reference import with_rope_offsets
    from oscar_kv.rope import RotaryLayout, pair_counts

    model = _partial_model(model_type)
    table = RopeTable(model, 16)
    assert table.layout == RotaryLayout(16, 8, interleaved)
    assert pair_counts(16, table.rotary_dim) == (4,)
    hf_apply = sys.modules[type(model).__module__].apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(7)
    pos = torch.tensor([0, 3, 17, 900, 4000])
    mu = torch.randn(2, 16, generator=gen) * 20
    mu[:, 8:] = 0  # as calibration leaves it: the pass-through mean is in mu_K
    hf_cos, hf_sin = model.model.rotary_emb(mu, pos[None])
    _, want = hf_apply(mu[None, :, None, :].expand(1, 2, 5, 16), mu[None, :, None, :].expand(1, 2, 5, 16),
                       hf_cos, hf_sin)
    want = want[0].double()  # [H, T, D]
    cos, sin = table(pos)
    assert torch.allclose(table.offsets(mu, pos).double(), want, atol=1e-3)
    x = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)
    _, hf_x = hf_apply(x[None].float(), x[None].float(), hf_cos, hf_sin)
    assert torch.allclose(apply_rope(x, cos.double(), sin.double(), table.layout), hf_x[0].double(), atol=1e-4)
    assert torch.allclose(remove_rope(hf_x[0].double(), cos.double(), sin.double(), table.layout), x, atol=1e-4)
    # the kernels' tables: D/2 = 8 pairs, the pass-through ones at angle 0
    kr = table.kernel_rope(mu, 4001)
    assert kr.table.shape[1] == 16 and torch.equal(kr.table[:, 4:8], torch.ones(kr.table.shape[0], 4))
    offsets = with_rope_offsets(torch.zeros(4001, 2, 16), 0, kr, None)[pos].transpose(0, 1)
    assert torch.allclose(offsets.double(), want, atol=1e-3)
    assert kr.pairs.shape == (2, 8) and (kr.pairs[:, :4] == torch.arange(4)).all()  # live pairs: the rotated ones
    q = torch.randn(5, 2, 16, generator=gen)  # one query row per position, GQA 1
    ab = rope_query_terms(q, mu, 1.0, kr.pairs, kr.layout).double()
    ang_cos, ang_sin = kr.table[pos].double()[:, :8], kr.table[pos].double()[:, 8:]
    r = kr.pairs.shape[1]
    terms = (ab[..., :r] * ang_cos[:, None, :].expand(-1, 2, -1).gather(-1, kr.pairs.long()[None].expand(5, -1, -1))
             + ab[..., r:] * ang_sin[:, None, :].expand(-1, 2, -1).gather(-1, kr.pairs.long()[None].expand(5, -1, -1)))
    assert torch.allclose(terms.sum(-1), torch.einsum("thd,htd->th", q.double(), want), atol=1e-2)


def test_partial_rotary_statistics_center_the_rotated_channels(held_out_ids):
    """Calibration's means at partial rotary: mu_pre is the mean key with RoPE undone on the rotated channels and
    zero on the pass-through ones, whose mean joins the constant mu_K; pairs are chosen among the rotated ones."""
    from oscar_kv.rope import key_offsets

    model = _partial_model("phi3")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a pre-RoPE key bias: a mean worth centering per position
        attn = model.model.layers[0].self_attn
        attn.qkv_proj.bias = torch.nn.Parameter(torch.zeros(attn.qkv_proj.out_features))
        attn.qkv_proj.bias[64:96] = torch.randn(32, generator=g) * 20
    ids = held_out_ids[:, :300] % 256
    samples = capture_samples(model, ids)
    rope = RopeTable(model, 16)
    stats = Statistics(AttentionGeometry.of(model.config), rope)
    s = samples[0]
    stats.add(0, s.q[None], s.k[None], s.v[None], torch.zeros_like(s.q[None]))
    mu_k, mu_pre = stats.key_means("rope")
    k = s.k.double()
    cos, sin = (x.double() for x in s.rope)
    expect_pre = remove_rope(k, cos, sin, rope.layout).mean(1)
    assert torch.allclose(mu_pre[0, :, :8], expect_pre[:, :8], atol=1e-6) and (mu_pre[0, :, 8:] == 0).all()
    rest = (k - key_offsets(mu_pre[0], cos, sin, rope.layout)).mean(1)  # key_offsets in float32: |mu_pre| ~ 20
    assert torch.allclose(mu_k[0], rest, atol=1e-4)
    assert torch.allclose(mu_k[0, :, 8:], k[..., 8:].mean(1), atol=1e-6)  # the pass-through mean, constant
    _, mu_pre2 = stats.key_means("rope", pairs=2)
    lo, hi = rope.layout.parts(mu_pre2[0])
    live = (lo != 0) | (hi != 0)
    assert (live.sum(-1) == 2).all() and not live[:, 4:].any()
    assert (kernel_pairs(mu_pre2[0].float(), rope.layout)[:, :2] < 4).all()


def test_an_artifact_for_another_rope_layout_is_refused():
    """layer_codecs compares the artifact's RoPE layout with the model's: an interleaved-layout mean on a
    rotate-half model (or an old whole-head artifact on a partial-rotary one) would center the wrong channels."""
    from oscar_kv.artifacts import ArtifactError, Rotations
    from oscar_kv.codec import layer_codecs
    from oscar_kv.rope import RotaryLayout

    model = _partial_model("phi3")
    geometry = AttentionGeometry.of(model.config)
    rot = Rotations.data_free(geometry, "hadamard")
    rot.k_rope_mean[..., 0] = 5.0
    for layout in (RotaryLayout(16, 8, interleaved=True), None):
        rot.rope_layout = layout
        with pytest.raises(ArtifactError, match="the artifact centers keys for RoPE"):
            layer_codecs(model, rot, "int2")
    rot.rope_layout = RotaryLayout(16, 8)
    codecs = layer_codecs(model, rot, "int2")
    assert codecs[0].rope.layout == rot.rope_layout and codecs[0].rope_pairs.shape == (2, 8)
