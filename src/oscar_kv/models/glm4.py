"""The executor's GLM-4 family (GLM-4-0414): q / k / v kept apart in the checkpoint (with a bias) and gate | up
fused in it (gate_up_proj: the executor's weight is that tensor); RoPE on the first rotary_dim channels of each
head (partial_rotary_factor, half of it in the released models) in interleaved pairs (2j, 2j + 1); and sandwich
norms: the attention's and the MLP's outputs are normed again before their residual adds (post_self_attn_layernorm,
post_mlp_layernorm; post_attention_layernorm is the MLP's input norm, as in Llama).

The engine's cache sees the keys as transformers' forward hands them to the attention (after RoPE, in the model's
channel order), and so does the executor: per-position key centering reads the interleaved layout from the model's
own apply_rotary_pos_emb (rope.probe_layout) either way."""

from __future__ import annotations

from .decoder import DecoderExecutor, DecoderLayer, fuse


class Glm4Executor(DecoderExecutor):
    MODEL_TYPES = ("glm4",)
    PARTIAL_ROTARY = True
    INTERLEAVED = True

    @staticmethod
    def read_layer(layer) -> DecoderLayer:
        attn, mlp = layer.self_attn, layer.mlp
        return DecoderLayer(layer.input_layernorm.weight, fuse([attn.q_proj, attn.k_proj, attn.v_proj]), None,
                            attn.o_proj, layer.post_attention_layernorm.weight, mlp.gate_up_proj, mlp.down_proj,
                            attn.scaling, post_attn_norm=layer.post_self_attn_layernorm.weight,
                            post_mlp_norm=layer.post_mlp_layernorm.weight)
