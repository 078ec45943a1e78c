"""Extend (chunked prefill / prefix-hit) attention over the mixed paged pool in Triton.
Specification: reference.extend_reference.  The engine runs it for short chunks (decode tokens beside a prefill
chunk, short suffixes after a prefix hit); long chunks take materialized_extend.py (kernel_attention.extend_path).

A chunk of new query tokens of each sequence attends to (a) the sequence's cached history in the pool
(BF16 sink pages, INT2 history pages, BF16 recent pages; ``batch`` describes the cache *before* the
chunk) and (b) causally to the chunk's own keys/values, passed in as tensors.  Sequences are packed:
sequence b owns rows cu_seqlens[b] .. cu_seqlens[b+1] of q / k_new / v_new / out.

Work decomposition: one program per (query tile, sequence, KV head[, history split]).  A program's rows
are BLOCK_T consecutive chunk tokens x the GQA group's query heads (padded to a power of two), i.e.
BLOCK_M = BLOCK_T * H_PAD rows, so every KV tile is loaded once per KV head and multiplied against all
its query heads with one MMA.  Normally the query tiles of the chunks (x batch x KV heads) fill the GPU
and each program reads its whole history; the heaviest tiles (last in a chunk, longest causal range)
are launched first.  When they do not (a short chunk after a long cached prefix, small batch), the INT2
history is split as in decode: split 0 reads the BF16 window + chunk, splits 1.. share the INT2 pages,
and decode's merge kernel combines the partial outputs by their log-sum-exp.

Per program, one online softmax (base 2, float32) over, in this order:
  1. the INT2 history, read as in decode.py (codes -> float16 1024 + c*4^k with the 4^k folded into the
     query slice, per-token scale/min applied in float32, the min from the zero point there; no dequantized tile
     is ever built; keys and values at the layer's widths, layout.KERNEL_KEY_WIDTHS / KERNEL_VALUE_WIDTHS,
     through common.code_slices), except
     that the values' 1024 offset is removed from the MMA accumulator tile by tile, not once at the end (a
     program may read 100K+ tokens: see _int2_history).  Its four per-slice accumulators are folded and
     concatenated into the [BLOCK_M, D] accumulator afterwards, so they are not live during the rest;
  2. the BF16 sink and recent pages (common.bf16_range);
  3. the chunk itself, causally (key j visible to chunk token i iff j <= i).
The BF16 parts multiply with a bf16 hi + lo split of the float32 query (two MMAs, ~16-bit logits, as the
decode window does); ``split_query=False`` uses one bf16 MMA.  A sliding-window layer (``window``, the SLIDING
constexpr) gives each row its own lower bound: every range starts at the key tile holding the query tile's
smallest bound, and a row that has seen no key yet keeps its running max at -inf without NaNs
(common.softmax_step).  The query is rotated before the launch
(float32 torch matmul: one GEMM for the whole chunk).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._compat import install_interpreter_shim
from .tuning import TUNING
from .common import (INTERPRET, LOG2E, asm_enabled, bf16_range, cat4, code_slices, grp_scores, grp_values, meta_slot,
                     group_metadata, kernel_widths, key_split, load_rope_ab, merge, mm, num_sms, own_value_rows,
                     rope_args, rope_logits, softmax_step, split_key_query, split_plan, split_scores, unpack4,
                     window_tokens)
from .layout import PagedBatch, PagedKVPool

install_interpreter_shim()


@triton.jit
def _int2_history(qrow, rmask, qk_scale, start, end, bt_row, Kc, Ks, Kz, Vc, Vs, Vz, head_c, head_m, stride_cp,
                  stride_mp, M: tl.constexpr, D: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
                  SINK_PAGES: tl.constexpr,
                  BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr, ra=None, rb=None, CS=None,
                  ROPE: tl.constexpr = False, PR=None, row_lo=None, SLIDING: tl.constexpr = False,
                  head_vc=None, stride_vcp=None, K_BITS: tl.constexpr = 2, V_BITS: tl.constexpr = 2,
                  V_ROWS: tl.constexpr = False, K_HI_DIMS: tl.constexpr = 0, K_HI_BITS: tl.constexpr = 2,
                  K_TAIL: tl.constexpr = 0):
    """Online softmax over quantized history tokens [start, end), counted from the sink's end.

    qrow: pointers [M, 1] to the rotated float32 query rows.  SLIDING: row m sees only tokens >= row_lo[m]
    (counted from the sink's end too).  Keys and values are K_BITS / V_BITS-bit codes (common.code_slices; with
    K_HI_DIMS > 0 split key rows, their first K_HI_DIMS channels at K_HI_BITS, with tails of K_TAIL bytes); with
    V_ROWS the value codes' rows are addressed by head_vc / stride_vcp, else by the keys' offsets.  Scales (Ks, Vs)
    and zero points (Kz, Vz) share one row offset (head_m, stride_mp).  Returns (m_i,
    l_i, acc [M, D]) with acc the unnormalized output in the true value space (offsets removed, slices
    concatenated).

    Value codes arrive as 1024 + c*4^k, so a tile's MMA adds 1024*sum(pp) to every column on top of the
    signal sum(pp*c*4^k) (<= 3/1024 of it in slice 0).  The offset is subtracted from the accumulator
    operand of each tile's MMA (acc*alpha - 1024*sum(pp): one FMA where a multiply was) instead of once at
    the end: the accumulator then only ever holds the signal plus one tile's offset.  Keeping the offset
    for the whole range makes the accumulator ~1024x the signal and, the tensor cores' float32 accumulation
    truncating at every MMA step, the error grows with the tokens of a program: rel. error ~0.075 over 131K
    tokens in one program on an H100 (~0.01 over 16K), where the output (min + scale*c, outlier-dominated
    groups) is itself a small difference of large terms.
    """
    D4: tl.constexpr = D // 4
    NG: tl.constexpr = D // G
    KCB: tl.constexpr = D * K_BITS // 8  # code bytes per row (split keys: their tails follow the page's rows)
    VCB: tl.constexpr = D * V_BITS // 8
    # rows start at multiples of the largest power of two dividing KCB / VCB (3D/8 at INT3, 5D/8 at INT5: D/8)
    K_ALIGN: tl.constexpr = KCB & -KCB
    V_ALIGN: tl.constexpr = VCB & -VCB
    # 2^-F, the unit of the zero points (F = quant.fraction_bits: 8 - bits, 0 at 8 bits)
    K_FRAC: tl.constexpr = 1.0 / (1 << ((8 - K_BITS) % 8))
    V_FRAC: tl.constexpr = 1.0 / (1 << ((8 - V_BITS) % 8))
    offs_c = tl.arange(0, D4)
    # query slices (float32, scaled); float16 slice k is pre-divided by 4^k (its codes arrive as 1024 + c*4^k)
    qf0 = tl.load(qrow + offs_c[None, :], mask=rmask, other=0.0).to(tl.float32) * qk_scale
    qf1 = tl.load(qrow + D4 + offs_c[None, :], mask=rmask, other=0.0).to(tl.float32) * qk_scale
    qf2 = tl.load(qrow + 2 * D4 + offs_c[None, :], mask=rmask, other=0.0).to(tl.float32) * qk_scale
    qf3 = tl.load(qrow + 3 * D4 + offs_c[None, :], mask=rmask, other=0.0).to(tl.float32) * qk_scale
    q0 = qf0.to(tl.float16)
    q1 = (qf1 * 0.25).to(tl.float16)
    q2 = (qf2 * 0.0625).to(tl.float16)
    q3 = (qf3 * 0.015625).to(tl.float16)
    # 1024 * sum of each float16 slice (the code offset to remove) and each true slice sum (for the minimum)
    o0 = 1024.0 * tl.sum(q0.to(tl.float32), 1)
    o1 = 1024.0 * tl.sum(q1.to(tl.float32), 1)
    o2 = 1024.0 * tl.sum(q2.to(tl.float32), 1)
    o3 = 1024.0 * tl.sum(q3.to(tl.float32), 1)
    t0s = tl.sum(qf0, 1)
    t1s = tl.sum(qf1, 1)
    t2s = tl.sum(qf2, 1)
    t3s = tl.sum(qf3, 1)
    o_all = o0 + o1 + o2 + o3  # one group per head: the slices share scale and min
    t_all = t0s + t1s + t2s + t3s
    if K_HI_DIMS > 0:  # split keys: the query's parts (common.split_key_query)
        qh0, qh1, ql0, ql1, oh, ol, th, tlo = split_key_query(qf0, qf1, o2, o3, t2s, t3s, D, K_HI_DIMS)
        qup = qh0
        if K_HI_DIMS >= 16:  # the first part's channels at once, for its upper bits (common.split_scores)
            qup = (tl.load(qrow + tl.arange(0, K_HI_DIMS)[None, :], mask=rmask, other=0.0).to(tl.float32)
                   * qk_scale).to(tl.float16)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    a0 = tl.zeros([M, D4], tl.float32)
    a1 = tl.zeros([M, D4], tl.float32)
    a2 = tl.zeros([M, D4], tl.float32)
    a3 = tl.zeros([M, D4], tl.float32)
    # per group: running sum of p*min
    n0 = tl.zeros([M], tl.float32)
    n1 = tl.zeros([M], tl.float32)
    n2 = tl.zeros([M], tl.float32)
    n3 = tl.zeros([M], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        offs = t0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        phys = tl.load(bt_row + SINK_PAGES + offs // P, mask=valid, other=0).to(tl.int64)
        crow = tl.multiple_of(phys * stride_cp + head_c + (offs % P) * KCB, K_ALIGN)
        trow = crow
        if K_HI_DIMS > 0:  # split keys: the rows' tails follow the page's P rows (split_keys.py)
            trow = phys * stride_cp + head_c + P * KCB + (offs % P) * K_TAIL
        if V_ROWS:
            vrow = tl.multiple_of(phys * stride_vcp + head_vc + (offs % P) * VCB, V_ALIGN)
        else:
            vrow = crow
        mrow = phys * stride_mp + head_m + meta_slot(offs % P) * NG  # scales and zero points alike
        # keys loaded transposed ([D4, N]): the MMA's key operand needs no register transpose
        # INT2 unpacks here as it always did, not through code_slices: ptxas schedules by the inlined calls its
        # line info shows, and one more level changed this kernel's INT2 SASS
        if K_BITS == 2:
            kraw = tl.load(Kc + crow[None, :] + offs_c[:, None], mask=valid[None, :], other=0)
            k0, k1, k2, k3 = unpack4(kraw, USE_ASM)
        else:
            k0, k1, k2, k3 = code_slices(Kc + crow[None, :] + offs_c[:, None], valid[None, :], offs_c[:, None],
                                         K_BITS, D, USE_ASM)
        if K_HI_DIMS > 0:
            sc = split_scores(qh0, qh1, ql0, ql1, q2, q3, oh, ol, th, tlo, qup, k0, k1, k2, k3, Kc, trow, offs_c, valid,
                              Ks, Kz, mrow, D, K_BITS, K_HI_DIMS, K_HI_BITS, K_FRAC)
        elif NG == 1:
            ks = tl.load(Ks + mrow, mask=valid, other=0.0).to(tl.float32)
            kn = -(ks * tl.load(Kz + mrow, mask=valid, other=0).to(tl.float32)) * K_FRAC  # the minimum, exact
            raw = tl.dot(q0, k0)
            raw = tl.dot(q1, k1, raw)
            raw = tl.dot(q2, k2, raw)
            raw = tl.dot(q3, k3, raw)
            sc = ks[None, :] * (raw - o_all[:, None]) + kn[None, :] * t_all[:, None]
        else:
            sc = grp_scores(q0, k0, o0, t0s, Ks, Kz, mrow, valid, (0 * D4) // G, K_FRAC)
            sc += grp_scores(q1, k1, o1, t1s, Ks, Kz, mrow, valid, (1 * D4) // G, K_FRAC)
            sc += grp_scores(q2, k2, o2, t2s, Ks, Kz, mrow, valid, (2 * D4) // G, K_FRAC)
            sc += grp_scores(q3, k3, o3, t3s, Ks, Kz, mrow, valid, (3 * D4) // G, K_FRAC)
        if ROPE:
            sc += rope_logits(ra, rb, CS, PR, SINK_PAGES * P + offs, valid, D // 2)
        see = valid[None, :]
        if SLIDING:
            see = see & (offs[None, :] >= row_lo[:, None])
        sc = tl.where(see, sc, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(sc, m_i, l_i, SLIDING)
        if V_BITS == 2:
            vraw = tl.load(Vc + vrow[:, None] + offs_c[None, :], mask=valid[:, None], other=0)
            v0, v1, v2, v3 = unpack4(vraw, USE_ASM)
        else:
            v0, v1, v2, v3 = code_slices(Vc + vrow[:, None] + offs_c[None, :], valid[:, None], offs_c[None, :],
                                         V_BITS, D, USE_ASM)
        if NG == 1:
            vs = tl.load(Vs + mrow, mask=valid, other=0.0).to(tl.float32)
            vn = -(vs * tl.load(Vz + mrow, mask=valid, other=0).to(tl.float32)) * V_FRAC  # the minimum, exact
            pp = (p * vs[None, :]).to(tl.float16)
            # this tile's code offset, taken out of the accumulator operand before the MMA adds it back
            off = 1024.0 * tl.sum(pp.to(tl.float32), 1)
            n0 = n0 * alpha + tl.sum(p * vn[None, :], 1)
            a0 = tl.dot(pp, v0, a0 * alpha[:, None] - off[:, None])
            a1 = tl.dot(pp, v1, a1 * alpha[:, None] - off[:, None])
            a2 = tl.dot(pp, v2, a2 * alpha[:, None] - off[:, None])
            a3 = tl.dot(pp, v3, a3 * alpha[:, None] - off[:, None])
        else:
            a0, n0 = grp_values(p, v0, a0, n0, alpha, Vs, Vz, mrow, valid, (0 * D4) // G, V_FRAC)
            a1, n1 = grp_values(p, v1, a1, n1, alpha, Vs, Vz, mrow, valid, (1 * D4) // G, V_FRAC)
            a2, n2 = grp_values(p, v2, a2, n2, alpha, Vs, Vz, mrow, valid, (2 * D4) // G, V_FRAC)
            a3, n3 = grp_values(p, v3, a3, n3, alpha, Vs, Vz, mrow, valid, (3 * D4) // G, V_FRAC)
    if NG == 1:
        n1 = n0
        n2 = n0
        n3 = n0
    a0 = a0 + n0[:, None]
    a1 = a1 * 0.25 + n1[:, None]
    a2 = a2 * 0.0625 + n2[:, None]
    a3 = a3 * 0.015625 + n3[:, None]
    return m_i, l_i, cat4(a0, a1, a2, a3, M, D4)


@triton.jit
def _chunk_causal(q, ql, m_i, l_i, acc, tok, n, end, Kn, Vn, stride_kt, stride_vt,
                  D: tl.constexpr, BLOCK: tl.constexpr, F32DOT: tl.constexpr, SPLITQ: tl.constexpr,
                  first_pos=0, ra=None, rb=None, CS=None, ROPE: tl.constexpr = False, PR=None,
                  start=0, window=0, SLIDING: tl.constexpr = False):
    """Online softmax over the chunk's own keys [start, end) (Kn/Vn point at the sequence's first row and the
    KV head); row r (chunk token tok[r]) sees key j iff j <= tok[r] and j < n, and with SLIDING iff also
    j > tok[r] - window.  Chunk key j sits at position first_pos + j (for the position-aware key offset, ROPE)."""
    offs_d = tl.arange(0, D)
    for j0 in range(start, end, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        valid = offs < n
        k = tl.load(Kn + offs.to(tl.int64)[:, None] * stride_kt + offs_d[None, :], mask=valid[:, None],
                    other=0.0).to(tl.bfloat16)
        s = mm(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK], tl.float32), F32DOT)
        if SPLITQ:
            s = mm(ql, tl.trans(k), s, F32DOT)
        if ROPE:
            s += rope_logits(ra, rb, CS, PR, first_pos + offs, valid, D // 2)
        see = valid[None, :] & (offs[None, :] <= tok[:, None])
        if SLIDING:
            see = see & (offs[None, :] > tok[:, None] - window)
        s = tl.where(see, s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, SLIDING)
        v = tl.load(Vn + offs.to(tl.int64)[:, None] * stride_vt + offs_d[None, :], mask=valid[:, None],
                    other=0.0).to(tl.bfloat16)
        acc = mm(p.to(tl.bfloat16), v, acc * alpha[:, None], F32DOT)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["window"])  # one compile for every window size
def _int2_extend_kernel(Q, Kn, Vn, CU, Kc, Ks, Kz, Vc, Vs, Vz, Kw, Vw, BT, SL, NQ, O, PO, PL, AB, PR, CS, qk_scale,
                        stride_qt, stride_qh, stride_abt, stride_abh, stride_prh, stride_knt, stride_knh, stride_vnt, stride_vnh,
                        stride_cp, stride_ch, stride_mp, stride_mh, stride_wp, stride_wh, stride_bt,
                        stride_ot, stride_oh, stride_pot, stride_poh, stride_pos, stride_plt, stride_plh,
                        num_tiles, num_splits, split_len, window, stride_vcp, stride_vch,
                        D: tl.constexpr, G: tl.constexpr, P: tl.constexpr, SINK_PAGES: tl.constexpr,
                        GQA: tl.constexpr, H_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        USE_ASM: tl.constexpr, F32DOT: tl.constexpr, SPLITQ: tl.constexpr,
                        PARTIAL: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr, SLIDING: tl.constexpr,
                        K_BITS: tl.constexpr = 2, V_BITS: tl.constexpr = 2, V_ROWS: tl.constexpr = False,
                        K_HI_DIMS: tl.constexpr = 0, K_HI_BITS: tl.constexpr = 2, K_TAIL: tl.constexpr = 0):
    tile = num_tiles - 1 - tl.program_id(0)  # last tiles of a chunk see the most keys: start them first
    b = tl.program_id(1)
    h = tl.program_id(2) // (num_splits + 1)
    s = tl.program_id(2) % (num_splits + 1)
    lo = tl.load(CU + b)
    n = tl.load(CU + b + 1) - lo
    t_start = tile * BLOCK_T
    if t_start >= n:
        return
    M: tl.constexpr = BLOCK_T * H_PAD
    SINK: tl.constexpr = SINK_PAGES * P
    offs_r = tl.arange(0, M)
    tok = t_start + offs_r // H_PAD  # row r = (token, query head of the group)
    qh = h * GQA + offs_r % H_PAD
    rvalid = (tok < n) & (offs_r % H_PAD < GQA)
    rmask = rvalid[:, None]
    row_t = (lo + tok).to(tl.int64)
    qrow = Q + row_t[:, None] * stride_qt + qh[:, None] * stride_qh
    hist = tl.load(SL + b)
    nq = tl.load(NQ + b)
    bt_row = BT + b.to(tl.int64) * stride_bt
    ra = None
    rb = None
    pr = PR + h * stride_prh  # this KV head's visited RoPE pairs
    if ROPE:  # the position-aware key offset's coefficients of every row (common.rope_query_terms)
        ra, rb = load_rope_ab(AB + row_t[:, None] * stride_abt + qh[:, None] * stride_abh, rmask, R)
    # Ranges by split: without splits (num_splits == 0) program s = 0 does everything; with splits, s = 0
    # does the BF16 window + chunk and s >= 1 one slice of the INT2 history each.  Empty ranges run no loop.
    # INT2 history is clipped to the history length: a chunk boundary may fall inside an INT2 page.
    int2_end = tl.maximum(tl.minimum(nq * P, hist - SINK), 0)
    # SLIDING: row r (position hist + tok[r]) sees positions >= row_lo[r]; the history ranges start at the tile
    # of the tile's smallest bound (its first token's), so the splits cover only the window's part of the history
    i_base = 0
    row_lo = None
    row_lo_h = None
    j_start = 0
    if SLIDING:
        row_lo = hist + tok - window + 1
        row_lo_h = row_lo - SINK
        first = tl.maximum(hist + t_start - window + 1 - SINK, 0)
        i_base = tl.where(first < int2_end, (first // BLOCK_N) * BLOCK_N, int2_end)
        j_start = (tl.maximum(t_start - window + 1, 0) // BLOCK_N) * BLOCK_N
    i_lo = i_base + tl.maximum(s - 1, 0) * split_len
    i_hi = tl.where(num_splits == 0, int2_end, tl.where(s == 0, 0, tl.minimum(i_base + s * split_len, int2_end)))
    mine = s == 0  # the window and the chunk
    head_vc = 0
    if V_ROWS:  # values at another width (or with other strides) than the keys: their own row offsets
        head_vc = h.to(tl.int64) * stride_vch
    # 1. INT2 history
    m_i, l_i, acc = _int2_history(qrow, rmask, qk_scale, i_lo, i_hi, bt_row, Kc, Ks, Kz, Vc, Vs, Vz,
                                  h.to(tl.int64) * stride_ch, h.to(tl.int64) * stride_mh, stride_cp, stride_mp,
                                  M, D, G, P, SINK_PAGES, BLOCK_N, USE_ASM, ra, rb, CS, ROPE, pr,
                                  row_lo_h, SLIDING, head_vc, stride_vcp, K_BITS, V_BITS, V_ROWS, K_HI_DIMS,
                                  K_HI_BITS, K_TAIL)
    # 2. BF16 sink and recent pages; the float32 query as bf16 hi + lo parts
    offs_d = tl.arange(0, D)
    qf = tl.load(qrow + offs_d[None, :], mask=rmask, other=0.0).to(tl.float32) * qk_scale
    q_hi = qf.to(tl.bfloat16)
    q_lo = (qf - q_hi.to(tl.float32)).to(tl.bfloat16)
    head_w = h.to(tl.int64) * stride_wh
    m_i, l_i, acc = bf16_range(q_hi, q_lo, m_i, l_i, acc, 0, tl.where(mine, tl.minimum(hist, SINK), 0), bt_row,
                                Kw, Vw, head_w, stride_wp, D, P, BLOCK_N, F32DOT, SPLITQ, ra, rb, CS, ROPE, pr,
                                row_lo=row_lo, SLIDING=SLIDING)
    m_i, l_i, acc = bf16_range(q_hi, q_lo, m_i, l_i, acc, tl.minimum(SINK + nq * P, hist), tl.where(mine, hist, 0),
                                bt_row, Kw, Vw, head_w, stride_wp, D, P, BLOCK_N, F32DOT, SPLITQ, ra, rb, CS, ROPE,
                                pr, row_lo=row_lo, SLIDING=SLIDING)
    # 3. the chunk, causally; keys beyond the tile's last token are never needed
    lo64 = lo.to(tl.int64)
    m_i, l_i, acc = _chunk_causal(q_hi, q_lo, m_i, l_i, acc, tok, n,
                                  tl.where(mine, tl.minimum(n, t_start + BLOCK_T), 0),
                                  Kn + lo64 * stride_knt + h * stride_knh, Vn + lo64 * stride_vnt + h * stride_vnh,
                                  stride_knt, stride_vnt, D, BLOCK_N, F32DOT, SPLITQ, hist, ra, rb, CS, ROPE, pr,
                                  j_start, window, SLIDING)
    # rows of split 0 see at least chunk key 0 (l_i > 0); an INT2 split may be empty (l_i = 0, lse = -inf)
    ok = l_i > 0
    o = acc / tl.where(ok, l_i, 1.0)[:, None]
    if PARTIAL:
        tl.store(PO + row_t[:, None] * stride_pot + qh[:, None] * stride_poh + s * stride_pos + offs_d[None, :], o,
                 mask=rmask)
        lse = tl.where(ok, m_i + tl.log2(tl.where(ok, l_i, 1.0)), float("-inf"))
        tl.store(PL + row_t * stride_plt + qh * stride_plh + s, lse, mask=rvalid)
    else:
        tl.store(O + row_t[:, None] * stride_ot + qh[:, None] * stride_oh + offs_d[None, :],
                 o.to(O.dtype.element_ty), mask=rmask)


# ------------------------------------------------------------------------------------------ wrapper
def _rotate_chunk_queries(q: torch.Tensor, k_rotation: torch.Tensor | None, num_kv_heads: int) -> torch.Tensor:
    """q @ R_K[kv_head(q)] in float32 as one batched GEMM ([T, Hq, D] -> float32 [T, Hq, D], contiguous)."""
    if k_rotation is None:
        return q
    t, hq, d = q.shape
    r = k_rotation.to(device=q.device, dtype=torch.float32)
    if r.shape[0] not in (1, num_kv_heads) or r.shape[1:] != (d, d):
        raise ValueError(f"k_rotation must be [1 or {num_kv_heads}, {d}, {d}], got {tuple(r.shape)}")
    x = q.float().reshape(t, num_kv_heads, hq // num_kv_heads, d)
    if r.shape[0] == 1:
        return (x.reshape(-1, d) @ r[0]).reshape(t, hq, d)
    return torch.einsum("thgd,hde->thge", x, r).reshape(t, hq, d)


def _history_splits(programs: int, batch: PagedBatch, page_size: int, device: torch.device, block_n: int,
                    num_splits: int | None, max_int2_pages: int | None, split_target: int,
                    window: int | None = None) -> tuple[int, int]:
    """(INT2 splits, tokens per split); (0, 0) = no split: each program reads its whole history.

    Splitting pays when the query tiles alone leave the GPU idle: a short chunk after a long cached
    prefix (prefix hit, small batch).  Then split 0 reads the BF16 window + chunk and splits 1.. share
    the INT2 history, as in decode; the partial outputs are merged by decode's merge kernel.  With a sliding
    ``window`` the splits share only the part of the history a query tile can see (from the key tile of its
    first token's bound on: at most window + block_n - 1 tokens).
    """
    if num_splits is None and programs >= split_target * num_sms(device):
        return 0, 0  # enough programs already: no partials, no merge, no host sync
    if num_splits is not None and num_splits <= 0:
        return 0, 0
    if max_int2_pages is None:
        max_int2_pages = int(batch.int2_pages.max()) if batch.batch_size else 0
    history = window_tokens(max_int2_pages * page_size, window, block_n)
    ns, split_len = split_plan(history, programs, device, block_n, num_splits=num_splits, per_sm=split_target)
    if num_splits is None and ns <= 1:
        return 0, 0
    return ns, split_len


def int2_extend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cu_seqlens: torch.Tensor,
                pool: PagedKVPool, layer: int, batch: PagedBatch, k_rotation: torch.Tensor | None = None,
                sm_scale: float | None = None, *, rope=None, max_seqlen: int | None = None,
                max_int2_pages: int | None = None,
                num_splits: int | None = None, split_target: int = TUNING.extend_split_target,
                block_m: int = TUNING.extend_block_m, block_n: int | None = None,
                num_warps: int | None = None, num_stages: int = TUNING.extend_num_stages,
                use_asm: bool | None = None, split_query: bool = True, window: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Chunked-prefill attention over the mixed pool; semantics of reference.extend_reference.

    Args:
        q: the chunks' new queries, unrotated if ``k_rotation`` is given, else rotated (float32 keeps the most
            precision).
        k_new, v_new: the chunks' rotated, centered keys and rotated values (consumed as BF16: float32 input is
            rounded in the kernel).
        cu_seqlens: sequence b owns rows cu_seqlens[b] .. cu_seqlens[b+1] (an empty chunk is allowed;
            cu_seqlens[-1] must be T).
        pool, layer: the paged pool and the layer to read.
        batch: each sequence's cache *before* the chunk (its seq_lens may end inside an INT2 page).
        k_rotation: R_K, applied to q here; None: q arrives rotated.
        sm_scale: default 1 / sqrt(D).
        rope: rope.KernelRope when keys are centered per position (decode.int2_decode); q must then be
            unrotated.  This kernel reads the per-position table (its query rows share each key tile).
        max_seqlen: a host bound on the longest chunk; None: a device sync.
        max_int2_pages: a host bound on the INT2 pages, read only when the history is split; None: a device sync.
        num_splits: INT2 history splits; None: automatic, only when fewer than ``split_target`` programs per SM
            would run; 0: never.
        block_m: query rows per program (chunk tokens x padded GQA group).
        block_n: keys per tile; default 64 with one quantization group per head, 32 with several (sm_90 builds
            at 4 warps then fit in 255 registers without spilling) or at head dim 256 (shared memory; tuning.py).
        num_warps, num_stages, use_asm: Triton tuning knobs; use_asm: PTX code conversion on the GPU; num_warps
            default: 4, 8 at head dim 256 (tuning.py).
        split_query: bf16 hi + lo query for the BF16 parts; off: one MMA, ~5x the logit error.
        window: the layer's sliding window (chunk token i at position seq_lens[b] + i sees keys in
            (position - window, position]); None or 0: the whole causal past.  A query tile then starts every
            range (INT2 history, windows, chunk) at the key tile of its first token's bound.
        out: the output (any float dtype, unit stride in D), written in place; None: a new tensor.
    Shapes:
        q, out: [T, Hq, D]; k_new, v_new: [T, Hkv, D], unit stride in D; cu_seqlens: int [B + 1];
        k_rotation: [Hkv | 1, D, D].
    Returns:
        [T, Hq, D] in q's dtype (``out`` when given).
    """
    g = pool.geometry
    t, hq, d = q.shape
    h = g.num_kv_heads
    if d != g.head_dim or hq % h or d < 64:
        raise ValueError("query shape does not match the pool geometry (or head dim < 64)")
    widths = kernel_widths(g, layer)
    hi_dims, hi_bits, k_tail = key_split(g, layer, pool.layer(layer)["k_codes"])
    if k_new.shape != (t, h, d) or v_new.shape != (t, h, d):
        raise ValueError(f"k_new / v_new must be [{t}, {h}, {d}]")
    if k_new.stride(-1) != 1 or v_new.stride(-1) != 1:
        raise ValueError("k_new / v_new need unit stride in the head dim")
    bsz = cu_seqlens.numel() - 1
    if bsz != batch.batch_size:
        raise ValueError("cu_seqlens and batch describe different numbers of sequences")
    if max_seqlen is None:
        cu = cu_seqlens.tolist()
        if cu[-1] != t:
            raise ValueError(f"cu_seqlens ends at {cu[-1]}, q has {t} rows")
        max_seqlen = max((cu[i + 1] - cu[i] for i in range(bsz)), default=0)
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    gqa = hq // h
    h_pad = triton.next_power_of_2(gqa)
    wide = d > 128
    block_n = block_n or (TUNING.extend_block_n_d256 if wide else 64 if g.group_size == d else 32)
    num_warps = num_warps or (TUNING.extend_num_warps_d256 if wide else TUNING.extend_num_warps)
    block_t = max(1, block_m // h_pad)
    if block_t * h_pad < 16 or block_n < 16 or block_m & (block_m - 1) or block_n & (block_n - 1):
        raise ValueError("block_m and block_n must be powers of two giving >= 16 rows / keys per tile")
    out = torch.empty(t, hq, d, device=q.device, dtype=q.dtype) if out is None else out
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError("out must have q's shape and unit stride in the head dim")
    if t == 0 or bsz == 0 or max_seqlen == 0:
        return out
    qr = _rotate_chunk_queries(q, k_rotation, h)
    if qr.stride(-1) != 1:
        qr = qr.contiguous()
    num_tiles = -(-max_seqlen // block_t)
    window = window or None
    ns, split_len = _history_splits(num_tiles * bsz * h, batch, g.page_size, q.device, block_n, num_splits,
                                    max_int2_pages, split_target, window)
    if ns:
        po = torch.empty(t, hq, ns + 1, d, device=q.device, dtype=torch.float32)
        pl = torch.empty(t, hq, ns + 1, device=q.device, dtype=torch.float32)
    else:
        po, pl = out, out  # not touched
    L = pool.layer(layer)
    kc, vc, kw, vw = L["k_codes"], L["v_codes"], L["k_win"], L["v_win"]
    ks, kz, vs, vz = group_metadata(L)
    bt = batch.block_table
    cu32 = cu_seqlens.to(device=q.device, dtype=torch.int32)
    # the extend kernel reads table rows of valid positions only (masked loads): its bound is exact
    ab, pr, stride_abt, stride_abh, stride_prh, r, on = rope_args(q, rope, sm_scale * LOG2E, 0)
    cs = rope.table if rope is not None else q
    _int2_extend_kernel[(num_tiles, bsz, h * (ns + 1))](
        qr, k_new, v_new, cu32, kc, ks, kz, vc, vs, vz, kw, vw, bt, batch.seq_lens, batch.int2_pages, out, po, pl, ab,
        pr, cs,
        sm_scale * LOG2E, qr.stride(0), qr.stride(1), stride_abt, stride_abh, stride_prh, k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1), kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), kw.stride(0), kw.stride(1),
        bt.stride(0), out.stride(0), out.stride(1), po.stride(0), po.stride(1), po.stride(2), pl.stride(0),
        pl.stride(1), num_tiles, ns, split_len, window or 0, vc.stride(0), vc.stride(1),
        D=d, G=g.group_size, P=g.page_size, SINK_PAGES=g.sink_pages, GQA=gqa, H_PAD=h_pad, BLOCK_T=block_t,
        BLOCK_N=block_n, USE_ASM=asm_enabled(q.device, use_asm), F32DOT=INTERPRET, SPLITQ=split_query,
        PARTIAL=ns > 0, ROPE=on, R=r, SLIDING=window is not None, K_BITS=widths[0], V_BITS=widths[1],
        V_ROWS=own_value_rows(kc, vc, widths), K_HI_DIMS=hi_dims, K_HI_BITS=hi_bits,
        K_TAIL=k_tail, num_warps=num_warps, num_stages=num_stages)
    return merge(po, pl, out) if ns else out
