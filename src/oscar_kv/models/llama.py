"""The executor's Llama family: Llama, Mistral, Qwen2 (QKV bias) and Qwen3 (per-head q_norm / k_norm), whose layers
keep q / k / v and gate / up apart (fused here, models/decoder.py)."""

from __future__ import annotations

import torch

from .decoder import DecoderExecutor, DecoderLayer, fuse


class LlamaExecutor(DecoderExecutor):
    MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

    @classmethod
    def family_support(cls, model) -> str | None:
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not all(hasattr(attn, f"{p}_proj") for p in "qkvo") or not all(
                    hasattr(mlp, f"{p}_proj") for p in ("gate", "up", "down")):
                return f"{type(layer).__name__} has no separate q/k/v/o and gate/up/down projections"
        return None

    @staticmethod
    def read_layer(layer) -> DecoderLayer:
        attn, mlp = layer.self_attn, layer.mlp
        qk_norm = None
        if hasattr(attn, "q_norm"):
            qk_norm = torch.stack([attn.q_norm.weight.detach(), attn.k_norm.weight.detach()])
        return DecoderLayer(layer.input_layernorm.weight, fuse([attn.q_proj, attn.k_proj, attn.v_proj]), qk_norm,
                            attn.o_proj, layer.post_attention_layernorm.weight, fuse([mlp.gate_proj, mlp.up_proj]),
                            mlp.down_proj, attn.scaling)
