"""The executor's fused elementwise steps (models/decoder.py) in Triton; their torch references, which the CPU runs,
are in elementwise_reference.py (no Triton there) and imported here too.

* ``rms_norm``: optional residual add, then RMSNorm (Llama's or Gemma's): one launch instead of transformers' five
  or six.
* ``glu``: act(gate) * up from the fused gate|up projection (SiLU, or GELU's tanh approximation).
* ``rope_qkv``: split the fused q|k|v projection into heads, RMS-normalize q and k per head (Qwen3, Gemma 3), apply RoPE
  to both (on the first rotary_dim channels of a head, in rotate-half or interleaved pairs) and copy v out: one
  launch per layer.

The references reproduce transformers' arithmetic step by step, including where it rounds to the model dtype
(Llama's ``RMSNorm.forward``, ``apply_rotary_pos_emb``, ``LlamaMLP``), so that our executor on the CPU matches the
model's own forward; the kernels round at the same points, and differ from the references only in the order of
float32 sums (the norm's mean of squares) and in GELU's tanh (``gate_activation``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from ._compat import install_interpreter_shim
from .common import wait_for_inputs
from .elementwise_reference import GLU_ACTIVATIONS, glu_reference, rms_norm_reference, rope_qkv_reference  # noqa: F401

install_interpreter_shim()


# ---- Triton kernels -------------------------------------------------------------------------------------------

@triton.jit
def _round(x, dt: tl.constexpr):
    """float32 x rounded to dt (half to even), kept in float32.  bfloat16 is rounded by hand: Triton's interpreter
    truncates on conversion (the GPU rounds), and the tests compare the kernels with torch's rounding."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dt).to(tl.float32)


@triton.jit
def _normed(x, w, dt: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """x / rms(x) (float32) times the norm's weight, rounded where transformers rounds: Gemma's x (1 + w) once,
    Llama's w times the rounded x."""
    if UNIT_OFFSET:
        return _round(x * (1.0 + w), dt)
    else:
        return _round(w * _round(x, dt), dt)


@triton.jit
def gate_activation(g, GELU: tl.constexpr):
    """float32 SiLU(g); with GELU, GELU's tanh approximation 0.5 g (1 + tanh u) = g sigmoid(2u), from exp(-2|u|)
    (no overflow).  torch computes 1 + tanh u, which cancels where u is very negative: there the two differ by
    about 2^-24 |g| (both round to zero in bf16 unless the product with up is large)."""
    if GELU:
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) (g + 0.044715 g^3)
        e = tl.exp(-2.0 * tl.abs(u))
        return g * tl.where(u >= 0, 1.0, e) / (1.0 + e)
    else:
        return g / (1.0 + tl.exp(-g))


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps, x_stride, res_stride,
                     HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, dt)  # the residual stream is kept in the model dtype, as transformers keeps it
        tl.store(res_out_ptr + row * n_cols + cols, x.to(dt), mask=mask)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, _normed(x * inv, w, dt, UNIT_OFFSET).to(dt), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm_reference`` in one launch.  x, residual [N, C] with unit column stride; returns new tensors."""
    n, c = x.shape
    out = torch.empty((n, c), dtype=x.dtype, device=x.device)
    if residual is None:
        res_out, res = x, x
    else:
        res_out, res = torch.empty_like(out), residual
    block = triton.next_power_of_2(c)
    _rms_norm_kernel[(n,)](x, res, weight, out, res_out, c, eps, x.stride(0), res.stride(0),
                           HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=block,
                           num_warps=min(16, max(1, block // 256)), **pdl.launch_options(x.device))
    return out, res_out


@triton.jit
def _glu_kernel(gu_ptr, out_ptr, n_cols, gu_stride, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    a = _round(gate_activation(g, GELU), dt)
    tl.store(out_ptr + row * n_cols + cols, _round(a * u, dt).to(dt), mask=mask)


def glu(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``glu_reference`` in one launch."""
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"gate activation {activation!r} is not one of {GLU_ACTIVATIONS}")
    n, two_f = gate_up.shape
    f = two_f // 2
    out = torch.empty((n, f), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(f))
    _glu_kernel[(n, triton.cdiv(f, block))](gate_up, out, f, gate_up.stride(0), GELU=activation != "silu",
                                            BLOCK=block, num_warps=4)
    return out



@triton.jit
def _rope_qkv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, norm_ptr, q_ptr, k_ptr, v_ptr, qkv_stride, eps,
                     HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr,
                     INTERLEAVED: tl.constexpr, NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                     PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)  # [0, HQ): query heads, then HKV key heads, then HKV value heads
    offs = tl.arange(0, HALF)  # pair j of the head's D/2: channels (lo_j, hi_j)
    mask = offs < D // 2
    if ROT == D and not INTERLEAVED:  # rotate-half over the whole head: the halves, contiguous loads
        lo_ch = offs
        hi_ch = offs + D // 2
    else:  # RoPE's pairs first; past them the pass-through channels [ROT, D) as pairs, unturned
        turned = offs < ROT // 2
        if INTERLEAVED:
            lo_ch = tl.where(turned, 2 * offs, offs + ROT // 2)
            hi_ch = tl.where(turned, 2 * offs + 1, offs + D // 2)
        else:
            lo_ch = tl.where(turned, offs, offs + ROT // 2)
            hi_ch = tl.where(turned, offs + ROT // 2, offs + D // 2)
    dt = q_ptr.dtype.element_ty
    src = qkv_ptr + t * qkv_stride + h * D
    lo = tl.load(src + lo_ch, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(src + hi_ch, mask=mask, other=0.0).to(tl.float32)
    if h >= HQ + HKV:
        dst = v_ptr + (t * HKV + h - HQ - HKV) * D
        tl.store(dst + lo_ch, lo.to(dt), mask=mask)
        tl.store(dst + hi_ch, hi.to(dt), mask=mask)
    else:
        if NORM:
            inv = tl.rsqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / D + eps)
            w = norm_ptr + (h >= HQ).to(tl.int32) * D  # q_norm's row for query heads, k_norm's for key heads
            lo = _normed(lo * inv, tl.load(w + lo_ch, mask=mask, other=0.0).to(tl.float32), dt, UNIT_OFFSET)
            hi = _normed(hi * inv, tl.load(w + hi_ch, mask=mask, other=0.0).to(tl.float32), dt, UNIT_OFFSET)
        # the tables' row: ROT channels, the pair's angle at j (rotate-half also at j + ROT/2, interleaved: the
        # first half turns both channels, as GLM's apply_rotary_pos_emb reads it)
        pos = tl.load(pos_ptr + t)
        row_mask = mask & (offs < ROT // 2)
        c_lo = tl.load(cos_ptr + pos * ROT + offs, mask=row_mask, other=1.0).to(tl.float32)
        s_lo = tl.load(sin_ptr + pos * ROT + offs, mask=row_mask, other=0.0).to(tl.float32)
        if INTERLEAVED:
            c_hi = c_lo
            s_hi = s_lo
        else:
            c_hi = tl.load(cos_ptr + pos * ROT + ROT // 2 + offs, mask=row_mask, other=1.0).to(tl.float32)
            s_hi = tl.load(sin_ptr + pos * ROT + ROT // 2 + offs, mask=row_mask, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin with each product and the sum rounded, as transformers computes it
        out_lo = _round(_round(lo * c_lo, dt) - _round(hi * s_lo, dt), dt)
        out_hi = _round(_round(hi * c_hi, dt) + _round(lo * s_hi, dt), dt)
        if ROT < D:  # pass-through channels keep their (normed) values
            out_lo = tl.where(offs < ROT // 2, out_lo, lo)
            out_hi = tl.where(offs < ROT // 2, out_hi, hi)
        if h < HQ:
            dst = q_ptr + (t * HQ + h) * D
        else:
            dst = k_ptr + (t * HKV + h - HQ) * D
        tl.store(dst + lo_ch, out_lo.to(dt), mask=mask)
        tl.store(dst + hi_ch, out_hi.to(dt), mask=mask)


def rope_qkv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             heads: tuple[int, int], head_dim: int, qk_norm: torch.Tensor | None = None,
             eps: float = 1e-6, interleaved: bool = False,
             unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rope_qkv_reference`` in one launch (qkv with unit column stride; cos / sin contiguous)."""
    hq, hkv = heads
    n = qkv.shape[0]
    q = torch.empty((n, hq, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((n, hkv, head_dim), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty((n, hkv, head_dim), dtype=qkv.dtype, device=qkv.device)
    if n:
        _rope_qkv_kernel[(n, hq + 2 * hkv)](
            qkv, positions, cos, sin, qk_norm if qk_norm is not None else cos, q, k, v, qkv.stride(0), eps,
            HQ=hq, HKV=hkv, D=head_dim, HALF=triton.next_power_of_2(head_dim // 2), ROT=cos.shape[-1],
            INTERLEAVED=interleaved, NORM=qk_norm is not None, UNIT_OFFSET=unit_offset,
            num_warps=1 if head_dim <= 128 else 2, **pdl.launch_options(qkv.device))
    return q, k, v
