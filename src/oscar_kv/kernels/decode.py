"""Paged decode attention in Triton: INT2 mixed cache [BF16 sink | INT2 history | BF16 recent], and the
BF16 paged baseline written the same way.  Specification: reference.decode_reference.

Work decomposition (both kernels): one program per (sequence, KV head, split).  A program loads the
GQA group's query rows once, streams its token range page by page through the block table, and keeps an
online softmax; every KV tile is read once per KV head and used by all query heads of the group.  Each
split writes a normalized partial output and its log-sum-exp (base 2); ``_merge_kernel`` combines the
splits exactly.  In the INT2 kernel split 0 is the BF16 window (sink + recent, <= S0 + W + P - 1 tokens)
and splits 1.. share the INT2 history evenly.  The INT2 path takes the query already rotated
(``rotate_query``: one small launch per call); the BF16 baseline rotates inside.  Where it applies,
``int2_decode`` runs all of this as one CUDA launch instead (int2_cuda.py, int2_decode.cu).

INT2 arithmetic (no dequantized tile is ever built):
  keys    q.k_hat = scale * (q.c) + min * sum(q)                 (per group of G channels)
  values  sum_n p_n v_hat_n = sum_n (p_n scale_n) c_n + sum_n p_n min_n
Codes become float16 with PTX PRMT + LOP3 (one LOP3 per two codes): OR-ing the masked code bits into
0x6400 gives 1024 + c*4^k for stride slice k (its bits sit at 2k..2k+1).  The 4^k is folded into the
float16 query slice, and the 1024 offset is removed with sum(q) / sum(p*scale) corrections, so the tensor
cores see the raw masked bytes; scale and min are applied per token in float32.  Under the Triton
interpreter the same values are made with ordinary integer ops.  Keys are loaded transposed ([D/4, N]) so
the MMA's key operand needs no register transpose.  Performance notes: benchmarks/NOTES.md.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ._compat import install_interpreter_shim
from .layout import PagedBatch, PagedKVPool

install_interpreter_shim()

LOG2E = 1.4426950408889634
ROPE_CAPPED_PAIRS = 16  # the register cap holds the position-aware term up to this many pairs (run R4)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

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
def _unpack4(raw, USE_ASM: tl.constexpr):
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
def _load_query(Q, R, b, h, stride_qb, stride_qh, stride_rh, qk_scale,
                D: tl.constexpr, GQA: tl.constexpr, H_PAD: tl.constexpr, ROTATE: tl.constexpr):
    """The GQA group's query rows [H_PAD, D] float32, rotated by R[h] if asked, times qk_scale."""
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D)
    qh = h * GQA + offs_h
    q = tl.load(Q + b * stride_qb + qh[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_h < GQA)[:, None], other=0.0).to(tl.float32)
    if ROTATE:
        r = tl.load(R + h * stride_rh + offs_d[:, None] * D + offs_d[None, :]).to(tl.float32)
        q = tl.dot(q, r, input_precision="ieee")
    return q * qk_scale


@triton.jit
def _load_rope_ab(abrow, rmask, R: tl.constexpr):
    """Rows [M, R] a and b of the position-aware key offset over the R visited pairs (``rope_query_terms``)."""
    offs_i = tl.arange(0, R)
    a = tl.load(abrow + offs_i[None, :], mask=rmask, other=0.0)
    b = tl.load(abrow + R + offs_i[None, :], mask=rmask, other=0.0)
    return a, b


@triton.jit
def _rope_logits(ra, rb, CS, PR, pos, valid, HALF: tl.constexpr):
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
def _rope_logits_tiled(ra, rb, BASE, STEPS, PR, p0, N: tl.constexpr, HALF: tl.constexpr, F32DOT: tl.constexpr):
    """_rope_logits for the N positions p0 .. p0 + N - 1 (p0 and N multiples of 16) without a per-position
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
def _mm(a, b, acc, F32DOT: tl.constexpr):
    """a @ b + acc; F32DOT (interpreter only: its bf16 dot is broken) multiplies in float32."""
    if F32DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _bf16_range(q, ql, m_i, l_i, acc, start, end, bt_row, Kw, Vw, head_off, stride_wp,
                D: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr, F32DOT: tl.constexpr, SPLITQ: tl.constexpr,
                ra=None, rb=None, CS=None, ROPE: tl.constexpr = False, PR=None,
                BASE=None, STEPS=None, TILED: tl.constexpr = False):
    """Online softmax over tokens [start, end) stored in BF16 window pages (logical page = t // P).
    SPLITQ: the query is q + ql (bf16 hi and lo parts), two MMAs per tile.  ROPE: add the position-aware
    key offset's logits (ra, rb, CS, PR: _rope_logits; TILED: _rope_logits_tiled from BASE / STEPS, start and
    BLOCK multiples of 16)."""
    offs_d = tl.arange(0, D)
    for t0 in range(start, end, BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        valid = offs < end
        phys = tl.load(bt_row + offs // P, mask=valid, other=0).to(tl.int64)
        row = phys * stride_wp + head_off + (offs % P) * D
        k = tl.load(Kw + row[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = _mm(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK], tl.float32), F32DOT)
        if SPLITQ:
            s = _mm(ql, tl.trans(k), s, F32DOT)
        if ROPE:
            if TILED:
                s += _rope_logits_tiled(ra, rb, BASE, STEPS, PR, t0, BLOCK, D // 2, F32DOT)
            else:
                s += _rope_logits(ra, rb, CS, PR, offs, valid, D // 2)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(Vw + row[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc = _mm(p.to(tl.bfloat16), v, acc * alpha[:, None], F32DOT)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _store_partial(PO, PL, b, h, s, acc, m_i, l_i, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                   col0, D_OUT: tl.constexpr, GQA: tl.constexpr, H_PAD: tl.constexpr, WRITE_LSE: tl.constexpr):
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


@triton.jit
def _bf16_decode_kernel(Q, R, Kw, Vw, BT, SL, PO, PL, qk_scale,
                        stride_qb, stride_qh, stride_rh, stride_wp, stride_wh, stride_bt,
                        stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, chunk,
                        D: tl.constexpr, P: tl.constexpr, GQA: tl.constexpr, H_PAD: tl.constexpr,
                        BLOCK: tl.constexpr, ROTATE: tl.constexpr, F32DOT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(SL + b)
    q = _load_query(Q, R, b, h, stride_qb, stride_qh, stride_rh, qk_scale, D, GQA, H_PAD, ROTATE).to(tl.bfloat16)
    m_i = tl.full([H_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([H_PAD], tl.float32)
    acc = tl.zeros([H_PAD, D], tl.float32)
    start = s * chunk
    end = tl.minimum(start + chunk, seq_len)
    m_i, l_i, acc = _bf16_range(q, q, m_i, l_i, acc, start, end, BT + b * stride_bt, Kw, Vw,
                                h.to(tl.int64) * stride_wh, stride_wp, D, P, BLOCK, F32DOT, False)
    _store_partial(PO, PL, b, h, s, acc, m_i, l_i, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                   0, D, GQA, H_PAD, True)


@triton.jit
def _int2_decode_kernel(Q, Kc, Km, Vc, Vm, Kw, Vw, BT, SL, NQ, PO, PL, AB, PR, BASE, STEPS, qk_scale,
                        stride_qb, stride_qh, stride_cp, stride_ch, stride_mp, stride_mh,
                        stride_wp, stride_wh, stride_bt, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                        stride_abb, stride_abh, stride_prh, chunk,
                        D: tl.constexpr, G: tl.constexpr, P: tl.constexpr, SINK_PAGES: tl.constexpr,
                        GQA: tl.constexpr, H_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                        USE_ASM: tl.constexpr, F32DOT: tl.constexpr, KT: tl.constexpr, ROPE: tl.constexpr,
                        R: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(SL + b)
    nq = tl.load(NQ + b)
    bt_row = BT + b * stride_bt
    offs_h = tl.arange(0, H_PAD)
    hm = (offs_h < GQA)[:, None]
    qrow = Q + b * stride_qb + (h * GQA + offs_h)[:, None] * stride_qh
    m_i = tl.full([H_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([H_PAD], tl.float32)
    ra = None
    rb = None
    pr = PR + h * stride_prh  # this KV head's visited RoPE pairs
    if ROPE:
        ra, rb = _load_rope_ab(AB + b * stride_abb + (h * GQA + offs_h)[:, None] * stride_abh, hm, R)
    if s == 0:
        # ---- BF16 window: sink [0, min(T, S0)) then recent [S0 + P*nq, T).  The query is split into
        # bf16 hi + lo parts (two MMAs) so the logits keep ~16 bits, like the float32 reference.
        SINK: tl.constexpr = SINK_PAGES * P
        offs_d = tl.arange(0, D)
        qf = tl.load(qrow + offs_d[None, :], mask=hm, other=0.0).to(tl.float32) * qk_scale
        qh = qf.to(tl.bfloat16)
        ql = (qf - qh.to(tl.float32)).to(tl.bfloat16)
        acc = tl.zeros([H_PAD, D], tl.float32)
        head_off = h.to(tl.int64) * stride_wh
        m_i, l_i, acc = _bf16_range(qh, ql, m_i, l_i, acc, 0, tl.minimum(seq_len, SINK), bt_row, Kw, Vw,
                                    head_off, stride_wp, D, P, BLOCK_W, F32DOT, True, ra, rb, None, ROPE, pr,
                                    BASE, STEPS, True)
        m_i, l_i, acc = _bf16_range(qh, ql, m_i, l_i, acc, tl.minimum(SINK + nq * P, seq_len), seq_len, bt_row,
                                    Kw, Vw, head_off, stride_wp, D, P, BLOCK_W, F32DOT, True, ra, rb, None, ROPE, pr,
                                    BASE, STEPS, True)
        _store_partial(PO, PL, b, h, s, acc, m_i, l_i, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                       0, D, GQA, H_PAD, True)
    else:
        # ---- INT2 history tokens [start, end) counted from the sink's end (start, end: multiples of P)
        D4: tl.constexpr = D // 4
        NG: tl.constexpr = D // G
        offs_c = tl.arange(0, D4)
        # query slices (float32, scaled), float16 slice k pre-divided by 4^k (its codes arrive as 1024 + c*4^k)
        qf0 = tl.load(qrow + offs_c[None, :], mask=hm, other=0.0).to(tl.float32) * qk_scale
        qf1 = tl.load(qrow + D4 + offs_c[None, :], mask=hm, other=0.0).to(tl.float32) * qk_scale
        qf2 = tl.load(qrow + 2 * D4 + offs_c[None, :], mask=hm, other=0.0).to(tl.float32) * qk_scale
        qf3 = tl.load(qrow + 3 * D4 + offs_c[None, :], mask=hm, other=0.0).to(tl.float32) * qk_scale
        q0 = qf0.to(tl.float16)
        q1 = (qf1 * 0.25).to(tl.float16)
        q2 = (qf2 * 0.0625).to(tl.float16)
        q3 = (qf3 * 0.015625).to(tl.float16)
        # per slice: 1024 * sum of the float16 slice (the offset to remove) and the true sum (for the minimum)
        o0 = 1024.0 * tl.sum(q0.to(tl.float32), 1)
        o1 = 1024.0 * tl.sum(q1.to(tl.float32), 1)
        o2 = 1024.0 * tl.sum(q2.to(tl.float32), 1)
        o3 = 1024.0 * tl.sum(q3.to(tl.float32), 1)
        t0s = tl.sum(qf0, 1)
        t1s = tl.sum(qf1, 1)
        t2s = tl.sum(qf2, 1)
        t3s = tl.sum(qf3, 1)
        a0 = tl.zeros([H_PAD, D4], tl.float32)
        a1 = tl.zeros([H_PAD, D4], tl.float32)
        a2 = tl.zeros([H_PAD, D4], tl.float32)
        a3 = tl.zeros([H_PAD, D4], tl.float32)
        # per group: running sum of float16(p*scale) (undoes the 1024 offset) and of p*min
        n0 = tl.zeros([H_PAD], tl.float32)
        n1 = tl.zeros([H_PAD], tl.float32)
        n2 = tl.zeros([H_PAD], tl.float32)
        n3 = tl.zeros([H_PAD], tl.float32)
        start = (s - 1) * chunk
        end = tl.minimum(start + chunk, nq * P)
        head_c = h.to(tl.int64) * stride_ch
        head_m = h.to(tl.int64) * stride_mh
        n_tiles = tl.cdiv(end - start, BLOCK_N)
        for i in range(0, n_tiles):
            t0 = start + i * BLOCK_N
            offs = t0 + tl.arange(0, BLOCK_N)
            valid = offs < end
            phys = tl.load(bt_row + SINK_PAGES + offs // P, mask=valid, other=0).to(tl.int64)
            crow = tl.multiple_of(phys * stride_cp + head_c + (offs % P) * D4, D4)
            mrow = phys * stride_mp + head_m + (offs % P) * (2 * NG)
            bias = tl.where(valid, 0.0, float("-inf"))
            if KT:
                kraw = tl.load(Kc + crow[None, :] + offs_c[:, None], mask=valid[None, :], other=0)
                k0, k1, k2, k3 = _unpack4(kraw, USE_ASM)
            else:
                kraw = tl.load(Kc + crow[:, None] + offs_c[None, :], mask=valid[:, None], other=0)
                k0, k1, k2, k3 = _unpack4(kraw, USE_ASM)
                k0 = tl.trans(k0)
                k1 = tl.trans(k1)
                k2 = tl.trans(k2)
                k3 = tl.trans(k3)
            if NG == 1:
                ks = tl.load(Km + mrow, mask=valid, other=0.0).to(tl.float32)
                kn = tl.load(Km + mrow + 1, mask=valid, other=0.0).to(tl.float32)
                raw = tl.dot(q0, k0)
                raw = tl.dot(q1, k1, raw)
                raw = tl.dot(q2, k2, raw)
                raw = tl.dot(q3, k3, raw)
                sc = ks[None, :] * (raw - (o0 + o1 + o2 + o3)[:, None]) + \
                    (kn[None, :] * (t0s + t1s + t2s + t3s)[:, None] + bias[None, :])
            else:
                sc = _grp_scores(q0, k0, o0, t0s, Km, mrow, valid, (0 * D4) // G, NG)
                sc += _grp_scores(q1, k1, o1, t1s, Km, mrow, valid, (1 * D4) // G, NG)
                sc += _grp_scores(q2, k2, o2, t2s, Km, mrow, valid, (2 * D4) // G, NG)
                sc += _grp_scores(q3, k3, o3, t3s, Km, mrow, valid, (3 * D4) // G, NG)
                sc = sc + bias[None, :]
            if ROPE:
                sc += _rope_logits_tiled(ra, rb, BASE, STEPS, pr, SINK_PAGES * P + t0, BLOCK_N, D // 2, F32DOT)
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            vraw = tl.load(Vc + crow[:, None] + offs_c[None, :], mask=valid[:, None], other=0)
            v0, v1, v2, v3 = _unpack4(vraw, USE_ASM)
            if NG == 1:
                vs = tl.load(Vm + mrow, mask=valid, other=0.0).to(tl.float32)
                vn = tl.load(Vm + mrow + 1, mask=valid, other=0.0).to(tl.float32)
                pp = (p * vs[None, :]).to(tl.float16)
                off = 1024.0 * tl.sum(pp.to(tl.float32), 1)  # see _grp_values: keep the offset out of the MMA sum
                n0 = n0 * alpha + tl.sum(p * vn[None, :], 1)
                a0 = tl.dot(pp, v0, a0 * alpha[:, None] - off[:, None])
                a1 = tl.dot(pp, v1, a1 * alpha[:, None] - off[:, None])
                a2 = tl.dot(pp, v2, a2 * alpha[:, None] - off[:, None])
                a3 = tl.dot(pp, v3, a3 * alpha[:, None] - off[:, None])
            else:
                a0, n0 = _grp_values(p, v0, a0, n0, alpha, Vm, mrow, valid, (0 * D4) // G, NG)
                a1, n1 = _grp_values(p, v1, a1, n1, alpha, Vm, mrow, valid, (1 * D4) // G, NG)
                a2, n2 = _grp_values(p, v2, a2, n2, alpha, Vm, mrow, valid, (2 * D4) // G, NG)
                a3, n3 = _grp_values(p, v3, a3, n3, alpha, Vm, mrow, valid, (3 * D4) // G, NG)
        if NG == 1:
            n1 = n0
            n2 = n0
            n3 = n0
        a0 = a0 + n0[:, None]
        a1 = a1 * 0.25 + n1[:, None]
        a2 = a2 * 0.0625 + n2[:, None]
        a3 = a3 * 0.015625 + n3[:, None]
        _store_partial(PO, PL, b, h, s, a0, m_i, l_i, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                       0, D4, GQA, H_PAD, True)
        _store_partial(PO, PL, b, h, s, a1, m_i, l_i, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                       D4, D4, GQA, H_PAD, False)
        _store_partial(PO, PL, b, h, s, a2, m_i, l_i, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                       2 * D4, D4, GQA, H_PAD, False)
        _store_partial(PO, PL, b, h, s, a3, m_i, l_i, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                       3 * D4, D4, GQA, H_PAD, False)


@triton.jit
def _grp_scores(qk, ck, off, tsum, Km, mrow, valid, g: tl.constexpr, NG: tl.constexpr):
    """Slice contribution s_g * (q_k . (1024 + c 4^k) - off_k) + m_g * sum(q_k) for the slice's group g."""
    ks = tl.load(Km + mrow + g, mask=valid, other=0.0).to(tl.float32)
    kn = tl.load(Km + mrow + NG + g, mask=valid, other=0.0).to(tl.float32)
    raw = tl.dot(qk, ck)
    return ks[None, :] * (raw - off[:, None]) + kn[None, :] * tsum[:, None]


@triton.jit
def _grp_values(p, vk, acc, n, alpha, Vm, mrow, valid, g: tl.constexpr, NG: tl.constexpr):
    """One tile of values for the slice's group g: acc <- alpha*acc + sum_n pp_n c_n 4^k, n <- alpha*n + sum_n p_n min_n.
    The codes arrive as 1024 + c 4^k; the tile's offset 1024*sum(pp) leaves the accumulator operand before the MMA
    adds it back, so the float32 accumulator never holds ~1024x the signal (the H100's MMA accumulation truncates,
    and over a long split that bias reached 7e-2 relative error in the extend kernel)."""
    vs = tl.load(Vm + mrow + g, mask=valid, other=0.0).to(tl.float32)
    vn = tl.load(Vm + mrow + NG + g, mask=valid, other=0.0).to(tl.float32)
    pp = (p * vs[None, :]).to(tl.float16)
    off = 1024.0 * tl.sum(pp.to(tl.float32), 1)
    acc = tl.dot(pp, vk, acc * alpha[:, None] - off[:, None])
    n = n * alpha + tl.sum(p * vn[None, :], 1)
    return acc, n


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


# ------------------------------------------------------------------------------------------ wrappers
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def _rotation_args(q: torch.Tensor, k_rotation: torch.Tensor | None, num_kv_heads: int):
    if k_rotation is None:
        return q, 0, False
    r = k_rotation.float().contiguous()
    if r.shape[0] not in (1, num_kv_heads):
        raise ValueError(f"k_rotation must have 1 or {num_kv_heads} heads, got {r.shape[0]}")
    return r, (0 if r.shape[0] == 1 else r.stride(0)), True


def _split_plan(tokens: int, programs_per_split: int, device: torch.device, block: int, min_tiles: int = 4,
                num_splits: int | None = None, per_sm: int = 4) -> tuple[int, int]:
    """(splits, chunk): enough programs to fill the GPU per_sm times over, each split >= min_tiles tiles."""
    if tokens <= 0:
        return 1, block
    if num_splits is None:
        target = per_sm * _num_sms(device)
        num_splits = max(1, -(-target // max(programs_per_split, 1)))
        num_splits = min(num_splits, max(1, tokens // (block * min_tiles)))
    chunk = -(-(-(-tokens // num_splits)) // block) * block
    return -(-tokens // chunk), chunk


def _merge(po: torch.Tensor, pl: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    b, hq, ns, d = po.shape
    bd = min(d, 32)
    _merge_kernel[(b, hq, d // bd)](po, pl, out, ns, po.stride(0), po.stride(1), po.stride(2), pl.stride(0),
                                    pl.stride(1), out.stride(0), out.stride(1), D=d,
                                    BLOCK_S=max(triton.next_power_of_2(ns), 2), BLOCK_D=bd, num_warps=4)
    return out


def compile_merges(device: torch.device, head_dim: int, max_splits: int = 2048) -> None:
    """Compile the merge kernel for every BLOCK_S up to ``max_splits`` (it follows the step's split count,
    so long contexts meet new ones mid-request otherwise): the server's warm-up calls this."""
    n = 2
    while n <= max_splits:
        po = torch.zeros(1, 1, n, head_dim, device=device)
        _merge(po, torch.zeros(1, 1, n, device=device), torch.empty(1, 1, head_dim, device=device))
        n *= 2


def _use_asm(device: torch.device, use_asm: bool | None) -> bool:
    if _INTERPRET or device.type != "cuda":
        return False
    return True if use_asm is None else bool(use_asm)


@triton.jit
def _rotate_query_kernel(Q, R, QR, stride_qb, stride_qh, stride_rh, D: tl.constexpr, GQA: tl.constexpr,
                         H_PAD: tl.constexpr, BLOCK_E: tl.constexpr):
    """qr[b, h*GQA + i] = q[b, h*GQA + i] @ R[h] in float32 (one program per sequence and KV head)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    e0 = tl.program_id(2) * BLOCK_E
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D)
    rows = h * GQA + offs_h
    hm = (offs_h < GQA)[:, None]
    q = tl.load(Q + b * stride_qb + rows[:, None] * stride_qh + offs_d[None, :], mask=hm, other=0.0).to(tl.float32)
    offs_e = e0 + tl.arange(0, BLOCK_E)
    r = tl.load(R + h * stride_rh + offs_d[:, None] * D + offs_e[None, :]).to(tl.float32)
    o = tl.sum(q[:, :, None] * r[None, :, :], 1)
    tl.store(QR + (b * GQA * tl.num_programs(1) + rows[:, None]) * D + offs_e[None, :], o, mask=hm)


def rotate_query(q: torch.Tensor, k_rotation: torch.Tensor | None, num_kv_heads: int) -> torch.Tensor:
    """q @ R_K[kv_head(q)] in float32 ([B, Hq, D] -> float32 [B, Hq, D]), one small launch per call instead
    of once per attention program (every split re-reading R from L2 cost ~8-10% in v2)."""
    if k_rotation is None:
        return q
    bsz, hq, d = q.shape
    r = k_rotation if k_rotation.dtype == torch.float32 and k_rotation.is_contiguous() else \
        k_rotation.float().contiguous()
    if r.shape[0] not in (1, num_kv_heads):
        raise ValueError(f"k_rotation must have 1 or {num_kv_heads} heads, got {r.shape[0]}")
    gqa = hq // num_kv_heads
    out = torch.empty(bsz, hq, d, device=q.device, dtype=torch.float32)
    if bsz:
        _rotate_query_kernel[(bsz, num_kv_heads, d // 16)](
            q, r, out, q.stride(0), q.stride(1), 0 if r.shape[0] == 1 else r.stride(0),
            D=d, GQA=gqa, H_PAD=triton.next_power_of_2(gqa), BLOCK_E=16, num_warps=4)
    return out


def rope_query_terms(q: torch.Tensor, mu_pre: torch.Tensor, scale: float, pairs: torch.Tensor) -> torch.Tensor:
    """Per query row the coefficients that turn the position-aware key offset into logits:
    q . RoPE_p(mu) = sum_i a_i cos(p t_i) + b_i sin(p t_i) (rotate-half layout, i < D/2) with
    a_i = q_i mu_i + q_{i+D/2} mu_{i+D/2}, b_i = q_{i+D/2} mu_i - q_i mu_{i+D/2}, kept for the pairs the
    kernels visit.  q [..., Hq, D] unrotated, mu_pre [Hkv, D], pairs [Hkv, R] -> float32 [..., Hq, 2R] =
    [a | b] * scale."""
    hq, d = q.shape[-2:]
    half = d // 2
    group = hq // mu_pre.shape[0]
    mu = mu_pre.float().repeat_interleave(group, 0)  # each query head's KV head
    idx = pairs.long().repeat_interleave(group, 0).expand(*q.shape[:-1], -1)
    qf = q.float()
    a = qf[..., :half] * mu[:, :half] + qf[..., half:] * mu[:, half:]
    b = qf[..., half:] * mu[:, :half] - qf[..., :half] * mu[:, half:]
    return (torch.cat([a.gather(-1, idx), b.gather(-1, idx)], -1) * scale).contiguous()


def _rope_args(q: torch.Tensor, rope, scale: float, positions: int, *blocks: int):
    """(AB, PR, stride_b, stride_h, stride_prh, R, on) for the kernels; ``rope``: a rope.KernelRope or None.
    ``positions``: a host bound on the positions of the keys the call scores (rope.KernelRope.check); its
    tiles (``blocks`` keys each) read past the last key by less than rope.TILE_MARGIN rows."""
    if rope is None:
        return q, q, 0, 0, 0, 1, False
    from ..rope import TILE_MARGIN

    if max(blocks, default=0) > TILE_MARGIN:
        raise ValueError(f"tiles of {max(blocks)} keys read past rope.TILE_MARGIN = {TILE_MARGIN} table rows")
    rope.check(positions)
    ab = rope_query_terms(q, rope.mu_pre, scale, rope.pairs)
    return ab, rope.pairs, ab.stride(0), ab.stride(-2), rope.pairs.stride(0), rope.pairs.shape[1], True


def int2_decode(q: torch.Tensor, pool: PagedKVPool, layer: int, batch: PagedBatch,
                k_rotation: torch.Tensor | None = None, sm_scale: float | None = None, *, rope=None,
                max_int2_pages: int | None = None, num_splits: int | None = None, block_n: int | None = None,
                block_w: int = 64, num_warps: int = 4, num_stages: int = 2, use_asm: bool | None = None,
                kt: bool = True, split_target: int | None = None, maxnreg: int | str | None = "auto",
                backend: str | None = None, cuda_split_target: int | None = None,
                max_seq_len: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over the mixed pool.  q: [B, Hq, D] (unrotated if k_rotation is given; any float
    dtype, float32 keeps the most precision) -> [B, Hq, D] in q's dtype.

    ``max_int2_pages`` (host int) avoids a device sync for the split plan; the engine knows it.  It may be
    any upper bound (CUDA graphs capture with a bucketed one).  ``max_seq_len`` (host int) bounds the sequences'
    lengths, i.e. the RoPE table rows a ``rope`` call reads (rope.KernelRope.check; None: a device sync).
    Tuning knobs (benchmark sweep): block_n tokens per INT2 tile, num_warps/num_stages, use_asm (PTX
    code conversion on GPU, default on), kt (keys loaded transposed), split_target (INT2 programs per SM;
    default 4 when batch x KV heads <= 8, else 8: measured best at 128K, bs 1 and bs 8, H100 run v5),
    maxnreg (register cap per thread: 128 gives 4 programs per SM instead of 3; "auto": 128 unless the
    position-aware term visits more than ROPE_CAPPED_PAIRS pairs; None: no cap).
    ``rope`` (rope.KernelRope) when the keys were centered per position: the kernel adds q . RoPE_p(mu_pre)
    to every logit.  q must then be unrotated, and the page size a multiple of 16.
    ``backend``: "cuda" runs the whole call as one CUDA launch (int2_cuda.py: rotation, window, history and
    merge), "triton" as the Triton kernels here, "auto" CUDA where int2_cuda supports the call; None: the
    environment variable OSCAR_KV_INT2_KERNEL, else "auto" (a server can be switched back to Triton without code).
    ``cuda_split_target``:
    CUDA CTAs per SM (default int2_cuda.min_blocks(pairs, head dim), the CTAs that fit on an SM at once).
    """
    g = pool.geometry
    bsz, hq, d = q.shape
    h = g.num_kv_heads
    gqa = hq // h
    if d != g.head_dim or hq % h:
        raise ValueError("query shape does not match the pool geometry")
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if max_int2_pages is None:
        max_int2_pages = int(batch.int2_pages.max()) if bsz else 0
    if rope is not None and max_seq_len is None:
        max_seq_len = int(batch.seq_lens.max()) if bsz else 0
    block_n = block_n or max(g.page_size, 256)
    if block_n % g.page_size:
        raise ValueError("block_n must be a multiple of the page size")
    if split_target is None:
        split_target = 4 if bsz * h <= 8 else 8
    if _use_cuda(backend or os.environ.get("OSCAR_KV_INT2_KERNEL", "auto"), q.device, g, gqa, rope, q.dtype):
        from . import int2_cuda

        # one full wave of the CTAs that fit on an SM: best at 128K, bs 1/8/32 (run C2)
        per_sm = cuda_split_target or int2_cuda.min_blocks(0 if rope is None else rope.pairs.shape[1], d)
        ns, chunk = int2_cuda.split_plan(max_int2_pages * g.page_size, bsz * h, g.page_size, _num_sms(q.device),
                                         per_sm)
        out = torch.empty(bsz, hq, d, device=q.device, dtype=q.dtype) if out is None else out
        if rope is not None:
            rope.check(max_seq_len)
        return int2_cuda.decode(q, k_rotation, pool.layer(layer), g, batch, out, ns, chunk, sm_scale * LOG2E,
                                rope=rope)
    ns, chunk = _split_plan(max_int2_pages * g.page_size, bsz * h, q.device, block_n, num_splits=num_splits,
                            per_sm=split_target)
    qr = rotate_query(q, k_rotation, h)
    po = torch.empty(bsz, hq, ns + 1, d, device=q.device, dtype=torch.float32)
    pl = torch.empty(bsz, hq, ns + 1, device=q.device, dtype=torch.float32)
    L = pool.layer(layer)
    kc, km, vc, vm, kw, vw = L["k_codes"], L["k_meta"], L["v_codes"], L["v_meta"], L["k_win"], L["v_win"]
    bt = batch.block_table
    h_pad = triton.next_power_of_2(gqa)
    # the position-aware term needs more registers: capped at 128 it spilled (2.5-6x slower, NOTES.md run R2)
    if maxnreg == "auto":  # capped, the full 64-pair term spilled (NOTES.md run R2)
        maxnreg = 128 if rope is None or rope.pairs.shape[1] <= ROPE_CAPPED_PAIRS else None
    extra = {"maxnreg": maxnreg} if (maxnreg and not _INTERPRET) else {}
    if rope is not None and (g.page_size % 16 or block_n % 16 or block_w % 16):
        raise ValueError("position-aware centering in the decode kernel needs page and block sizes that are multiples of 16")
    ab, pr, stride_abb, stride_abh, stride_prh, r, on = _rope_args(q, rope, sm_scale * LOG2E, max_seq_len, block_n,
                                                                   block_w)
    base, steps = (rope.base, rope.steps) if rope is not None else (q, q)
    _int2_decode_kernel[(bsz, h, ns + 1)](
        qr, kc, km, vc, vm, kw, vw, bt, batch.seq_lens, batch.int2_pages, po, pl, ab, pr, base, steps,
        sm_scale * LOG2E, qr.stride(0), qr.stride(1), kc.stride(0), kc.stride(1), km.stride(0), km.stride(1),
        kw.stride(0), kw.stride(1), bt.stride(0), po.stride(0), po.stride(1), po.stride(2), pl.stride(0),
        pl.stride(1), stride_abb, stride_abh, stride_prh, chunk,
        D=d, G=g.group_size, P=g.page_size, SINK_PAGES=g.sink_pages, GQA=gqa, H_PAD=h_pad, BLOCK_N=block_n,
        BLOCK_W=block_w, USE_ASM=_use_asm(q.device, use_asm), F32DOT=_INTERPRET, KT=kt, ROPE=on, R=r,
        num_warps=num_warps, num_stages=num_stages, **extra)
    out = torch.empty(bsz, hq, d, device=q.device, dtype=q.dtype) if out is None else out
    return _merge(po, pl, out)


def _use_cuda(backend: str, device: torch.device, geom, gqa: int, rope, dtype: torch.dtype = torch.bfloat16) -> bool:
    if backend not in ("auto", "cuda", "triton"):
        raise ValueError(f"backend must be auto, cuda or triton, got {backend!r}")
    if backend == "triton":
        return False
    from . import int2_cuda

    why = int2_cuda.unsupported(device, geom, gqa, rope, dtype) or ("the Triton interpreter is on" if _INTERPRET else None)
    if why and backend == "cuda":
        raise ValueError(f"the CUDA INT2 kernel cannot run this call: {why}")
    return why is None


def bf16_decode(q: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, k_rotation: torch.Tensor | None = None, sm_scale: float | None = None, *,
                page_size: int, max_seq_len: int | None = None, num_splits: int | None = None, block: int = 64,
                num_warps: int = 4, num_stages: int = 2, out: torch.Tensor | None = None) -> torch.Tensor:
    """BF16 paged decode (the in-house baseline).  k_win/v_win: one layer's pages [N, H, P, D]; every
    logical page of a sequence points into them."""
    bsz, hq, d = q.shape
    h = k_win.shape[1]
    gqa = hq // h
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if bsz else 0
    ns, chunk = _split_plan(max_seq_len, bsz * h, q.device, block)
    r, stride_rh, rotate = _rotation_args(q, k_rotation, h)
    po = torch.empty(bsz, hq, ns, d, device=q.device, dtype=torch.float32)
    pl = torch.empty(bsz, hq, ns, device=q.device, dtype=torch.float32)
    h_pad = max(16, triton.next_power_of_2(gqa))
    _bf16_decode_kernel[(bsz, h, ns)](
        q, r, k_win, v_win, block_table, seq_lens, po, pl, sm_scale * LOG2E,
        q.stride(0), q.stride(1), stride_rh, k_win.stride(0), k_win.stride(1), block_table.stride(0),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1), chunk,
        D=d, P=page_size, GQA=gqa, H_PAD=h_pad, BLOCK=block, ROTATE=rotate, F32DOT=_INTERPRET, num_warps=num_warps,
        num_stages=num_stages)
    out = torch.empty(bsz, hq, d, device=q.device, dtype=q.dtype) if out is None else out
    return _merge(po, pl, out)
