"""Our Llama-family executor (models/llama.py) against transformers' forward, and its fused elementwise kernels
(kernels/elementwise.py) against their torch references (Triton's interpreter on the CPU, the GPU where there is one).
"""

import os

import pytest
import torch
import torch.nn.functional as F

from oscar_kv.models.llama import FAMILY, LlamaExecutor, executor_support

from test_architectures import tiny_model

EXECUTED = ["llama", "qwen2", "qwen3", "mistral"]  # tiny random models of each family (test_architectures.ARCHS)
NOT_EXECUTED = {"phi3": "model type 'phi3'", "qwen3_moe": "model type 'qwen3_moe'", "mixtral": "model type 'mixtral'"}

triton_device = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                   reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def _model(arch: str, dtype=torch.float32):
    if arch == "llama":  # test_architectures' Llama has head dim 256; this one has the usual hidden / heads
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    else:
        model = tiny_model(arch)
    return model.to(dtype)


class CausalAttention:
    """Exact causal attention over the step's own tokens (one sequence from position 0): the engine's seam."""

    def attend(self, layer, query, key, value, scaling):
        group = query.shape[1] // key.shape[1]
        out = F.scaled_dot_product_attention(query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1),
                                             is_causal=True, scale=scaling)
        return out.transpose(1, 2), None


def test_family_models_are_supported_and_others_say_why():
    assert set(EXECUTED) == set(FAMILY)
    for arch in EXECUTED:
        assert executor_support(_model(arch)) is None, arch
    for arch, why in NOT_EXECUTED.items():
        assert why in executor_support(tiny_model(arch))
    with pytest.raises(ValueError, match="cannot run this model: model type 'phi3'"):
        LlamaExecutor(tiny_model("phi3"), 64)


@pytest.mark.parametrize("arch", EXECUTED)
@torch.no_grad()
def test_executor_logits_equal_transformers(arch, held_out_ids):
    model = _model(arch)
    ids = held_out_ids[0, :96]
    ref = model(ids[None]).logits[0]
    executor = LlamaExecutor(model, 128, kernels=False)
    hidden = executor.forward(ids, torch.arange(len(ids)), CausalAttention())
    got = model.lm_head(hidden)
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()
    # the modules' weights are now views of the fused ones: transformers' forward is unchanged
    assert (model(ids[None]).logits[0] - ref).abs().max() == 0
    qkv = executor.layers[0].qkv[0]
    assert model.model.layers[0].self_attn.v_proj.weight.data_ptr() > qkv.data_ptr()
    assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == qkv.data_ptr()


@triton_device
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@torch.no_grad()
def test_executor_kernels_equal_references_in_bf16(arch, held_out_ids):
    """The whole forward in bf16 with the Triton kernels against the same forward with the torch references, and
    against transformers' own bf16 forward."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _model(arch, torch.bfloat16).to(device)
    ids = held_out_ids[0, :40].to(device)
    ref = model(ids[None]).logits[0].float()
    pos = torch.arange(len(ids), device=device)
    with_refs = model.lm_head(LlamaExecutor(model, 64, kernels=False).forward(ids, pos, CausalAttention())).float()
    with_kernels = model.lm_head(LlamaExecutor(model, 64, kernels=True).forward(ids, pos, CausalAttention())).float()
    scale = ref.abs().max()
    assert (with_kernels - with_refs).abs().max() < 2e-2 * scale
    assert (with_refs - ref).abs().max() < 3e-2 * scale


def _bf16_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to one rounding step of the dtype (the kernels sum squares in another order); in bf16 on a few
    elements only."""
    ulp = 2 ** -7 if ref.dtype == torch.bfloat16 else 2 ** -21
    diff = (got.float() - ref.float()).abs()
    assert (diff <= ref.float().abs() * ulp + 1e-6).all()
    if ref.dtype == torch.bfloat16:
        assert (diff > 0).float().mean() < 0.05


@triton_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel(dtype):
    from oscar_kv.kernels.elementwise import rms_norm, rms_norm_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    x, res = (torch.randn(5, 96, generator=g).to(device, dtype) * 3 for _ in range(2))
    w = (torch.rand(96, generator=g) + 0.5).to(device, dtype)
    for residual in (None, res):
        out, new_res = rms_norm(x, w, 1e-6, residual)
        ref, ref_res = rms_norm_reference(x, w, 1e-6, residual)
        assert torch.equal(new_res, ref_res)
        _bf16_close(out, ref)


@triton_device
def test_silu_mul_kernel():
    from oscar_kv.kernels.elementwise import silu_mul, silu_mul_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gu = (torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(2)) * 4).to(device, torch.bfloat16)
    _bf16_close(silu_mul(gu), silu_mul_reference(gu))


@triton_device
@pytest.mark.parametrize("head_dim,norm", [(64, False), (128, True), (96, True)])
def test_rope_qkv_kernel(head_dim, norm):
    from oscar_kv.kernels.elementwise import rope_qkv, rope_qkv_reference
    from oscar_kv.models.llama import rope_tables
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = AutoConfig.for_model("llama", vocab_size=32, hidden_size=4 * head_dim, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=head_dim, max_position_embeddings=4096)
    rotary = AutoModelForCausalLM.from_config(config).model.rotary_emb.to(device)
    cos, sin = rope_tables(rotary, 4096, device, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    qkv = (torch.randn(7, 8 * head_dim, generator=g) * 2).to(device, torch.bfloat16)
    positions = torch.tensor([0, 1, 5, 700, 2000, 4095, 3], device=device)
    qk_norm = (torch.rand(2, head_dim, generator=g) + 0.5).to(device, torch.bfloat16) if norm else None
    got = rope_qkv(qkv, positions, cos, sin, (4, 2), head_dim, qk_norm)
    ref = rope_qkv_reference(qkv, positions, cos, sin, (4, 2), head_dim, qk_norm)
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        if norm:
            _bf16_close(a, b)
        else:
            assert torch.equal(a, b)
