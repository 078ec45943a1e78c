"""The model set of the decode benchmark: public architecture numbers, built with random weights on the device
(decode speed does not depend on weight values), and the stand-in tokenizer the engine needs."""

from __future__ import annotations

import time

import torch

from ..models import AttentionGeometry

# Public architecture numbers (config.json of each model).  Qwen3's published max_position_embeddings is
# 40960 (131072 with YaRN per the model card); 131072 is used so that 100K contexts are accepted - RoPE
# scaling does not change the cost of a step.
ARCHS = {
    "qwen3-8b": dict(cls="Qwen3Config", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=131072, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                     rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
                     max_window_layers=36),
    "qwen3-4b": dict(cls="Qwen3Config", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=131072, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                     rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
                     max_window_layers=36),
    "llama-3.1-8b": dict(cls="LlamaConfig", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192},
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000,
                         eos_token_id=[128001, 128008, 128009]),
    # mixture of experts: Qwen3-style attention (4 KV heads), 128 experts of which 8 run per token
    "qwen3-30b-a3b": dict(cls="Qwen3MoeConfig", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                          mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, max_position_embeddings=131072,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    # fused qkv_proj and gate_up_proj; the 128K model's LongRoPE factors are left out (default RoPE, which our
    # executor runs; LongRoPE runs transformers' forward): they do not change the cost of a step
    "phi-3-medium": dict(cls="Phi3Config", vocab_size=32064, hidden_size=5120, intermediate_size=17920,
                         num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10,
                         max_position_embeddings=131072, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000,
                         sliding_window=None),
    # Gemma-3-12B's sizes (48 layers, hidden 3840, 16 query and 8 KV heads of head dim 256, MLP 15360, vocabulary
    # 262208, global RoPE base 1e6) on a Llama decoder: Gemma's KV geometry, not Gemma's layers (no sliding-window
    # layers, QK-norm, GeGLU or extra norms).  Every layer attends globally here.
    "gemma3-12b-attn": dict(cls="LlamaConfig", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                            num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                            max_position_embeddings=131072,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
                            tie_word_embeddings=True, bos_token_id=2, eos_token_id=1),
    # partial rotary (RoPE on the first half of each head, interleaved pairs), 2 KV heads for 32 query heads (GQA
    # 16: past the CUDA INT2 kernel's 8), fused QKV bias, sandwich norms
    "glm-4-9b": dict(cls="Glm4Config", vocab_size=151552, hidden_size=4096, intermediate_size=13696,
                     num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                     partial_rotary_factor=0.5, attention_bias=True, max_position_embeddings=131072,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1.5625e-07,
                     tie_word_embeddings=False, pad_token_id=151329, bos_token_id=None, eos_token_id=151329),
    # sliding windows: every layer attends to the last 4096 tokens (the engine reads only those)
    "mistral-7b-v0.1": dict(cls="MistralConfig", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            max_position_embeddings=32768, sliding_window=4096,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
                            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    # For CPU tests: head dim 64 is the smallest the extend kernel accepts.
    "tiny": dict(cls="LlamaConfig", vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=131072,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}


# ---------------------------------------------------------------------------------------------- model
def build_model(arch: str, layers: int | None, device: torch.device, dtype: torch.dtype | None = None):
    """A causal LM with the architecture's public numbers and random weights (bf16 on a GPU), built on ``device``."""
    import transformers
    from transformers import AutoModelForCausalLM

    spec = dict(ARCHS[arch])
    config = getattr(transformers, spec.pop("cls"))(**spec)
    if layers:
        config.num_hidden_layers = min(layers, config.num_hidden_layers)
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:config.num_hidden_layers]
        if getattr(config, "max_window_layers", None):
            config.max_window_layers = min(config.max_window_layers, config.num_hidden_layers)
    # bf16 as served on a GPU; float32 on the CPU, where bf16 matmuls are slow and timings are not meaningful anyway
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    started = time.perf_counter()
    # Parameters are created and initialized (normal_, std 0.02) on the device itself: seconds for 8B on a GPU.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    params = sum(p.numel() for p in model.parameters())
    info = dict(arch=arch, model_type=config.model_type, num_layers=config.num_hidden_layers,
                hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                num_attention_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                head_dim=AttentionGeometry.of(config).head_dim, vocab_size=config.vocab_size,
                max_position_embeddings=config.max_position_embeddings, parameters=params,
                weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                streamed_weight_bytes=streamed_weight_bytes(model),
                token_matmul_parameters=token_matmul_parameters(model),
                build_seconds=round(time.perf_counter() - started, 2),
                weights=f"random (normal, std 0.02), {str(dtype).replace('torch.', '')}")
    return model, info


def streamed_weight_bytes(model) -> int:
    """Weight bytes a decode step reads: every parameter except an untied input embedding (it reads only the
    batch's rows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    if embed is not model.get_output_embeddings().weight:
        total -= embed.numel() * embed.element_size()
    return total


def token_matmul_parameters(model) -> int:
    """Parameters every prompt token multiplies in a prefill: all but the embedding and the LM head (which sees
    only each chunk's last token)."""
    skip = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in skip)


class TokenIdsOnly:
    """Stand-in tokenizer: the engine detokenizes outputs (discarded here) and falls back to
    ``eos_token_id`` when the generation config has none.  Requests set ignore_eos, so no EOS stops them."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


# ---------------------------------------------------------------------------------------------- pool arithmetic
