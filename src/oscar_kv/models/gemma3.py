"""The executor's Gemma 3 family (the text decoder, ``Gemma3ForCausalLM``): Gemma's RMSNorm, x (1 + weight) in
float32; a per-head q_norm / k_norm; sandwich norms (the attention's and the MLP's outputs normed again before their
residual adds); GeGLU (GELU's tanh approximation); sliding-window layers beside full ones, each layer type with its
own RoPE (local base 1e4, global 1e6 and, from 4B up, linear scaling): one table per type, shared by its layers; the
embedding scaled by sqrt(hidden) and the softmax scale from query_pre_attn_scalar, both the modules' own.

Refused: logit softcapping (Gemma 2's; the engine refuses it too) and bidirectional attention (the embedding
models: the engine's attention is causal)."""

from __future__ import annotations

import torch

from .decoder import DecoderExecutor, DecoderLayer, fuse


class Gemma3Executor(DecoderExecutor):
    MODEL_TYPES = ("gemma3_text",)
    UNIT_OFFSET = True
    ACTIVATION_KEY = "hidden_activation"

    @classmethod
    def family_support(cls, model) -> str | None:
        cfg = model.config
        for where in ("attn", "final"):
            if getattr(cfg, f"{where}_logit_softcapping", None):
                return f"{where} logit softcapping (the executor's attention and logits leave it out)"
        if getattr(cfg, "use_bidirectional_attention", False):
            return "bidirectional attention (the engine's attention is causal)"
        return None

    @staticmethod
    def read_layer(layer) -> DecoderLayer:
        attn, mlp = layer.self_attn, layer.mlp
        qk_norm = torch.stack([attn.q_norm.weight.detach(), attn.k_norm.weight.detach()])
        return DecoderLayer(layer.input_layernorm.weight, fuse([attn.q_proj, attn.k_proj, attn.v_proj]), qk_norm,
                            attn.o_proj, layer.pre_feedforward_layernorm.weight, fuse([mlp.gate_proj, mlp.up_proj]),
                            mlp.down_proj, attn.scaling, post_attn_norm=layer.post_attention_layernorm.weight,
                            post_mlp_norm=layer.post_feedforward_layernorm.weight, rope_type=attn.layer_type)
