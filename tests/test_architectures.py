"""Other attention variants with small random models: Qwen2 (QKV bias), Qwen3 (QK-norm), Mistral."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from oscar_kv.cache import CacheSettings, OscarCache, unprepare_model
from oscar_kv.calibrate import CalibrationSettings, calibrate
from oscar_kv.folding import fold_values
from oscar_kv.models import AttentionGeometry

ARCHS = {
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "mistral": dict(model_type="mistral", sliding_window=None),
}


def tiny_model(arch: str):
    kw = dict(ARCHS[arch])
    config = AutoConfig.for_model(kw.pop("model_type"), vocab_size=49152, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=2048, tie_word_embeddings=True, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if attn.k_proj.bias is not None:  # Qwen2-style large key/value offsets
                attn.k_proj.bias.add_(torch.randn_like(attn.k_proj.bias) * 20)
                attn.v_proj.bias.add_(torch.randn_like(attn.v_proj.bias) * 5)
    return model


@pytest.mark.parametrize("arch", list(ARCHS))
@torch.no_grad()
def test_cache_equivalences_and_calibration(arch, tokenizer, held_out_ids):
    model = tiny_model(arch)
    ids = held_out_ids[:, :200]
    ref = model(ids, past_key_values=DynamicCache(config=model.config)).logits

    rot = calibrate(model, tokenizer, CalibrationSettings(calib_tokens=512, seq_len=256, probe_tokens=128),
                    progress=False)
    unprepare_model(model)
    rot.validate(AttentionGeometry.of(model.config))
    assert rot.k_mean.abs().max() > 0

    fold_values(model, rot.v_rotation, rot.v_mean)
    assert (model(ids).logits - ref).abs().max() < 1e-3, "folding R_V and mu_V must not change logits"
    unprepare_model(model)

    bf16 = OscarCache(model, None, CacheSettings("bf16", window_dtype=torch.float32))
    out = torch.cat([model(ids[:, :150], past_key_values=bf16).logits]
                    + [model(ids[:, i:i + 1], past_key_values=bf16).logits for i in range(150, 200)], 1)
    assert (out - ref).abs().max() < 1e-3
    unprepare_model(model)

    wide = OscarCache(model, rot, CacheSettings("int2", sink_size=16, recent_size=512, window_dtype=torch.float32))
    out = torch.cat([model(ids[:, :150], past_key_values=wide).logits]
                    + [model(ids[:, i:i + 1], past_key_values=wide).logits for i in range(150, 200)], 1)
    assert (out - ref).abs().max() < 1e-3, "centered, rotated storage must be exact while nothing is quantized"
    unprepare_model(model)

    int2 = OscarCache(model, rot, CacheSettings("int2", sink_size=16, recent_size=32))
    model(ids, past_key_values=int2)
    assert int2.layers[0].history_len > 0
