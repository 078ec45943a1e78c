"""The in-house BF16 paged decode baseline in Triton: every logical page of a sequence in one BF16 pool, written as
decode.py's INT2 kernel is (one program per sequence, KV head and split over the tokens; the GQA group's query rows
loaded once; an online softmax; ``common.merge`` combines the splits).  The benchmarks time it beside the INT2 path
and cuDNN / FlashAttention, and the engine decodes a BF16 cache with it.  Specification:
reference.decode_reference over a pool stored unquantized.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._compat import install_interpreter_shim
from .common import INTERPRET, LOG2E, bf16_range, merge, split_plan, store_partial, window_tokens
from .decode import rotate_query
from .tuning import TUNING

install_interpreter_shim()

# bf16_decode rotates the query in the kernel up to this head dim; above, its float32 D x D operand does not fit
# an SM's shared memory (256 KiB at D = 256) and rotate_query runs first (benchmarks/kernel_smem.py)
ROTATE_IN_KERNEL_MAX_DIM = 128


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


@triton.jit(do_not_specialize=["window"])  # one compile for every window size
def _bf16_decode_kernel(Q, R, Kw, Vw, BT, SL, PO, PL, qk_scale,
                        stride_qb, stride_qh, stride_rh, stride_wp, stride_wh, stride_bt,
                        stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, chunk, window,
                        D: tl.constexpr, P: tl.constexpr, GQA: tl.constexpr, H_PAD: tl.constexpr,
                        BLOCK: tl.constexpr, ROTATE: tl.constexpr, F32DOT: tl.constexpr, SLIDING: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(SL + b)
    q = _load_query(Q, R, b, h, stride_qb, stride_qh, stride_rh, qk_scale, D, GQA, H_PAD, ROTATE).to(tl.bfloat16)
    m_i = tl.full([H_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([H_PAD], tl.float32)
    acc = tl.zeros([H_PAD, D], tl.float32)
    base = 0
    row_lo = None
    if SLIDING:  # the splits cover the window, from the page of its first token
        lo = tl.maximum(seq_len - window, 0)
        base = (lo // P) * P
        row_lo = tl.zeros([H_PAD], tl.int32) + lo
    start = base + s * chunk
    end = tl.minimum(start + chunk, seq_len)
    m_i, l_i, acc = bf16_range(q, q, m_i, l_i, acc, start, end, BT + b * stride_bt, Kw, Vw,
                                h.to(tl.int64) * stride_wh, stride_wp, D, P, BLOCK, F32DOT, False,
                                row_lo=row_lo, SLIDING=SLIDING)
    store_partial(PO, PL, b, h, s, acc, m_i, l_i, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                  0, D, GQA, H_PAD, True)


def _rotation_args(q: torch.Tensor, k_rotation: torch.Tensor | None, num_kv_heads: int):
    if k_rotation is None:
        return q, 0, False
    r = k_rotation.float().contiguous()
    if r.shape[0] not in (1, num_kv_heads):
        raise ValueError(f"k_rotation must have 1 or {num_kv_heads} heads, got {r.shape[0]}")
    return r, (0 if r.shape[0] == 1 else r.stride(0)), True


def bf16_decode(q: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, k_rotation: torch.Tensor | None = None, sm_scale: float | None = None, *,
                page_size: int, max_seq_len: int | None = None, num_splits: int | None = None,
                block: int = TUNING.bf16_decode_block, num_warps: int = TUNING.bf16_decode_num_warps,
                num_stages: int = TUNING.bf16_decode_num_stages, window: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """BF16 paged decode (the in-house baseline): every logical page of a sequence points into one BF16 pool.

    Args:
        q: the queries, unrotated if ``k_rotation`` is given.
        k_win, v_win: one layer's pages.
        block_table, seq_lens: the sequences' physical pages and lengths.
        k_rotation: R_K, applied to q inside the kernel; None: q as it is.
        sm_scale: default 1 / sqrt(D).
        page_size: P.
        max_seq_len: a host bound on seq_lens for the split plan; None: a device sync.
        num_splits: unused (the split plan decides).
        block, num_warps, num_stages: Triton tuning knobs (tokens per tile).
        window: the layer's sliding window (the query sees the last ``window`` tokens; the splits cover only
            those); None or 0: the whole sequence.
        out: the output, written in place; None: a new tensor.
    Shapes:
        q, out: [B, Hq, D]; k_win, v_win: [N, Hkv, P, D]; block_table: int32 [B, max_pages]; seq_lens: int32 [B];
        k_rotation: [Hkv | 1, D, D].
    Returns:
        [B, Hq, D] in q's dtype (``out`` when given).
    """
    bsz, hq, d = q.shape
    h = k_win.shape[1]
    gqa = hq // h
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if bsz else 0
    window = window or None
    # with a window the splits start at its first token's page (the kernel's base)
    ns, chunk = split_plan(window_tokens(max_seq_len, window, page_size), bsz * h,
                           q.device, block)
    out = torch.empty(bsz, hq, d, device=q.device, dtype=q.dtype) if out is None else out
    if d > ROTATE_IN_KERNEL_MAX_DIM and k_rotation is not None:
        q, k_rotation = rotate_query(q, k_rotation, h), None  # float32
    r, stride_rh, rotate = _rotation_args(q, k_rotation, h)
    po = torch.empty(bsz, hq, ns, d, device=q.device, dtype=torch.float32)
    pl = torch.empty(bsz, hq, ns, device=q.device, dtype=torch.float32)
    h_pad = max(16, triton.next_power_of_2(gqa))
    _bf16_decode_kernel[(bsz, h, ns)](
        q, r, k_win, v_win, block_table, seq_lens, po, pl, sm_scale * LOG2E,
        q.stride(0), q.stride(1), stride_rh, k_win.stride(0), k_win.stride(1), block_table.stride(0),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1), chunk, window or 0,
        D=d, P=page_size, GQA=gqa, H_PAD=h_pad, BLOCK=block, ROTATE=rotate, F32DOT=INTERPRET,
        SLIDING=window is not None, num_warps=num_warps, num_stages=num_stages)
    return merge(po, pl, out)
