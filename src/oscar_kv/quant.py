"""Reference (torch) quantizer for KV rows: clip, asymmetric INT2/INT3/INT4/INT5/INT8, packing.

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
  * INT5 codes (keys only: allocation.KEY_WIDTHS) are two bit planes, ``5 * D / 8`` bytes: first the low four bits
    of every code, stride-packed as INT4 (``D / 2`` bytes: byte j holds channel j in the low nibble and channel
    ``j + D/2`` in the high nibble), then the high (fifth) bit, stride-packed as 1-bit codes as INT3's high plane
    (``D / 8`` bytes: byte j holds channel ``j + m * D/8`` in bit m).  So ``pack_codes(codes, 5)`` is
    ``cat(pack_codes(codes & 15, 4), pack_codes(codes >> 4, 1))``; a kernel reads the INT4 plane as it reads INT4
    and adds 16 x the high bit.  INT3 and INT5 need a head dim that is a multiple of 8 (their high-bit plane).
  * scale and zero point per group of G contiguous channels (``D // G`` of each per row): a float16 scale s and a
    uint8 zero point z in units of 2^-F of the scale, F = ``fraction_bits(bits)`` (8 - bits below 8 bits, 0 at 8).
    x_hat = s * (code - z 2^-F); the group's minimum is -s z 2^-F.  24 metadata bits a group (a float16 minimum
    took 32).

The zero point (``grid_metadata``).  The group's range is widened to hold 0 (lo = min(x, 0), hi = max(x, 0)); with
zmax = 2^F L (L = 2^bits - 1 levels; below 8 bits zmax = 2^8 - 2^F fits a uint8, 248 at 5 bits) the exact zero point
t = zmax (-lo) / (hi - lo) is rounded down and up, each candidate z gets the least scale whose grid reaches both ends,
max((-lo) 2^F / z, hi 2^F / (zmax - z)), and the candidate needing the smaller scale wins (the floor on a tie).  The
grid covers the group, a zero group is stored exactly (scale 0) and nothing is shared between a group's channels: the
only cost against a float16 minimum is the scale's growth, at most 1 / (1 - 2^(1-F) / L) (+1.05% at 2 bits).
benchmarks/NOTES.md, run Z1: key and value noise +0.1-0.6% at the median, 7-24% less at 8 bits (a float16 minimum's
rounding is an offset shared by the group).  Every step is one IEEE float32 operation (products by powers of two and integers below 2^8 are exact, the
divisions are tensor by tensor), so the write kernel reproduces it bit for bit on every device.  s z 2^-F is exact
in float32 (11 x 8 significant bits), so x_hat = s (c - z 2^-F) = c s + minimum is one rounding whichever way a
kernel computes it.

Codes are computed against the *stored* (float16-rounded) scale: code = round-half-even(x / s + z 2^-F), clamped
to [0, L], so dequantization with the stored metadata is the nearest level of the clipped row.

With ``rescale`` = g in (0, 1] the stored scale of each group is then multiplied by 1 + g (alpha - 1), alpha =
<x, x> / <x, x_hat> (x the unclipped group, x_hat its reconstruction; float64 arithmetic, alpha clamped to [1/2, 2],
the factor rounded to float32, the product rounded to float16); the zero point stays, so the minimum scales with
it.  Clipping shrinks a row's largest components, so x_hat's component along x falls short of |x|: a query aligned
with the row (the one that retrieves it) sees its logit shrink.  g = 1 makes the reconstruction's projection
on x equal |x|; smaller g takes back that share of the shrink (the rescale also scales the noise).  No storage
or kernel cost: the codes are the same, only the float16 scale changes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from .errors import ConfigError, NonFiniteActivations

METADATA_DTYPE = torch.float16
SUPPORTED_BITS = (2, 3, 4, 5, 8)
_F16_MAX = 65504.0
RESCALE_RANGE = (0.5, 2.0)


def fraction_bits(bits: int) -> int:
    """F: a ``bits``-wide code's zero point counts 2^-F of the scale (z < 2^8 spans the L = 2^bits - 1 levels)."""
    return 8 - bits if bits < 8 else 0


@dataclass
class QuantizedRows:
    """Packed codes plus per-group float16 scale / uint8 zero point for a batch of rows (leading dims free)."""

    codes: torch.Tensor  # uint8 [..., D * bits / 8]
    scale: torch.Tensor  # float16 [..., D // G]
    # uint8 [..., D // G]: the zero point, in units of 2^-fraction_bits(bits) of the scale; float16: the group's
    # minimum itself (KIVI's own format, quantize_rows(float_minimum=True))
    zero: torch.Tensor
    bits: int
    group_size: int

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1] * 8 // self.bits

    @property
    def minimum(self) -> torch.Tensor:
        """Each group's minimum -s z 2^-F (or the stored float16 minimum), float32 (exact)."""
        if self.zero.dtype == METADATA_DTYPE:
            return self.zero.float()
        return stored_minimum(self.scale, self.zero, self.bits)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    def select(self, index) -> "QuantizedRows":
        """Index the leading dimensions of all three tensors alike (e.g. a token range)."""
        return QuantizedRows(self.codes[index], self.scale[index], self.zero[index], self.bits, self.group_size)


def stored_minimum(scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """-s z 2^-F in float32: exact (an 11-bit scale times an 8-bit integer times a power of two)."""
    return -(scale.float() * zero.float()) * 2.0 ** -fraction_bits(bits)


def check_geometry(head_dim: int, group_size: int, bits: int) -> None:
    """Raise ConfigError unless ``bits`` is supported, ``group_size`` divides ``head_dim`` and a row's codes fill
    whole bytes."""
    if bits not in SUPPORTED_BITS:
        raise ConfigError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size <= 0 or head_dim % group_size != 0:
        raise ConfigError(f"group size {group_size} must divide the head dim {head_dim}")
    multiple = 8 if bits in (3, 5) else 8 // bits  # INT3's and INT5's high-bit planes pack 8 channels per byte
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
    """Stride-pack integer codes (last dim D) into uint8, ``8 // bits`` codes per byte (INT3, INT5: two bit planes,
    the low 2 / 4 bits as INT2 / INT4, then the high bit)."""
    if bits in (3, 5):
        codes, low = codes.to(torch.uint8), bits - 1
        return torch.cat([pack_codes(codes & ((1 << low) - 1), low), pack_codes(codes >> low, 1)], dim=-1)
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
    if bits in (3, 5):
        d, low = packed.shape[-1] * 8 // bits, bits - 1
        plane = d * low // 8  # bytes of the low plane
        return unpack_codes(packed[..., :plane], low) | (unpack_codes(packed[..., plane:], 1) << low)
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    mask = (1 << bits) - 1
    parts = [(packed >> (k * bits)) & mask for k in range(per_byte)]
    return torch.cat(parts, dim=-1)


def grid_metadata(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 scale (before its float16 rounding) and the zero point of groups spanning [lo, hi] (module
    docstring, "The zero point"); every operation is one IEEE float32 step, as the write kernel does them.

    Shapes:
        lo, hi: float32 [...] (the groups' minima and maxima, within float16's range).
    Returns:
        (scale float32 [...], zero point float32 [...], an integer in [0, 2^F L]).
    """
    levels, frac = (1 << bits) - 1, float(1 << fraction_bits(bits))
    z_max = levels * frac
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    span = hi - lo
    t = torch.where(span > 0, (lo * -z_max) / torch.where(span > 0, span, torch.ones_like(span)),
                    torch.zeros_like(span))
    below_num, above_num = lo * -frac, hi * frac  # exact: powers of two

    def needed(z):  # the least scale whose grid holds [lo, hi] with this zero point
        below = torch.where(z > 0, below_num / torch.where(z > 0, z, torch.ones_like(z)),
                            torch.where(lo < 0, torch.full_like(z, torch.inf), torch.zeros_like(z)))
        room = z_max - z
        above = torch.where(room > 0, above_num / torch.where(room > 0, room, torch.ones_like(room)),
                            torch.where(hi > 0, torch.full_like(z, torch.inf), torch.zeros_like(z)))
        return torch.maximum(below, above)

    z_floor, z_ceil = t.floor().clamp(0, z_max), t.ceil().clamp(0, z_max)
    s_floor, s_ceil = needed(z_floor), needed(z_ceil)
    take_floor = s_floor <= s_ceil
    scale = torch.where(take_floor, s_floor, s_ceil)
    # A zero group's scale is +0.0: with -0.0 in the group (or made by the clip, whose -tau is -0.0 at tau = 0) the
    # CPU's torch.maximum keeps one zero or the other depending on the tensor's size (its vectorized loop).
    return torch.where(scale > 0, scale, 0.0), torch.where(take_floor, z_floor, z_ceil)


def quantize_rows(x: torch.Tensor, bits: int = 2, group_size: int | None = None,
                  clip_ratio: float | torch.Tensor = 1.0, rescale: float = 0.0,
                  exact: torch.Tensor | None = None, float_minimum: bool = False) -> QuantizedRows:
    """Clip then asymmetrically quantize each row of ``x`` per group of channels (module docstring).

    Args:
        x: rows to quantize; NaN or Inf raises NonFiniteActivations.
        bits: 2, 3, 4, 5 or 8.
        group_size: channels sharing one scale / zero point (default: the whole row).
        clip_ratio: see :func:`clip_rows`.
        rescale: the strength g of the scale rescale (module docstring); 0: none.
        exact: the unclipped rows the rescale aims at when ``x`` arrives clipped already (calibration clips
            once for many candidate ratios); default ``x``.
        float_minimum: KIVI's own format instead of the zero point: the grid spans the group's [min, max] (not
            widened to hold 0) and ``zero`` holds the float16 minimum.  A group far from 0 (KIVI's per-channel keys
            of a model with key biases, such as Qwen2.5's) loses most of its levels to a grid that must reach 0.
    Shapes:
        x, exact: [..., D] (exact broadcastable to x).
    Returns:
        QuantizedRows: codes uint8 [..., D * bits / 8], scale float16 and zero uint8 [..., D // group_size].
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
    if float_minimum:
        if rescale:
            raise ConfigError("the scale rescale is defined for the zero point format only")
        minimum = lo.to(METADATA_DTYPE)
        scale = ((hi - minimum.float()) / levels).clamp(max=_F16_MAX).to(METADATA_DTYPE)
        safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(lo))
        codes = ((groups - minimum.float().unsqueeze(-1)) / safe.unsqueeze(-1)).round().clamp(0, levels)
        return QuantizedRows(pack_codes(codes.reshape(xf.shape).to(torch.uint8), bits), scale, minimum, bits,
                             group_size)
    step, zero = grid_metadata(lo, hi, bits)
    scale = step.clamp(max=_F16_MAX).to(METADATA_DTYPE)
    # A zero group has scale 0: every code is z 2^-F rounded, x_hat = 0.
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(lo))
    offset = zero * 2.0 ** -fraction_bits(bits)
    codes = (groups / safe.unsqueeze(-1) + offset.unsqueeze(-1)).round().clamp(0, levels)
    zero = zero.to(torch.uint8)
    if rescale:
        target = (x if exact is None else exact).float().expand_as(xf).reshape(groups.shape)
        scale = rescaled_scale(target, codes, scale, zero, bits, rescale)
    codes = codes.reshape(xf.shape).to(torch.uint8)
    return QuantizedRows(pack_codes(codes, bits), scale, zero, bits, group_size)


def check_rescale(strength: float) -> float:
    """The strength as its float32 value (what a kernel receives), after checking it lies in [0, 1]."""
    if not 0.0 <= float(strength) <= 1.0:
        raise ConfigError(f"rescale strength must lie in [0, 1], got {strength}")
    return struct.unpack("f", struct.pack("f", float(strength)))[0]


def rescaled_scale(exact: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                   strength: float = 1.0) -> torch.Tensor:
    """The scale times 1 + strength (alpha - 1), alpha = <x, x> / <x, x_hat> per group (the zero point stays).

    The products in float64 are exact, so only the order of the sums differs between devices; the strength
    enters as its float32 value, as the kernels receive it.

    Args:
        exact: the unclipped rows x, split into groups.
        codes: their codes (unpacked, any number type).
        scale, zero: the groups' stored metadata at ``bits``.
        strength: g in [0, 1].
    Shapes:
        exact, codes: [..., NG, G]; scale float16, zero uint8: [..., NG].
    Returns:
        the scale, float16 [..., NG].
    """
    x = exact.double()
    x_hat = codes.double() * scale.double().unsqueeze(-1) + stored_minimum(scale, zero, bits).double().unsqueeze(-1)
    num, den = (x * x).sum(-1), (x * x_hat).sum(-1)
    alpha = torch.where(den > 0, num / den.clamp_min(1e-300), torch.ones_like(num)).clamp(*RESCALE_RANGE)
    g = check_rescale(strength)
    alpha = (1.0 + g * (alpha - 1.0)).float()
    return (alpha * scale.float()).clamp(-_F16_MAX, _F16_MAX).to(METADATA_DTYPE)


def dequantize_rows(q: QuantizedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """code * scale + minimum per group: the rows [..., D] in ``dtype``."""
    codes = unpack_codes(q.codes, q.bits).float()
    d = codes.shape[-1]
    groups = codes.reshape(*codes.shape[:-1], d // q.group_size, q.group_size)
    out = groups * q.scale.float().unsqueeze(-1) + q.minimum.unsqueeze(-1)
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


@dataclass(frozen=True)
class SplitWidth:
    """Keys stored at two widths (allocation.py, "Split keys"): the first ``hi_dims`` channels of a rotated row (the
    queries' top eigen-directions, rotation.compose_split) at ``hi_bits``, the other ``D - hi_dims`` at ``bits``;
    each part is one group with its own scale and zero point."""

    bits: int
    hi_dims: int
    hi_bits: int

    def __str__(self) -> str:  # e.g. "4x32+2": 32 channels at 4 bits, the rest at 2
        return f"{self.hi_bits}x{self.hi_dims}+{self.bits}"

    def code_bits(self, head_dim: int) -> float:
        """Mean code bits per element of a row (metadata not counted)."""
        return (self.hi_dims * self.hi_bits + (head_dim - self.hi_dims) * self.bits) / head_dim

    def check(self, head_dim: int) -> None:
        """Raise ConfigError unless both parts pack (quant.check_geometry) and the first part is the wider."""
        if not 0 < self.hi_dims < head_dim or self.hi_bits <= self.bits:
            raise ConfigError(f"a split key width needs 0 < hi_dims < {head_dim} and hi_bits > bits, got {self}")
        check_geometry(self.hi_dims, self.hi_dims, self.hi_bits)
        check_geometry(head_dim - self.hi_dims, head_dim - self.hi_dims, self.bits)


def parse_key_width(text: str) -> int | SplitWidth:
    """A key width as written: bits ("3") or a split width ("4x16+2": 16 channels at 4 bits, the rest at 2);
    ValueError otherwise (the split's fit to a head dim is SplitWidth.check's)."""
    try:
        if "x" not in text:
            return int(text)
        wide, rest = text.split("x")
        dims, narrow = rest.split("+")
        return SplitWidth(int(narrow), int(dims), int(wide))
    except ValueError:
        raise ValueError(f"a key width is bits (e.g. 3) or a split width WIDExCHANNELS+NARROW (e.g. 4x16+2), "
                         f"not {text!r}") from None


@dataclass
class SplitRows:
    """Rows stored at a SplitWidth: the first part's QuantizedRows and the rest's (each one group per row)."""

    hi: QuantizedRows
    lo: QuantizedRows

    @property
    def width(self) -> SplitWidth:
        return SplitWidth(self.lo.bits, self.hi.head_dim, self.hi.bits)

    def nbytes(self) -> int:
        return self.hi.nbytes() + self.lo.nbytes()

    def select(self, index) -> "SplitRows":
        return SplitRows(self.hi.select(index), self.lo.select(index))


def quantize_split(x: torch.Tensor, width: SplitWidth, clip_ratio: float | torch.Tensor = 1.0,
                   rescale: float = 0.0) -> SplitRows:
    """Quantize each row's two parts at their widths, each clipped at ``clip_ratio`` of its own |x| (quantize_rows).

    Shapes:
        x: [..., D]; clip_ratio as quantize_rows takes it.
    """
    width.check(x.shape[-1])
    m = width.hi_dims
    return SplitRows(quantize_rows(x[..., :m], width.hi_bits, m, clip_ratio, rescale),
                     quantize_rows(x[..., m:], width.bits, x.shape[-1] - m, clip_ratio, rescale))


def dequantize_split(q: SplitRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The rows [..., D] in ``dtype``: both parts dequantized, side by side."""
    return torch.cat([dequantize_rows(q.hi, dtype), dequantize_rows(q.lo, dtype)], -1)


def cat_rows(a: QuantizedRows | SplitRows, b: QuantizedRows | SplitRows, dim: int) -> QuantizedRows | SplitRows:
    """Two stores of rows joined along ``dim`` (e.g. tokens)."""
    if isinstance(a, SplitRows):
        return SplitRows(cat_rows(a.hi, b.hi, dim), cat_rows(a.lo, b.lo, dim))
    return QuantizedRows(torch.cat([a.codes, b.codes], dim), torch.cat([a.scale, b.scale], dim),
                         torch.cat([a.zero, b.zero], dim), a.bits, a.group_size)


def fake_quantize_width(x: torch.Tensor, width: int | SplitWidth, group_size: int | None = None,
                        clip_ratio: float | torch.Tensor = 1.0, rescale: float = 0.0) -> torch.Tensor:
    """fake_quantize at a plain width, or both parts of a SplitWidth (``group_size`` applies to plain widths)."""
    if isinstance(width, SplitWidth):
        return dequantize_split(quantize_split(x, width, clip_ratio, rescale), x.dtype)
    return fake_quantize(x, width, group_size, clip_ratio, rescale)
