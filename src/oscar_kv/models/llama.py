"""Our forward for the Llama family (Llama, Mistral, Qwen2, Qwen3): the engine's model executor.

transformers' decoder layer launches ~50 small kernels per layer at batch 1 (six for each RMSNorm, eight for RoPE,
separate q / k / v and gate / up projections); inside a CUDA graph each still costs a few microseconds, which is
most of a decode step beside the weights.  The executor runs the same arithmetic as:

    residual add + RMSNorm   one launch (kernels/elementwise.rms_norm)
    q | k | v                one GEMM over the fused weight (+ bias: Qwen2, or values folded with a mean);
                             at <= 16 tokens every projection runs kernels/gemv.py's GEMV instead of cuBLAS
    q/k norm + RoPE + split  one launch (Qwen3's per-head q_norm / k_norm included)
    attention                the engine's (runner.StepAttention.attend: OSCAR write + paged kernels)
    o_proj                   one GEMM
    residual add + RMSNorm   one launch
    gate | up                one GEMM over the fused weight
    SiLU * up                one launch (at <= 16 tokens: inside the gate | up GEMV)
    down_proj                one GEMM

It reads the model's own modules: the fused weights are built once and the modules' weights become views of them
(no second copy), so transformers' forward keeps working on the same model and stays the reference the executor is
tested against (tests/test_executor.py).  On the CPU, and on a GPU without Triton, the elementwise steps run their
torch references (kernels/elementwise_reference.py), and nothing imports Triton.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

FAMILY = ("llama", "mistral", "qwen2", "qwen3")
_DYNAMIC_ROPE = ("dynamic", "longrope")  # RoPE whose tables depend on the sequence length


def executor_support(model) -> str | None:
    """None when :class:`LlamaExecutor` runs ``model``, else why not (said at start-up)."""
    from ..parallel import is_sharded

    cfg = model.config
    if cfg.model_type not in FAMILY:
        return f"model type {cfg.model_type!r} is not one the executor runs ({', '.join(FAMILY)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (the executor fuses SiLU)"
    if is_sharded(model):
        return "tensor-parallel ranks run transformers' forward (its row-parallel all-reduces)"
    rope_type = getattr(getattr(model.model, "rotary_emb", None), "rope_type", None)
    if rope_type is None or rope_type in _DYNAMIC_ROPE:
        return f"RoPE type {rope_type!r} (the executor keeps fixed position tables)"
    if getattr(cfg, "partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(attn, f"{p}_proj") for p in "qkvo") or not all(
                hasattr(mlp, f"{p}_proj") for p in ("gate", "up", "down")):
            return f"{type(layer).__name__} has no separate q/k/v/o and gate/up/down projections"
    return None


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias, zeros where a part has none) for several linears over the same input; each linear's
    weight and bias become views of it, so the model holds one copy."""
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
    return weight, bias


@dataclass
class _Layer:
    """One decoder layer's tensors as the executor reads them."""

    input_norm: torch.Tensor  # [C]
    post_norm: torch.Tensor  # [C]
    qkv: tuple[torch.Tensor, torch.Tensor | None]  # [(Hq + 2 Hkv) D, C], bias
    qk_norm: torch.Tensor | None  # [2, D]: Qwen3's q_norm and k_norm weights
    o_proj: torch.nn.Linear  # read at each call: folding may give it a bias later
    gate_up: tuple[torch.Tensor, torch.Tensor | None]  # [2F, C], bias
    down: torch.nn.Linear
    scaling: float

    @classmethod
    def of(cls, layer) -> "_Layer":
        attn, mlp = layer.self_attn, layer.mlp
        qk_norm = None
        if hasattr(attn, "q_norm"):
            qk_norm = torch.stack([attn.q_norm.weight.detach(), attn.k_norm.weight.detach()])
        return cls(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                   _fuse([attn.q_proj, attn.k_proj, attn.v_proj]), qk_norm, attn.o_proj,
                   _fuse([mlp.gate_proj, mlp.up_proj]), mlp.down_proj, attn.scaling)


def rope_tables(rotary_emb, positions: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, D] as the model's rotary embedding computes them (attention scaling included,
    rounded to the model dtype as transformers rounds them), built in chunks to bound the float32 temporaries."""
    cos, sin = [], []
    probe = torch.empty(0, device=device, dtype=dtype)
    for start in range(0, positions, 1 << 15):
        ids = torch.arange(start, min(positions, start + (1 << 15)), device=device)[None]
        c, s = rotary_emb(probe, ids)
        cos.append(c[0])
        sin.append(s[0])
    return torch.cat(cos).contiguous(), torch.cat(sin).contiguous()


class LlamaExecutor:
    """The forward of a Llama-family model over a packed step of tokens, with the engine's attention.

    ``kernels``: run the elementwise steps as Triton kernels (default: on CUDA where Triton is installed) or as their
    torch references; True without Triton raises ModuleNotFoundError saying how to install it."""

    def __init__(self, model, max_positions: int, kernels: bool | None = None):
        why = executor_support(model)
        if why is not None:
            raise ValueError(f"the executor cannot run this model: {why}")
        inner, cfg = model.model, model.config
        param = next(model.parameters())
        self.embed, self.final_norm = inner.embed_tokens, inner.norm.weight
        self.eps = cfg.rms_norm_eps
        self.heads = (cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        with torch.no_grad():
            self.layers = [_Layer.of(layer) for layer in inner.layers]
            self.cos, self.sin = rope_tables(inner.rotary_emb, max_positions, param.device, param.dtype)
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
        if kernels:  # the GPU path: the Triton modules are imported only here
            from ..kernels import elementwise as ops
            from ..kernels.gemv import linear, linear_silu_mul, small_gemm_choice

            self.gemm, self.gemm_why = small_gemm_choice(param.device)
            self.rms_norm, self.silu_mul, self.rope_qkv = ops.rms_norm, ops.silu_mul, ops.rope_qkv
        else:
            from ..kernels import elementwise_reference as ops

            self.gemm, self.gemm_why = "cublas", "torch references" + (f": {why_not}" if why_not else "")
            self.rms_norm, self.silu_mul = ops.rms_norm_reference, ops.silu_mul_reference
            self.rope_qkv = ops.rope_qkv_reference
        if self.gemm == "triton":
            self.linear, self.gate_up_silu = linear, linear_silu_mul
        else:
            self.gate_up_silu = lambda x, weight, bias: self.silu_mul(F.linear(x, weight, bias))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Args: input_ids [N] and positions [N] (int64, on the model's device) of the step's packed tokens;
        ``attention``: has ``attend(layer, query, key, value, scaling)`` taking [1, heads, N, D] tensors and
        returning ([1, N, Hq, D], _) (runner.StepAttention).  Returns the final hidden states [N, C]."""
        n = input_ids.shape[0]
        h = self.embed(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = self.rms_norm(h, layer.input_norm, self.eps, residual)
            q, k, v = self.rope_qkv(self.linear(x, *layer.qkv), positions, self.cos, self.sin, self.heads,
                                    self.head_dim, layer.qk_norm, self.eps)
            out, _ = attention.attend(i, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                      layer.scaling)
            h = self.linear(out.reshape(n, -1), layer.o_proj.weight, layer.o_proj.bias)
            x, residual = self.rms_norm(h, layer.post_norm, self.eps, residual)
            h = self.linear(self.gate_up_silu(x, *layer.gate_up), layer.down.weight, layer.down.bias)
        return self.rms_norm(h, self.final_norm, self.eps, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, C] (each sequence's last position) -> logits [B, vocab] in the model dtype."""
        return self.linear(hidden, self.lm_head.weight, self.lm_head.bias)
