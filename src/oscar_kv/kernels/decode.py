"""Paged decode attention in Triton over the INT2 mixed cache [BF16 sink | INT2 history | BF16 recent] (the BF16
paged baseline written the same way: bf16_decode.py).  Specification: reference.decode_reference.

Work decomposition (both kernels): one program per (sequence, KV head, split).  A program loads the
GQA group's query rows once, streams its token range page by page through the block table, and keeps an
online softmax; every KV tile is read once per KV head and used by all query heads of the group.  Each
split writes a normalized partial output and its log-sum-exp (base 2); ``common.merge`` combines the
splits exactly.  In the INT2 kernel split 0 is the BF16 window (sink + recent, <= S0 + W + P - 1 tokens)
and splits 1.. share the INT2 history evenly.  The INT2 path takes the query already rotated
(``rotate_query``: one small launch per call); the BF16 baseline rotates inside.  Where it applies,
``int2_decode`` runs all of this as one CUDA launch instead (int2_cuda.py, int2_decode.cu).

Sliding-window layers (``window``; SLIDING, a constexpr, so full layers compile as before): the query sees tokens
>= lo = T - window.  The history splits cover only [lo, T) from the tile holding lo (a 1024-token window at 32K
tokens: a split or a few, not dozens), the window split starts at lo's page, and rows below lo are masked and
never loaded.  The CUDA kernel does the same (int2_cuda.py, SLIDING).

INT2 arithmetic (no dequantized tile is ever built):
  keys    q.k_hat = scale * (q.c) + min * sum(q)                 (per group of G channels)
  values  sum_n p_n v_hat_n = sum_n (p_n scale_n) c_n + sum_n p_n min_n
with min = -(scale * zero) 2^-F from a row's float16 scale and uint8 zero point (quant.py), computed in float32,
where it is exact (so it is the reference's minimum bit for bit); 2^-F is a constexpr per side (K_BITS / V_BITS).
Codes become float16 with PTX PRMT + LOP3 (one LOP3 per two codes): OR-ing the masked code bits into
0x6400 gives 1024 + c*4^k for stride slice k (its bits sit at 2k..2k+1).  The 4^k is folded into the
float16 query slice, and the 1024 offset is removed with sum(q) / sum(p*scale) corrections, so the tensor
cores see the raw masked bytes; scale and min are applied per token in float32.  Under the Triton
interpreter the same values are made with ordinary integer ops.  Keys are loaded transposed ([D/4, N]) so
the MMA's key operand needs no register transpose.  Performance notes: benchmarks/NOTES.md.

Keys and values at 3, 4 or 8 bits, keys at 5 (a layer's ``PoolGeometry.layer_widths``; K_BITS / V_BITS are
constexprs, so the INT2 kernel compiles to the same SASS as before): ``common.code_slices`` turns every width into the
same four float16 slices 1024 + c*4^k (exact up to c = 255), so the scores, values and offset corrections above are
unchanged.  INT3 reads its INT2 plane as INT2 (the PTX conversion included) and adds the high-bit plane as + 4^(k+1)
where set (4 code steps: 4 x scale once scaled); INT4 shifts its nibbles into place with integer ops; INT5 reads its
INT4 plane as INT4 and adds its high-bit plane as + 16 * 4^k where set.  Values at another width than the keys address
their own rows (V_ROWS).  The CUDA kernel reads the widths int2_cuda.WIDTHS lists; layers at other widths (values at
8 bits, say) take this one (int2_kernel_choice).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._compat import install_interpreter_shim
from .tuning import TUNING, kernel_choice
from .common import (INTERPRET, LOG2E, asm_enabled, bf16_range, code_slices, grp_scores, grp_values, group_metadata,
                     kernel_widths, key_split, load_rope_ab, meta_slot, merge, num_sms, own_value_rows, rope_args,
                     rope_logits_tiled, split_key_query, split_plan, split_scores, store_partial, unpack4,
                     window_tokens)
from .layout import PagedBatch, PagedKVPool

install_interpreter_shim()

# The history tile of layers whose codes unpack into more live registers than INT2's (a side at 4 bits, or values at
# 3): at the INT2 default of 256 tokens their sm_90 builds spill 220-460 bytes a thread under the 128-register cap
# (INT2 and K3V2: 40 at D = G = 128), at 128 tokens at most 48 (sm_90 builds read with cuobjdump -res-usage, D = 64
# and 128; not yet timed on a GPU).  Keys at 5 bits hold INT4's two code tensors and one more (the high bits): taken
# as wide too (neither built nor timed on a GPU)
WIDE_CODES_BLOCK_N = 128

# the register cap holds the position-aware term up to this many pairs (benchmarks/NOTES.md, "cost vs pairs, with
# and without the register cap")
ROPE_CAPPED_PAIRS = 16

@triton.jit(do_not_specialize=["window"])  # one compile for every window size
def _int2_decode_kernel(Q, Kc, Ks, Kz, Vc, Vs, Vz, Kw, Vw, BT, SL, NQ, PO, PL, AB, PR, BASE, STEPS, qk_scale,
                        stride_qb, stride_qh, stride_cp, stride_ch, stride_mp, stride_mh,
                        stride_wp, stride_wh, stride_bt, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                        stride_abb, stride_abh, stride_prh, chunk, window, stride_vcp, stride_vch,
                        D: tl.constexpr, G: tl.constexpr, P: tl.constexpr, SINK_PAGES: tl.constexpr,
                        GQA: tl.constexpr, H_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                        USE_ASM: tl.constexpr, F32DOT: tl.constexpr, KT: tl.constexpr, ROPE: tl.constexpr,
                        R: tl.constexpr, SLIDING: tl.constexpr, K_BITS: tl.constexpr = 2, V_BITS: tl.constexpr = 2,
                        V_ROWS: tl.constexpr = False, K_HI_DIMS: tl.constexpr = 0, K_HI_BITS: tl.constexpr = 2,
                        K_TAIL: tl.constexpr = 0):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(SL + b)
    nq = tl.load(NQ + b)
    SINK: tl.constexpr = SINK_PAGES * P
    # SLIDING: the query (position seq_len - 1) sees tokens >= lo only
    lo = 0
    row_lo = None
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)
        row_lo = tl.zeros([H_PAD], tl.int32) + lo
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
        ra, rb = load_rope_ab(AB + b * stride_abb + (h * GQA + offs_h)[:, None] * stride_abh, hm, R)
    if s == 0:
        # ---- BF16 window: sink [0, min(T, S0)) then recent [S0 + P*nq, T).  The query is split into
        # bf16 hi + lo parts (two MMAs) so the logits keep ~16 bits, like the float32 reference.
        offs_d = tl.arange(0, D)
        qf = tl.load(qrow + offs_d[None, :], mask=hm, other=0.0).to(tl.float32) * qk_scale
        qh = qf.to(tl.bfloat16)
        ql = (qf - qh.to(tl.float32)).to(tl.bfloat16)
        acc = tl.zeros([H_PAD, D], tl.float32)
        head_off = h.to(tl.int64) * stride_wh
        m_i, l_i, acc = bf16_range(qh, ql, m_i, l_i, acc, 0, tl.minimum(seq_len, SINK), bt_row, Kw, Vw,
                                    head_off, stride_wp, D, P, BLOCK_W, F32DOT, True, ra, rb, None, ROPE, pr,
                                    BASE, STEPS, True, row_lo, SLIDING)
        m_i, l_i, acc = bf16_range(qh, ql, m_i, l_i, acc, tl.minimum(SINK + nq * P, seq_len), seq_len, bt_row,
                                    Kw, Vw, head_off, stride_wp, D, P, BLOCK_W, F32DOT, True, ra, rb, None, ROPE, pr,
                                    BASE, STEPS, True, row_lo, SLIDING)
        store_partial(PO, PL, b, h, s, acc, m_i, l_i, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                      0, D, GQA, H_PAD, True)
    else:
        # ---- quantized history tokens [start, end) counted from the sink's end (start, end: multiples of P)
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
        if K_HI_DIMS > 0:  # split keys: the query's parts (common.split_key_query)
            qh0, qh1, ql0, ql1, oh, ol, th, tlo = split_key_query(qf0, qf1, o2, o3, t2s, t3s, D, K_HI_DIMS)
            qup = qh0
            if K_HI_DIMS >= 16:  # the first part's channels at once, for its upper bits (common.split_scores)
                qup = (tl.load(qrow + tl.arange(0, K_HI_DIMS)[None, :], mask=hm, other=0.0).to(tl.float32)
                       * qk_scale).to(tl.float16)
        a0 = tl.zeros([H_PAD, D4], tl.float32)
        a1 = tl.zeros([H_PAD, D4], tl.float32)
        a2 = tl.zeros([H_PAD, D4], tl.float32)
        a3 = tl.zeros([H_PAD, D4], tl.float32)
        # per group: running sum of float16(p*scale) (undoes the 1024 offset) and of p*min
        n0 = tl.zeros([H_PAD], tl.float32)
        n1 = tl.zeros([H_PAD], tl.float32)
        n2 = tl.zeros([H_PAD], tl.float32)
        n3 = tl.zeros([H_PAD], tl.float32)
        base = 0
        if SLIDING:
            # the splits cover the window's part of the history from the tile of its first token; a split past
            # the history's end (or all of them, when the window lies in the recent pages) loads nothing and
            # writes an empty partial (lse -inf), which the merge ignores
            lo_h = tl.maximum(lo - SINK, 0)
            base = tl.where(lo_h < nq * P, (lo_h // BLOCK_N) * BLOCK_N, nq * P)  # (no tile wholly masked)
        start = base + (s - 1) * chunk
        end = tl.minimum(start + chunk, nq * P)
        head_c = h.to(tl.int64) * stride_ch
        head_m = h.to(tl.int64) * stride_mh
        n_tiles = tl.cdiv(end - start, BLOCK_N)
        for i in range(0, n_tiles):
            t0 = start + i * BLOCK_N
            offs = t0 + tl.arange(0, BLOCK_N)
            valid = offs < end
            if SLIDING:  # one bound for every row: the tokens below it are neither loaded nor counted
                valid = valid & (offs >= lo - SINK)
            phys = tl.load(bt_row + SINK_PAGES + offs // P, mask=valid, other=0).to(tl.int64)
            crow = tl.multiple_of(phys * stride_cp + head_c + (offs % P) * KCB, K_ALIGN)
            trow = crow
            if K_HI_DIMS > 0:  # split keys: the rows' tails follow the page's P rows (split_keys.py)
                trow = phys * stride_cp + head_c + P * KCB + (offs % P) * K_TAIL
            if V_ROWS:  # values at another width (or in a tensor with other strides) than the keys
                vrow = tl.multiple_of(phys * stride_vcp + h.to(tl.int64) * stride_vch + (offs % P) * VCB, V_ALIGN)
            else:
                vrow = crow
            mrow = phys * stride_mp + head_m + meta_slot(offs % P) * NG  # scales and zero points alike
            bias = tl.where(valid, 0.0, float("-inf"))
            # INT2 unpacks here as it always did, not through code_slices: ptxas schedules by the inlined calls its
            # line info shows, and one more level changed the INT2 extend kernel's SASS
            if KT:
                if K_BITS == 2:
                    kraw = tl.load(Kc + crow[None, :] + offs_c[:, None], mask=valid[None, :], other=0)
                    k0, k1, k2, k3 = unpack4(kraw, USE_ASM)
                else:
                    k0, k1, k2, k3 = code_slices(Kc + crow[None, :] + offs_c[:, None], valid[None, :],
                                                 offs_c[:, None], K_BITS, D, USE_ASM)
            else:
                if K_BITS == 2:
                    kraw = tl.load(Kc + crow[:, None] + offs_c[None, :], mask=valid[:, None], other=0)
                    k0, k1, k2, k3 = unpack4(kraw, USE_ASM)
                else:
                    k0, k1, k2, k3 = code_slices(Kc + crow[:, None] + offs_c[None, :], valid[:, None],
                                                 offs_c[None, :], K_BITS, D, USE_ASM)
                k0 = tl.trans(k0)
                k1 = tl.trans(k1)
                k2 = tl.trans(k2)
                k3 = tl.trans(k3)
            if K_HI_DIMS > 0:  # the first part's channels gain their upper bits; two groups' scores
                sc = bias[None, :] + split_scores(qh0, qh1, ql0, ql1, q2, q3, oh, ol, th, tlo, qup, k0, k1, k2, k3, Kc,
                                                  trow, offs_c, valid, Ks, Kz, mrow, D, K_BITS, K_HI_DIMS, K_HI_BITS,
                                                  K_FRAC)
            elif NG == 1:
                ks = tl.load(Ks + mrow, mask=valid, other=0.0).to(tl.float32)
                kn = -(ks * tl.load(Kz + mrow, mask=valid, other=0).to(tl.float32)) * K_FRAC  # the minimum, exact
                raw = tl.dot(q0, k0)
                raw = tl.dot(q1, k1, raw)
                raw = tl.dot(q2, k2, raw)
                raw = tl.dot(q3, k3, raw)
                sc = ks[None, :] * (raw - (o0 + o1 + o2 + o3)[:, None]) + \
                    (kn[None, :] * (t0s + t1s + t2s + t3s)[:, None] + bias[None, :])
            else:
                sc = grp_scores(q0, k0, o0, t0s, Ks, Kz, mrow, valid, (0 * D4) // G, K_FRAC)
                sc += grp_scores(q1, k1, o1, t1s, Ks, Kz, mrow, valid, (1 * D4) // G, K_FRAC)
                sc += grp_scores(q2, k2, o2, t2s, Ks, Kz, mrow, valid, (2 * D4) // G, K_FRAC)
                sc += grp_scores(q3, k3, o3, t3s, Ks, Kz, mrow, valid, (3 * D4) // G, K_FRAC)
                sc = sc + bias[None, :]
            if ROPE:
                sc += rope_logits_tiled(ra, rb, BASE, STEPS, pr, SINK_PAGES * P + t0, BLOCK_N, D // 2, F32DOT)
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
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
                off = 1024.0 * tl.sum(pp.to(tl.float32), 1)  # see grp_values: keep the offset out of the MMA sum
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
        store_partial(PO, PL, b, h, s, a0, m_i, l_i, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                      0, D4, GQA, H_PAD, True)
        store_partial(PO, PL, b, h, s, a1, m_i, l_i, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                      D4, D4, GQA, H_PAD, False)
        store_partial(PO, PL, b, h, s, a2, m_i, l_i, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                      2 * D4, D4, GQA, H_PAD, False)
        store_partial(PO, PL, b, h, s, a3, m_i, l_i, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                      3 * D4, D4, GQA, H_PAD, False)


# ------------------------------------------------------------------------------------------ wrappers
def compile_merges(device: torch.device, head_dim: int, max_splits: int = 2048) -> None:
    """Compile the merge kernel for every BLOCK_S up to ``max_splits`` (it follows the step's split count,
    so long contexts meet new ones mid-request otherwise): the server's warm-up calls this."""
    n = 2
    while n <= max_splits:
        po = torch.zeros(1, 1, n, head_dim, device=device)
        merge(po, torch.zeros(1, 1, n, device=device), torch.empty(1, 1, head_dim, device=device))
        n *= 2


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
    """q @ R_K[kv_head(q)] in float32 ([B, Hq, D] -> float32 [B, Hq, D]; R_K [Hkv | 1, D, D]), one small launch
    per call instead of once per attention program (every split re-reading R from L2 costs ~8-10%;
    benchmarks/NOTES.md, "Versions").  None: q as it is."""
    if k_rotation is None:
        return q
    bsz, hq, d = q.shape
    r = k_rotation if k_rotation.dtype == torch.float32 and k_rotation.is_contiguous() else \
        k_rotation.float().contiguous()
    if r.shape[0] not in (1, num_kv_heads):
        raise ValueError(f"k_rotation must have 1 or {num_kv_heads} heads, got {r.shape[0]}")
    gqa = hq // num_kv_heads
    out = torch.empty(bsz, hq, d, device=q.device, dtype=torch.float32)
    block_e = d if INTERPRET else 16  # the interpreter's cost is per program: one per head there
    if bsz:
        _rotate_query_kernel[(bsz, num_kv_heads, d // block_e)](
            q, r, out, q.stride(0), q.stride(1), 0 if r.shape[0] == 1 else r.stride(0),
            D=d, GQA=gqa, H_PAD=triton.next_power_of_2(gqa), BLOCK_E=block_e, num_warps=4)
    return out


def int2_decode(q: torch.Tensor, pool: PagedKVPool, layer: int, batch: PagedBatch,
                k_rotation: torch.Tensor | None = None, sm_scale: float | None = None, *, rope=None,
                max_int2_pages: int | None = None, num_splits: int | None = None, block_n: int | None = None,
                block_w: int = TUNING.decode_block_w, num_warps: int | None = None,
                num_stages: int = TUNING.decode_num_stages, use_asm: bool | None = None,
                kt: bool = True, split_target: int | None = None, maxnreg: int | str | None = "auto",
                backend: str | None = None, cuda_split_target: int | None = None, cuda_warps: int | None = None,
                max_seq_len: int | None = None, window: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over the mixed pool: one query token per sequence.

    Args:
        q: the queries, unrotated if ``k_rotation`` is given (any float dtype; float32 keeps the most precision).
        pool, layer: the paged pool and the layer to read.
        batch: the sequences' block tables, lengths and INT2 page counts.
        k_rotation: R_K, applied to q here; None: q arrives rotated.
        sm_scale: default 1 / sqrt(D).
        rope: rope.KernelRope when the keys were centered per position: the kernel adds q . RoPE_p(mu_pre) to
            every logit.  q must then be unrotated, and the page size a multiple of 16.
        max_int2_pages: a host bound on the sequences' INT2 pages, for the split plan without a device sync (the
            engine knows it; CUDA graphs capture with a bucketed one).  None: a device sync.
        max_seq_len: a host bound on the sequences' lengths, i.e. the RoPE table rows a ``rope`` call reads
            (rope.KernelRope.check).  None: a device sync.
        num_splits: INT2 splits of the Triton path (default: the split plan's).
        block_n, block_w: tokens per INT2 / BF16 window tile (Triton).
        num_warps, num_stages, use_asm, kt: Triton tuning knobs (benchmark sweep); use_asm: PTX code conversion
            on the GPU (default on); kt: keys loaded transposed; num_warps default: 4, 8 at head dim 256
            (tuning.py).
        split_target: Triton INT2 programs per SM; default 4 when batch x KV heads <= 8, else 8 (measured best at 128K,
            batch 1 and 8, on the H100).
        maxnreg: register cap per thread: 128 gives 4 programs per SM instead of 3; "auto": 128 unless the
            position-aware term visits more than ROPE_CAPPED_PAIRS pairs; None: no cap.
        backend: "cuda" runs the whole call as one CUDA launch (int2_cuda.py: rotation, window, history and
            merge), "triton" as the Triton kernels here, "auto" CUDA where int2_cuda supports the call; None: the
            environment variable OSCAR_KV_INT2_KERNEL, else "auto" (a server can be switched back to Triton
            without code).
        cuda_split_target: CUDA CTAs per SM (default int2_cuda.min_blocks(pairs, head dim, widths), the CTAs that
            fit on an SM at once).
        cuda_warps: CUDA warps per CTA, int2_cuda.NUM_WARPS or WIDE_WARPS; default: int2_cuda.cta_plan's choice (the
            wide CTAs for short chunks, where the variant has them; NUM_WARPS when ``cuda_split_target`` is given).
        window: the layer's sliding window (the query sees the last ``window`` tokens); None or 0: the whole
            sequence.  The history splits then cover only the window's part of the INT2 history.  Layers stored at
            widths the CUDA kernel does not read (``pool.geometry.layer_widths(layer)`` not in int2_cuda.WIDTHS:
            values at 8 bits) run the Triton kernel.
        out: the output, written in place; None: a new tensor.
    Shapes:
        q, out: [B, Hq, D]; k_rotation: [Hkv | 1, D, D].
    Returns:
        [B, Hq, D] in q's dtype (``out`` when given).
    """
    g = pool.geometry
    bsz, hq, d = q.shape
    h = g.num_kv_heads
    gqa = hq // h
    if d != g.head_dim or hq % h:
        raise ValueError("query shape does not match the pool geometry")
    widths = kernel_widths(g, layer)
    hi_dims, hi_bits, k_tail = key_split(g, layer, pool.layer(layer)["k_codes"])
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if max_int2_pages is None:
        max_int2_pages = int(batch.int2_pages.max()) if bsz else 0
    num_warps = num_warps or (TUNING.decode_num_warps_d256 if d > 128 else TUNING.decode_num_warps)
    if rope is not None and max_seq_len is None:
        max_seq_len = int(batch.seq_lens.max()) if bsz else 0
    wide = widths[0] in (4, 5) or widths[1] > 2 or hi_dims > 0
    block_n = block_n or max(g.page_size, WIDE_CODES_BLOCK_N if wide else TUNING.decode_block_n)
    if block_n % g.page_size:
        raise ValueError("block_n must be a multiple of the page size")
    if split_target is None:
        split_target = TUNING.decode_split_target_small if bsz * h <= 8 else TUNING.decode_split_target
    window = window or None
    split = g.k_split[layer] if g.quantizes else None
    if _use_cuda(backend, q.device, g, gqa, rope, q.dtype, widths, split):
        from . import int2_cuda

        # one full wave of the CTAs that fit on an SM: best at 128K, bs 1/8/32 (benchmarks/NOTES.md, "lazy
        # rescale, window on a side stream, split targets"), with fewer, longer splits where the merge would cost
        # more than they save (int2_cuda.MERGE_BALANCE_TOKENS)
        rope_pairs = 0 if rope is None else rope.pairs.shape[1]
        per_sm = cuda_split_target or int2_cuda.min_blocks(rope_pairs, d, widths[0], vbits=widths[1],
                                                           split=split is not None)
        # with a window, from the page of its first token on (the kernel's start)
        history = window_tokens(max_int2_pages * g.page_size, window, g.page_size)
        programs = bsz * h * int2_cuda.query_groups(gqa)
        if cuda_warps in (None, int2_cuda.NUM_WARPS):
            # a given split target or 4 warps asks for the 4-warp plan
            wide = cuda_warps is None and cuda_split_target is None and \
                int2_cuda.wide_error(d, rope_pairs, split) is None
            warps, ns, chunk = int2_cuda.cta_plan(history, programs, g.page_size, num_sms(q.device), per_sm, d, wide)
        else:
            warps = cuda_warps
            ns, chunk = int2_cuda.split_plan(history, programs, g.page_size, num_sms(q.device),
                                             cuda_split_target or 1, d, warps, int2_cuda.WIDE_MIN_ROUNDS)
        out = torch.empty(bsz, hq, d, device=q.device, dtype=q.dtype) if out is None else out
        if rope is not None:
            rope.check(max_seq_len)
        return int2_cuda.decode(q, k_rotation, pool.layer(layer), g, batch, out, ns, chunk, sm_scale * LOG2E,
                                rope=rope, widths=widths, window=window, split=split, warps=warps)
    # with a window, from the tile of its first token on (the kernel's base)
    history = window_tokens(max_int2_pages * g.page_size, window, block_n)
    ns, chunk = split_plan(history, bsz * h, q.device, block_n, num_splits=num_splits, per_sm=split_target)
    qr = rotate_query(q, k_rotation, h)
    po = torch.empty(bsz, hq, ns + 1, d, device=q.device, dtype=torch.float32)
    pl = torch.empty(bsz, hq, ns + 1, device=q.device, dtype=torch.float32)
    L = pool.layer(layer)
    kc, vc, kw, vw = L["k_codes"], L["v_codes"], L["k_win"], L["v_win"]
    ks, kz, vs, vz = group_metadata(L)
    bt = batch.block_table
    h_pad = triton.next_power_of_2(gqa)
    # the position-aware term needs more registers: over more than ROPE_CAPPED_PAIRS pairs the 128 cap spills
    # (2.5-6x slower; benchmarks/NOTES.md, "cost vs pairs, with and without the register cap")
    if maxnreg == "auto":
        maxnreg = 128 if rope is None or rope.pairs.shape[1] <= ROPE_CAPPED_PAIRS else None
    extra = {"maxnreg": maxnreg} if (maxnreg and not INTERPRET) else {}
    if rope is not None and (g.page_size % 16 or block_n % 16 or block_w % 16):
        raise ValueError("position-aware centering in the decode kernel needs page and block sizes that are multiples of 16")
    ab, pr, stride_abb, stride_abh, stride_prh, r, on = rope_args(q, rope, sm_scale * LOG2E, max_seq_len, block_n,
                                                                  block_w)
    base, steps = (rope.base, rope.steps) if rope is not None else (q, q)
    _int2_decode_kernel[(bsz, h, ns + 1)](
        qr, kc, ks, kz, vc, vs, vz, kw, vw, bt, batch.seq_lens, batch.int2_pages, po, pl, ab, pr, base, steps,
        sm_scale * LOG2E, qr.stride(0), qr.stride(1), kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1),
        kw.stride(0), kw.stride(1), bt.stride(0), po.stride(0), po.stride(1), po.stride(2), pl.stride(0),
        pl.stride(1), stride_abb, stride_abh, stride_prh, chunk, window or 0, vc.stride(0), vc.stride(1),
        D=d, G=g.group_size, P=g.page_size, SINK_PAGES=g.sink_pages, GQA=gqa, H_PAD=h_pad, BLOCK_N=block_n,
        BLOCK_W=block_w, USE_ASM=asm_enabled(q.device, use_asm), F32DOT=INTERPRET, KT=kt, ROPE=on, R=r,
        SLIDING=window is not None, K_BITS=widths[0], V_BITS=widths[1], V_ROWS=own_value_rows(kc, vc, widths),
        K_HI_DIMS=hi_dims, K_HI_BITS=hi_bits, K_TAIL=k_tail,
        num_warps=num_warps, num_stages=num_stages, **extra)
    out = torch.empty(bsz, hq, d, device=q.device, dtype=q.dtype) if out is None else out
    return merge(po, pl, out)


INT2_KERNEL_ENV = "OSCAR_KV_INT2_KERNEL"  # "auto" (default) | "cuda" | "triton": which INT2 decode kernel runs


def int2_kernel_choice(device: torch.device, geom, gqa: int, rope=None, dtype: torch.dtype = torch.bfloat16,
                       backend: str | None = None, widths: tuple[int, int] = (2, 2),
                       split=None) -> tuple[str, str | None]:
    """Which kernel decode attention runs for a layer of this pool: ("cuda", None), the one-launch CUDA kernel, or
    ("triton", why not CUDA).  ``backend``: "auto" (CUDA where it runs), "cuda" (raises where it cannot) or
    "triton"; default: $OSCAR_KV_INT2_KERNEL, else "auto".  ``rope``: the per-position centering (its pairs), or
    None.  ``widths``: the layer's (key, value) code widths (both kernels take sliding windows).  A layer stored at
    widths the CUDA kernel does not read (not in int2_cuda.WIDTHS: values at 8 bits) takes Triton where the model's other layers take CUDA, $OSCAR_KV_INT2_KERNEL=cuda
    included; only a call that itself asks for "cuda" raises (int2_cuda.width_error says why).  ``split``: the
    layer's quant.SplitWidth when its keys are split (int2_cuda.split_error says which the CUDA kernel reads).  The
    engine reports the choice at start-up; ``int2_decode`` makes it per call."""
    from . import int2_cuda

    own = int2_cuda.width_error(*widths) or int2_cuda.split_error(split, geom.head_dim)
    if own is not None and backend == "cuda":
        raise ValueError(f"the CUDA INT2 kernel cannot run this call: {own}")

    def why_not() -> str | None:  # (a layer at widths the kernel cannot read asks about its INT2 variant)
        readable = own is None
        return int2_cuda.unsupported(device, geom, gqa, rope, dtype, tuple(widths) if readable else (2, 2),
                                     split if readable else None) or (
            "the Triton interpreter is on" if INTERPRET else None)

    kernel, why = kernel_choice(INT2_KERNEL_ENV, backend, "cuda", "triton", why_not, "the CUDA INT2 kernel")
    if own is not None and kernel == "cuda":
        return "triton", own
    return kernel, why


def _use_cuda(backend: str, device: torch.device, geom, gqa: int, rope, dtype: torch.dtype = torch.bfloat16,
              widths: tuple[int, int] = (2, 2), split=None) -> bool:
    return int2_kernel_choice(device, geom, gqa, rope, dtype, backend, widths, split)[0] == "cuda"
