"""Our executor (models/decoder.py, its families dispatched by models/executor.py) against transformers' forward over
a prefill, a chunk and decode steps, and its fused elementwise kernels (kernels/elementwise.py) against their torch
references (Triton's interpreter on the CPU, the GPU where there is one).
"""

import itertools
import os
import re

import pytest
import torch
import torch.nn.functional as F
from test_architectures import _greedy_tokens, tiny_model

from oscar_kv.models import layer_windows
from oscar_kv.models.executor import EXECUTORS, executor_support, make_executor
from oscar_kv.models.llama import LlamaExecutor

# tiny random models of each family (test_architectures.ARCHS), with their variants
EXECUTED = ["llama", "qwen2", "qwen3", "mistral", "phi3", "phi3-partial-rotary", "glm4", "gemma3", "gemma3-key-bias"]
NOT_EXECUTED = {"qwen3_moe": "model type 'qwen3_moe'", "mixtral": "model type 'mixtral'"}

triton_device = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                   reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def _model(arch: str, dtype=torch.float32, **config):
    """A tiny random model of ``arch`` whose norms are not all ones (or zeros: Gemma), so that each one counts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch == "llama":  # test_architectures' Llama has head dim 256; this one has the usual hidden / heads
        config = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    else:
        model = tiny_model(arch, **config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=g) * 0.2)
    return model.to(dtype)


class CachedAttention:
    """Exact attention of one sequence over its keys so far (the step's own included), each layer with its sliding
    window (a query at p sees keys in (p - window, p]): the engine's seam, over steps from position 0 on."""

    def __init__(self, windows=None):
        self.windows, self.kv = windows, {}

    def attend(self, layer, query, key, value, scaling):
        if layer in self.kv:
            key, value = (torch.cat([old, new], 2) for old, new in zip(self.kv[layer], (key, value)))
        self.kv[layer] = key, value
        n, keys = query.shape[2], key.shape[2]
        q_pos, k_pos = torch.arange(keys - n, keys)[:, None], torch.arange(keys)[None]
        allowed = k_pos <= q_pos
        window = self.windows[layer] if self.windows else None
        if window is not None:
            allowed &= k_pos > q_pos - window
        group = query.shape[1] // key.shape[1]
        out = F.scaled_dot_product_attention(query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1),
                                             attn_mask=allowed.to(query.device), scale=scaling)
        return out.transpose(1, 2), None


def _run(executor, model, ids: torch.Tensor, cuts=(80, 87)) -> torch.Tensor:
    """Hidden states [len(ids), C]: a prefill up to cuts[0], a chunk up to cuts[1], then one token per step."""
    attention = CachedAttention(layer_windows(model.config))
    bounds = [0, *cuts, *range(cuts[-1] + 1, len(ids) + 1)]
    return torch.cat([executor.forward(ids[a:b], torch.arange(a, b, device=ids.device), attention)
                      for a, b in itertools.pairwise(bounds)])


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_family_models_are_supported_and_others_say_why():
    assert {model.config.model_type for model in map(_model, EXECUTED)} == set(EXECUTORS)
    for arch in EXECUTED:
        assert executor_support(_model(arch)) is None, arch
    for arch, why in NOT_EXECUTED.items():
        assert why in executor_support(tiny_model(arch))
    with pytest.raises(ValueError, match="cannot run this model: model type 'phi3' is not one LlamaExecutor runs"):
        LlamaExecutor(tiny_model("phi3"), 64)


def test_variants_the_executor_cannot_run_say_why():
    """Phi-3's LongRoPE (the 128K checkpoints) changes its tables with the sequence length, Gemma's logit softcapping
    and bidirectional attention are outside the executor's forward, and so is an activation it does not fuse: the
    start-up line names each, and make_executor refuses them."""
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                "original_max_position_embeddings": 512}
    refused = [
        ("phi3", {"rope_parameters": longrope}, "RoPE type 'longrope' (the executor keeps fixed position tables)"),
        ("gemma3", {"final_logit_softcapping": 30.0}, "final logit softcapping"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn logit softcapping"),
        ("gemma3", {"use_bidirectional_attention": True}, "bidirectional attention"),
        ("gemma3", {"hidden_activation": "gelu"}, "activation 'gelu'"),
        ("qwen2", {"hidden_act": "relu"}, "activation 'relu'"),
    ]
    for arch, config, why in refused:
        model = tiny_model(arch, **config)
        assert why in executor_support(model), (arch, config)
        with pytest.raises(ValueError, match=re.escape(f"cannot run this model: {why}")):
            make_executor(model, 64)


@pytest.mark.parametrize("arch", EXECUTED)
@torch.no_grad()
def test_executor_logits_equal_transformers(arch, held_out_ids):
    model = _model(arch)
    ids = held_out_ids[0, :96]
    ref = model(ids[None]).logits[0]
    executor = make_executor(model, 128, kernels=False)
    got = model.lm_head(_run(executor, model, ids))
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()
    # the fused weights are the modules' own tensors: transformers' forward is unchanged
    assert (model(ids[None]).logits[0] - ref).abs().max() == 0
    for layer, mine in zip(model.model.layers, executor.layers):
        for module, fused in ((layer.self_attn, mine.qkv), (layer.mlp, mine.gate_up)):
            parts = [p.weight for name, p in module.named_children() if name in (
                "q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj")]
            assert parts and all(_shares(p, fused.weight) for p in parts)
            assert parts[0].data_ptr() == fused.weight.data_ptr()


@pytest.mark.parametrize("arch", ["phi3", "glm4", "gemma3"])
@torch.no_grad()
def test_the_engine_serves_the_family_through_the_executor(arch, tokenizer, held_out_ids):
    """The engine with our executor gives the greedy tokens of the engine with transformers' forward, two requests
    together over an INT2 pool, with a calibrated artifact: the folded value mean reaches the executor's
    projections (a new bias on Phi-3's fused qkv_proj), and the keys the executor hands the cache are centered per
    position in the model's RoPE layout (GLM-4: interleaved pairs on half of each head; Gemma 3: each layer with its
    type's RoPE, its sliding layers read past their window)."""
    from oscar_kv.cache import unprepare_model
    from oscar_kv.calibrate import CalibrationSettings, calibrate
    from oscar_kv.engine import EngineConfig, LLMEngine

    model = _model(arch)
    model.generation_config.eos_token_id = None
    rot = calibrate(model, tokenizer, CalibrationSettings(calib_tokens=256, seq_len=128, probe_tokens=64, max_kl=None,
                                                          max_answer_kl=None, key_centering="rope"), progress=False)
    unprepare_model(model)
    assert rot.k_rope_mean is not None and rot.v_mean.abs().max() > 0
    prompts = [held_out_ids[0, :100].tolist(), held_out_ids[0, 300:340].tolist()]
    tokens = {}
    for impl in ("transformers", "oscar"):
        engine = LLMEngine(model, tokenizer, rot, EngineConfig(
            kv_cache_dtype="int2", kv_cache_memory=0.05, attention_backend="torch", model_impl=impl, sink_size=16,
            recent_size=32, page_size=16))
        assert (engine.executor_status is None) == (impl == "oscar")
        tokens[impl] = _greedy_tokens(engine, prompts)
        unprepare_model(model)
    assert tokens["oscar"] == tokens["transformers"]


@triton_device
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3-partial-rotary", "glm4", "gemma3"])
@torch.no_grad()
def test_executor_kernels_equal_references_in_bf16(arch, held_out_ids):
    """The whole forward in bf16 with the Triton kernels against the same forward with the torch references, and
    against transformers' own bf16 forward."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _model(arch, torch.bfloat16).to(device)
    ids = held_out_ids[0, :40].to(device)
    ref = model(ids[None]).logits[0].float()
    with_refs = model.lm_head(_run(make_executor(model, 64, kernels=False), model, ids, (30, 35))).float()
    with_kernels = model.lm_head(_run(make_executor(model, 64, kernels=True), model, ids, (30, 35))).float()
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


@torch.no_grad()
def test_references_round_as_transformers_modules():
    """In bf16 the references are transformers' own modules to the bit: Llama's and Gemma 3's RMSNorm (which round
    at different points) and the gate activations of their MLPs."""
    from transformers.activations import ACT2FN
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from oscar_kv.kernels import elementwise_reference as refs

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 96, generator=g) * 3).to(torch.bfloat16)
    for module, unit_offset in ((LlamaRMSNorm(96, eps=1e-5), False), (Gemma3RMSNorm(96, eps=1e-5), True)):
        module.weight.copy_(torch.randn(96, generator=g))
        module.to(torch.bfloat16)
        assert torch.equal(refs.rms_norm_reference(x, module.weight, 1e-5, unit_offset=unit_offset)[0], module(x))
    gate, up = ((torch.randn(6, 300, generator=g) * scale).to(torch.bfloat16) for scale in (4, 1))
    for activation in refs.GLU_ACTIVATIONS:
        assert torch.equal(refs.glu_reference(torch.cat([gate, up], -1), activation), ACT2FN[activation](gate) * up)


@triton_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_kernel(dtype, unit_offset):
    from oscar_kv.kernels.elementwise import rms_norm, rms_norm_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    x, res = (torch.randn(5, 96, generator=g).to(device, dtype) * 3 for _ in range(2))
    w = (torch.rand(96, generator=g) + 0.5 - float(unit_offset)).to(device, dtype)
    for residual in (None, res):
        out, new_res = rms_norm(x, w, 1e-6, residual, unit_offset)
        ref, ref_res = rms_norm_reference(x, w, 1e-6, residual, unit_offset)
        assert torch.equal(new_res, ref_res)
        _bf16_close(out, ref)


@triton_device
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_glu_kernel(activation):
    from oscar_kv.kernels.elementwise import glu, glu_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gu = (torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(2)) * 4).to(device, torch.bfloat16)
    got, ref = glu(gu, activation), glu_reference(gu, activation)
    gate, up = gu.float().chunk(2, dim=-1)
    kept = gate > (-2 if activation == "gelu_pytorch_tanh" else -torch.inf)
    _bf16_close(got[kept], ref[kept])
    # below, torch's GELU cancels in 1 + tanh u (kernels/elementwise.gate_activation): about 2^-24 |gate| apart too
    got, ref = got.float(), ref.float()
    assert ((got - ref).abs() <= ref.abs() * 2 ** -7 + 2 ** -23 * (gate * up).abs() + 1e-6)[~kept].all()


@triton_device
@pytest.mark.parametrize("head_dim,norm,rotary_dim,interleaved", [
    (64, False, 64, False), (128, True, 128, False), (96, True, 96, False), (256, "gemma", 256, False),
    (64, False, 32, False), (96, True, 48, False),  # partial rotary (Phi-4-mini)
    (128, True, 64, True), (64, False, 64, True)])  # interleaved pairs (GLM-4: half the head)
def test_rope_qkv_kernel(head_dim, norm, rotary_dim, interleaved):
    """norm: Qwen3's q/k norms, or Gemma's (x (1 + weight))."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from oscar_kv.kernels.elementwise import rope_qkv, rope_qkv_reference
    from oscar_kv.models.decoder import rope_tables

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = Phi3Config(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                        max_position_embeddings=4096, partial_rotary_factor=rotary_dim / head_dim)
    rotary = Phi3RotaryEmbedding(config).to(device)
    cos, sin = rope_tables(rotary, 4096, device, torch.bfloat16)
    assert cos.shape == (4096, rotary_dim)
    g = torch.Generator().manual_seed(3)
    qkv = (torch.randn(7, 8 * head_dim, generator=g) * 2).to(device, torch.bfloat16)
    positions = torch.tensor([0, 1, 5, 700, 2000, 4095, 3], device=device)
    qk_norm = (torch.rand(2, head_dim, generator=g) + 0.5).to(device, torch.bfloat16) if norm else None
    flags = {"interleaved": interleaved, "unit_offset": norm == "gemma"}
    got = rope_qkv(qkv, positions, cos, sin, (4, 2), head_dim, qk_norm, **flags)
    ref = rope_qkv_reference(qkv, positions, cos, sin, (4, 2), head_dim, qk_norm, **flags)
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        if norm:
            _bf16_close(a, b)
        else:
            assert torch.equal(a, b)
