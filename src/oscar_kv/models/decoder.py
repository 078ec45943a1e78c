"""Our forward of a decoder-only model over a packed step of tokens: the engine's model executor.

transformers' decoder layer launches ~50 small kernels per layer at batch 1 (six for each RMSNorm, eight for RoPE,
separate q / k / v and gate / up projections); inside a CUDA graph each still costs a few microseconds, which is
most of a decode step beside the weights.  The executor runs the same arithmetic as:

    residual add + RMSNorm   one launch (kernels/elementwise.rms_norm)
    q | k | v                one GEMM over the fused weight (+ bias: Qwen2, GLM-4, or values folded with a mean);
                             at <= 16 tokens every projection runs kernels/gemv.py's GEMV instead of cuBLAS
    q/k norm + RoPE + split  one launch (a per-head q_norm / k_norm included: Qwen3, Gemma 3; RoPE on the first
                             rotary_dim channels of a head, in rotate-half or interleaved pairs: Phi-3, GLM-4; each
                             layer with its layer type's RoPE: Gemma 3)
    attention                the engine's (runner.StepAttention.attend: OSCAR write + paged kernels)
    o_proj                   one GEMM
    RMSNorm                  one launch, only where the layer norms its sublayers' outputs too (sandwich norms)
    residual add + RMSNorm   one launch
    gate | up                one GEMM over the fused weight
    act(gate) * up           one launch (SiLU, or GELU's tanh approximation: Gemma 3; at <= 16 tokens inside the
                             gate | up GEMV)
    down_proj                one GEMM
    RMSNorm                  one launch, sandwich norms only

Every RMSNorm is the family's: Llama's weight times the rounded normed x, or Gemma's x (1 + weight) rounded once.
The embedding is the model's own module (Gemma's scales it by sqrt(hidden)), the softmax scale each attention
module's own (Gemma's from query_pre_attn_scalar), and sliding-window layers are the engine's attention's to
apply (it reads each layer's window from the config: models.layer_windows).

One class runs every family: a family (llama.py, phi3.py, ...) says which of its modules hold a layer's tensors
(``read_layer``) and which of its variants the executor runs (``family_support``); executor.py picks the family by
model type.  The executor reads the model's own modules: fused weights are either the checkpoint's (Phi-3's
qkv_proj) or built once with the modules' weights turned into views of them (no second copy), so transformers'
forward keeps working on the same model and stays the reference the executor is tested against
(tests/test_executor.py).  On the CPU, and on a GPU without Triton, the elementwise steps run their torch
references (kernels/elementwise_reference.py), and nothing imports Triton.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.elementwise_reference import GLU_ACTIVATIONS

log = logging.getLogger(__name__)

_DYNAMIC_ROPE = ("dynamic", "longrope")  # RoPE whose tables depend on the sequence length


@dataclass
class Fused:
    """One weight (and bias) for several linears over the same input, which hold row slices of it."""

    weight: torch.Tensor  # [sum of out_features, C]
    bias: torch.Tensor | None


def fuse(linears: list[torch.nn.Linear]) -> Fused:
    """Fuse several linears over the same input (zeros in the bias where a part has none); each linear's weight and
    bias become views of the fused ones, so the model holds one copy."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat([lin.bias.detach() if lin.bias is not None else weight.new_zeros(lin.out_features)
                          for lin in linears])
    start = 0
    for lin in linears:
        rows = slice(start, start + lin.out_features)
        lin.weight.data = weight[rows]
        if lin.bias is not None:
            lin.bias.data = bias[rows]
        start = rows.stop
    return Fused(weight, bias)


@dataclass
class DecoderLayer:
    """One decoder layer's tensors as the executor reads them.  ``qkv`` and ``gate_up`` are a checkpoint's fused
    linear or a :class:`Fused`; like o_proj they are read at each call (folding may give a linear a bias later)."""

    input_norm: torch.Tensor  # [C]
    qkv: torch.nn.Linear | Fused  # [(Hq + 2 Hkv) D, C]
    qk_norm: torch.Tensor | None  # [2, D]: the per-head q_norm and k_norm weights
    o_proj: torch.nn.Linear
    pre_mlp_norm: torch.Tensor  # [C]
    gate_up: torch.nn.Linear | Fused  # [2F, C]
    down: torch.nn.Linear
    scaling: float
    post_attn_norm: torch.Tensor | None = None  # [C]: sandwich norms, on the sublayers' outputs
    post_mlp_norm: torch.Tensor | None = None
    rope_type: str | None = None  # the layer type whose RoPE the layer uses; None: the model's one RoPE


def _rotary(rotary_emb, positions: torch.Tensor, probe: torch.Tensor, layer_type: str | None):
    return rotary_emb(probe, positions) if layer_type is None else rotary_emb(probe, positions, layer_type)


def rope_tables(rotary_emb, positions: int, device, dtype,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, rotary_dim] as the model's rotary embedding computes them (of ``layer_type``'s RoPE
    where it keeps one per layer type; attention scaling included, rounded to the model dtype as transformers rounds
    them), built in chunks to bound the float32 temporaries."""
    cos, sin = [], []
    probe = torch.empty(0, device=device, dtype=dtype)
    for start in range(0, positions, 1 << 15):
        ids = torch.arange(start, min(positions, start + (1 << 15)), device=device)[None]
        c, s = _rotary(rotary_emb, ids, probe, layer_type)
        cos.append(c[0])
        sin.append(s[0])
    return torch.cat(cos).contiguous(), torch.cat(sin).contiguous()


def _rope_types(rotary_emb) -> dict[str | None, str | None]:
    """Layer type (None: the model's one RoPE) -> its RoPE type."""
    rope_type = getattr(rotary_emb, "rope_type", None)
    return dict(rope_type) if isinstance(rope_type, dict) else {None: rope_type}


class DecoderExecutor:
    """The forward of a decoder-only model over a packed step of tokens, with the engine's attention.  Subclasses
    are the families: they set the class attributes below and read each layer's modules.

    ``kernels``: run the elementwise steps as Triton kernels (default: on CUDA where Triton is installed) or as their
    torch references; True without Triton raises ModuleNotFoundError saying how to install it."""

    MODEL_TYPES: tuple[str, ...] = ()
    PARTIAL_ROTARY = False  # the family's RoPE may turn only the first rotary_dim channels of a head
    INTERLEAVED = False  # RoPE turns channel pairs (2j, 2j + 1) (GLM), not (j, j + rotary_dim / 2)
    UNIT_OFFSET = False  # Gemma's RMSNorm, x (1 + weight) (kernels/elementwise_reference.rms_norm_reference)
    ACTIVATION_KEY = "hidden_act"  # the config field naming the MLP's gate activation

    @classmethod
    def support(cls, model) -> str | None:
        """None when this family's executor runs ``model``, else why not (said at start-up)."""
        from ..parallel import is_sharded

        cfg = model.config
        if cfg.model_type not in cls.MODEL_TYPES:
            return f"model type {cfg.model_type!r} is not one {cls.__name__} runs ({', '.join(cls.MODEL_TYPES)})"
        if cls.activation(cfg) not in GLU_ACTIVATIONS:
            return f"activation {cls.activation(cfg)!r} (the executor fuses {' and '.join(GLU_ACTIVATIONS)})"
        if is_sharded(model):
            return "tensor-parallel ranks run transformers' forward (its row-parallel all-reduces)"
        rotary_emb = getattr(model.model, "rotary_emb", None)
        for layer_type, rope_type in _rope_types(rotary_emb).items():
            if rope_type is None or rope_type in _DYNAMIC_ROPE:
                return f"RoPE type {rope_type!r} (the executor keeps fixed position tables)"
            probe = next(model.parameters())
            rotary_dim = _rotary(rotary_emb, torch.zeros(1, 1, dtype=torch.long, device=probe.device), probe,
                                 layer_type)[0].shape[-1]
            if rotary_dim != _head_dim(cfg) and not cls.PARTIAL_ROTARY:
                return "partial rotary embeddings"
        return cls.family_support(model)

    @classmethod
    def activation(cls, cfg) -> str:
        return getattr(cfg, cls.ACTIVATION_KEY, None) or "silu"

    @classmethod
    def family_support(cls, model) -> str | None:
        """What the family refuses beyond ``support``'s common checks (None: nothing)."""
        return None

    @staticmethod
    def read_layer(layer) -> DecoderLayer:
        """The tensors of one of the family's decoder layers (fusing what the checkpoint keeps apart)."""
        raise NotImplementedError

    def __init__(self, model, max_positions: int, kernels: bool | None = None):
        why = self.support(model)
        if why is not None:
            raise ValueError(f"the executor cannot run this model: {why}")
        inner, cfg = model.model, model.config
        param = next(model.parameters())
        self.embed, self.final_norm = inner.embed_tokens, inner.norm.weight
        self.eps = cfg.rms_norm_eps
        self.heads = (cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = _head_dim(cfg)
        with torch.no_grad():
            self.layers = [self.read_layer(layer) for layer in inner.layers]
            tables = {t: rope_tables(inner.rotary_emb, max_positions, param.device, param.dtype, t)
                      for t in dict.fromkeys(layer.rope_type for layer in self.layers)}
        self.ropes = [tables[layer.rope_type] for layer in self.layers]  # (cos, sin) per layer
        from ..kernels import TRITON_MISSING, require_triton, triton_available

        why_not = None  # why the torch references run on a GPU
        if kernels is None:
            kernels = param.device.type == "cuda" and triton_available()
            if param.device.type == "cuda" and not kernels:
                why_not = TRITON_MISSING
                log.warning("the executor runs its torch references on the GPU: %s", why_not)
        elif kernels:
            require_triton("the executor's kernels (kernels=True)")
        self.lm_head = model.lm_head
        self.linear = F.linear
        activation = self.activation(cfg)
        if kernels:  # the GPU path: the Triton modules are imported only here
            from ..kernels import elementwise as ops
            from ..kernels.gemv import linear, linear_glu, small_gemm_choice

            self.gemm, self.gemm_why = small_gemm_choice(param.device)
            rms_norm, glu, rope_qkv = ops.rms_norm, ops.glu, ops.rope_qkv
        else:
            from ..kernels import elementwise_reference as ops

            self.gemm, self.gemm_why = "cublas", "torch references" + (f": {why_not}" if why_not else "")
            rms_norm, glu, rope_qkv = ops.rms_norm_reference, ops.glu_reference, ops.rope_qkv_reference
        # the family's variants bound once: forward calls every step the same way
        self.rms_norm = functools.partial(rms_norm, unit_offset=self.UNIT_OFFSET)
        self.rope_qkv = functools.partial(rope_qkv, interleaved=self.INTERLEAVED, unit_offset=self.UNIT_OFFSET)
        if self.gemm == "triton":
            self.linear = linear
            self.gate_up_act = functools.partial(linear_glu, activation=activation)
        else:
            self.gate_up_act = lambda x, weight, bias: glu(F.linear(x, weight, bias), activation)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Args: input_ids [N] and positions [N] (int64, on the model's device) of the step's packed tokens;
        ``attention``: has ``attend(layer, query, key, value, scaling)`` taking [1, heads, N, D] tensors and
        returning ([1, N, Hq, D], _) (runner.StepAttention).  Returns the final hidden states [N, C]."""
        n = input_ids.shape[0]
        h = self.embed(input_ids)
        residual = None
        for i, (layer, (cos, sin)) in enumerate(zip(self.layers, self.ropes)):
            x, residual = self.rms_norm(h, layer.input_norm, self.eps, residual)
            q, k, v = self.rope_qkv(self.linear(x, layer.qkv.weight, layer.qkv.bias), positions, cos, sin,
                                    self.heads, self.head_dim, layer.qk_norm, self.eps)
            out, _ = attention.attend(i, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                      layer.scaling)
            h = self.linear(out.reshape(n, -1), layer.o_proj.weight, layer.o_proj.bias)
            if layer.post_attn_norm is not None:
                h = self.rms_norm(h, layer.post_attn_norm, self.eps)[0]
            x, residual = self.rms_norm(h, layer.pre_mlp_norm, self.eps, residual)
            h = self.linear(self.gate_up_act(x, layer.gate_up.weight, layer.gate_up.bias), layer.down.weight,
                            layer.down.bias)
            if layer.post_mlp_norm is not None:
                h = self.rms_norm(h, layer.post_mlp_norm, self.eps)[0]
        return self.rms_norm(h, self.final_norm, self.eps, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, C] (each sequence's last position) -> logits [B, vocab] in the model dtype."""
        return self.linear(hidden, self.lm_head.weight, self.lm_head.bias)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
