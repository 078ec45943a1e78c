"""The torch references of the executor's fused elementwise steps (kernels/elementwise.py), which the CPU runs.

Kept apart from the kernels so that the CPU path imports no Triton (a CPU install has none: README, Install).
They reproduce transformers' arithmetic step by step, including where it rounds to the model dtype (Llama's
``RMSNorm.forward``, ``apply_rotary_pos_emb``, ``LlamaMLP``), so that our executor on the CPU matches the model's
own forward.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Args: x [N, C] (the sublayer's output), weight [C], residual [N, C] or None (the first layer).
    Returns: (RMSNorm(x + residual), x + residual) in x's dtype; the second is the next residual."""
    if residual is not None:
        x = residual + x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2F] (gate | up) -> SiLU(gate) * up, [N, F]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_qkv_reference(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       heads: tuple[int, int], head_dim: int, qk_norm: torch.Tensor | None = None,
                       eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Args: qkv [N, (Hq + 2 Hkv) D] (the fused projection), positions [N] int64, cos / sin [max positions, D] in
    the model dtype (rotary tables), heads (Hq, Hkv), qk_norm [2, D] (Qwen3's q_norm | k_norm weights) or None.
    Returns: q [N, Hq, D], k [N, Hkv, D] after the norm and RoPE, v [N, Hkv, D] (contiguous)."""
    hq, hkv = heads
    n = qkv.shape[0]
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    q, k, v = q.view(n, hq, head_dim), k.view(n, hkv, head_dim), v.reshape(n, hkv, head_dim)
    if qk_norm is not None:
        q = rms_norm_reference(q, qk_norm[0], eps)[0]
        k = rms_norm_reference(k, qk_norm[1], eps)[0]
    c, s = cos[positions][:, None], sin[positions][:, None]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s, v.contiguous()
