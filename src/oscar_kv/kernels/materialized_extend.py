"""Extend (prefill chunk) attention at the cost of float16 BF16-cache attention: materialize, then SDPA.
Specification: reference.extend_reference (the same semantics as extend.int2_extend).

Per sequence and layer, one Triton pass writes the sequence's keys and values of positions [0, n) into a
contiguous float16 scratch in the rotated space: positions before the chunk as stored (INT2 pages dequantized,
keys and values each at the layer's width, 2, 3, 4, 5 (keys) or 8 bits; sink / recent BF16 pages copied), then the
chunk's own keys and values exactly as given; keys get the position-aware offset RoPE_p(mu_pre) @ R_K added back
(rope.py), as codec.LayerCodec.restore_offsets does.  Then the rotated queries attend over [history | chunk]
(chunk_attention.py: cuDNN over the history and the chunk, merged by log-sum-exp, or one flash call with a
lower-right mask).  Nothing about the attention
itself is INT2-specific: the cost is the BF16 cache's attention plus one streaming pass over the history.

A sliding-window layer materializes only what the chunk's first query sees, positions from hist - window + 1
on (``window_start``; later queries see less), and the attention masks each query's band (chunk_attention.py):
at 32K tokens with a 1024-token window the pass writes ~1K history rows per sequence, not 32K.

Why float16 and not bfloat16: with per-position centering a restored key is stored key + offset, and the
offset can be large (|mu_pre| in the hundreds with a k_proj bias, as in Qwen2.5).  A scratch element is
rounded to 2^-11 of its size in float16, 2^-8 in bfloat16, so the logit error is ~1e-4 of the size of the
position-aware logit term in float16 (8x less than a BF16 model's own keys carry) and ~1e-3 in bfloat16.
On the tests' |mu_pre| ~ 900 cases (3 pairs per head, the term hundreds of logit units) the output is 0.009 /
0.015 from the torch reference (bfloat16 scratch: 0.077 / 0.126; the extend kernel, which adds the term in
float32 on CUDA cores, 4e-4 but ~13x slower); at |mu_pre| ~ 20, 0.002.  Exact would take hi / lo splits of both
operands of the term: 6R more head dims, past flash attention's 256 at D = 128.  Dequantized INT2 values and
rotated queries keep 3 more bits too.  A value past float16's 65504 (none in a sane model: a dequantized value
lies in its group's range, quantized with a float16 scale) overflows: the caller checks the outputs are finite
(kernel_attention.py).

Cost per chunk and layer (Qwen3-8B, 8 KV heads, D = 128; history h tokens, chunk T): the pass reads 70 B
(codes + scales and zero points of K and V) or 512 B (BF16 window rows) and writes 512 B per token and KV head:
~4.7 KB x h, plus 2R x D float32 multiply-adds per key for the offset; the attention does
4 x 32 x 128 x T x (h + T/2) FLOPs.  At h = 96K, T = 8K: 0.45 GB (~0.15 ms at 3 TB/s) against 1.1e13 FLOPs
(~25 ms): the pass is < 1% of the attention.

Scratch memory: one buffer pair reused by every layer and step, grown to the largest group of sequences
(``SCRATCH_ROWS`` rows, or one sequence of history + chunk if longer): 2 x rows x H x D x 2 bytes (Qwen3-8B:
4 KiB per row, 0.41 GB for a 100K-token sequence, 0.13 GB for the default 32K rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._compat import install_interpreter_shim
from .chunk_attention import chunk_attention, prefill_attention_choice
from .common import group_metadata, kernel_widths, key_split, meta_slot, own_value_rows, split_tail_minimum
from .layout import PagedBatch, PagedKVPool

install_interpreter_shim()

SCRATCH_ROWS = 32768  # sequences are materialized together up to this many rows (one longer sequence: alone)
BLOCK_ROWS = 32  # positions per program of the materialize pass
SCRATCH_DTYPE = torch.float16


# ------------------------------------------------------------------------------------------ kernel
@triton.jit
def _codes(Codes, crow, is_q, D: tl.constexpr, BITS: tl.constexpr):
    """float32 [BLOCK, D] codes of the rows at Codes + crow (quant.py's stride packing at BITS = 2, 3, 4, 5 or 8)."""
    offs_d = tl.arange(0, D)
    if BITS == 3 or BITS == 5:
        # an INT2 / INT4 plane (LW = D (BITS - 1) / 8 bytes), then the high bits: byte LW + j holds channel j + m D/8
        # in bit m
        LB: tl.constexpr = BITS - 1
        LW: tl.constexpr = D * LB // 8
        D8: tl.constexpr = D // 8
        low = tl.load(Codes + crow[:, None] + (offs_d % LW)[None, :], mask=is_q[:, None], other=0)
        high = tl.load(Codes + crow[:, None] + LW + (offs_d % D8)[None, :], mask=is_q[:, None], other=0)
        code = ((low >> (LB * (offs_d // LW)).to(tl.uint8)[None, :]) & ((1 << LB) - 1)) | \
            (((high >> (offs_d // D8).to(tl.uint8)[None, :]) & 1) << LB)
    else:  # byte j of a row holds channels j + k W at bits k BITS (W = D BITS / 8 bytes a row)
        W: tl.constexpr = D * BITS // 8
        raw = tl.load(Codes + crow[:, None] + (offs_d % W)[None, :], mask=is_q[:, None], other=0)
        code = (raw >> (BITS * (offs_d // W)).to(tl.uint8)[None, :]) & ((1 << BITS) - 1)
    return code.to(tl.float32)


@triton.jit
def _stored_rows(Codes, Scale, Zero, Win, Knew, phys, pos, chunk_row, is_q, is_w, is_new, head_c, head_m, head_w,
                 head_n, stride_cp, stride_mp, stride_wp, stride_nt,
                 D: tl.constexpr, G: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr = 2,
                 HI_DIMS: tl.constexpr = 0, HI_BITS: tl.constexpr = 2, TAIL: tl.constexpr = 0):
    """float32 [BLOCK, D] rows of one KV head: quantized rows (BITS-bit codes) dequantized (code * scale + min per
    group, min = -(scale * zero point) 2^-F in float32, exact as quant.stored_minimum), BF16 window rows, or chunk
    rows, by the masks.  Scales and zero points share one row offset (head_m, stride_mp).  HI_DIMS > 0: split key
    rows (split_keys.py), the first HI_DIMS channels at HI_BITS, tails of TAIL bytes after each page's P rows."""
    NG: tl.constexpr = D // G
    FRAC: tl.constexpr = 1.0 / (1 << ((8 - BITS) % 8))  # 2^-F, F = quant.fraction_bits: 8 - bits, 0 at 8 bits
    offs_d = tl.arange(0, D)
    slot = pos % P
    crow = phys * stride_cp + head_c + slot * (D * BITS // 8)
    code = _codes(Codes, crow, is_q, D, BITS)
    mrow = phys * stride_mp + head_m + meta_slot(slot) * NG
    if HI_DIMS > 0:
        # the first part's channels: their upper bits from the planes, their scale and minimum from the tail; the
        # rest: group 0 of the layer's metadata
        M8: tl.constexpr = HI_DIMS // 8  # bytes of one plane
        first = (offs_d < HI_DIMS)[None, :]
        trow = phys * stride_cp + head_c + P * (D * BITS // 8) + slot * TAIL  # after the page's P rows
        planes = Codes + trow[:, None] + 3 + (offs_d % M8)[None, :]
        up = tl.zeros([BLOCK, D], tl.int32)
        for p in tl.static_range(HI_BITS - BITS):
            bits = tl.load(planes + p * M8, mask=is_q[:, None] & first, other=0).to(tl.int32)
            up |= ((bits >> (offs_d // M8)[None, :]) & 1) << p
        code = code + (up << BITS).to(tl.float32)
        hs, hn = split_tail_minimum(Codes, trow, is_q, HI_BITS)
        ls = tl.load(Scale + mrow, mask=is_q, other=0.0).to(tl.float32)
        ln = -(ls * tl.load(Zero + mrow, mask=is_q, other=0).to(tl.float32)) * FRAC
        deq = tl.where(first, code * hs[:, None] + hn[:, None], code * ls[:, None] + ln[:, None])
    else:
        moff = mrow[:, None] + tl.arange(0, NG)[None, :]
        scale = tl.load(Scale + moff, mask=is_q[:, None], other=0.0).to(tl.float32)
        minimum = -(scale * tl.load(Zero + moff, mask=is_q[:, None], other=0).to(tl.float32)) * FRAC
        deq = tl.reshape(tl.reshape(code, (BLOCK, NG, G)) * scale[:, :, None] + minimum[:, :, None], (BLOCK, D))
    wrow = phys * stride_wp + head_w + slot * D
    win = tl.load(Win + wrow[:, None] + offs_d[None, :], mask=is_w[:, None], other=0.0).to(tl.float32)
    new = tl.load(Knew + chunk_row[:, None] * stride_nt + head_n + offs_d[None, :], mask=is_new[:, None],
                  other=0.0).to(tl.float32)
    return tl.where(is_q[:, None], deq, tl.where(is_w[:, None], win, new))


@triton.jit(do_not_specialize=["window"])  # one compile for every window size
def _materialize_kernel(Kc, Ks, Kz, Vc, Vs, Vz, Kw, Vw, BT, HIST, NQ, CU, SEQ, ROW0, Kn, Vn, W, PR, CS, Ko, Vo,
                        stride_cp, stride_ch, stride_mp, stride_mh, stride_wp, stride_wh, stride_bt,
                        stride_knt, stride_knh, stride_vnt, stride_vnh, stride_wgt, stride_prh, stride_ot, stride_oh,
                        window, stride_vcp, stride_vch, D: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
                        SINK_PAGES: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr,
                        HALF: tl.constexpr, SLIDING: tl.constexpr, K_BITS: tl.constexpr = 2,
                        V_BITS: tl.constexpr = 2, V_ROWS: tl.constexpr = False, K_HI_DIMS: tl.constexpr = 0,
                        K_HI_BITS: tl.constexpr = 2, K_TAIL: tl.constexpr = 0):
    """Program (block of positions, sequence of the group, KV head): positions [first, hist + chunk) of the
    sequence -> scratch rows ROW0 + position - first (keys with the position-aware offset when ROPE); first is 0,
    or with SLIDING the first position the chunk's first query sees, hist - window + 1 (window_start)."""
    b = tl.load(SEQ + tl.program_id(1))
    h = tl.program_id(2)
    hist = tl.load(HIST + b)
    lo = tl.load(CU + b)
    n = hist + tl.load(CU + b + 1) - lo
    first = 0
    if SLIDING:
        first = tl.maximum(hist - window + 1, 0)
    if first + tl.program_id(0) * BLOCK >= n:
        return
    pos = first + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = pos < n
    in_hist = valid & (pos < hist)
    lpage = pos // P
    nq = tl.load(NQ + b)
    is_q = in_hist & (lpage >= SINK_PAGES) & (lpage < SINK_PAGES + nq)
    is_w = in_hist & ~is_q
    is_new = valid & (pos >= hist)
    phys = tl.load(BT + b.to(tl.int64) * stride_bt + lpage, mask=in_hist, other=0).to(tl.int64)
    chunk_row = tl.where(is_new, lo + pos - hist, 0).to(tl.int64)
    h64 = h.to(tl.int64)
    k = _stored_rows(Kc, Ks, Kz, Kw, Kn, phys, pos, chunk_row, is_q, is_w, is_new, h64 * stride_ch,
                     h64 * stride_mh, h64 * stride_wh, h64 * stride_knh, stride_cp, stride_mp, stride_wp, stride_knt,
                     D, G, P, BLOCK, K_BITS, K_HI_DIMS, K_HI_BITS, K_TAIL)
    offs_d = tl.arange(0, D)
    if ROPE:
        # RoPE_p(mu_pre) @ R_K = sum over the kept pairs i of cos(p t_i) A_i + sin(p t_i) B_i (W rows: A | B),
        # cos | sin from the float32 table (rope.KernelRope.table).  Float32 FMAs per pair: a tl.dot with
        # input_precision="ieee" makes this pass 80x slower than the copy alone on the H100 (benchmarks/NOTES.md,
        # "Prefill with the float16-materialized path")
        trow = CS + pos.to(tl.int64) * (2 * HALF)
        for i in tl.static_range(R):
            col = tl.load(PR + h * stride_prh + i)
            c = tl.load(trow + col, mask=valid, other=0.0)
            s = tl.load(trow + col + HALF, mask=valid, other=0.0)
            wa = tl.load(W + h * stride_wgt + i * D + offs_d)
            wb = tl.load(W + h * stride_wgt + (R + i) * D + offs_d)
            k += c[:, None] * wa[None, :] + s[:, None] * wb[None, :]
    out_row = (tl.load(ROW0 + tl.program_id(1)) + pos - first).to(tl.int64)
    tl.store(Ko + out_row[:, None] * stride_ot + h64 * stride_oh + offs_d[None, :], k.to(Ko.dtype.element_ty),
             mask=valid[:, None])
    if V_ROWS:  # values at another width (or with other strides) than the keys
        v = _stored_rows(Vc, Vs, Vz, Vw, Vn, phys, pos, chunk_row, is_q, is_w, is_new, h64 * stride_vch,
                         h64 * stride_mh, h64 * stride_wh, h64 * stride_vnh, stride_vcp, stride_mp, stride_wp,
                         stride_vnt, D, G, P, BLOCK, V_BITS)
    else:
        v = _stored_rows(Vc, Vs, Vz, Vw, Vn, phys, pos, chunk_row, is_q, is_w, is_new, h64 * stride_ch,
                         h64 * stride_mh, h64 * stride_wh, h64 * stride_vnh, stride_cp, stride_mp, stride_wp,
                         stride_vnt, D, G, P, BLOCK, V_BITS)
    tl.store(Vo + out_row[:, None] * stride_ot + h64 * stride_oh + offs_d[None, :], v.to(Vo.dtype.element_ty),
             mask=valid[:, None])


# ------------------------------------------------------------------------------------------ host side
def window_start(history: int, window: int | None) -> int:
    """The first position a chunk after ``history`` cached tokens attends to: 0, or with a sliding window the
    first query's (position ``history``) lower bound.  Later queries of the chunk see less of the history."""
    return max(history - window + 1, 0) if window else 0


@dataclass
class MaterializeGroup:
    """Sequences materialized by one launch: batch rows ``seqs`` at scratch rows ``row0`` (device int32), and per
    sequence (chunk rows lo, hi; first scratch row; rows: history seen + chunk) for its attention call.
    ``longest``: the most rows of one sequence; ``positions``: the largest history + chunk (the RoPE table rows
    read); ``window``: the sliding window the rows were counted for (None: full attention)."""

    seqs: torch.Tensor
    row0: torch.Tensor
    rows: int
    longest: int
    calls: list[tuple[int, int, int, int]]
    positions: int
    window: int | None = None


@dataclass
class MaterializePlan:
    """Which sequences of a packed extend batch go through this path, grouped to fit the scratch (host only).
    ``window``: the layer's sliding window the plan was built for (None: full attention)."""

    groups: list[MaterializeGroup]
    longest: int  # the longest history + chunk (bounds the RoPE table rows read)
    window: int | None = None

    @classmethod
    def build(cls, cu: list[int], starts: list[int], seqs: list[int], device,
              max_rows: int = SCRATCH_ROWS, window: int | None = None) -> "MaterializePlan":
        """Group the sequences: consecutive ones share a group while its rows fit ``max_rows`` (a longer sequence
        gets a group of its own).

        Args:
            cu: chunk row offsets, B + 1 of them (cu_seqlens on the host).
            starts: each sequence's history length (its cached tokens before the chunk).
            seqs: the batch rows to plan (only those with a non-empty chunk are kept).
            device: where the groups' index tensors go.
            max_rows: scratch rows one group may take.
            window: the layer's sliding window: a sequence takes rows from window_start on only.
        """
        window = window or None
        groups, cur, rows = [], [], 0

        def close():
            if cur:
                calls = [(cu[b], cu[b + 1], r0, starts[b] + cu[b + 1] - cu[b] - window_start(starts[b], window))
                         for b, r0 in cur]
                idx = torch.tensor([[b for b, _ in cur], [r0 for _, r0 in cur]], dtype=torch.int32).to(device)
                ends = max(starts[b] + cu[b + 1] - cu[b] for b, _ in cur)
                groups.append(MaterializeGroup(idx[0], idx[1], rows, max(c[3] for c in calls), calls, ends, window))

        for b in seqs:
            n = starts[b] + cu[b + 1] - cu[b] - window_start(starts[b], window)
            if cu[b + 1] == cu[b]:
                continue  # no query rows
            if cur and rows + n > max_rows:
                close()
                cur, rows = [], 0
            cur.append((b, rows))
            rows += n
        close()
        return cls(groups, max((g.positions for g in groups), default=0), window)

    @property
    def rows(self) -> int:
        return max((g.rows for g in self.groups), default=0)


class Scratch:
    """The float16 K / V buffers [rows, H, D], reused across layers and steps and grown on demand."""

    def __init__(self):
        self.k = self.v = None

    def take(self, rows: int, heads: int, dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) buffers of at least ``rows`` rows [>= rows, heads, dim], reallocated when too small or shaped
        otherwise."""
        if self.k is None or self.k.shape[0] < rows or self.k.shape[1:] != (heads, dim) or self.k.device != device:
            shape = (max(rows, 1), heads, dim)
            self.k = self.v = None  # free the old pair first
            self.k = torch.empty(shape, dtype=SCRATCH_DTYPE, device=device)
            self.v = torch.empty(shape, dtype=SCRATCH_DTYPE, device=device)
        return self.k, self.v

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()


def rope_key_weights(rope, k_rotation: torch.Tensor | None, num_kv_heads: int) -> torch.Tensor:
    """W with RoPE_p(mu_pre) @ R_K = [cos(p t_i) | sin(p t_i)]_(kept pairs i) @ W[h], built in float64.

    Rows A_i = mu_l R_l + mu_h R_h, then B_i = mu_l R_h - mu_h R_l (R_j: row j of R_K; pair i's channels
    (l, h) = rope.RotaryLayout.channels, (i, i + D/2) in the rotate-half layout; rope.key_offsets).

    Args:
        rope: the layer's rope.KernelRope (mu_pre and the kept pairs).
        k_rotation: R_K; None: the identity.
        num_kv_heads: the pool's, which mu_pre must have.
    Shapes:
        mu_pre: [H, D]; pairs: [H, R]; k_rotation: [H | 1, D, D].
    Returns:
        float32 [H, 2R, D].
    """
    mu = rope.mu_pre.double()
    h, d = mu.shape
    r = (torch.eye(d, dtype=torch.float64, device=mu.device).expand(h, d, d) if k_rotation is None
         else k_rotation.to(mu.device).double().expand(h, d, d))
    pairs = rope.pairs.long().to(mu.device)  # [H, R]
    channels = rope.rotary_layout.channels_on(mu.device)
    lo, hi = channels[0][pairs], channels[1][pairs]
    take = lambda m, idx: m.gather(1, idx)  # noqa: E731  [H, R]
    rows = lambda idx: r.gather(1, idx[:, :, None].expand(-1, -1, d))  # noqa: E731  [H, R, D]
    mu_lo, mu_hi = take(mu, lo)[..., None], take(mu, hi)[..., None]
    a = mu_lo * rows(lo) + mu_hi * rows(hi)
    b = mu_lo * rows(hi) - mu_hi * rows(lo)
    if num_kv_heads != h:
        raise ValueError(f"mu_pre has {h} heads, the pool {num_kv_heads}")
    return torch.cat([a, b], 1).float().contiguous()


def materialize(pool: PagedKVPool, layer: int, batch: PagedBatch, k_new: torch.Tensor, v_new: torch.Tensor,
                cu_seqlens: torch.Tensor, group: MaterializeGroup, k_out: torch.Tensor, v_out: torch.Tensor,
                rope=None, rope_weights: torch.Tensor | None = None) -> None:
    """Write the group's sequences, history as stored + chunk, into k_out / v_out from scratch row group.row0
    on.  Semantics: materialize_reference.

    Args:
        pool, layer, batch: the pool, the layer and the cache before the chunk.
        k_new, v_new, cu_seqlens: the packed chunks (as extend.int2_extend).
        group: the sequences of this launch (MaterializePlan); with a sliding window (group.window) each from its
            window_start on.
        k_out, v_out: the scratch buffers (Scratch.take).
        rope, rope_weights: a rope.KernelRope and its rope_key_weights, when keys get the position-aware offset
            back; None: no offset.
    Shapes:
        k_new, v_new: [T, H, D]; cu_seqlens: int32 [B + 1]; k_out, v_out: float16 [rows, H, D].
    """
    g = pool.geometry
    h, d = g.num_kv_heads, g.head_dim
    if group.rows == 0:
        return
    k_bits, v_bits = kernel_widths(g, layer)
    hi_dims, hi_bits, k_tail = key_split(g, layer, pool.layer(layer)["k_codes"])
    L = pool.layer(layer)
    kc, vc, kw, vw = L["k_codes"], L["v_codes"], L["k_win"], L["v_win"]
    ks, kz, vs, vz = group_metadata(L)
    bt = batch.block_table
    if rope is not None:
        rope.check(group.positions)
        w, pr, cs, r = rope_weights, rope.pairs, rope.table, rope.pairs.shape[1]
        stride_w, stride_pr = w.stride(0), pr.stride(0)
    else:
        w = pr = cs = k_out
        stride_w = stride_pr = 0
        r = 1
    grid = (triton.cdiv(group.longest, BLOCK_ROWS), group.seqs.numel(), h)
    _materialize_kernel[grid](
        kc, ks, kz, vc, vs, vz, kw, vw, bt, batch.seq_lens, batch.int2_pages, cu_seqlens, group.seqs, group.row0,
        k_new, v_new, w, pr, cs, k_out, v_out,
        kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), kw.stride(0), kw.stride(1), bt.stride(0),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), stride_w, stride_pr,
        k_out.stride(0), k_out.stride(1), group.window or 0, vc.stride(0), vc.stride(1),
        D=d, G=g.group_size, P=g.page_size, SINK_PAGES=g.sink_pages, BLOCK=BLOCK_ROWS, ROPE=rope is not None,
        R=r, HALF=d // 2, SLIDING=bool(group.window), K_BITS=k_bits, V_BITS=v_bits,
        V_ROWS=own_value_rows(kc, vc, (k_bits, v_bits)), K_HI_DIMS=hi_dims, K_HI_BITS=hi_bits,
        K_TAIL=k_tail,
        num_warps=4 if d <= 64 else 8)  # [BLOCK, D] float32 tiles: 32 values a thread


def materialize_reference(pool: PagedKVPool, layer: int, batch: PagedBatch, k_new: torch.Tensor,
                          v_new: torch.Tensor, cu_seqlens: torch.Tensor, b: int, rope=None,
                          k_rotation: torch.Tensor | None = None,
                          window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [hist + chunk - first, H, D] keys and values of sequence b as the extend attention sees them:
    history as stored (reference.gather_sequence), then the chunk, keys with the position-aware offset added back
    (reference.with_rope_offsets); positions from first = window_start(hist, window) on."""
    from .reference import gather_sequence, with_rope_offsets

    g = pool.geometry
    lo, hi = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
    if int(batch.seq_lens[b]) > 0:
        kh, vh = gather_sequence(pool, layer, batch, b)
    else:
        kh = vh = k_new.new_zeros(0, g.num_kv_heads, g.head_dim).float()
    k = with_rope_offsets(torch.cat([kh, k_new[lo:hi].float()]), 0, rope, k_rotation)
    first = window_start(kh.shape[0], window)
    return k[first:], torch.cat([vh, v_new[lo:hi].float()])[first:]


def _heads_first(rows: torch.Tensor) -> torch.Tensor:
    return rows.transpose(0, 1).unsqueeze(0)  # [n, H, D] -> [1, H, n, D] (a view)


def materialized_extend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cu_seqlens: torch.Tensor,
                        pool: PagedKVPool, layer: int, batch: PagedBatch, k_rotation: torch.Tensor | None = None,
                        sm_scale: float | None = None, *, rope=None, plan: MaterializePlan | None = None,
                        scratch: Scratch | None = None, rope_weights: torch.Tensor | None = None,
                        q_rotated: torch.Tensor | None = None, window: int | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Chunked-prefill attention over the mixed pool with the semantics of extend.int2_extend
    (reference.extend_reference).

    Args:
        q, k_new, v_new, cu_seqlens, pool, layer, batch, k_rotation, sm_scale, rope: as extend.int2_extend
            (q unrotated if ``k_rotation`` is given; ``batch``: the cache before the chunk).
        plan: the sequences to compute (MaterializePlan; default: all, a host sync).
        scratch: buffers to reuse; None: fresh ones for this call.
        rope_weights: rope_key_weights(rope, k_rotation, H) when the caller keeps them per layer.
        q_rotated: q already rotated (float32), to skip the rotation.
        window: the layer's sliding window (reference.extend_reference); None or 0: full attention.  Only the
            history the chunk's first query sees is materialized, and the attention masks each query's band.
        out: written in place (only the planned sequences' rows); None: a new tensor.
    Shapes:
        q, q_rotated, out: [T, Hq, D]; k_new, v_new: [T, Hkv, D], unit stride in D.
    Returns:
        [T, Hq, D] in q's dtype (``out`` when given).
    """
    from .extend import _rotate_chunk_queries

    g = pool.geometry
    t, hq, d = q.shape
    h = g.num_kv_heads
    if d != g.head_dim or hq % h:
        raise ValueError("query shape does not match the pool geometry")
    if k_new.shape != (t, h, d) or v_new.shape != (t, h, d) or k_new.stride(-1) != 1 or v_new.stride(-1) != 1:
        raise ValueError(f"k_new / v_new must be [{t}, {h}, {d}] with unit stride in the head dim")
    window = window or None
    if plan is None:
        cu = cu_seqlens.tolist()
        plan = MaterializePlan.build(cu, batch.seq_lens.tolist(), list(range(len(cu) - 1)), q.device, window=window)
    elif plan.window != window:
        raise ValueError(f"the plan was built for window {plan.window}, the call has {window}")
    out = torch.empty(t, hq, d, device=q.device, dtype=q.dtype) if out is None else out
    if not plan.groups:
        return out
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if rope is not None and rope_weights is None:
        rope_weights = rope_key_weights(rope, k_rotation, h)
    qr = q_rotated if q_rotated is not None else _rotate_chunk_queries(q, k_rotation, h)
    qr = qr.to(SCRATCH_DTYPE)
    k_buf, v_buf = (scratch or Scratch()).take(plan.rows, h, d, q.device)
    kernel, _ = prefill_attention_choice(q.device, SCRATCH_DTYPE, hq, h, d)
    cu32 = cu_seqlens.to(device=q.device, dtype=torch.int32)
    for group in plan.groups:
        materialize(pool, layer, batch, k_new, v_new, cu32, group, k_buf, v_buf, rope, rope_weights)
        for lo, hi, r0, n in group.calls:
            o = chunk_attention(_heads_first(qr[lo:hi]), _heads_first(k_buf[r0:r0 + n]),
                                _heads_first(v_buf[r0:r0 + n]), sm_scale, kernel, window)
            out[lo:hi] = o[0].transpose(0, 1)
    return out
