"""Fused write path and page migration in Triton.  Specification: reference.write_reference / migrate_reference.

``write_kv``: one launch per layer for a batch of tokens (decode step: one per sequence; prefill chunk: many):
center and rotate K by R_K (float32), then per token and KV head either store BF16 into a window page or
clip + quantize + pack into an INT2 page (values arrive rotated).  ``migrate_pages``: one launch for all
layers and all migrating requests, quantizing whole BF16 recent pages into INT2 pages.  The engine's decode steps
(every token to a window page) take kernels/window_write.py instead, up to ``TUNING.window_write_max_rows``.

The quantizer reproduces quant.quantize_rows bit for bit at 2, 3, 4, 5 or 8 bits (keys and values each at their layer's
width, ``PoolGeometry.layer_widths``; a constexpr, so the INT2 kernel compiles as it did): clip threshold = the
floor(c*D)-th smallest |x| of the row (a sort), each group's min/max in float32, then quant.grid_metadata's rule
step for step (``_grid_metadata``): the range widened to hold 0, the exact zero point t = 2^F L (-lo) / (hi - lo)
rounded down and up, each candidate's least scale max((-lo) 2^F / z, hi 2^F / (2^F L - z)), the smaller one (the
floor on a tie).  Every step is one IEEE float32 operation, rounded alike by torch on any device and by the kernel:
products by a power of two (exact) or by 2^F L, differences, floor / ceil, comparisons, and divisions of a tensor
by a tensor, which torch rounds correctly on every device (CUDA: div.rn) and the kernel does with
``tl.math.div_rn``; no division by a scalar remains, which torch would do through a reciprocal on CUDA.  Masked
denominators are replaced by 1 before dividing, as torch's code does.  Then
scale16 = float16(min(scale, 65504)) rounded half to even (``_f16_rne``), zero point z stored as uint8, code =
round-half-even(x / scale16 + z 2^-F) clamped to [0, L] (scale16 0 -> /1), packed as quant.pack_codes does (INT3 /
INT5: an INT2 / INT4 plane, then a plane of high bits).  A zero scale is stored as +0.0, as torch's rule gives it.

With a rescale strength g > 0 (quant.py: the artifact's ``rescale``) the scale is then multiplied by 1 + g (alpha - 1),
alpha = <x, x> / <x, x_hat> over the unclipped group, x_hat = code scale16 - scale16 z 2^-F (exact in float64); the
zero point stays.  Float64 sums of exact products, so the order of the sums (the only difference from torch) moves
alpha by ~1e-16 and its float32 rounding practically never.

Split keys (``PoolGeometry.k_split``, constexprs K_HI_DIMS / K_HI_BITS, common.key_split; K_HI_DIMS = 0 compiles
the plain path as before): each part of a row is one group quantized by the same steps at its own width, clipped at
its own clip index among its own channels (``_quantize_split_store``: split_keys.quantize_indexed), and the row is
stored as split_keys.py lays it out: the plain row at the narrow width among the page's P rows, its tail (byte by
byte) after them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import check_rescale
from ..rope import RotaryLayout
from . import pdl
from ._compat import install_interpreter_shim
from .tuning import TUNING
from .common import INTERPRET, kernel_widths, key_split, meta_slot, own_value_rows, wait_for_inputs
from .layout import PagedKVPool

install_interpreter_shim()

# Head dims up to this rotate keys with one float32 D x D MMA operand (64 KiB of shared memory at 128); above, in
# four row slices (_write_kernel).  benchmarks/kernel_smem.py prints what each compiles to.
ROTATE_WHOLE_MAX_DIM = 128


@triton.jit
def _f16_rne(x):
    """float32 -> float16 rounding half to even, made explicit (|x| <= 65504): the mantissa is rounded in
    float32 first so the final conversion is exact whatever rounding the hardware path uses at ties."""
    bits = x.to(tl.int32, bitcast=True)
    rn = (bits + 0x0FFF + ((bits >> 13) & 1)) & -8192  # ~0x1FFF: keep 10 mantissa bits
    normal = rn.to(tl.float32, bitcast=True)
    y = tl.abs(x) * 16777216.0  # subnormal float16 range: multiples of 2^-24
    sub = ((y + 12582912.0) - 12582912.0) * 5.9604644775390625e-08
    sub = tl.where(x < 0, sub * -1.0, sub)  # keeps the sign of zero (unary minus is 0 - x)
    return tl.where(tl.abs(x) < 6.103515625e-05, sub, normal).to(tl.float16)


@triton.jit
def _clip_threshold(ax, clip_idx, D: tl.constexpr, SORT: tl.constexpr):
    """The clip_idx-th smallest value of each row of ax [ROWS, D] (ax >= 0)."""
    offs_d = tl.arange(0, D)
    if SORT:
        srt = tl.sort(ax, 1)
        tau = tl.sum(tl.where(offs_d[None, :] == clip_idx, srt, 0.0), 1)
    else:
        # rank of element i = #{j: a_j < a_i} + #{j < i: a_j == a_i}; one element per rank.  Used under the
        # interpreter, where this is one vectorized op and tl.sort is very slow; same result as the sort.
        ai = ax[:, :, None]
        aj = ax[:, None, :]
        before = (offs_d[None, :] < offs_d[:, None])[None, :, :]
        rank = tl.sum(((aj < ai) | ((aj == ai) & before)).to(tl.int32), 2)
        tau = tl.sum(tl.where(rank == clip_idx, ax, 0.0), 1)
    return tau


@triton.jit
def _rescaled(m, alpha):
    return _f16_rne(tl.minimum(tl.maximum(alpha * m, -65504.0), 65504.0))


@triton.jit
def _needed_scale(z, lo, hi, below_num, above_num, ZMAX: tl.constexpr):
    """The least scale whose grid with zero point z (float32 integers in [0, ZMAX]) holds [lo, hi]
    (quant.grid_metadata's ``needed``): the divisions take safe denominators where z or ZMAX - z is 0, whose
    quotients the where drops."""
    below = tl.where(z > 0, tl.math.div_rn(below_num, tl.where(z > 0, z, 1.0)), tl.where(lo < 0, float("inf"), 0.0))
    room = ZMAX - z  # exact: integers
    above = tl.where(room > 0, tl.math.div_rn(above_num, tl.where(room > 0, room, 1.0)),
                     tl.where(hi > 0, float("inf"), 0.0))
    return tl.where(above > below, above, below)


@triton.jit
def _grid_metadata(lo, hi, BITS: tl.constexpr):
    """quant.grid_metadata step for step, one float32 operation each: (float32 scale >= 0, zero point as a float32
    integer in [0, 2^F L]) of groups spanning [lo, hi].  A zero scale comes out +0.0 whatever the signs of the zeros
    in the group, as quant.grid_metadata makes it."""
    FRAC: tl.constexpr = 1 << (8 - BITS)  # 2^F, F = quant.fraction_bits(BITS) = 8 - BITS (0 at 8 bits)
    ZMAX: tl.constexpr = ((1 << BITS) - 1) * FRAC
    lo = tl.minimum(lo, 0.0)
    hi = tl.maximum(hi, 0.0)
    span = hi - lo
    t = tl.where(span > 0, tl.math.div_rn(lo * (-1.0 * ZMAX), tl.where(span > 0, span, 1.0)), 0.0)
    below_num = lo * (-1.0 * FRAC)  # exact: powers of two
    above_num = hi * (1.0 * FRAC)
    z_floor = tl.minimum(tl.maximum(tl.math.floor(t), 0.0), 1.0 * ZMAX)
    z_ceil = tl.minimum(tl.maximum(tl.math.ceil(t), 0.0), 1.0 * ZMAX)
    s_floor = _needed_scale(z_floor, lo, hi, below_num, above_num, ZMAX)
    s_ceil = _needed_scale(z_ceil, lo, hi, below_num, above_num, ZMAX)
    take_floor = s_floor <= s_ceil
    step = tl.where(take_floor, s_floor, s_ceil)
    return tl.where(step > 0, step, 0.0), tl.where(take_floor, z_floor, z_ceil)


@triton.jit
def _stride_pack(code, ROWS: tl.constexpr, D: tl.constexpr, B: tl.constexpr):
    """int32 codes [ROWS, D] of B bits (1, 2 or 4) -> uint8 [ROWS, D*B/8]: byte j = sum_k c[j + k*D*B/8] << kB."""
    N: tl.constexpr = 8 // B  # codes per byte
    W: tl.constexpr = D // N  # bytes per row
    code = tl.reshape(code, [ROWS, N, W])
    shift = (B * tl.arange(0, N))[None, :, None]
    return tl.sum(code << shift, 1).to(tl.uint8)


@triton.jit
def _alpha(num, den, strength):
    """The rescale factor 1 + g (alpha - 1) in float32 of groups with float64 sums num = <x, x>, den = <x, x_hat>
    (quant.rescaled_scale): alpha clamped to [0.5, 2], 1 where den <= 0."""
    alpha = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 1.0)
    alpha = tl.minimum(tl.maximum(alpha, 0.5), 2.0)
    return (1.0 + (alpha - 1.0) * strength).to(tl.float32)  # float64: the float32 strength widens


@triton.jit
def _store_codes(code, rmask, Codes, crow, ROWS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Pack int32 codes of ROWS rows of D channels (any shape holding them in row order: [ROWS, D] or
    [ROWS, NG, G]) at BITS bits as quant.pack_codes does and store them at Codes+crow (D*BITS/8 bytes a row)."""
    D4: tl.constexpr = D // 4
    if BITS == 2:
        code = tl.reshape(code, [ROWS, 4, D4])
        shift = (2 * tl.arange(0, 4))[None, :, None]
        packed = tl.sum(code << shift, 1).to(tl.uint8)  # [ROWS, D4]: byte j = sum_k c[j + k*D4] << 2k
        offs_b = tl.arange(0, D4)
        tl.store(Codes + crow[:, None] + offs_b[None, :], packed, mask=rmask[:, None])
    elif BITS == 3:  # the low two bits as INT2, then the high bits at one bit a channel
        D8: tl.constexpr = D // 8
        low = _stride_pack(tl.reshape(code & 3, [ROWS, D]), ROWS, D, 2)
        high = _stride_pack(tl.reshape(code >> 2, [ROWS, D]), ROWS, D, 1)
        tl.store(Codes + crow[:, None] + tl.arange(0, D4)[None, :], low, mask=rmask[:, None])
        tl.store(Codes + crow[:, None] + D4 + tl.arange(0, D8)[None, :], high, mask=rmask[:, None])
    elif BITS == 4:
        packed = _stride_pack(tl.reshape(code, [ROWS, D]), ROWS, D, 4)
        tl.store(Codes + crow[:, None] + tl.arange(0, D // 2)[None, :], packed, mask=rmask[:, None])
    elif BITS == 5:  # the low four bits as INT4, then the high bits at one bit a channel
        D8: tl.constexpr = D // 8
        low = _stride_pack(tl.reshape(code & 15, [ROWS, D]), ROWS, D, 4)
        high = _stride_pack(tl.reshape(code >> 4, [ROWS, D]), ROWS, D, 1)
        tl.store(Codes + crow[:, None] + tl.arange(0, D // 2)[None, :], low, mask=rmask[:, None])
        tl.store(Codes + crow[:, None] + D // 2 + tl.arange(0, D8)[None, :], high, mask=rmask[:, None])
    else:  # INT8: byte j holds channel j
        code = tl.reshape(code, [ROWS, D]).to(tl.uint8)
        tl.store(Codes + crow[:, None] + tl.arange(0, D)[None, :], code, mask=rmask[:, None])


@triton.jit
def _quantize_rows_store(x, clip_idx, rmask, Codes, Scale, Zero, crow, mrow,
                         D: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, SORT: tl.constexpr,
                         RESCALE: tl.constexpr, strength, BITS: tl.constexpr = 2):
    """Clip/quantize/pack x [ROWS, D] float32 to BITS-bit codes (2, 3, 4, 5 or 8) and store the codes at Codes+crow
    (D*BITS/8 bytes a row), the float16 scales at Scale+mrow and the uint8 zero points at Zero+mrow (NG a row)."""
    NG: tl.constexpr = D // G
    LEVELS: tl.constexpr = (1 << BITS) - 1
    UNIT: tl.constexpr = 1.0 / (1 << (8 - BITS))  # 2^-F: the zero point's unit (exact)
    exact = tl.reshape(x, [ROWS, NG, G])
    tau = _clip_threshold(tl.abs(x), clip_idx, D, SORT)
    x = tl.maximum(tl.minimum(x, tau[:, None]), -tau[:, None])
    xg = tl.reshape(x, [ROWS, NG, G])
    lo = tl.minimum(tl.maximum(tl.min(xg, 2), -65504.0), 65504.0)
    hi = tl.minimum(tl.maximum(tl.max(xg, 2), -65504.0), 65504.0)
    step, zf = _grid_metadata(lo, hi, BITS)
    sc16 = _f16_rne(tl.minimum(step, 65504.0))
    scf = sc16.to(tl.float32)
    safe = tl.where(scf > 0, scf, 1.0)
    # one rounding for the sum, as torch: z 2^-F is exact, so a contraction into an FMA changes nothing
    y = tl.math.div_rn(xg, safe[:, :, None]) + (zf * UNIT)[:, :, None]
    y = (y + 12582912.0) - 12582912.0  # round half to even (|y| << 2^22)
    code = tl.minimum(tl.maximum(y, 0.0), 1.0 * LEVELS).to(tl.int32)
    if RESCALE:
        e64 = exact.to(tl.float64)
        mnf = -(scf * zf) * UNIT  # the stored minimum, exact in float32 (quant.stored_minimum)
        x_hat = code.to(tl.float64) * scf.to(tl.float64)[:, :, None] + mnf.to(tl.float64)[:, :, None]
        sc16 = _rescaled(scf, _alpha(tl.sum(e64 * e64, 2), tl.sum(e64 * x_hat, 2), strength))  # the zero point stays
    _store_codes(code, rmask, Codes, crow, ROWS, D, BITS)
    offs_g = tl.arange(0, NG)
    tl.store(Scale + mrow[:, None] + offs_g[None, :], sc16, mask=rmask[:, None])
    tl.store(Zero + mrow[:, None] + offs_g[None, :], zf.to(tl.int32).to(tl.uint8), mask=rmask[:, None])


@triton.jit
def _split_part(xc, own, BITS: tl.constexpr):
    """One part of split rows as one group: (float16 scale, float32 scale, zero point as a float32 integer) of the
    clipped rows xc [ROWS, D] over the channels where ``own`` ([1, D]) holds, at BITS, as _quantize_rows_store
    computes a group's."""
    lo = tl.minimum(tl.maximum(tl.min(tl.where(own, xc, float("inf")), 1), -65504.0), 65504.0)
    hi = tl.minimum(tl.maximum(tl.max(tl.where(own, xc, float("-inf")), 1), -65504.0), 65504.0)
    step, zf = _grid_metadata(lo, hi, BITS)
    sc16 = _f16_rne(tl.minimum(step, 65504.0))
    return sc16, sc16.to(tl.float32), zf


@triton.jit
def _split_rescaled(e64, code, own, scf, zf, strength, BITS: tl.constexpr):
    """The rescaled float16 scale of one part of split rows (quant.rescaled_scale over the part's channels, where
    ``own`` holds): e64 the unclipped rows in float64, code the int32 codes, scf / zf the part's metadata [ROWS]."""
    UNIT: tl.constexpr = 1.0 / (1 << (8 - BITS))
    mnf = -(scf * zf) * UNIT  # the stored minimum, exact in float32 (quant.stored_minimum)
    x_hat = code.to(tl.float64) * scf.to(tl.float64)[:, None] + mnf.to(tl.float64)[:, None]
    # the other part's channels add exact zeros: the sums are the part's
    num = tl.sum(tl.where(own, e64 * e64, 0.0), 1)
    den = tl.sum(tl.where(own, e64 * x_hat, 0.0), 1)
    return _rescaled(scf, _alpha(num, den, strength))


@triton.jit
def _quantize_split_store(x, clip_hi, clip_lo, rmask, Codes, Scale, Zero, crow, trow, mrow,
                          D: tl.constexpr, ROWS: tl.constexpr, SORT: tl.constexpr, RESCALE: tl.constexpr, strength,
                          BITS: tl.constexpr, HI_DIMS: tl.constexpr, HI_BITS: tl.constexpr):
    """split_keys.quantize_indexed + split_keys.pack of x [ROWS, D] float32 (split key rows, split_keys.py): the
    first HI_DIMS channels clipped at their clip_hi-th smallest |x| and quantized as one group at HI_BITS, the rest
    clipped at their clip_lo-th and quantized at BITS, each as _quantize_rows_store quantizes a group.  Stores at
    Codes+crow the row at the plain width BITS (the first part's channels: the low BITS bits of their codes), at
    Codes+trow its tail: the first part's float16 scale (2 bytes, little-endian) and zero point, and its
    HI_BITS - BITS planes of upper bits (1 bit a channel); the second part's scale / zero point at Scale+mrow /
    Zero+mrow (group 0)."""
    LEVELS_HI: tl.constexpr = (1 << HI_BITS) - 1
    LEVELS_LO: tl.constexpr = (1 << BITS) - 1
    UNIT_HI: tl.constexpr = 1.0 / (1 << (8 - HI_BITS))  # 2^-F of each part (exact)
    UNIT_LO: tl.constexpr = 1.0 / (1 << (8 - BITS))
    M8: tl.constexpr = HI_DIMS // 8  # bytes of one plane
    offs_d = tl.arange(0, D)
    own = (offs_d < HI_DIMS)[None, :]  # the first part's channels
    rest = (offs_d >= HI_DIMS)[None, :]
    ax = tl.abs(x)
    # each part's threshold among its own channels: the other part's rank above every finite |x|
    tau_hi = _clip_threshold(tl.where(own, ax, float("inf")), clip_hi, D, SORT)
    tau_lo = _clip_threshold(tl.where(own, float("inf"), ax), clip_lo, D, SORT)
    tau = tl.where(own, tau_hi[:, None], tau_lo[:, None])
    xc = tl.maximum(tl.minimum(x, tau), -tau)
    sc16_hi, scf_hi, zf_hi = _split_part(xc, own, HI_BITS)
    sc16_lo, scf_lo, zf_lo = _split_part(xc, rest, BITS)
    scf = tl.where(own, scf_hi[:, None], scf_lo[:, None])
    safe = tl.where(scf > 0, scf, 1.0)
    # one rounding for the sum, as torch: z 2^-F is exact (_quantize_rows_store)
    y = tl.math.div_rn(xc, safe) + tl.where(own, (zf_hi * UNIT_HI)[:, None], (zf_lo * UNIT_LO)[:, None])
    y = (y + 12582912.0) - 12582912.0  # round half to even (|y| << 2^22)
    code = tl.minimum(tl.maximum(y, 0.0), tl.where(own, 1.0 * LEVELS_HI, 1.0 * LEVELS_LO)).to(tl.int32)
    if RESCALE:  # against the unclipped parts; the codes stay those of the unrescaled scales
        e64 = x.to(tl.float64)
        sc16_hi = _split_rescaled(e64, code, own, scf_hi, zf_hi, strength, HI_BITS)
        sc16_lo = _split_rescaled(e64, code, rest, scf_lo, zf_lo, strength, BITS)
    # the row at the plain width: the first part's low BITS bits; the second part's codes are < 2^BITS already
    _store_codes(code & LEVELS_LO, rmask, Codes, crow, ROWS, D, BITS)
    # the tail, byte by byte (its length may be odd): the first part's scale, zero point, upper-bit planes
    sbits = sc16_hi.to(tl.int16, bitcast=True).to(tl.int32)
    tl.store(Codes + trow, (sbits & 255).to(tl.uint8), mask=rmask)
    tl.store(Codes + trow + 1, ((sbits >> 8) & 255).to(tl.uint8), mask=rmask)
    tl.store(Codes + trow + 2, zf_hi.to(tl.int32).to(tl.uint8), mask=rmask)
    # the first HI_DIMS columns as a [ROWS, HI_DIMS] tensor (HI_DIMS a power of two: block 0 of D / HI_DIMS)
    NB: tl.constexpr = D // HI_DIMS
    upper = tl.reshape(code >> BITS, [ROWS, NB, HI_DIMS])
    upper = tl.sum(tl.where((tl.arange(0, NB) == 0)[None, :, None], upper, 0), 1)
    offs_m = tl.arange(0, M8)
    for p in tl.static_range(HI_BITS - BITS):
        plane = _stride_pack((upper >> p) & 1, ROWS, HI_DIMS, 1)
        tl.store(Codes + trow[:, None] + (3 + p * M8) + offs_m[None, :], plane, mask=rmask[:, None])
    tl.store(Scale + mrow, sc16_lo, mask=rmask)  # group 0; the layer's other groups stay as they are
    tl.store(Zero + mrow, zf_lo.to(tl.int32).to(tl.uint8), mask=rmask)


@triton.jit
def _centered_keys(K, MU, MUP, COS, SIN, offs_t, tmask, h, stride_kt, stride_kh, cols,
                   D: tl.constexpr, CENTER: tl.constexpr, ROPE_CENTER: tl.constexpr, ROT_HALF: tl.constexpr,
                   INTERLEAVED: tl.constexpr):
    """Columns ``cols`` of the block's keys in float32, minus the constant mean (CENTER) and minus
    RoPE_p(mu_pre) = mu_pre * cos_p + rotate_half(mu_pre) * sin_p per token (ROPE_CENTER)."""
    k = tl.load(K + offs_t[:, None] * stride_kt + h * stride_kh + cols[None, :], mask=tmask[:, None],
                other=0.0).to(tl.float32)
    if CENTER:
        k = k - tl.load(MU + h * D + cols)[None, :]
    if ROPE_CENTER:
        # rotate_half in the model's layout (rope.RotaryLayout): each rotated channel takes its pair partner's
        # value, negated on the pair's first channel; pass-through channels (>= 2 ROT_HALF) have sin 0
        ROT: tl.constexpr = 2 * ROT_HALF
        mu = tl.load(MUP + h * D + cols)
        if INTERLEAVED:  # pairs (2j, 2j + 1)
            idx = tl.where(cols < ROT, cols + 1 - 2 * (cols % 2), cols)
            sign = tl.where(cols < ROT, tl.where(cols % 2 == 0, -1.0, 1.0), 0.0)
        else:  # pairs (j, j + ROT_HALF)
            idx = tl.where(cols < ROT, (cols + ROT_HALF) % ROT, cols)
            sign = tl.where(cols < ROT_HALF, -1.0, tl.where(cols < ROT, 1.0, 0.0))
        mu_half = sign * tl.load(MUP + h * D + idx)
        trig = offs_t[:, None] * D + cols[None, :]
        cos = tl.load(COS + trig, mask=tmask[:, None], other=0.0)
        sin = tl.load(SIN + trig, mask=tmask[:, None], other=0.0)
        k = k - (mu[None, :] * cos + mu_half[None, :] * sin)
    return k


@triton.jit(do_not_specialize=["T"])  # the step's token count: one compile for all counts (server warm-up)
def _write_kernel(K, V, R, MU, MUP, COS, SIN, WS, QS, CK, CV, Kc, Ks, Kz, Vc, Vs, Vz, Kw, Vw, T, GK, GV,
                  stride_kt, stride_kh, stride_vt, stride_vh, stride_rh,
                  stride_cp, stride_ch, stride_mp, stride_mh, stride_wp, stride_wh, stride_vcp, stride_vch,
                  D: tl.constexpr, G: tl.constexpr, P: tl.constexpr, BLOCK_T: tl.constexpr,
                  ROTATE: tl.constexpr, ROTATE_SLICED: tl.constexpr, CENTER: tl.constexpr,
                  ROPE_CENTER: tl.constexpr, SORT: tl.constexpr, RESCALE_K: tl.constexpr,
                  RESCALE_V: tl.constexpr, ROT_HALF: tl.constexpr = 0, INTERLEAVED: tl.constexpr = False,
                  K_BITS: tl.constexpr = 2, V_BITS: tl.constexpr = 2, V_ROWS: tl.constexpr = False,
                  K_HI_DIMS: tl.constexpr = 0, K_HI_BITS: tl.constexpr = 2, K_TAIL: tl.constexpr = 0,
                  PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    NG: tl.constexpr = D // G
    KCB: tl.constexpr = D * K_BITS // 8  # code bytes per row (split keys: their tails follow the page's P rows)
    VCB: tl.constexpr = D * V_BITS // 8
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = offs_t < T
    offs_d = tl.arange(0, D)
    ws = tl.load(WS + offs_t, mask=tmask, other=-1).to(tl.int64)
    qs = tl.load(QS + offs_t, mask=tmask, other=-1).to(tl.int64)
    wmask = ws >= 0
    qmask = qs >= 0
    wrow = (ws // P) * stride_wp + h * stride_wh + (ws % P) * D
    crow = (qs // P) * stride_cp + h * stride_ch + (qs % P) * KCB
    trow = (qs // P) * stride_cp + h * stride_ch + P * KCB + (qs % P) * K_TAIL  # split keys' tails
    if V_ROWS:  # values at another width (or in a tensor with other strides) than the keys
        vrow = (qs // P) * stride_vcp + h * stride_vch + (qs % P) * VCB
    else:
        vrow = crow
    mrow = (qs // P) * stride_mp + h * stride_mh + meta_slot(qs % P) * NG  # scales and zero points alike
    if ROTATE and not ROTATE_SLICED:  # R before the wait for the keys (pdl.py: no kernel of the step writes it)
        r = tl.load(R + h * stride_rh + offs_d[:, None] * D + offs_d[None, :]).to(tl.float32)
    wait_for_inputs(PDL)
    # ---- keys: center, rotate (float32), store
    if ROTATE_SLICED:
        # k @ R as four [BLOCK_T, D/4] x [D/4, D] products over R's row slices: the MMA's float32 R operand is a
        # quarter of D x D (the whole one is 256 KiB at D = 256, past an SM's 227 KiB)
        D4S: tl.constexpr = D // 4
        k = tl.zeros([BLOCK_T, D], tl.float32)
        for j in tl.static_range(4):
            cols = j * D4S + tl.arange(0, D4S)
            kj = _centered_keys(K, MU, MUP, COS, SIN, offs_t, tmask, h, stride_kt, stride_kh, cols, D, CENTER,
                                ROPE_CENTER, ROT_HALF, INTERLEAVED)
            r = tl.load(R + h * stride_rh + cols[:, None] * D + offs_d[None, :]).to(tl.float32)
            k = tl.dot(kj, r, k, input_precision="ieee")
    else:
        k = _centered_keys(K, MU, MUP, COS, SIN, offs_t, tmask, h, stride_kt, stride_kh, offs_d, D, CENTER,
                           ROPE_CENTER, ROT_HALF, INTERLEAVED)
        if ROTATE:
            k = tl.dot(k, r, input_precision="ieee")
    tl.store(Kw + wrow[:, None] + offs_d[None, :], k.to(tl.bfloat16), mask=wmask[:, None])
    # ---- values: already rotated
    v = tl.load(V + offs_t[:, None] * stride_vt + h * stride_vh + offs_d[None, :], mask=tmask[:, None],
                other=0.0).to(tl.float32)
    tl.store(Vw + wrow[:, None] + offs_d[None, :], v.to(tl.bfloat16), mask=wmask[:, None])
    # Quantizing sorts every row (the clip threshold): skipped unless a token of this block goes to INT2.
    # Decode tokens never do (they enter the recent window), so decode steps pay only the rotation and stores.
    if tl.max(qs) >= 0:
        if K_HI_DIMS > 0:  # the key clip indices: [H, 2], (first part, second part)
            _quantize_split_store(k, tl.load(CK + 2 * h), tl.load(CK + 2 * h + 1), qmask, Kc, Ks, Kz, crow, trow,
                                  mrow, D, BLOCK_T, SORT, RESCALE_K, GK, K_BITS, K_HI_DIMS, K_HI_BITS)
        else:
            _quantize_rows_store(k, tl.load(CK + h), qmask, Kc, Ks, Kz, crow, mrow, D, G, BLOCK_T, SORT, RESCALE_K,
                                 GK, K_BITS)
        _quantize_rows_store(v, tl.load(CV + h), qmask, Vc, Vs, Vz, vrow, mrow, D, G, BLOCK_T, SORT, RESCALE_V,
                             GV, V_BITS)


@triton.jit
def _migrate_kernel(SRC, DST, CK, CV, Kw, Vw, Kc, Ks, Kz, Vc, Vs, Vz, H, GK, GV,
                    stride_wl, stride_wp, stride_wh, stride_cl, stride_cp, stride_ch,
                    stride_ml, stride_mp, stride_mh, stride_vcl, stride_vcp, stride_vch,
                    D: tl.constexpr, G: tl.constexpr, P: tl.constexpr, SORT: tl.constexpr,
                    RESCALE_K: tl.constexpr, RESCALE_V: tl.constexpr,
                    K_BITS: tl.constexpr = 2, V_BITS: tl.constexpr = 2, V_ROWS: tl.constexpr = False,
                    K_HI_DIMS: tl.constexpr = 0, K_HI_BITS: tl.constexpr = 2, K_TAIL: tl.constexpr = 0):
    m = tl.program_id(0)
    h = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    NG: tl.constexpr = D // G
    KCB: tl.constexpr = D * K_BITS // 8  # code bytes per row (split keys: their tails follow the page's P rows)
    VCB: tl.constexpr = D * V_BITS // 8
    src = tl.load(SRC + m).to(tl.int64)
    dst = tl.load(DST + m).to(tl.int64)
    offs_t = tl.arange(0, P)
    offs_d = tl.arange(0, D)
    rmask = offs_t < P
    wrow = layer * stride_wl + src * stride_wp + h * stride_wh + offs_t * D
    crow = layer * stride_cl + dst * stride_cp + h * stride_ch + offs_t * KCB
    trow = layer * stride_cl + dst * stride_cp + h * stride_ch + P * KCB + offs_t * K_TAIL  # split keys' tails
    if V_ROWS:  # values at another width (or in a tensor with other strides) than the keys
        vrow = layer * stride_vcl + dst * stride_vcp + h * stride_vch + offs_t * VCB
    else:
        vrow = crow
    mrow = layer * stride_ml + dst * stride_mp + h * stride_mh + meta_slot(offs_t) * NG  # scales, zero points alike
    k = tl.load(Kw + wrow[:, None] + offs_d[None, :]).to(tl.float32)
    if K_HI_DIMS > 0:  # the key clip indices: [L, H, 2], (first part, second part)
        ck = CK + (layer * H + h) * 2
        _quantize_split_store(k, tl.load(ck), tl.load(ck + 1), rmask, Kc, Ks, Kz, crow, trow, mrow, D, P, SORT,
                              RESCALE_K, GK, K_BITS, K_HI_DIMS, K_HI_BITS)
    else:
        _quantize_rows_store(k, tl.load(CK + layer * H + h), rmask, Kc, Ks, Kz, crow, mrow, D, G, P, SORT,
                             RESCALE_K, GK, K_BITS)
    v = tl.load(Vw + wrow[:, None] + offs_d[None, :]).to(tl.float32)
    _quantize_rows_store(v, tl.load(CV + layer * H + h), rmask, Vc, Vs, Vz, vrow, mrow, D, G, P, SORT,
                         RESCALE_V, GV, V_BITS)


def _metadata_strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """The element strides the kernels address every scale and zero-point tensor with (one row offset serves
    them all, layout.py); ValueError when the tensors disagree."""
    strides = {t.stride() for t in tensors}
    if len(strides) > 1 or tensors[0].stride(-1) != 1 or tensors[0].stride(-2) != tensors[0].shape[-1]:
        raise ValueError(f"scale and zero-point tensors need one layout with contiguous rows, got strides "
                         f"{sorted(strides)} for shape {tuple(tensors[0].shape)}")
    return tensors[0].stride()


def _key_split_args(g, layer: int, clip_k_idx: torch.Tensor, shape: tuple[int, ...],
                    k_codes: torch.Tensor) -> tuple[int, int, int, torch.Tensor]:
    """(K_HI_DIMS, K_HI_BITS, K_TAIL, the key clip indices as the kernel reads them) of ``layer``'s keys
    (common.key_split, which checks the pages' layout).  Split keys take clip indices [*shape, 2]
    (split_keys.clip_indices); ValueError otherwise, or where the wider part's channels are not a power of two (the
    kernel cuts them out of a row as one block of D / hi_dims)."""
    hi_dims, hi_bits, tail = key_split(g, layer, k_codes)
    if hi_dims == 0:
        return hi_dims, hi_bits, tail, clip_k_idx
    split = g.k_split[layer]
    if tuple(clip_k_idx.shape) != (*shape, 2):
        raise ValueError(f"layer {layer} stores split keys ({split}): clip_k_idx must be int32 "
                         f"{list((*shape, 2))}, each part's clip index (split_keys.clip_indices), "
                         f"not {list(clip_k_idx.shape)}")
    if hi_dims & (hi_dims - 1):
        raise ValueError(f"the write kernels quantize split keys whose wider part is a power of two channels, not "
                         f"{split}")
    return hi_dims, hi_bits, tail, clip_k_idx.contiguous()


def key_operands(k: torch.Tensor, k_rotation: torch.Tensor | None, k_mean: torch.Tensor | None,
                 k_rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> tuple:
    """The centering and rotation operands of a write launch, float32 and contiguous: (R, R's head stride (0: one R
    for every head), mu, mu_pre, cos, sin); k stands in for each one a launch does not read (its constexpr off)."""
    if k_rotation is not None:
        r = k_rotation.float().contiguous()
        stride_rh = 0 if r.shape[0] == 1 else r.stride(0)
    else:
        r, stride_rh = k, 0
    mu = k_mean.float().contiguous() if k_mean is not None else k
    mu_pre, cos, sin = (x.float().contiguous() for x in k_rope) if k_rope is not None else (k, k, k)
    return r, stride_rh, mu, mu_pre, cos, sin


def write_kv(pool: PagedKVPool, layer: int, k: torch.Tensor, v: torch.Tensor, win_slot: torch.Tensor,
             int2_slot: torch.Tensor, k_rotation: torch.Tensor | None, k_mean: torch.Tensor | None,
             clip_k_idx: torch.Tensor, clip_v_idx: torch.Tensor, block_t: int = TUNING.write_block_t,
             num_warps: int | None = None, rescale: tuple[float, float] = (0.0, 0.0),
             k_rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             rope_layout: RotaryLayout | None = None) -> None:
    """Store T tokens of one layer: BF16 into window pages, or clipped, quantized and packed into INT2 pages (keys
    and values each at the layer's width, ``pool.geometry.layer_widths(layer)``).

    Args:
        pool, layer: the pool and the layer to write.
        k: post-RoPE keys (any float dtype, last dim contiguous).
        v: rotated values (likewise).
        win_slot, int2_slot: each token's flat slot (page * P + offset) in the window / INT2 pool, or -1
            (layout.token_slots).
        k_rotation: R_K; None when keys arrive rotated.
        k_mean: the constant key offset subtracted before the rotation; None: none.
        clip_k_idx, clip_v_idx: per KV head, the index of the clip threshold in a row's ascending |x|
            (layout.clip_indices); split keys (``pool.geometry.k_split[layer]``): per KV head, each part's among
            its own channels (split_keys.clip_indices).
        block_t: tokens per program.
        num_warps: default 8 with a rotation (its float32 D x D operand spills out of 4 warps' registers: 79 us
            a launch instead of 7 on an H200; benchmarks/NOTES.md, "Tensor parallelism on 2 x H200"), 16 with a
            rotation at head dim 256 (tuning.py), else 4.
        rescale: the quantizer's rescale strengths (keys, values), quant.py.
        k_rope: per-position centering (rope.py): (mu_pre, cos, sin) float32 at the tokens' positions;
            RoPE_p(mu_pre) is subtracted after k_mean.  None: none.
        rope_layout: the RoPE's channel pairs (rope.RotaryLayout, partial rotary); None: rotate-half over all D.
    Shapes:
        k, v: [T, Hkv, D]; win_slot, int2_slot: int32 [T]; k_rotation: [Hkv | 1, D, D]; k_mean: [Hkv, D];
        clip_k_idx, clip_v_idx: int32 [Hkv] (split keys: clip_k_idx [Hkv, 2]); k_rope: ([Hkv, D], [T, D], [T, D]).
    """
    g = pool.geometry
    t, h, d = k.shape
    if t == 0:
        return
    widths = kernel_widths(g, layer)
    L = pool.layer(layer)
    kc, vc, kw, vw = L["k_codes"], L["v_codes"], L["k_win"], L["v_win"]
    ks, kz, vs, vz = L["k_scale"], L["k_zero"], L["v_scale"], L["v_zero"]
    stride_m = _metadata_strides(ks, kz, vs, vz)
    hi_dims, hi_bits, k_tail, clip_k_idx = _key_split_args(g, layer, clip_k_idx, (h,), kc)
    r, stride_rh, mu, mu_pre, cos, sin = key_operands(k, k_rotation, k_mean, k_rope)
    sliced = k_rotation is not None and d > ROTATE_WHOLE_MAX_DIM
    warps = (TUNING.write_num_warps_rotating_d256 if sliced else TUNING.write_num_warps_rotating
             if k_rotation is not None else TUNING.write_num_warps)
    _write_kernel[(triton.cdiv(t, block_t), h)](
        k, v, r, mu, mu_pre, cos, sin, win_slot, int2_slot, clip_k_idx, clip_v_idx, kc, ks, kz, vc, vs, vz, kw, vw, t,
        check_rescale(rescale[0]), check_rescale(rescale[1]),  # float32 values: the interpreter keeps float64
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), stride_rh,
        kc.stride(0), kc.stride(1), stride_m[0], stride_m[1], kw.stride(0), kw.stride(1), vc.stride(0), vc.stride(1),
        D=d, G=g.group_size, P=g.page_size, BLOCK_T=block_t, ROTATE=k_rotation is not None, ROTATE_SLICED=sliced,
        CENTER=k_mean is not None, ROPE_CENTER=k_rope is not None, SORT=not INTERPRET,
        RESCALE_K=rescale[0] > 0, RESCALE_V=rescale[1] > 0,
        ROT_HALF=(rope_layout.rotary_dim if rope_layout is not None else d) // 2,
        INTERLEAVED=rope_layout is not None and rope_layout.interleaved,
        K_BITS=widths[0], V_BITS=widths[1], V_ROWS=own_value_rows(kc, vc, widths) or hi_dims > 0,
        K_HI_DIMS=hi_dims, K_HI_BITS=hi_bits, K_TAIL=k_tail, num_warps=num_warps or warps,
        **pdl.launch_options(k.device))


def migrate_pages(pool: PagedKVPool, src_win_pages: torch.Tensor, dst_int2_pages: torch.Tensor,
                  clip_k_idx: torch.Tensor, clip_v_idx: torch.Tensor, num_warps: int = TUNING.migrate_num_warps,
                  rescale: tuple[float, float] = (0.0, 0.0)) -> None:
    """Quantize full BF16 window pages into INT2 pages, every layer, one launch.  The caller then swaps the
    block-table entries and frees the window pages.  The pool's layers are stacked, so they share one key width (split
    keys included: ``PoolGeometry.key_widths``) and one value width (ValueError otherwise); the engine, whose layers
    may differ, migrates each layer's one-layer pool (engine/attention.py).

    Args:
        pool: the pool.
        src_win_pages, dst_int2_pages: window page src_win_pages[m] is quantized into INT2 page
            dst_int2_pages[m].
        clip_k_idx, clip_v_idx: per layer and KV head, as write_kv's (split keys: each part's).
        num_warps: Triton's.
        rescale: the quantizer's rescale strengths (keys, values), the same for every layer (quant.py).
    Shapes:
        src_win_pages, dst_int2_pages: int32 [M]; clip_k_idx, clip_v_idx: int32 [L, Hkv] (split keys: clip_k_idx
        [L, Hkv, 2]).
    """
    g = pool.geometry
    m = src_win_pages.numel()
    if m == 0:
        return
    if len(set(g.key_widths())) > 1 or len(set(g.v_bits)) > 1:
        raise ValueError(f"one migration launch quantizes every layer at one key and one value width, not "
                         f"{g.width_summary()}: migrate each layer's pool (PoolView.layer_pool) on its own")
    widths = kernel_widths(g, 0)
    kw, kc, vc = pool.k_win, pool.k_codes, pool.v_codes
    stride_m = _metadata_strides(pool.k_scale, pool.k_zero, pool.v_scale, pool.v_zero)
    hi_dims, hi_bits, k_tail, clip_k_idx = _key_split_args(g, 0, clip_k_idx, (g.num_layers, g.num_kv_heads), kc)
    _migrate_kernel[(m, g.num_kv_heads, g.num_layers)](
        src_win_pages, dst_int2_pages, clip_k_idx.contiguous(), clip_v_idx.contiguous(), pool.k_win, pool.v_win,
        pool.k_codes, pool.k_scale, pool.k_zero, pool.v_codes, pool.v_scale, pool.v_zero, g.num_kv_heads,
        check_rescale(rescale[0]), check_rescale(rescale[1]),
        kw.stride(0), kw.stride(1), kw.stride(2), kc.stride(0), kc.stride(1), kc.stride(2),
        stride_m[0], stride_m[1], stride_m[2], vc.stride(0), vc.stride(1), vc.stride(2),
        D=g.head_dim, G=g.group_size, P=g.page_size, SORT=not INTERPRET,
        RESCALE_K=rescale[0] > 0, RESCALE_V=rescale[1] > 0,
        K_BITS=widths[0], V_BITS=widths[1], V_ROWS=own_value_rows(kc, vc, widths) or hi_dims > 0,
        K_HI_DIMS=hi_dims, K_HI_BITS=hi_bits, K_TAIL=k_tail, num_warps=num_warps)
