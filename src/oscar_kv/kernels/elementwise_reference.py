"""The torch references of the executor's fused elementwise steps (kernels/elementwise.py), which the CPU runs.

Kept apart from the kernels so that the CPU path imports no Triton (a CPU install has none: README, Install).
They reproduce transformers' arithmetic step by step, including where it rounds to the model dtype (Llama's
``RMSNorm.forward``, Gemma 3's, ``apply_rotary_pos_emb``, ``LlamaMLP``), so that our executor on the CPU matches
the model's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# transformers' names (ACT2FN) of the gate activations the executor fuses: SwiGLU, and GeGLU with GELU's tanh
# approximation (Gemma)
GLU_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                       unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Args: x [N, C] (the sublayer's output), weight [C], residual [N, C] or None (the first layer);
    ``unit_offset``: Gemma's norm, x * (1 + weight) in float32 rounded once, instead of Llama's weight times the
    rounded x.
    Returns: (RMSNorm(x + residual), x + residual) in x's dtype; the second is the next residual."""
    if residual is not None:
        x = residual + x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (h * (1.0 + weight.float())).to(x.dtype), x
    return weight * h.to(x.dtype), x


def glu_reference(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """gate_up [N, 2F] (gate | up) -> act(gate) * up, [N, F]; ``activation``: one of GLU_ACTIVATIONS."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_pytorch_tanh":
        # Gemma's gate_proj output is a tensor of its own: torch's CPU GELU over a strided view (a vectorized path
        # apart) rounds a few elements differently
        return F.gelu(gate.contiguous(), approximate="tanh") * up
    raise ValueError(f"gate activation {activation!r} is not one of {GLU_ACTIVATIONS}")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE on the first rotary_dim = cos.shape[-1] channels of x, as transformers applies it (the others pass
    through): rotate-half pairs (j, j + rotary_dim/2) (Llama's ``apply_rotary_pos_emb``, Phi-3's), or interleaved
    pairs (2j, 2j + 1) turned by the first half of the tables (GLM-4's)."""
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        cos, sin = (t[..., :rotary_dim // 2].repeat_interleave(2, dim=-1) for t in (cos, sin))
        turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    else:
        half = rotary_dim // 2
        turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + turned * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def rope_qkv_reference(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       heads: tuple[int, int], head_dim: int, qk_norm: torch.Tensor | None = None,
                       eps: float = 1e-6, interleaved: bool = False,
                       unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Args: qkv [N, (Hq + 2 Hkv) D] (the fused projection), positions [N] int64, cos / sin [max positions,
    rotary_dim] in the model dtype (the rotary module's tables; RoPE turns the first rotary_dim <= D channels of each
    head), heads (Hq, Hkv), qk_norm [2, D] (the per-head q_norm | k_norm weights) or None, interleaved: RoPE pairs
    (2j, 2j + 1) instead of (j, j + rotary_dim/2), unit_offset: the q/k norms are Gemma's (rms_norm_reference).
    Returns: q [N, Hq, D], k [N, Hkv, D] after the norm and RoPE, v [N, Hkv, D] (contiguous)."""
    hq, hkv = heads
    n = qkv.shape[0]
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    q, k, v = q.view(n, hq, head_dim), k.view(n, hkv, head_dim), v.reshape(n, hkv, head_dim)
    if qk_norm is not None:
        q = rms_norm_reference(q, qk_norm[0], eps, unit_offset=unit_offset)[0]
        k = rms_norm_reference(k, qk_norm[1], eps, unit_offset=unit_offset)[0]
    c, s = cos[positions][:, None], sin[positions][:, None]
    return _rope(q, c, s, interleaved), _rope(k, c, s, interleaved), v.contiguous()
