"""Split key rows in the paged pool: a layer's keys at two widths (quant.SplitWidth) in its pages of codes.

A layer whose keys are split ``hi_bits x m + bits`` (the first m rotated channels at hi_bits, the other D - m at
bits, one scale and zero point each: quant.quantize_split) stores ``row_bytes`` bytes a key row.  A row's bytes, as
``pack`` gives them:

    [0, D bits/8)        the row as a plain ``bits``-wide row over all D channels (quant.pack_codes); the first m
                         channels hold the low ``bits`` bits of their hi_bits codes
    then its tail:
    +0, +1               the first part's float16 scale (little-endian)
    +2                   its uint8 zero point
    +3 ...               the first m channels' upper e = hi_bits - bits bits: e planes of m/8 bytes, plane p holding
                         bit p of (code >> bits) one bit a channel (quant.pack_codes at 1 bit: byte j, bit k holds
                         channel j + k m/8)

In the pool a page's P rows of one KV head (its P * row_bytes contiguous bytes, ``k_codes[l][page, head]``) hold the
P plain rows first, exactly as a plain page at ``bits`` does, then the P tails (``tile_views``).  The second part's
scale and zero point are the layer's ordinary metadata, group 0 of ``k_scale`` / ``k_zero`` (groups past the first
stay unused when the pool's group size is below D).

Why this layout: the kernels read a page as P rows of one plain width (common.code_slices; the CUDA kernel streams
whole pages with 16-byte loads) and the write kernel packs rows of a power-of-two width; the second part alone
(D - m channels: 112 or 96 at D = 128) is not a power of two.  Reading the rows at the narrow width keeps every
kernel's loads and alignment as they are; the first part's channels then gain their upper bits from the tails, and
the scores sum the two parts with queries masked to each part's channels.  The bytes are exactly the two parts'
codes and two groups of metadata, as memory.bits_per_element counts a split row (one group in the tail, one in
``k_scale`` / ``k_zero``), when the pool's group size is D; below it the layer's unused groups cost 3 bytes each
(PoolGeometry counts them).
"""

from __future__ import annotations

import torch

from ..quant import QuantizedRows, SplitRows, SplitWidth, pack_codes, quantize_rows, unpack_codes

# the first part's float16 scale and uint8 zero point
TAIL_METADATA_BYTES = 3


def upper_bits(width: SplitWidth) -> int:
    """e: the bits the first part's codes have beyond the row's plain width."""
    return width.hi_bits - width.bits


def tail_bytes(width: SplitWidth) -> int:
    """Bytes of a row's tail: the first part's scale, zero point and upper bits."""
    return TAIL_METADATA_BYTES + width.hi_dims * upper_bits(width) // 8


def row_bytes(width: SplitWidth, head_dim: int) -> int:
    """Bytes of one stored key row (the module docstring)."""
    return head_dim * width.bits // 8 + tail_bytes(width)


def tile_views(codes: torch.Tensor, width: SplitWidth, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (plain rows [..., P, D bits/8], tails [..., P, tail_bytes]) of a pool's key pages ``codes`` [..., P,
    row_bytes] (each page's rows contiguous), as the module docstring lays them out."""
    p, plain = codes.shape[-2], head_dim * width.bits // 8
    if codes.shape[-1] != row_bytes(width, head_dim) or codes.stride(-1) != 1 or codes.stride(-2) != codes.shape[-1]:
        raise ValueError(f"split key pages need contiguous rows of {row_bytes(width, head_dim)} bytes, got shape "
                         f"{tuple(codes.shape)} strides {codes.stride()}")
    flat = codes.flatten(-2)
    return flat[..., :p * plain].unflatten(-1, (p, plain)), flat[..., p * plain:].unflatten(-1, (p, -1))


def store_rows(codes: torch.Tensor, index, rows: torch.Tensor, width: SplitWidth, head_dim: int) -> None:
    """Write stored rows (``pack``'s form, [..., row_bytes]) into key pages ``codes`` [..., P, row_bytes] at
    ``index`` (a tuple indexing the pages' leading dims and the token within the page, as codes[index] would)."""
    plain, tail = tile_views(codes, width, head_dim)
    n = plain.shape[-1]
    plain[index] = rows[..., :n]
    tail[index] = rows[..., n:]


def load_rows(codes: torch.Tensor, index, width: SplitWidth, head_dim: int) -> torch.Tensor:
    """Stored rows (``pack``'s form) read from key pages ``codes`` at ``index`` (``store_rows``' inverse)."""
    plain, tail = tile_views(codes, width, head_dim)
    return torch.cat([plain[index], tail[index]], -1)


def head_dim_of(width: SplitWidth, nbytes: int) -> int:
    """D of stored rows of ``nbytes`` bytes (``row_bytes``' inverse)."""
    return (nbytes - TAIL_METADATA_BYTES - width.hi_dims * upper_bits(width) // 8) * 8 // width.bits


def clip_indices(ratios: torch.Tensor | float, width: SplitWidth, head_dim: int,
                 shape: tuple[int, ...]) -> torch.Tensor:
    """int32 [*shape, 2]: each part's clip index floor(c * n) clamped to [0, n - 1] for n = m and D - m channels,
    as quant.clip_rows computes it for that part (quant.quantize_split clips each part at the same ratio)."""
    r = torch.as_tensor(ratios, dtype=torch.float64)
    parts = [(r * n).floor().clamp(0, n - 1) for n in (width.hi_dims, head_dim - width.hi_dims)]
    return torch.stack([p.expand(shape) for p in parts], -1).to(torch.int32).contiguous()


def quantize_indexed(x: torch.Tensor, width: SplitWidth, clip_idx: torch.Tensor,
                     rescale: float = 0.0) -> SplitRows:
    """quant.quantize_split of rows [..., D] with each part clipped at its clip index (``clip_indices``, broadcast
    to x.shape[:-1] + (2,)): the same rows quantize_split gives for the ratio the indices came from."""
    m = width.hi_dims
    idx = clip_idx.to(x.device).long().expand(*x.shape[:-1], 2)
    out = []
    for part, bits, i in ((x[..., :m].float(), width.hi_bits, idx[..., 0]), (x[..., m:].float(), width.bits,
                                                                               idx[..., 1])):
        tau = part.abs().sort(-1).values.gather(-1, i.unsqueeze(-1))
        clipped = torch.maximum(torch.minimum(part, tau), -tau)
        out.append(quantize_rows(clipped, bits, part.shape[-1], 1.0, rescale, exact=part))
    return SplitRows(*out)


def pack(rows: SplitRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stored rows of SplitRows: (codes uint8 [..., row_bytes], a row's plain part then its tail; the second part's
    scale float16 [..., 1] and zero point uint8 [..., 1]).  In the pool: ``store_rows``."""
    width = rows.width
    hi = unpack_codes(rows.hi.codes, width.hi_bits).to(torch.int32)
    lo = unpack_codes(rows.lo.codes, width.bits).to(torch.int32)
    base = torch.cat([hi & ((1 << width.bits) - 1), lo], -1)
    upper = hi >> width.bits
    planes = [pack_codes((upper >> p) & 1, 1) for p in range(upper_bits(width))]
    meta = torch.cat([rows.hi.scale.view(torch.uint8), rows.hi.zero], -1)
    codes = torch.cat([pack_codes(base, width.bits), meta, *planes], -1)
    return codes, rows.lo.scale, rows.lo.zero


def unpack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, width: SplitWidth,
           head_dim: int) -> SplitRows:
    """The SplitRows of stored rows (``pack``'s inverse); scale / zero: the layer's metadata, group 0 read."""
    m, plain = width.hi_dims, head_dim * width.bits // 8
    base = unpack_codes(codes[..., :plain].contiguous(), width.bits).to(torch.int32)
    hi_scale = codes[..., plain:plain + 2].contiguous().view(torch.float16)
    hi_zero = codes[..., plain + 2:plain + 3]
    upper = torch.zeros_like(base[..., :m])
    start = plain + TAIL_METADATA_BYTES
    for p in range(upper_bits(width)):
        plane = codes[..., start + p * m // 8:start + (p + 1) * m // 8].contiguous()
        upper |= unpack_codes(plane, 1).to(torch.int32) << p
    hi = (base[..., :m] | (upper << width.bits)).to(torch.uint8)
    lo = base[..., m:].to(torch.uint8)
    return SplitRows(QuantizedRows(pack_codes(hi, width.hi_bits), hi_scale, hi_zero.contiguous(), width.hi_bits, m),
                     QuantizedRows(pack_codes(lo, width.bits), scale[..., :1].contiguous(), zero[..., :1].contiguous(),
                                   width.bits, head_dim - m))
