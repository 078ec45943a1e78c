"""Reference (torch) quantizer for KV rows: clip, asymmetric INT2/INT3/INT4/INT8, packing.

This module is the specification the Triton kernels are tested against.

Layout of one quantized row (one token x one KV head, D channels, group size G):
  * codes: ``D * bits / 8`` uint8 bytes, **stride-packed**: with ``n = 8 // bits`` codes per byte,
    byte ``j`` (0 <= j < D/n) holds channel ``j + k * D/n`` in bits ``[k*bits, (k+1)*bits)`` for
    k = 0..n-1.  For INT2 and D=128: byte j holds channels j, j+32, j+64, j+96 in bit pairs
    0-1, 2-3, 4-5, 6-7.  Unpacking yields n contiguous channel slices, which lets a kernel
    dot each slice with a contiguous slice of the query instead of interleaving lanes.
  * INT3 codes are two bit planes, ``3 * D / 8`` bytes: first the low two bits of every code, stride-packed as
    INT2 (``D / 4`` bytes), then the high bit, stride-packed as 1-bit codes (``D / 8`` bytes: byte j holds channel
    ``j + k * D/8`` in bit k).  A kernel reads the INT2 plane as it reads INT2 and adds 4 x the high bit.
  * scale and minimum: one float16 each per group of G contiguous channels
    (``D // G`` of each per row).  x_hat = code * scale + minimum.

Codes are computed against the *stored* (float16-rounded) scale and minimum, so dequantization
with the stored metadata is the nearest-level reconstruction of the clipped row.

With ``rescale`` = g in (0, 1] the stored scale and minimum of each group are then multiplied by
1 + g (alpha - 1), alpha = <x, x> / <x, x_hat> (x the unclipped group, x_hat its reconstruction; float64
arithmetic, alpha clamped to [1/2, 2], the factor rounded to float32, each product rounded to float16).
Clipping shrinks a row's largest components, so x_hat's component along x falls short of |x|: a query aligned
with the row (the one that retrieves it) sees its logit shrink.  g = 1 makes the reconstruction's projection
on x equal |x|; smaller g takes back that share of the shrink (the rescale also scales the noise).  No storage
or kernel cost: the codes are the same, only the two float16 numbers change.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from .errors import ConfigError, NonFiniteActivations

METADATA_DTYPE = torch.float16
SUPPORTED_BITS = (2, 3, 4, 8)
_F16_MAX = 65504.0
RESCALE_RANGE = (0.5, 2.0)


@dataclass
class QuantizedRows:
    """Packed codes plus per-group float16 scale/minimum for a batch of rows (leading dims free)."""

    codes: torch.Tensor  # uint8 [..., D * bits / 8]
    scale: torch.Tensor  # float16 [..., D // G]
    minimum: torch.Tensor  # float16 [..., D // G]
    bits: int
    group_size: int

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1] * 8 // self.bits

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.minimum))

    def select(self, index) -> "QuantizedRows":
        """Index the leading dimensions of all three tensors alike (e.g. a token range)."""
        return QuantizedRows(self.codes[index], self.scale[index], self.minimum[index], self.bits, self.group_size)


def check_geometry(head_dim: int, group_size: int, bits: int) -> None:
    """Raise ConfigError unless ``bits`` is supported, ``group_size`` divides ``head_dim`` and a row's codes fill
    whole bytes."""
    if bits not in SUPPORTED_BITS:
        raise ConfigError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size <= 0 or head_dim % group_size != 0:
        raise ConfigError(f"group size {group_size} must divide the head dim {head_dim}")
    multiple = 8 if bits == 3 else 8 // bits  # INT3's high-bit plane packs 8 channels per byte
    if head_dim % multiple != 0:
        raise ConfigError(f"head dim {head_dim} must be a multiple of {multiple} for {bits}-bit packing")


def clip_index(head_dim: int, ratio: float) -> int:
    """Index into the ascending |x| of a row whose value is the clip threshold."""
    return min(max(int(ratio * head_dim), 0), head_dim - 1)


def clip_rows(x: torch.Tensor, ratio: float | torch.Tensor) -> torch.Tensor:
    """Symmetrically clamp every row (last dim) at its ``ratio`` quantile of |x|.

    The threshold is the (floor(ratio*D))-th smallest |x| of the row; a ratio of 1.0 leaves rows unchanged.

    Args:
        x: rows to clip.
        ratio: one ratio, or a tensor of them (per layer / head).
    Shapes:
        x: [..., D]; ratio: broadcastable to ``x.shape[:-1]``.
    Returns:
        The clipped rows, x's shape and dtype.
    """
    d = x.shape[-1]
    sorted_abs = x.abs().sort(dim=-1).values
    if isinstance(ratio, torch.Tensor):
        idx = (ratio.to(x.device, torch.float64) * d).floor().clamp(0, d - 1).long()
        idx = idx.expand(x.shape[:-1]).unsqueeze(-1)
        tau = sorted_abs.gather(-1, idx)
    else:
        tau = sorted_abs[..., clip_index(d, ratio) : clip_index(d, ratio) + 1]
    return torch.maximum(torch.minimum(x, tau), -tau)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Stride-pack integer codes (last dim D) into uint8, ``8 // bits`` codes per byte (INT3: two bit planes)."""
    if bits == 3:
        codes = codes.to(torch.uint8)
        return torch.cat([pack_codes(codes & 3, 2), pack_codes(codes >> 2, 1)], dim=-1)
    per_byte = 8 // bits
    if per_byte == 1:
        return codes.to(torch.uint8)
    d = codes.shape[-1]
    slices = codes.to(torch.uint8).reshape(*codes.shape[:-1], per_byte, d // per_byte)
    packed = torch.zeros_like(slices[..., 0, :])
    for k in range(per_byte):
        packed |= slices[..., k, :] << (k * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 [..., D*bits/8] -> uint8 codes [..., D]."""
    if bits == 3:
        d = packed.shape[-1] * 8 // 3
        return unpack_codes(packed[..., :d // 4], 2) | (unpack_codes(packed[..., d // 4:], 1) << 2)
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    mask = (1 << bits) - 1
    parts = [(packed >> (k * bits)) & mask for k in range(per_byte)]
    return torch.cat(parts, dim=-1)


def quantize_rows(x: torch.Tensor, bits: int = 2, group_size: int | None = None,
                  clip_ratio: float | torch.Tensor = 1.0, rescale: float = 0.0,
                  exact: torch.Tensor | None = None) -> QuantizedRows:
    """Clip then asymmetrically quantize each row of ``x`` per group of channels.

    Args:
        x: rows to quantize; NaN or Inf raises NonFiniteActivations.
        bits: 2, 3, 4 or 8.
        group_size: channels sharing one scale / minimum (default: the whole row).
        clip_ratio: see :func:`clip_rows`.
        rescale: the strength g of the metadata rescale (module docstring); 0: none.
        exact: the unclipped rows the rescale aims at when ``x`` arrives clipped already (calibration clips
            once for many candidate ratios); default ``x``.
    Shapes:
        x, exact: [..., D] (exact broadcastable to x).
    Returns:
        QuantizedRows: codes uint8 [..., D * bits / 8], scale and minimum float16 [..., D // group_size].
    """
    d = x.shape[-1]
    group_size = group_size or d
    check_geometry(d, group_size, bits)
    if not torch.isfinite(x).all():
        raise NonFiniteActivations("cannot quantize non-finite KV values (NaN or Inf in the activations)")
    xf = clip_rows(x.float(), clip_ratio) if _clips(clip_ratio) else x.float()
    groups = xf.reshape(*xf.shape[:-1], d // group_size, group_size)
    lo = groups.amin(dim=-1).clamp(-_F16_MAX, _F16_MAX)
    hi = groups.amax(dim=-1).clamp(-_F16_MAX, _F16_MAX)
    levels = (1 << bits) - 1
    minimum = lo.to(METADATA_DTYPE)
    scale = ((hi - minimum.float()) / levels).to(METADATA_DTYPE)
    # A constant group has scale 0: every code is 0 and x_hat = minimum.
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(lo))
    codes = ((groups - minimum.float().unsqueeze(-1)) / safe.unsqueeze(-1)).round().clamp(0, levels)
    if rescale:
        target = (x if exact is None else exact).float().expand_as(xf).reshape(groups.shape)
        scale, minimum = rescaled_metadata(target, codes, scale, minimum, rescale)
    codes = codes.reshape(xf.shape).to(torch.uint8)
    return QuantizedRows(pack_codes(codes, bits), scale, minimum, bits, group_size)


def check_rescale(strength: float) -> float:
    """The strength as its float32 value (what a kernel receives), after checking it lies in [0, 1]."""
    if not 0.0 <= float(strength) <= 1.0:
        raise ConfigError(f"rescale strength must lie in [0, 1], got {strength}")
    return struct.unpack("f", struct.pack("f", float(strength)))[0]


def rescaled_metadata(exact: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                      strength: float = 1.0):
    """Scale and minimum times 1 + strength (alpha - 1), alpha = <x, x> / <x, x_hat> per group.

    The products in float64 are exact, so only the order of the sums differs between devices; the strength
    enters as its float32 value, as the kernels receive it.

    Args:
        exact: the unclipped rows x, split into groups.
        codes: their codes (unpacked, any number type).
        scale, minimum: the groups' stored metadata.
        strength: g in [0, 1].
    Shapes:
        exact, codes: [..., NG, G]; scale, minimum: float16 [..., NG].
    Returns:
        (scale, minimum), float16 [..., NG] each.
    """
    x = exact.double()
    x_hat = codes.double() * scale.double().unsqueeze(-1) + minimum.double().unsqueeze(-1)
    num, den = (x * x).sum(-1), (x * x_hat).sum(-1)
    alpha = torch.where(den > 0, num / den.clamp_min(1e-300), torch.ones_like(num)).clamp(*RESCALE_RANGE)
    g = check_rescale(strength)
    alpha = (1.0 + g * (alpha - 1.0)).float()

    def times_alpha(m):
        return (alpha * m.float()).clamp(-_F16_MAX, _F16_MAX).to(METADATA_DTYPE)

    return times_alpha(scale), times_alpha(minimum)


def dequantize_rows(q: QuantizedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """code * scale + minimum per group: the rows [..., D] in ``dtype``."""
    codes = unpack_codes(q.codes, q.bits).float()
    d = codes.shape[-1]
    groups = codes.reshape(*codes.shape[:-1], d // q.group_size, q.group_size)
    out = groups * q.scale.float().unsqueeze(-1) + q.minimum.float().unsqueeze(-1)
    return out.reshape(codes.shape).to(dtype)


def fake_quantize(x: torch.Tensor, bits: int = 2, group_size: int | None = None,
                  clip_ratio: float | torch.Tensor = 1.0, rescale: float = 0.0,
                  exact: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize and dequantize in one go (for simulation and error probes); arguments as :func:`quantize_rows`.
    Returns x's shape and dtype."""
    return dequantize_rows(quantize_rows(x, bits, group_size, clip_ratio, rescale, exact), x.dtype)


def _clips(ratio: float | torch.Tensor) -> bool:
    if isinstance(ratio, torch.Tensor):
        return bool((ratio < 1.0).any())
    return ratio < 1.0
