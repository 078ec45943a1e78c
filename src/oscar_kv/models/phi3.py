"""The executor's Phi-3 family (Phi-3, Phi-3.5, Phi-4-mini): Llama's layer with q | k | v and gate | up already fused
in the checkpoint (qkv_proj, gate_up_proj: the executor's fused weights are those tensors), RoPE in rotate-half
pairs over the first rotary_dim channels of each head (partial_rotary_factor).  The long-context checkpoints'
LongRoPE changes its tables with the sequence length: refused (models/decoder.py, ``support``)."""

from __future__ import annotations

from .decoder import DecoderExecutor, DecoderLayer


class Phi3Executor(DecoderExecutor):
    MODEL_TYPES = ("phi3",)
    PARTIAL_ROTARY = True

    @staticmethod
    def read_layer(layer) -> DecoderLayer:
        attn, mlp = layer.self_attn, layer.mlp
        return DecoderLayer(layer.input_layernorm.weight, attn.qkv_proj, None, attn.o_proj,
                            layer.post_attention_layernorm.weight, mlp.gate_up_proj, mlp.down_proj, attn.scaling)
