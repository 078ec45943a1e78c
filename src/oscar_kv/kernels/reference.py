"""Pure-torch specification of every kernel over the paged pool (see layout.py).

The Triton kernels in write.py / decode.py / extend.py are tested against these functions.  They
favour clarity over speed (Python loops over sequences are fine here).
"""

from __future__ import annotations

import torch

from ..rope import apply_rope
from ..rotation import rotate
from ..quant import dequantize_rows, dequantize_split, quantize_rows, QuantizedRows
from . import split_keys
from .layout import PagedBatch, PagedKVPool, metadata_slot


# ----------------------------------------------------------------------------------------- helpers
def rotate_keys(k: torch.Tensor, k_rotation: torch.Tensor | None, k_mean: torch.Tensor | None) -> torch.Tensor:
    """(k - mu_K) @ R_K per KV head in float32.  k: [..., H, D]; R: [Hr, D, D], Hr in {1, H}; mu: [H, D]."""
    x = k.float()
    if k_mean is not None:
        x = x - k_mean.float()
    if k_rotation is None:
        return x
    return rotate(x.unsqueeze(-2), k_rotation.float()).squeeze(-2)


def rotate_queries(q: torch.Tensor, k_rotation: torch.Tensor | None, num_kv_heads: int) -> torch.Tensor:
    """q @ R_K[kv_head(q)] in float32.  q: [..., Hq, D]."""
    x = q.float()
    if k_rotation is None:
        return x
    hq = x.shape[-2]
    r = k_rotation.float().expand(num_kv_heads, -1, -1).repeat_interleave(hq // num_kv_heads, 0)
    return rotate(x.unsqueeze(-2), r).squeeze(-2)


def _quantize_heads(x: torch.Tensor, bits: int, group: int, clip_idx: torch.Tensor,
                    rescale: float = 0.0) -> QuantizedRows:
    """quant.quantize_rows at ``bits`` with a per-head clip ratio given as clip index (x: [T, H, D])."""
    d = x.shape[-1]
    ratio = (clip_idx.double() / d).to(x.device)  # floor(ratio*D) == idx
    # quant.clip_rows computes floor(ratio*D) in float64: idx/D*D == idx exactly for D a power of two.
    return quantize_rows(x.float(), bits, group, ratio.view(1, -1) if bool((clip_idx < d - 1).any()) else 1.0,
                         rescale)


def _stored_rows(g, layer: int, side: str, x: torch.Tensor, clip_idx: torch.Tensor,
                 rescale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale, zero) of rows x [T, H, D] of one side ("k" or "v") as the layer stores them: at its width,
    or split keys as split_keys.py lays them out (``clip_idx`` then [H, 2], split_keys.clip_indices)."""
    split = g.k_split[layer] if side == "k" else None
    if split is not None:
        return split_keys.pack(split_keys.quantize_indexed(x, split, clip_idx, rescale))
    qr = _quantize_heads(x, g.layer_widths(layer)[side == "v"], g.group_size, clip_idx, rescale)
    return qr.codes, qr.scale, qr.zero


def _store_codes(pool: PagedKVPool, layer: int, side: str, index: tuple, codes: torch.Tensor) -> None:
    """Stored rows of one side into the layer's pages at ``index`` (split keys: each page's plain rows, then its
    tails, split_keys.store_rows)."""
    split = pool.geometry.k_split[layer] if side == "k" else None
    if split is not None:
        split_keys.store_rows(pool.k_codes[layer], index, codes, split, pool.geometry.head_dim)
    else:
        getattr(pool, f"{side}_codes")[(layer, *index)] = codes


# ----------------------------------------------------------------------------------------- write
def write_reference(pool: PagedKVPool, layer: int, k: torch.Tensor, v: torch.Tensor,
                    win_slot: torch.Tensor, int2_slot: torch.Tensor,
                    k_rotation: torch.Tensor | None, k_mean: torch.Tensor | None,
                    clip_k_idx: torch.Tensor, clip_v_idx: torch.Tensor,
                    rescale: tuple[float, float] = (0.0, 0.0),
                    k_rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    rope_layout=None) -> None:
    """Store T tokens of one layer; the specification of write.write_kv, with its arguments (``k_rope``:
    RoPE_p(mu_pre) subtracted after k_mean, then the rotation; ``rope_layout``: its rope.RotaryLayout).

    Keys are centered and rotated in float32; a token bound for a window page is stored as BF16,
    one bound for an INT2 page is clipped/quantized from the float32 row (quant.quantize_rows, keys and values
    each at the layer's width, ``pool.geometry.layer_widths``; split keys: split_keys.py, with ``clip_k_idx``
    [Hkv, 2]; ``rescale``: its strength for keys and values).

    Shapes:
        k (post-RoPE), v (rotated): [T, Hkv, D]; win_slot, int2_slot: int32 [T]; k_rotation: [Hkv | 1, D, D];
        k_mean: [Hkv, D]; clip_k_idx, clip_v_idx: int32 [Hkv].
    """
    g = pool.geometry
    p = g.page_size
    if k_rope is not None:  # (k - mu) - RoPE_p(mu_pre), in the kernel's order
        mu_pre, cos, sin = (x.float() for x in k_rope)
        kr = rotate_keys(rotate_keys(k, None, k_mean) - apply_rope(mu_pre[None], cos[:, None], sin[:, None],
                                                                  rope_layout), k_rotation, None)
    else:
        kr = rotate_keys(k, k_rotation, k_mean)
    vr = v.float()
    win = win_slot.long() >= 0
    if win.any():
        s = win_slot.long()[win]
        pool.k_win[layer, s // p, :, s % p] = kr[win].to(torch.bfloat16)
        pool.v_win[layer, s // p, :, s % p] = vr[win].to(torch.bfloat16)
    qm = int2_slot.long() >= 0
    if qm.any():
        s = int2_slot.long()[qm]
        for x, side, idx, resc in ((kr, "k", clip_k_idx, rescale[0]), (vr, "v", clip_v_idx, rescale[1])):
            stored = _stored_rows(g, layer, side, x[qm], idx, resc)
            _store_codes(pool, layer, side, (s // p, slice(None), s % p), stored[0])
            for name, t in zip(("scale", "zero"), stored[1:]):
                getattr(pool, f"{side}_{name}")[layer, s // p, :, metadata_slot(s % p, p), :t.shape[-1]] = t


def migrate_reference(pool: PagedKVPool, src_win_pages: torch.Tensor, dst_int2_pages: torch.Tensor,
                      clip_k_idx: torch.Tensor, clip_v_idx: torch.Tensor,
                      rescale: tuple[float, float] = (0.0, 0.0)) -> None:
    """Quantize whole window pages (all layers, each side at its layer's width) into INT2 pages.
    clip_*_idx: int32 [L, H] ([L, H, 2] for split keys: split_keys.clip_indices)."""
    g = pool.geometry
    src, dst = src_win_pages.long(), dst_int2_pages.long()
    for layer in range(g.num_layers):
        for win, side, idx, resc in ((pool.k_win, "k", clip_k_idx, rescale[0]), (pool.v_win, "v", clip_v_idx,
                                                                                    rescale[1])):
            rows = win[layer, src].float().transpose(1, 2)  # [M, P, H, D]
            stored = _stored_rows(g, layer, side, rows.reshape(-1, g.num_kv_heads, g.head_dim), idx[layer], resc)
            m, slots = rows.shape[0], metadata_slot(torch.arange(g.page_size), g.page_size)
            page = lambda t: t.view(m, g.page_size, g.num_kv_heads, -1).transpose(1, 2)  # noqa: E731
            _store_codes(pool, layer, side, (dst,), page(stored[0]))
            for name, t in zip(("scale", "zero"), stored[1:]):
                tile = torch.empty_like(page(t))
                tile[:, :, slots] = page(t)
                getattr(pool, f"{side}_{name}")[layer, dst, ..., :t.shape[-1]] = tile


# ----------------------------------------------------------------------------------------- read
def gather_sequence(pool: PagedKVPool, layer: int, batch: PagedBatch, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized rotated K and V of sequence b in token order, float32 [T, H, D] (codes at the layer's widths)."""
    g = pool.geometry
    p, sp = g.page_size, g.sink_pages
    widths = g.layer_widths(layer)
    t = int(batch.seq_lens[b])
    nq = int(batch.int2_pages[b])
    ks, vs = [], []
    for i in range(-(-t // p)):
        phys = int(batch.block_table[b, i])
        if sp <= i < sp + nq:
            slots = metadata_slot(torch.arange(p), p)
            for out, bits, side in ((ks, widths[0], "k"), (vs, widths[1], "v")):
                codes = getattr(pool, f"{side}_codes")[layer, phys].transpose(0, 1)
                scale, zero = (getattr(pool, f"{side}_{name}")[layer, phys][:, slots].transpose(0, 1)
                               for name in ("scale", "zero"))
                split = g.k_split[layer] if side == "k" else None
                if split is not None:
                    codes = split_keys.load_rows(pool.k_codes[layer], (phys,), split, g.head_dim).transpose(0, 1)
                    out.append(dequantize_split(split_keys.unpack(codes, scale, zero, split, g.head_dim)))
                else:
                    out.append(dequantize_rows(QuantizedRows(codes, scale, zero, bits, g.group_size)))  # [P, H, D]
        else:
            ks.append(pool.k_win[layer, phys].transpose(0, 1).float())
            vs.append(pool.v_win[layer, phys].transpose(0, 1).float())
    k = torch.cat(ks)[:t] if ks else pool.k_win.new_zeros(0, g.num_kv_heads, g.head_dim).float()
    v = torch.cat(vs)[:t] if vs else k.clone()
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [M, Hq, D], k/v [N, H, D] (GQA), float64 softmax; mask [M, N] bool (True = attend)."""
    hq, h = q.shape[1], k.shape[1]
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    kk = k.double().repeat_interleave(hq // h, 1)
    vv = v.double().repeat_interleave(hq // h, 1)
    s = torch.einsum("mhd,nhd->hmn", q.double(), kk) * sm_scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), vv).float()


def with_rope_offsets(k: torch.Tensor, start: int, rope, k_rotation: torch.Tensor | None) -> torch.Tensor:
    """Stored keys [T, H, D] of positions start.. with the position-aware offset RoPE_p(mu_pre) added back in
    rotated space (rope.py); ``rope``: a rope.KernelRope or None."""
    if rope is None or k.shape[0] == 0:
        return k
    from ..rope import key_offsets

    mu_pre, table, layout = rope.mu_pre, rope.table, rope.rotary_layout
    half = table.shape[1] // 2
    rows = table[start:start + k.shape[0]].float()  # per pair: cos | sin
    cos, sin = layout.spread(rows[:, :half]), layout.spread(rows[:, half:])
    off = key_offsets(mu_pre.to(k.device), cos, sin, layout)  # [H, T, D]
    off_rot = rotate(off, k_rotation.float()) if k_rotation is not None else off
    return k + off_rot.transpose(0, 1)


def window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool [M, N]: query at position query_pos[m] sees the key at key_pos[n] (causal; with a sliding ``window``
    only keys in (p - window, p], transformers' sliding_window_overlay).  None or 0: the whole causal past."""
    see = key_pos[None, :] <= query_pos[:, None]
    if window:
        see &= key_pos[None, :] > query_pos[:, None] - window
    return see


def decode_reference(pool: PagedKVPool, layer: int, q: torch.Tensor, batch: PagedBatch,
                     k_rotation: torch.Tensor | None, sm_scale: float | None = None, rope=None,
                     window: int | None = None) -> torch.Tensor:
    """Decode attention, one new query token per sequence; the specification of decode.int2_decode.

    A sequence of length 0 yields zeros.  The query sits at the last position (seq_len - 1): with a sliding
    ``window`` it sees only the last ``window`` tokens (sink, INT2 and recent rows alike).

    Args:
        pool, layer, batch: the pool, the layer and the sequences.
        q: the unrotated queries.
        k_rotation: R_K; None: the identity.
        sm_scale: default 1 / sqrt(D).
        rope: a rope.KernelRope when keys are centered per position (with_rope_offsets); None: not.
        window: the layer's sliding window; None or 0: the whole sequence.
    Shapes:
        q: [B, Hq, D]; k_rotation: [Hkv | 1, D, D].
    Returns:
        float32 [B, Hq, D].
    """
    g = pool.geometry
    qr = rotate_queries(q, k_rotation, g.num_kv_heads)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        if int(batch.seq_lens[b]) == 0:
            continue
        k, v = gather_sequence(pool, layer, batch, b)
        pos = torch.arange(k.shape[0], device=q.device)
        mask = window_mask(pos[-1:], pos, window)
        out[b] = _attend(qr[b : b + 1], with_rope_offsets(k, 0, rope, k_rotation), v, sm_scale, mask)[0]
    return out


def extend_reference(pool: PagedKVPool, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     cu_seqlens: torch.Tensor, batch: PagedBatch, k_rotation: torch.Tensor | None,
                     sm_scale: float | None = None, rope=None, window: int | None = None) -> torch.Tensor:
    """Chunked prefill; the specification of extend.int2_extend and materialized_extend.

    Sequence b's new tokens q[cu[b]:cu[b+1]] (unrotated) attend to its cached history (``batch`` describes the
    cache *before* the chunk) and causally to the chunk itself, whose rotated keys / values k_new / v_new are
    used exactly as given.  Chunk token i sits at position seq_lens[b] + i; with a sliding ``window`` it sees only
    keys in (position - window, position].  Other arguments as decode_reference.

    Shapes:
        q: [T, Hq, D]; k_new, v_new: [T, Hkv, D]; cu_seqlens: int [B + 1].
    Returns:
        float32 [T, Hq, D].
    """
    g = pool.geometry
    qr = rotate_queries(q, k_rotation, g.num_kv_heads)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        lo, hi = cu[b], cu[b + 1]
        if hi == lo:
            continue
        n = hi - lo
        if int(batch.seq_lens[b]) > 0:
            kh, vh = gather_sequence(pool, layer, batch, b)
        else:
            kh = vh = k_new.new_zeros(0, g.num_kv_heads, g.head_dim).float()
        k = with_rope_offsets(torch.cat([kh, k_new[lo:hi].float()]), 0, rope, k_rotation)
        v = torch.cat([vh, v_new[lo:hi].float()])
        t0 = kh.shape[0]
        mask = window_mask(t0 + torch.arange(n, device=q.device), torch.arange(t0 + n, device=q.device), window)
        out[lo:hi] = _attend(qr[lo:hi], k, v, sm_scale, mask)
    return out
