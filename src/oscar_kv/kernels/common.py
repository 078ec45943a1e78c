"""Building blocks shared by the Triton attention kernels (decode.py, extend.py): code unpacking (INT2 to INT8),
per-group scores and values over the codes, the BF16 window range, the matmul helper, the position-aware (RoPE)
logits, the split plan and the merge of split partials, and the constants and device queries they use.  The
arithmetic over the codes is described in decode.py's docstring.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._compat import install_interpreter_shim
from . import split_keys
from .layout import KERNEL_KEY_WIDTHS, KERNEL_VALUE_WIDTHS, kernel_widths_text
from .tuning import TUNING

install_interpreter_shim()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """With PDL (pdl.py): wait until the kernel before this one has finished and its writes are visible, then let
    the next kernel launch.  A no-op without."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


LOG2E = 1.4426950408889634  # log2(e): logits are scaled by sm_scale * LOG2E and the softmax runs in base 2
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # True under Triton's CPU interpreter (the tests)

# One PTX block per 4 packed code bytes -> 4 slices x 4 float16 values (2 registers each).
_UNPACK_ASM = tl.constexpr("""
{
.reg .b32 lo, hi, z;
mov.b32 z, 0;
prmt.b32 lo, $8, z, 0x4140;
prmt.b32 hi, $8, z, 0x4342;
lop3.b32 $0, lo, 0x00030003, 0x64006400, 0xEA;
lop3.b32 $1, hi, 0x00030003, 0x64006400, 0xEA;
lop3.b32 $2, lo, 0x000C000C, 0x64006400, 0xEA;
lop3.b32 $3, hi, 0x000C000C, 0x64006400, 0xEA;
lop3.b32 $4, lo, 0x00300030, 0x64006400, 0xEA;
lop3.b32 $5, hi, 0x00300030, 0x64006400, 0xEA;
lop3.b32 $6, lo, 0x00C000C0, 0x64006400, 0xEA;
lop3.b32 $7, hi, 0x00C000C0, 0x64006400, 0xEA;
}
""")


@triton.jit
def unpack4(raw, USE_ASM: tl.constexpr):
    """uint8 codes -> four float16 tensors 1024 + (raw & (3 << 2k)), k = 0..3 (exact)."""
    if USE_ASM:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            _UNPACK_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [raw],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        c0 = ((raw & 3).to(tl.float16) + 1024.0).to(tl.float16)
        c1 = ((raw & 12).to(tl.float16) + 1024.0).to(tl.float16)
        c2 = ((raw & 48).to(tl.float16) + 1024.0).to(tl.float16)
        c3 = ((raw & 192).to(tl.float16) + 1024.0).to(tl.float16)
    return c0, c1, c2, c3


@triton.jit
def code_slices(ptrs, mask, ch, BITS: tl.constexpr, D: tl.constexpr, USE_ASM: tl.constexpr):
    """Load rows of BITS-bit codes (quant.py's layout) as four float16 tensors 1024 + c * 4^k, slice k holding
    channels k*D/4 .. (k+1)*D/4 - 1: what the INT2 arithmetic takes (decode.py), whatever the width.

    ``ptrs`` and ``mask`` address the rows' first D/4 bytes in the orientation the caller wants ([D/4, N] or
    [N, D/4]); ``ch`` (broadcastable to ptrs) is each element's channel within its slice, i.e. its byte's index in
    the row.  1024 + c * 4^k is exact in float16 for c <= 255 at k <= 3 (c * 4^k is a multiple of 4^k below 2^14,
    where float16's spacing is at most 4^k).
      INT2: one byte per four channels; unpack4 (PTX on the GPU).
      INT3: the INT2 plane as INT2, plus the high-bit plane at byte D/4 + j % (D/8), bit 2k + j // (D/8) for channel
            j of slice k (quant.py: byte j' holds channel j' + m D/8 in bit m): + 4^(k+1) where set.
      INT4: bytes j and D/4 + j hold channels j, D/4 + j in their low nibbles and D/2 + j, 3D/4 + j in their high
            nibbles; nibble c goes to c * 4^k by a shift (0, 2, 0, 2 after the high nibble's built-in 16).
      INT5: the INT4 plane as INT4, plus the high-bit plane at byte D/2 + j % (D/8), bit 2k + j // (D/8) for channel
            j of slice k (as INT3's, after D/2 bytes of nibbles): + 16 * 4^k where set, so c = nibble + 16 h.
      INT8: byte k D/4 + j holds channel j of slice k; shifted by 2k.
    """
    if BITS == 2:
        c0, c1, c2, c3 = unpack4(tl.load(ptrs, mask=mask, other=0), USE_ASM)
    elif BITS == 3:
        D4: tl.constexpr = D // 4
        D8: tl.constexpr = D // 8
        c0, c1, c2, c3 = unpack4(tl.load(ptrs, mask=mask, other=0), USE_ASM)
        hi = tl.load(ptrs + (D4 - ch + ch % D8), mask=mask, other=0).to(tl.int32)
        hi = hi >> (ch // D8)  # bit 2k of this now holds the high bit of slice k
        c0 = (c0 + ((hi & 1) << 2).to(tl.float16)).to(tl.float16)
        c1 = (c1 + ((hi & 4) << 2).to(tl.float16)).to(tl.float16)
        c2 = (c2 + ((hi & 16) << 2).to(tl.float16)).to(tl.float16)
        c3 = (c3 + ((hi & 64) << 2).to(tl.float16)).to(tl.float16)
    elif BITS == 4:
        D4: tl.constexpr = D // 4
        lo = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        up = tl.load(ptrs + D4, mask=mask, other=0).to(tl.int32)
        c0 = ((lo & 15).to(tl.float16) + 1024.0).to(tl.float16)
        c1 = (((up & 15) << 2).to(tl.float16) + 1024.0).to(tl.float16)
        c2 = ((lo & 240).to(tl.float16) + 1024.0).to(tl.float16)
        c3 = (((up & 240) << 2).to(tl.float16) + 1024.0).to(tl.float16)
    elif BITS == 5:
        D4: tl.constexpr = D // 4
        D8: tl.constexpr = D // 8
        lo = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        up = tl.load(ptrs + D4, mask=mask, other=0).to(tl.int32)
        hi = tl.load(ptrs + (2 * D4 - ch + ch % D8), mask=mask, other=0).to(tl.int32)
        hi = hi >> (ch // D8)  # bit 2k of this now holds the high bit of slice k
        # nibble + 16 h, times 4^k: at most 31 * 64, a multiple of 4^k (exact)
        c0 = (((lo & 15) | ((hi & 1) << 4)).to(tl.float16) + 1024.0).to(tl.float16)
        c1 = ((((up & 15) << 2) | ((hi & 4) << 4)).to(tl.float16) + 1024.0).to(tl.float16)
        c2 = (((lo & 240) | ((hi & 16) << 4)).to(tl.float16) + 1024.0).to(tl.float16)
        c3 = ((((up & 240) << 2) | ((hi & 64) << 4)).to(tl.float16) + 1024.0).to(tl.float16)
    else:  # INT8: byte k D/4 + j holds channel j of slice k
        D4: tl.constexpr = D // 4
        c0 = (tl.load(ptrs, mask=mask, other=0).to(tl.int32).to(tl.float16) + 1024.0).to(tl.float16)
        c1 = ((tl.load(ptrs + D4, mask=mask, other=0).to(tl.int32) << 2).to(tl.float16) + 1024.0).to(tl.float16)
        c2 = ((tl.load(ptrs + 2 * D4, mask=mask, other=0).to(tl.int32) << 4).to(tl.float16) + 1024.0).to(tl.float16)
        c3 = ((tl.load(ptrs + 3 * D4, mask=mask, other=0).to(tl.int32) << 6).to(tl.float16) + 1024.0).to(tl.float16)
    return c0, c1, c2, c3


@triton.jit
def split_tail_minimum(Kc, trow, valid, HI_BITS: tl.constexpr):
    """(scale, minimum) float32 [N] of split key rows' first part, from the rows' tails at Kc + trow (split_keys.py):
    the float16 scale's two bytes, then the zero point; minimum = -(scale z) 2^-F at HI_BITS, exact as
    quant.stored_minimum."""
    HI_FRAC: tl.constexpr = 1.0 / (1 << ((8 - HI_BITS) % 8))
    b0 = tl.load(Kc + trow, mask=valid, other=0).to(tl.uint16)
    b1 = tl.load(Kc + trow + 1, mask=valid, other=0).to(tl.uint16)
    scale = (b0 | (b1 << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    zero = tl.load(Kc + trow + 2, mask=valid, other=0).to(tl.float32)
    return scale, -(scale * zero) * HI_FRAC


@triton.jit
def split_upper(code, Kc, trows, ch, valid, k: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                HI_DIMS: tl.constexpr, HI_BITS: tl.constexpr):
    """Slice k of split key rows read at the narrow width BITS (float16 1024 + c 4^k, code_slices) with the first
    HI_DIMS channels' upper bits added from the planes in the rows' tails at Kc + trows (split_keys.py): 1024 + c_hi
    4^k, exact as code_slices' INT8 (c_hi 4^k <= 255 * 64).  ``trows`` (tail offsets) and ``ch`` (the channel within
    the slice) broadcast to the slice's orientation, as code_slices takes them; a slice past HI_DIMS comes back
    unchanged."""
    D4: tl.constexpr = D // 4
    if k * D4 < HI_DIMS:
        M8: tl.constexpr = HI_DIMS // 8  # bytes of one plane
        c = k * D4 + ch
        own = valid & (c < HI_DIMS)
        base = Kc + trows + 3 + c % M8
        up = (tl.load(base, mask=own, other=0).to(tl.int32) >> (c // M8)) & 1
        for p in tl.static_range(1, HI_BITS - BITS):
            up |= ((tl.load(base + p * M8, mask=own, other=0).to(tl.int32) >> (c // M8)) & 1) << p
        code = (code + ((up << BITS) << (2 * k)).to(tl.float16)).to(tl.float16)
    return code


@triton.jit
def split_upper_tile(Kc, trow, valid, HI_DIMS: tl.constexpr, UPPER: tl.constexpr):
    """float16 [HI_DIMS, N]: the upper bits (code >> bits, < 2^UPPER) of split key rows' first HI_DIMS channels,
    channel by channel, from the planes in the rows' tails at Kc + trow (split_keys.py): each plane read as its
    HI_DIMS/8 bytes a row (byte j, bit k: channel j + k HI_DIMS/8), whose bits reshape to channel order."""
    M8: tl.constexpr = HI_DIMS // 8
    N: tl.constexpr = trow.shape[0]
    offs_j = tl.arange(0, M8)
    shift = tl.arange(0, 8)[:, None, None]
    up = tl.zeros([8, M8, N], tl.int32)
    for p in tl.static_range(UPPER):
        raw = tl.load(Kc + trow[None, :] + (3 + p * M8) + offs_j[:, None], mask=valid[None, :], other=0)
        up |= ((raw.to(tl.int32)[None, :, :] >> shift) & 1) << p
    return tl.reshape(up, (HI_DIMS, N)).to(tl.float16)


@triton.jit
def split_key_query(qf0, qf1, o2, o3, t2s, t3s, D: tl.constexpr, HI_DIMS: tl.constexpr):
    """A query's parts for split key rows (split_keys.py; the first part lies in slices 0-1, as it never passes D/2):
    query slices 0 and 1 (float32 [M, D/4], scaled) each split into the first part's channels (qh0, qh1) and the
    rest (ql0, ql1), float16 pre-divided by 4^k like the plain slices, with zeros elsewhere; slices 2 and 3 are the
    rest's whole (o2, o3, t2s, t3s: their offsets and true sums).  Returns (qh0, qh1, ql0, ql1, oh, ol, th, tlo): the
    parts, each part's offset 1024 sum(float16 slices) and true sum (for its minimum)."""
    D4: tl.constexpr = D // 4
    first0 = tl.arange(0, D4)[None, :] < HI_DIMS
    first1 = (D4 + tl.arange(0, D4))[None, :] < HI_DIMS
    th = tl.sum(tl.where(first0, qf0, 0.0), 1) + tl.sum(tl.where(first1, qf1, 0.0), 1)
    tlo = tl.sum(tl.where(first0, 0.0, qf0), 1) + tl.sum(tl.where(first1, 0.0, qf1), 1) + t2s + t3s
    qh0 = tl.where(first0, qf0, 0.0).to(tl.float16)
    ql0 = tl.where(first0, 0.0, qf0).to(tl.float16)
    qh1 = tl.where(first1, qf1 * 0.25, 0.0).to(tl.float16)
    ql1 = tl.where(first1, 0.0, qf1 * 0.25).to(tl.float16)
    oh = 1024.0 * (tl.sum(qh0.to(tl.float32), 1) + tl.sum(qh1.to(tl.float32), 1))
    ol = 1024.0 * (tl.sum(ql0.to(tl.float32), 1) + tl.sum(ql1.to(tl.float32), 1)) + o2 + o3
    return qh0, qh1, ql0, ql1, oh, ol, th, tlo


@triton.jit
def split_scores(qh0, qh1, ql0, ql1, ql2, ql3, oh, ol, th, tlo, qup, k0, k1, k2, k3, Kc, trow, offs_c, valid, Ks,
                 Kz, mrow, D: tl.constexpr, BITS: tl.constexpr, HI_DIMS: tl.constexpr, HI_BITS: tl.constexpr,
                 FRAC: tl.constexpr):
    """[M, N] base-2 logits of a tile of split key rows (split_keys.py) read at the narrow width BITS as slices
    k0..k3 [D/4, N], their tails at Kc + trow: the first part's channels (queries qh0, qh1: slices 0-1, as the first
    part never passes D/2), their upper bits (one more MMA against ``qup``, float16 [M, HI_DIMS]: the query's first
    HI_DIMS channels, scaled; below 16 channels added to slice 0's codes instead) scored against the tail's scale and
    minimum, the rest against the layer's group 0.  Dots over a slice with no channel of a part are skipped."""
    D4: tl.constexpr = D // 4
    if HI_DIMS < 16:  # too few channels for an MMA of their own: the upper bits join slice 0's codes
        k0 = split_upper(k0, Kc, trow[None, :], offs_c[:, None], valid[None, :], 0, D, BITS, HI_DIMS, HI_BITS)
    hs, hn = split_tail_minimum(Kc, trow, valid, HI_BITS)
    ls = tl.load(Ks + mrow, mask=valid, other=0.0).to(tl.float32)
    ln = -(ls * tl.load(Kz + mrow, mask=valid, other=0).to(tl.float32)) * FRAC  # the minimum, exact
    raw_h = tl.dot(qh0, k0)
    if D4 < HI_DIMS:
        raw_h = tl.dot(qh1, k1, raw_h)
    if HI_DIMS >= 16:  # the upper bits' share, 2^BITS q . up, exact products in the float32 accumulator
        raw_h += (1 << BITS) * tl.dot(qup, split_upper_tile(Kc, trow, valid, HI_DIMS, HI_BITS - BITS))
    raw_l = tl.dot(ql3, k3)
    raw_l = tl.dot(ql2, k2, raw_l)
    if 2 * D4 > HI_DIMS:
        raw_l = tl.dot(ql1, k1, raw_l)
    if D4 > HI_DIMS:
        raw_l = tl.dot(ql0, k0, raw_l)
    return (hs[None, :] * (raw_h - oh[:, None]) + hn[None, :] * th[:, None] +
            ls[None, :] * (raw_l - ol[:, None]) + ln[None, :] * tlo[:, None])


@triton.jit
def load_rope_ab(abrow, rmask, R: tl.constexpr):
    """Rows [M, R] a and b of the position-aware key offset over the R visited pairs (``rope_query_terms``)."""
    offs_i = tl.arange(0, R)
    a = tl.load(abrow + offs_i[None, :], mask=rmask, other=0.0)
    b = tl.load(abrow + R + offs_i[None, :], mask=rmask, other=0.0)
    return a, b


@triton.jit
def rope_logits(ra, rb, CS, PR, pos, valid, HALF: tl.constexpr):
    """[M, N] logits q . RoPE_p(mu_pre) of keys at positions ``pos`` [N]: sum_i a_i cos(p t_i) + b_i sin(p t_i)
    over the R pairs i listed at PR (rope.kernel_pairs; mu_pre is zero elsewhere), cos | sin read from the
    float32 table [N, 2 HALF] (rope.py), multiplied in float32 (exact add-back).  One dot over 2R >= 16
    (a_i, b_i interleaved against cos, sin rows)."""
    M: tl.constexpr = ra.shape[0]
    R: tl.constexpr = ra.shape[1]
    x = tl.reshape(tl.join(ra, rb), (M, 2 * R))
    offs_k = tl.arange(0, 2 * R)
    col = tl.load(PR + offs_k // 2) + (offs_k % 2) * HALF
    t = tl.load(CS + pos.to(tl.int64)[None, :] * (2 * HALF) + col[:, None], mask=valid[None, :], other=0.0)
    return tl.dot(x, t, input_precision="ieee")


@triton.jit
def rope_logits_tiled(ra, rb, BASE, STEPS, PR, p0, N: tl.constexpr, HALF: tl.constexpr, F32DOT: tl.constexpr):
    """rope_logits for the N positions p0 .. p0 + N - 1 (p0 and N multiples of 16) without a per-position
    table: with p = p0 + 16u + v, a cos(p t) + b sin(p t) = Re(W_u e^{i v t}), W_u = (a - ib) e^{i (p0+16u) t}.
    W needs one table row per 16 positions (BASE: cos | sin at multiples of 16); the sum over the R pairs
    and the 16 v's is one [G*N/16, 2R] x [2R, 16] MMA against STEPS (rows 2i, 2i+1: cos(v t_i), -sin(v t_i)),
    at ~float32 precision (3xTF32)."""
    U: tl.constexpr = N // 16
    G: tl.constexpr = ra.shape[0]
    R: tl.constexpr = ra.shape[1]
    offs_u = tl.arange(0, U)
    pr = tl.load(PR + tl.arange(0, R))
    row = BASE + (p0 // 16 + offs_u).to(tl.int64)[:, None] * (2 * HALF) + pr[None, :]
    c0 = tl.load(row)[None, :, :]  # [1, U, R]
    s0 = tl.load(row + HALF)[None, :, :]
    a = ra[:, None, :]
    b = rb[:, None, :]
    x = tl.reshape(tl.join(a * c0 + b * s0, a * s0 - b * c0), (G * U, 2 * R))  # re, im interleaved per pair
    offs_k = tl.arange(0, 2 * R)
    srow = 2 * tl.load(PR + offs_k // 2) + offs_k % 2
    f = tl.load(STEPS + srow[:, None] * 16 + tl.arange(0, 16)[None, :])
    if F32DOT:
        out = tl.dot(x, f)
    else:
        out = tl.dot(x, f, input_precision="tf32x3")
    return tl.reshape(out, (G, N))


@triton.jit
def cat4(a0, a1, a2, a3, M: tl.constexpr, D4: tl.constexpr):
    """Four column slices [M, D4] -> [M, 4*D4] with slice k at columns k*D4 .. (k+1)*D4."""
    x = tl.join(tl.join(a0, a1), tl.join(a2, a3))  # [M, D4, 2 (inner pair), 2 (outer pair)]
    return tl.reshape(tl.permute(x, (0, 3, 2, 1)), (M, 4 * D4))


@triton.jit
def mm(a, b, acc, F32DOT: tl.constexpr):
    """a @ b + acc; F32DOT (interpreter only: its bf16 dot is broken) multiplies in float32."""
    if F32DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def softmax_step(s, m_i, l_i, SLIDING: tl.constexpr):
    """One tile of base-2 logits s [M, N] (-inf = masked) -> (p, alpha, m_new, l_new).  SLIDING: a row may have
    seen no key yet and have none in this tile (a sliding window's lower bound): its max stays -inf, and
    exponents are taken against 0 instead of -inf - -inf = NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if SLIDING:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def bf16_range(q, ql, m_i, l_i, acc, start, end, bt_row, Kw, Vw, head_off, stride_wp,
                D: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr, F32DOT: tl.constexpr, SPLITQ: tl.constexpr,
                ra=None, rb=None, CS=None, ROPE: tl.constexpr = False, PR=None,
                BASE=None, STEPS=None, TILED: tl.constexpr = False, row_lo=None, SLIDING: tl.constexpr = False):
    """Online softmax over tokens [start, end) stored in BF16 window pages (logical page = t // P).
    SPLITQ: the query is q + ql (bf16 hi and lo parts), two MMAs per tile.  ROPE: add the position-aware
    key offset's logits (ra, rb, CS, PR: rope_logits; TILED: rope_logits_tiled from BASE / STEPS, start and
    BLOCK multiples of 16).  SLIDING: row m sees only tokens >= row_lo[m] (int32 [M], a sliding window's
    lower bound); the range starts at the page of the smallest bound (start must be a page boundary), and
    tokens below it are not loaded."""
    offs_d = tl.arange(0, D)
    lo = 0
    if SLIDING:
        lo = tl.maximum(tl.min(row_lo, 0), 0)
        start = tl.maximum(start, (lo // P) * P)  # a page boundary: keeps TILED's multiples of 16
    for t0 in range(start, end, BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        valid = offs < end
        if SLIDING:
            valid = valid & (offs >= lo)
        phys = tl.load(bt_row + offs // P, mask=valid, other=0).to(tl.int64)
        row = phys * stride_wp + head_off + (offs % P) * D
        k = tl.load(Kw + row[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = mm(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK], tl.float32), F32DOT)
        if SPLITQ:
            s = mm(ql, tl.trans(k), s, F32DOT)
        if ROPE:
            if TILED:
                s += rope_logits_tiled(ra, rb, BASE, STEPS, PR, t0, BLOCK, D // 2, F32DOT)
            else:
                s += rope_logits(ra, rb, CS, PR, offs, valid, D // 2)
        see = valid[None, :]
        if SLIDING:
            see = see & (offs[None, :] >= row_lo[:, None])
        s = tl.where(see, s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, SLIDING)
        v = tl.load(Vw + row[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc = mm(p.to(tl.bfloat16), v, acc * alpha[:, None], F32DOT)
    return m_i, l_i, acc


@triton.jit
def meta_slot(off):
    """layout.metadata_slot for a page of a multiple of 16 tokens (every page a kernel reads): token j of each 16
    keeps its scales and zero points at slot 2 (j mod 8) + j // 8."""
    return off - off % 16 + 2 * (off % 8) + (off % 16) // 8


@triton.jit
def grp_scores(qk, ck, off, tsum, Ks, Kz, mrow, valid, g: tl.constexpr, FRAC: tl.constexpr):
    """Slice contribution s_g * (q_k . (1024 + c 4^k) - off_k) + m_g * sum(q_k) for the slice's group g: scales at
    Ks, zero points at Kz (one offset mrow + g addresses both), m_g = -(s_g z_g) 2^-F in float32 with FRAC = 2^-F
    (exact: quant.stored_minimum bit for bit)."""
    ks = tl.load(Ks + mrow + g, mask=valid, other=0.0).to(tl.float32)
    kn = -(ks * tl.load(Kz + mrow + g, mask=valid, other=0).to(tl.float32)) * FRAC  # the minimum, exact
    raw = tl.dot(qk, ck)
    return ks[None, :] * (raw - off[:, None]) + kn[None, :] * tsum[:, None]


@triton.jit
def grp_values(p, vk, acc, n, alpha, Vs, Vz, mrow, valid, g: tl.constexpr, FRAC: tl.constexpr):
    """One tile of values for the slice's group g: acc <- alpha*acc + sum_n pp_n c_n 4^k, n <- alpha*n + sum_n p_n min_n.
    The codes arrive as 1024 + c 4^k; the tile's offset 1024*sum(pp) leaves the accumulator operand before the MMA
    adds it back, so the float32 accumulator never holds ~1024x the signal (the H100's MMA accumulation truncates,
    and over a long split that bias reached 7e-2 relative error in the extend kernel).  Scales, zero points and
    FRAC as grp_scores."""
    vs = tl.load(Vs + mrow + g, mask=valid, other=0.0).to(tl.float32)
    vn = -(vs * tl.load(Vz + mrow + g, mask=valid, other=0).to(tl.float32)) * FRAC  # the minimum, exact
    pp = (p * vs[None, :]).to(tl.float16)
    off = 1024.0 * tl.sum(pp.to(tl.float32), 1)
    acc = tl.dot(pp, vk, acc * alpha[:, None] - off[:, None])
    n = n * alpha + tl.sum(p * vn[None, :], 1)
    return acc, n


@triton.jit
def store_partial(PO, PL, b, h, s, acc, m_i, l_i, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                  col0, D_OUT: tl.constexpr, GQA: tl.constexpr, H_PAD: tl.constexpr, WRITE_LSE: tl.constexpr):
    """One split's normalized partial output (columns col0 .. col0 + D_OUT of the GQA group's rows) and, with
    WRITE_LSE, its base-2 log-sum-exp (-inf where the split saw no key): what ``merge`` combines."""
    offs_h = tl.arange(0, H_PAD)
    hm = offs_h < GQA
    qh = h * GQA + offs_h
    ok = l_i > 0
    o = acc / tl.where(ok, l_i, 1.0)[:, None]
    offs_d = col0 + tl.arange(0, D_OUT)
    tl.store(PO + b * stride_pob + qh[:, None] * stride_poh + s * stride_pos + offs_d[None, :], o, mask=hm[:, None])
    if WRITE_LSE:
        lse = tl.where(ok, m_i + tl.log2(tl.where(ok, l_i, 1.0)), float("-inf"))
        tl.store(PL + b * stride_plb + qh * stride_plh + s, lse, mask=hm)


@triton.jit(do_not_specialize=["NS"])  # the split count varies per step: one compile per BLOCK_S only
def _merge_kernel(PO, PL, O, NS, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh,
                  D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    sm = offs_s < NS
    lse = tl.load(PL + b * stride_plb + hq * stride_plh + offs_s, mask=sm, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)
    w = tl.where(sm, w, 0.0)
    tot = tl.sum(w, 0)
    o = tl.load(PO + b * stride_pob + hq * stride_poh + offs_s[:, None] * stride_pos + offs_d[None, :],
                mask=sm[:, None] & (lse > float("-inf"))[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(tot > 0, tot, 1.0)
    tl.store(O + b * stride_ob + hq * stride_oh + offs_d, out.to(O.dtype.element_ty))


# ------------------------------------------------------------------------------------------ host helpers
def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessor count (8 off CUDA, for the split plan under the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def kernel_widths(geom, layer: int) -> tuple[int, int]:
    """(key bits, value bits) of ``layer``'s codes (``PoolGeometry.layer_widths``), the kernels' K_BITS / V_BITS;
    ValueError for a width they do not read.  A BF16 cache has no codes: (2, 2), for the INT2 placeholders the
    kernels are handed there and never read."""
    if not geom.quantizes:
        return 2, 2
    widths = geom.layer_widths(layer)
    if widths[0] not in KERNEL_KEY_WIDTHS or widths[1] not in KERNEL_VALUE_WIDTHS:
        raise ValueError(f"layer {layer} stores keys / values at {widths[0]} / {widths[1]} bits; the kernels read "
                         f"{kernel_widths_text()}")
    return widths


def key_split(geom, layer: int, k_codes: torch.Tensor | None = None) -> tuple[int, int, int]:
    """(HI_DIMS, HI_BITS, K_TAIL) of ``layer``'s keys, the kernels' split constexprs: the channels at the wider width,
    its bits and the bytes of a row's tail (split_keys.py), or (0, key bits, 0) where every channel is at one width.
    ``k_codes``: the layer's key pages, checked to hold each page's rows contiguously (ValueError otherwise)."""
    split = geom.k_split[layer] if geom.quantizes else None
    if split is None:
        return 0, kernel_widths(geom, layer)[0], 0
    if k_codes is not None:
        split_keys.tile_views(k_codes, split, geom.head_dim)
    return split.hi_dims, split.hi_bits, split_keys.tail_bytes(split)


def group_metadata(layer: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_scale, k_zero, v_scale, v_zero) of a layer's tensors (``PagedKVPool.layer``).  The kernels address all four
    with the key scales' page and head strides and a token's groups at (token % P) * NG + g, so a layer whose scales
    and zero points (of keys or values) are laid out otherwise raises ValueError, as do zero points not stored as
    uint8."""
    names = ("k_scale", "k_zero", "v_scale", "v_zero")
    tensors = tuple(layer[name] for name in names)
    strides = {name: tuple(t.stride()) for name, t in zip(names, tensors)}
    if len(set(strides.values())) > 1:
        raise ValueError(f"the kernels address scales and zero points with one set of strides: {strides}")
    if tensors[0].stride()[-2:] != (tensors[0].shape[-1], 1):
        raise ValueError(f"the kernels read a token's scales and zero points as one contiguous row, not with strides "
                         f"{strides['k_scale']}")
    for name, t in zip(names[1::2], tensors[1::2]):
        if t.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8 zero points, got {t.dtype}")
    return tensors


def own_value_rows(k_codes: torch.Tensor, v_codes: torch.Tensor, widths: tuple[int, int]) -> bool:
    """Whether a kernel addresses the value codes' rows on their own (its V_ROWS constexpr): values at another
    width than the keys, or in a tensor with other strides.  Otherwise the key rows' offsets serve both, as they
    always did for INT2 (no extra address arithmetic in the INT2 kernels)."""
    return widths[0] != widths[1] or k_codes.stride()[:-1] != v_codes.stride()[:-1]


def asm_enabled(device: torch.device, use_asm: bool | None) -> bool:
    """Whether the kernels convert codes with PTX (unpack4's USE_ASM): on a GPU unless use_asm is False."""
    if INTERPRET or device.type != "cuda":
        return False
    return True if use_asm is None else bool(use_asm)


def window_tokens(tokens: int, window: int | None, tile: int) -> int:
    """The tokens a split plan must cover: ``tokens`` (a bound on the history), or for a sliding ``window`` the
    window's tokens from the start of the tile (or page) holding its first one, at most window + tile - 1."""
    return min(tokens, window + tile - 1) if window else tokens


def split_plan(tokens: int, programs_per_split: int, device: torch.device, block: int,
               min_tiles: int = TUNING.split_min_tiles,
               num_splits: int | None = None, per_sm: int = 4) -> tuple[int, int]:
    """(splits, chunk): enough programs to fill the GPU per_sm times over, each split >= min_tiles tiles.

    Args:
        tokens: a bound on the tokens to split (the longest sequence's).
        programs_per_split: programs per split index (sequences x KV heads).
        device: whose SMs to fill.
        block: tokens per tile; a chunk is whole tiles.
        min_tiles: the fewest tiles per split.
        num_splits: a fixed split count instead of the plan's.
        per_sm: programs per SM to aim for.
    Returns:
        (splits, chunk): the split count and tokens per split.
    """
    if tokens <= 0:
        return 1, block
    if num_splits is None:
        target = per_sm * num_sms(device)
        num_splits = max(1, -(-target // max(programs_per_split, 1)))
        num_splits = min(num_splits, max(1, tokens // (block * min_tiles)))
    chunk = -(-(-(-tokens // num_splits)) // block) * block
    return -(-tokens // chunk), chunk


def merge(po: torch.Tensor, pl: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Combine the splits exactly: po [B, Hq, NS, D] normalized partials, pl [B, Hq, NS] log2-sum-exps -> out
    [B, Hq, D] (written and returned; a split with pl = -inf counts for nothing)."""
    b, hq, ns, d = po.shape
    bd = d if INTERPRET else min(d, 32)  # the interpreter's cost is per program: one per head there
    _merge_kernel[(b, hq, d // bd)](po, pl, out, ns, po.stride(0), po.stride(1), po.stride(2), pl.stride(0),
                                    pl.stride(1), out.stride(0), out.stride(1), D=d,
                                    BLOCK_S=max(triton.next_power_of_2(ns), 2), BLOCK_D=bd, num_warps=4)
    return out


def rope_query_terms(q: torch.Tensor, mu_pre: torch.Tensor, scale: float, pairs: torch.Tensor,
                     layout=None) -> torch.Tensor:
    """Per query row the coefficients that turn the position-aware key offset into logits:
    q . RoPE_p(mu) = sum_i a_i cos(p t_i) + b_i sin(p t_i) (pairs i < D/2 of channels (l, h) = (i, i + D/2) in
    the rotate-half layout, rope.RotaryLayout.channels in general) with a_i = q_l mu_l + q_h mu_h,
    b_i = q_h mu_l - q_l mu_h, kept for the pairs the kernels visit.

    Args:
        q: the unrotated queries.
        mu_pre: the mean pre-RoPE key per KV head.
        scale: multiplies the coefficients (the kernels' sm_scale * log2(e)).
        pairs: the pairs i each KV head visits (rope.kernel_pairs).
        layout: the pairs' channels (rope.RotaryLayout); None: rotate-half over all D channels.
    Shapes:
        q: [..., Hq, D]; mu_pre: [Hkv, D]; pairs: [Hkv, R].
    Returns:
        float32 [..., Hq, 2R]: [a | b] * scale, contiguous.
    """
    from ..rope import RotaryLayout

    hq, d = q.shape[-2:]
    layout = layout or RotaryLayout.full(d)
    group = hq // mu_pre.shape[0]
    mu_lo, mu_hi = layout.parts(mu_pre.float().repeat_interleave(group, 0))  # each query head's KV head
    idx = pairs.long().repeat_interleave(group, 0).expand(*q.shape[:-1], -1)
    q_lo, q_hi = layout.parts(q.float())
    a = q_lo * mu_lo + q_hi * mu_hi
    b = q_hi * mu_lo - q_lo * mu_hi
    return (torch.cat([a.gather(-1, idx), b.gather(-1, idx)], -1) * scale).contiguous()


def rope_args(q: torch.Tensor, rope, scale: float, positions: int, *blocks: int):
    """The position-aware arguments of a kernel launch.

    Args:
        q: the unrotated queries.
        rope: a rope.KernelRope, or None (placeholders, ``on`` False).
        scale: sm_scale * log2(e).
        positions: a host bound on the positions of the keys the call scores (rope.KernelRope.check).
        blocks: the call's tile sizes in keys; a tile reads past the last key by less than rope.TILE_MARGIN rows.
    Returns:
        (AB, PR, stride_b, stride_h, stride_prh, R, on): rope_query_terms(q) and its batch / head strides, the
        pairs [Hkv, R] and their head stride, R, and whether the term is on.
    """
    if rope is None:
        return q, q, 0, 0, 0, 1, False
    from ..rope import TILE_MARGIN

    if max(blocks, default=0) > TILE_MARGIN:
        raise ValueError(f"tiles of {max(blocks)} keys read past rope.TILE_MARGIN = {TILE_MARGIN} table rows")
    rope.check(positions)
    ab = rope_query_terms(q, rope.mu_pre, scale, rope.pairs, rope.layout)
    return ab, rope.pairs, ab.stride(0), ab.stride(-2), rope.pairs.stride(0), rope.pairs.shape[1], True

