"""Paged decode attention kernels vs the torch reference (kernels/reference.py).

On a machine without CUDA the kernels run under Triton's interpreter at small sizes; on a GPU the same
tests run at full size (Qwen3-8B geometry, a 128K sequence mixed with short ones).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from oscar_kv.kernels import reference as ref  # noqa: E402
from oscar_kv.kernels.layout import PagedKVPool, PoolGeometry, clip_indices, plan_batch, token_slots  # noqa: E402

from kernel_utils import DEV, GPU, outlier_rows, random_orthogonal, rel_err, relaid_metadata, rope_case  # noqa: E402


def cuda_plans(d: int, rope=None) -> list[dict]:
    """int2_decode's CUDA plan options for one long split per sequence and many short ones, in CTAs of
    int2_cuda.NUM_WARPS warps and, where the variant has them (int2_cuda.wide_error), of WIDE_WARPS."""
    from oscar_kv.kernels import int2_cuda

    plans = [dict(cuda_split_target=t) for t in (1, 16)]
    if int2_cuda.wide_error(d, 0 if rope is None else rope.pairs.shape[1]) is None:
        plans += [dict(cuda_split_target=t, cuda_warps=int2_cuda.WIDE_WARPS) for t in (1, 16)]
    return plans


def build_pool(geom, seq_lens, gen, layer=0, int2_pages=None, clip=(0.96, 0.92)):
    """A pool filled through the reference writer with random keys/values (keys rotated by a random R)."""
    batch, nq, nw = plan_batch(geom, seq_lens, int2_pages, generator=gen)
    pool = PagedKVPool.allocate(geom, nq, nw, device=DEV, fill_nan=True)
    batch = batch.to(DEV)
    h, d = geom.num_kv_heads, geom.head_dim
    rot = random_orthogonal(h, d, gen).to(DEV)
    mean = torch.randn(h, d, generator=gen).to(DEV)
    ck = clip_indices(clip[0], d, (h,)).to(DEV)
    cv = clip_indices(clip[1], d, (h,)).to(DEV)
    for b, n in enumerate(seq_lens):
        if n == 0:
            continue
        pos = torch.arange(n, device=DEV)
        win, q2 = token_slots(geom, batch, torch.full_like(pos, b), pos)
        k = outlier_rows(n, h, d, gen)
        v = outlier_rows(n, h, d, gen, scale=0.5)
        ref.write_reference(pool, layer, k, v, win, q2, rot, mean, ck, cv)
    return pool, batch, rot


def small_geoms(widths=(2, 2)):
    """D = G = 64, P = 16 (two layers), and D = 128 with two groups, P = 32; keys / values at ``widths``."""
    k, v = widths
    yield PoolGeometry(num_layers=2, num_kv_heads=2, head_dim=64, group_size=64, page_size=16,
                       sink_size=32, recent_size=64, k_bits=(k, k), v_bits=(v, v))
    yield PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=128, group_size=64, page_size=32,
                       sink_size=64, recent_size=64, k_bits=(k,), v_bits=(v,))


# keys and values at their own widths (PoolGeometry.k_bits / v_bits: 3, 4, 5 and 8 bits beside INT2)
WIDTHS = [(2, 2), (3, 2), (4, 2), (3, 3), (2, 4), (4, 4), (8, 2), (5, 2)]


def width_ids(value):
    """Test ids that name a (key, value) width pair as K<k>V<v> (``-k V3`` selects the 3-bit value cases)."""
    return f"K{value[0]}V{value[1]}" if isinstance(value, tuple) else None


@pytest.mark.parametrize("widths", WIDTHS, ids=width_ids)
@pytest.mark.parametrize("gi", [0, 1])
def test_int2_decode_matches_reference(gi, widths):
    from oscar_kv.kernels.decode import int2_decode

    geom = list(small_geoms(widths))[gi]
    gen = torch.Generator().manual_seed(10 + gi)
    seq_lens = [0, 7, geom.sink_size, 300, 517] if not GPU else [0, 7, 64, 1000, 5003, 131072 + 77]
    pool, batch, rot = build_pool(geom, seq_lens, gen, layer=geom.num_layers - 1)
    hq = geom.num_kv_heads * 4
    q = torch.randn(len(seq_lens), hq, geom.head_dim, generator=gen).to(DEV, torch.bfloat16)
    want = ref.decode_reference(pool, geom.num_layers - 1, q, batch, rot, None)
    # the rotation is the query's business, not the codes': other widths run it once (interpreted runs are slow)
    for rotation in ("per-head", "shared") if widths == (2, 2) or GPU else ("per-head",):
        r = rot if rotation == "per-head" else rot[:1]
        want_r = want if rotation == "per-head" else ref.decode_reference(pool, geom.num_layers - 1, q, batch, r, None)
        out = torch.full_like(q, float("nan"))
        int2_decode(q, pool, geom.num_layers - 1, batch, r, out=out)
        assert not out.isnan().any()
        assert rel_err(out, want_r) < 1e-2, rotation
        assert out[0].abs().max() == 0  # empty sequence


def test_readers_refuse_metadata_they_cannot_address():
    """One stride pair addresses the scales and zero points of keys and values (common.group_metadata): a layer whose
    zero points have other strides, or are not uint8, is refused before the launch, and the pool as allocated reads
    the reference's values."""
    from oscar_kv.kernels.common import group_metadata
    from oscar_kv.kernels.decode import int2_decode

    geom = list(small_geoms())[0]
    pool, batch, rot = build_pool(geom, [geom.sink_size + 40], torch.Generator().manual_seed(3))
    layer = pool.layer(0)
    assert [t.data_ptr() for t in group_metadata(layer)] == [
        layer[n].data_ptr() for n in ("k_scale", "k_zero", "v_scale", "v_zero")]
    q = torch.randn(1, 8, geom.head_dim).to(DEV)
    for name, error in (("v_zero", "one set of strides"), ("k_zero", "uint8")):
        with pytest.raises(ValueError, match=error):
            int2_decode(q, relaid_metadata(pool, name), 0, batch, rot, backend="triton")
    assert rel_err(int2_decode(q, pool, 0, batch, rot, backend="triton"),
                   ref.decode_reference(pool, 0, q, batch, rot, None)) < 1e-2


@pytest.mark.parametrize("live,rotary", [(None, None), (3, None), (5, "half"), (None, "interleaved")])
def test_int2_decode_adds_the_position_aware_key_offset(live, rotary):
    """Keys centered per position (rope.py): every logit, window and INT2 alike, gets q . RoPE_p(mu_pre) back.
    live=3: mu_pre lives in 3 random pairs per head (as calibration keeps it): the kernel visits only those.
    rotary: partial rotary, RoPE on the first half of each head (rotate-half as Phi-3, interleaved as GLM)."""
    from oscar_kv.kernels.decode import int2_decode

    geom = list(small_geoms())[1]
    gen = torch.Generator().manual_seed(21)
    seq_lens = [5, geom.sink_size + 40, 300, 517] if not GPU else [5, 64, 5003, 131072 + 77]
    pool, batch, rot = build_pool(geom, seq_lens, gen)
    rotary_dim = geom.head_dim // 2 if rotary else None
    rope = rope_case(geom.num_kv_heads, geom.head_dim, max(seq_lens), gen, live=live, rotary_dim=rotary_dim,
                     interleaved=rotary == "interleaved")
    assert rope.pairs.shape[1] == max(8, (rotary_dim or geom.head_dim) // 2 if live is None else 8)
    q = torch.randn(len(seq_lens), geom.num_kv_heads * 4, geom.head_dim, generator=gen).to(DEV)
    want = ref.decode_reference(pool, 0, q, batch, rot, None, rope=rope)
    out = torch.full_like(q, float("nan"))
    int2_decode(q, pool, 0, batch, rot, rope=rope, num_splits=3, out=out)
    assert rel_err(out, want) < 1e-2
    assert rel_err(ref.decode_reference(pool, 0, q, batch, rot, None), want) > 0.1  # the term matters here


def test_rope_table_bound_is_the_sequence_length_not_the_split_plan():
    """Under CUDA graphs the INT2 page bound is a bucket up to 25% above the history (engine/graphs.py); the
    RoPE table is sized for max-model-len.  The table's check must follow the keys' positions, so a call whose
    page bound reaches far past the table but whose sequences end at its last row is served (it raised before:
    "the RoPE table covers N positions, the kernel reads M" at 100K through the engine); a length past the
    table is refused."""
    from oscar_kv.kernels.decode import int2_decode
    from oscar_kv.rope import TILE_MARGIN

    geom = list(small_geoms())[0]
    gen = torch.Generator().manual_seed(22)
    seq_lens = [geom.sink_size + geom.recent_size + 7 * 16 + 5, 40] if not GPU else [70001, 300]
    pool, batch, rot = build_pool(geom, seq_lens, gen)
    rope = rope_case(geom.num_kv_heads, geom.head_dim, max(seq_lens), gen, live=5)
    assert rope.covers >= max(seq_lens) and rope.covers - max(seq_lens) < 16
    q = torch.randn(len(seq_lens), geom.num_kv_heads * 2, geom.head_dim, generator=gen).to(DEV)
    want = ref.decode_reference(pool, 0, q, batch, rot, None, rope=rope)
    bucket = int(batch.int2_pages.max()) + 2 * TILE_MARGIN // geom.page_size  # a bound far past the table
    out = int2_decode(q, pool, 0, batch, rot, rope=rope, max_int2_pages=bucket, max_seq_len=max(seq_lens))
    assert rel_err(out, want) < 1e-2
    with pytest.raises(ValueError, match="RoPE table covers"):
        int2_decode(q, pool, 0, batch, rot, rope=rope, max_int2_pages=bucket, max_seq_len=rope.covers + 1)


def test_int2_decode_many_splits_and_prerotated_query():
    """D=64, G=32 (two groups), realistic query scale 1.0; the pre-rotated query is passed in float32."""
    from oscar_kv.kernels.decode import int2_decode

    geom = PoolGeometry(num_layers=1, num_kv_heads=1, head_dim=64, group_size=32, page_size=16,
                        sink_size=16, recent_size=32)
    gen = torch.Generator().manual_seed(3)
    seq_lens = [700, 33] if not GPU else [70000, 33]
    pool, batch, rot = build_pool(geom, seq_lens, gen)
    q = torch.randn(2, 8, geom.head_dim, generator=gen).to(DEV, torch.bfloat16)
    want = ref.decode_reference(pool, 0, q, batch, rot, 0.3)
    qr = ref.rotate_queries(q, rot, 1)
    out = torch.full_like(qr, float("nan"))
    int2_decode(qr, pool, 0, batch, None, 0.3, num_splits=7, out=out)
    assert not out.isnan().any()
    assert rel_err(out, want) < 1e-2
    out2 = int2_decode(q, pool, 0, batch, rot, 0.3, num_splits=3, block_n=32)  # rotation inside, bf16 out
    assert rel_err(out2, want) < 1e-2
    # One split over the whole history: the MMA accumulator must not carry the codes' 1024 offset (on the H100
    # its truncating float32 accumulation then drifts with the number of tokens per program).
    out3 = int2_decode(qr, pool, 0, batch, None, 0.3, num_splits=1)
    assert rel_err(out3, want) < 1e-2


@pytest.mark.parametrize("d", [64, 256])
def test_bf16_decode_matches_reference(d):
    """With and without a key rotation; at head dim 256 the query is rotated before the launch (bf16_decode.py)."""
    from oscar_kv.kernels.bf16_decode import bf16_decode

    geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=d, group_size=d, page_size=16, sink_size=0,
                        recent_size=16)
    gen = torch.Generator().manual_seed(5)
    if GPU:
        seq_lens = [1, 100, (131072 if d == 64 else 65536) + 5, 0]
    else:
        seq_lens = [1, 100, 333, 0] if d == 64 else [1, 90, 0]
    batch, _, nw = plan_batch(geom, seq_lens, [0] * len(seq_lens), generator=gen)
    pool = PagedKVPool.allocate(geom, 1, nw, device=DEV)
    pool.k_win.normal_()
    pool.v_win.normal_()
    batch = batch.to(DEV)
    rot = random_orthogonal(2, d, gen).to(DEV)
    q = torch.randn(len(seq_lens), 8 if d == 64 else 4, d, generator=gen).to(DEV, torch.bfloat16)
    for r in (rot, None):
        want = ref.decode_reference(pool, 0, q, batch, r, None)
        out = torch.full_like(q, float("nan"))
        bf16_decode(q, pool.k_win[0], pool.v_win[0], batch.block_table, batch.seq_lens, r, page_size=16, out=out)
        assert not out.isnan().any()
        assert rel_err(out, want) < 1e-2


@pytest.mark.parametrize("group,centering", [(256, "constant"), (128, "rope")])
def test_int2_decode_head_dim_256(group, centering):
    """Head dim 256 (Gemma's) through the Triton INT2 kernel and, on a GPU, the CUDA one (written for it too: one group
    per head or two), GQA 2 as Gemma 3; one group per head or two (calibration's default there, 128); per-head and
    shared rotations, and the position-aware key offset."""
    from oscar_kv.kernels import int2_cuda
    from oscar_kv.kernels.decode import int2_decode, int2_kernel_choice

    geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=256, group_size=group, page_size=16, sink_size=16,
                        recent_size=32)
    gen = torch.Generator().manual_seed(group)
    seq_lens = [0, 7, 150] if not GPU else [0, 7, 64, 5003, 65536 + 77]
    pool, batch, rot = build_pool(geom, seq_lens, gen)
    q = torch.randn(len(seq_lens), 4, 256, generator=gen).to(DEV, torch.bfloat16)
    assert int2_cuda.shape_error(geom, 2, None) is None
    if GPU:
        assert int2_kernel_choice(q.device, geom, 2) == ("cuda", None)
    rope = rope_case(2, 256, max(seq_lens), gen, live=3) if centering == "rope" else None
    for backend in ("triton", "cuda") if GPU else ("triton",):
        for r in (rot, rot[:1]) if rope is None else (rot,):
            want = ref.decode_reference(pool, 0, q, batch, r, None, rope=rope)
            out = torch.full_like(q, float("nan"))
            int2_decode(q, pool, 0, batch, r, rope=rope, num_splits=2, out=out, backend=backend)
            assert not out.isnan().any(), backend
            assert rel_err(out, want) < 1e-2, backend
            assert out[0].abs().max() == 0  # empty sequence


@pytest.mark.parametrize("widths", [(2, 2), (3, 4), (4, 3), (5, 3)])
def test_int2_decode_variants_agree(widths):
    """Tile sizes, warps, key-load orientation and the PTX code conversion give the same result; INT3, INT4 and INT5
    keys in both orientations (``kt``)."""
    from oscar_kv.kernels.decode import int2_decode

    geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=128, group_size=128, page_size=16,
                        sink_size=16, recent_size=32, k_bits=widths[:1], v_bits=widths[1:])
    gen = torch.Generator().manual_seed(7)
    pool, batch, rot = build_pool(geom, [400, 3] if not GPU else [20000, 3000, 1], gen)
    q = torch.randn(batch.batch_size, 8, 128, generator=gen).to(DEV, torch.bfloat16)
    want = ref.decode_reference(pool, 0, q, batch, rot)
    variants = [dict(block_n=64, num_warps=4, kt=True), dict(block_n=32, num_warps=2, kt=False)]
    if GPU:
        variants += [dict(block_n=128, num_warps=4, use_asm=False), dict(block_n=256, num_warps=8, num_stages=3),
                     dict(block_n=128, num_warps=4, split_target=8)]
    first = None
    for v in variants:
        out = int2_decode(q, pool, 0, batch, rot, backend="triton", **v)
        assert rel_err(out, want) < 1e-2, v
        first = out if first is None else first
        assert rel_err(out, first) < 3e-3, v


def windowed_case(geom, gen, gqa=4):
    """Sequences whose last few dozen tokens (a sliding window of 20-48) reach back into each part of the layout
    (P = 16, sink 32, recent 64): sink + recent (60), sink + INT2 + recent (70, a prefix hit: 2 INT2 pages and a
    6-token recent window), INT2 + recent (90 and 150: prefix hits), recent only (300, steady state), shorter
    than the window (7) and empty; on a GPU also 32K tokens (most INT2 pages below any window's bound)."""
    seq_lens = [0, 7, 60, 70, 90, 150, 300]
    int2 = [0, 0, 0, 2, 1, 6, geom.int2_pages_for(300)]
    if GPU:
        seq_lens.append(32768 + 77)
        int2.append(geom.int2_pages_for(32768 + 77))
    pool, batch, rot = build_pool(geom, seq_lens, gen, int2_pages=int2)
    q = torch.randn(len(seq_lens), geom.num_kv_heads * gqa, geom.head_dim, generator=gen).to(DEV, torch.bfloat16)
    return pool, batch, rot, q


WINDOW_GEOM = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=64, group_size=64, page_size=16, sink_size=32,
                           recent_size=64)


@pytest.mark.parametrize("window", [20, 48, 1 << 20])
def test_int2_decode_sliding_window(window):
    """A sliding-window layer: the query (position T - 1) sees positions > T - 1 - window, across the sink / INT2 /
    recent boundaries; the kernel the call picks (on a GPU the CUDA one: this geometry is one it takes) and Triton with
    forced history splits (splits past the window's part of the history write empty partials).  A window longer
    than every sequence is the full attention."""
    from oscar_kv.kernels.decode import int2_decode

    gen = torch.Generator().manual_seed(60)
    pool, batch, rot, q = windowed_case(WINDOW_GEOM, gen)
    want = ref.decode_reference(pool, 0, q, batch, rot, None, window=window)
    full = ref.decode_reference(pool, 0, q, batch, rot, None)
    if window < 64:
        assert rel_err(full, want) > 0.1  # the window matters
    else:
        assert torch.equal(full, want)
    for backend, splits in (("auto", None), ("triton", 3)):
        out = torch.full_like(q, float("nan"))
        int2_decode(q, pool, 0, batch, rot, window=window, num_splits=splits, out=out, backend=backend)
        assert not out.isnan().any()
        assert out[0].abs().max() == 0  # empty sequence
        assert rel_err(out, want) < 1e-2, splits
        for b in range(1, batch.batch_size):
            assert rel_err(out[b], want[b]) < 1e-2, (splits, b)


def test_int2_decode_sliding_window_with_the_position_aware_key_offset():
    """Windowed decode with keys centered per position (the window's ranges start on page boundaries, as the tiled
    RoPE term needs): D = 128 with two groups, pages of 32, the window crossing sink, INT2 and recent pages."""
    from oscar_kv.kernels.decode import int2_decode

    geom = list(small_geoms())[1]  # P = 32, sink 64, recent 64
    gen = torch.Generator().manual_seed(61)
    seq_lens = [5, 100, 200, 300] if not GPU else [5, 100, 200, 300, 20000 + 5]
    int2 = [0, 1, 3, geom.int2_pages_for(300)] + ([geom.int2_pages_for(20005)] if GPU else [])
    pool, batch, rot = build_pool(geom, seq_lens, gen, int2_pages=int2)
    rope = rope_case(geom.num_kv_heads, geom.head_dim, max(seq_lens), gen, live=3)
    q = torch.randn(len(seq_lens), geom.num_kv_heads * 4, geom.head_dim, generator=gen).to(DEV)
    for window in (45, 150):
        want = ref.decode_reference(pool, 0, q, batch, rot, None, rope=rope, window=window)
        out = int2_decode(q, pool, 0, batch, rot, rope=rope, num_splits=2, window=window)
        assert rel_err(out, want) < 1e-2, window


def test_bf16_decode_sliding_window():
    """The BF16 paged decode with a window: its splits cover only the window (from the page of its first token)."""
    from oscar_kv.kernels.bf16_decode import bf16_decode

    geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=64, group_size=64, page_size=16, sink_size=0,
                        recent_size=16)
    gen = torch.Generator().manual_seed(62)
    seq_lens = [1, 30, 100, 333, 0] if not GPU else [1, 30, 100, 333, 0, 32768 + 5]
    batch, _, nw = plan_batch(geom, seq_lens, [0] * len(seq_lens), generator=gen)
    pool = PagedKVPool.allocate(geom, 1, nw, device=DEV)
    pool.k_win.normal_()
    pool.v_win.normal_()
    batch = batch.to(DEV)
    rot = random_orthogonal(2, 64, gen).to(DEV)
    q = torch.randn(len(seq_lens), 8, 64, generator=gen).to(DEV, torch.bfloat16)
    for window in (37, 1 << 20):
        want = ref.decode_reference(pool, 0, q, batch, rot, None, window=window)
        out = torch.full_like(q, float("nan"))
        bf16_decode(q, pool.k_win[0], pool.v_win[0], batch.block_table, batch.seq_lens, rot, page_size=16,
                    window=window, out=out)
        assert not out.isnan().any()
        assert rel_err(out, want) < 1e-2, window
    assert rel_err(ref.decode_reference(pool, 0, q, batch, rot, None), want) < 1e-6  # the long window: full


@pytest.mark.skipif(not GPU, reason="the CUDA INT2 kernel runs on a GPU only")
@pytest.mark.parametrize("d,page_size,widths", [(128, 16, (2, 2)), (128, 32, (3, 2)), (64, 16, (8, 2)),
                                                (128, 16, (8, 2)), (128, 32, (2, 3)), (64, 16, (4, 4)),
                                                (128, 16, (5, 2))], ids=width_ids)
def test_cuda_decode_sliding_window(d, page_size, widths):
    """The CUDA kernel's sliding-window variant (int2_decode.cu, SLIDING) against the float64 reference and Triton:
    windows of 1 token to longer than every sequence, their first token in the sink, the INT2 history (32K and 128K
    sequences: the splits cover only the window's pages) or the recent window, a prefix hit with a short recent
    window, GQA 4 and 16 (two query groups), one split per sequence and many; keys and values at 2 to 8 bits; the
    engine's choice takes CUDA for windowed layers."""
    from oscar_kv.kernels.decode import int2_decode, int2_kernel_choice

    geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=d, group_size=d, page_size=page_size, sink_size=64,
                        recent_size=256, k_bits=widths[:1], v_bits=widths[1:], layer_windows=(1024,))
    gen = torch.Generator().manual_seed(71 + d + page_size + widths[0] + 10 * (widths[1] - 2))
    seq_lens = [0, 7, 64 + 256 + 3 * page_size + 5, 5003, 32768 + 77, 131072 + 77, 9000]
    steady = [geom.int2_pages_for(n) for n in seq_lens]
    steady[-1] = (9000 - 64 - 40) // page_size  # prefix hit: more INT2 pages, a 40-odd-token recent window
    pool, batch, rot = build_pool(geom, seq_lens, gen, int2_pages=steady)
    for gqa in (4, 16):
        assert int2_kernel_choice(torch.device(DEV), geom, gqa, widths=widths) == ("cuda", None)
        q = torch.randn(len(seq_lens), 2 * gqa, d, generator=gen).to(DEV, torch.bfloat16)
        for window in (1, 20, 300, 1000, 4096 + 7, 1 << 20):
            want = ref.decode_reference(pool, 0, q, batch, rot, None, window=window)
            out = torch.full_like(q, float("nan"))
            int2_decode(q, pool, 0, batch, rot, backend="cuda", window=window, out=out)
            assert not out.isnan().any(), (gqa, window)
            assert out[0].abs().max() == 0  # empty sequence
            assert rel_err(out, want) < 1e-2, (gqa, window)
            for b in range(1, len(seq_lens)):
                assert rel_err(out[b], want[b]) < 1e-2, (gqa, window, b)
            for plan in cuda_plans(d):
                o2 = int2_decode(q, pool, 0, batch, rot, backend="cuda", window=window, **plan)
                assert rel_err(o2, want) < 1e-2, (gqa, window, plan)
            tri = int2_decode(q, pool, 0, batch, rot, backend="triton", window=window)
            assert rel_err(out, tri) < 5e-3, (gqa, window)  # two approximations of the reference
        assert rel_err(ref.decode_reference(pool, 0, q, batch, rot, None), want) < 1e-6  # the long window: full


@pytest.mark.skipif(not GPU, reason="the CUDA INT2 kernel runs on a GPU only")
@pytest.mark.parametrize("d,rotary,widths", [(128, None, (2, 2)), (128, "interleaved", (2, 2)), (64, "partial", (2, 2)),
                                             (128, None, (4, 3)), (64, "partial", (3, 4))], ids=width_ids)
def test_cuda_decode_sliding_window_with_the_position_aware_key_offset(d, rotary, widths):
    """Windows with keys centered per position in the CUDA kernel: the term is added at each kept token's position,
    the masked ones drop out; GQA 16 (GLM-4's, interleaved partial RoPE) beside GQA 4; INT2 and wider codes."""
    from oscar_kv.kernels.decode import int2_decode

    geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=d, group_size=d, page_size=16, sink_size=64,
                        recent_size=256, k_bits=widths[:1], v_bits=widths[1:])
    gen = torch.Generator().manual_seed(81 + d + (0 if widths == (2, 2) else 10 * widths[0] + widths[1]))
    seq_lens = [7, 64 + 100, 64 + 256 + 16 * 5 + 3, 20000 + 16 * 3 + 5, 131072 + 77]
    pool, batch, rot = build_pool(geom, seq_lens, gen)
    rotary_dim = {None: None, "partial": 3 * d // 4, "interleaved": d // 2}[rotary]
    rope = rope_case(2, d, max(seq_lens), gen, live=16, scale=300.0, rotary_dim=rotary_dim,
                     interleaved=rotary == "interleaved")
    for gqa in (4, 16):
        q = torch.randn(len(seq_lens), 2 * gqa, d, generator=gen).to(DEV, torch.bfloat16)
        for window in (45, 1000, 8192 + 3):
            want = ref.decode_reference(pool, 0, q, batch, rot, None, rope=rope, window=window)
            out = torch.full_like(q, float("nan"))
            int2_decode(q, pool, 0, batch, rot, rope=rope, backend="cuda", window=window, out=out,
                        max_int2_pages=int(batch.int2_pages.max()) + 999, max_seq_len=max(seq_lens))
            assert not out.isnan().any()
            assert rel_err(out, want) < 1e-2, (gqa, window)
            o2 = int2_decode(q, pool, 0, batch, rot, rope=rope, backend="cuda", window=window, cuda_split_target=16)
            assert rel_err(o2, want) < 1e-2, (gqa, window)


def test_query_groups_split_large_gqa_into_equal_groups_of_at_most_8():
    """int2_cuda.query_groups (host side): GLM-4's 16 query heads per KV head run as 2 CTAs of 8; 12 as 2 of 6; a
    prime above 8 as groups of 1; up to 8 as one."""
    from oscar_kv.kernels import int2_cuda

    assert [int2_cuda.query_groups(g) for g in (1, 3, 8, 9, 10, 12, 16, 24, 11)] == [1, 1, 1, 3, 2, 2, 2, 3, 11]
    for gqa in range(1, int2_cuda.MAX_GQA + 1):
        groups = int2_cuda.query_groups(gqa)
        assert gqa % groups == 0 and gqa // groups <= int2_cuda.MAX_GQA_PER_CTA


def test_layers_at_other_widths_take_the_triton_kernel(monkeypatch):
    """The CUDA kernel reads keys at 2, 3, 4, 5 or 8 bits and values at 2, 3 or 4 (int2_cuda.WIDTHS: calibrate's K4V3,
    K3V3, K8V3 layers among them): a layer whose values are stored at 8 bits takes Triton, and says why, also under
    OSCAR_KV_INT2_KERNEL=cuda (the model's other layers keep CUDA); a call that itself asks for CUDA raises.
    int2_decode decides by its layer's widths (PoolGeometry.layer_widths)."""
    from oscar_kv.kernels import decode, int2_cuda

    k_bits, v_bits = (2, 3, 4, 8, 4, 3, 8, 2, 2), (2, 2, 2, 2, 3, 3, 3, 4, 8)
    geom = PoolGeometry(num_layers=9, num_kv_heads=8, head_dim=128, group_size=128, k_bits=k_bits, v_bits=v_bits,
                        layer_windows=(None, None, None, 1024, 1024, None, 1024, None, 1024))
    asked = []
    monkeypatch.setattr(int2_cuda, "unsupported", lambda *args: asked.append(args[5]))  # None: as on an H100
    monkeypatch.setattr(decode, "INTERPRET", False)
    cuda = torch.device("cuda")
    choices = [decode.int2_kernel_choice(cuda, geom, 4, widths=geom.layer_widths(i)) for i in range(9)]
    assert choices == [("cuda", None)] * 8 + [("triton", int2_cuda.width_error(2, 8))]
    assert asked[:8] == list(zip(k_bits, v_bits))[:8]  # each layer's variant is what gets compiled (and may fail)
    assert "K2V8" in choices[8][1] and "values at 2, 3 or 4" in choices[8][1]
    assert set(int2_cuda.WIDTHS) == {(k, v) for k in (2, 3, 4, 5, 8) for v in (2, 3, 4)}
    for widths in int2_cuda.WIDTHS:
        assert int2_cuda.width_error(*widths) is None
    assert "K3V8" in int2_cuda.width_error(3, 8) and "K16V2" in int2_cuda.width_error(16, 2)
    assert decode.int2_kernel_choice(cuda, geom, 4, widths=(2, 2)) == ("cuda", None)  # the default: K2V2
    with pytest.raises(ValueError, match="cannot run this call: layer stored at K3V8"):
        decode.int2_kernel_choice(cuda, geom, 4, backend="cuda", widths=(3, 8))
    monkeypatch.setenv(decode.INT2_KERNEL_ENV, "cuda")
    assert decode.int2_kernel_choice(cuda, geom, 4, widths=(2, 8))[0] == "triton"
    assert decode._use_cuda(None, cuda, geom, 4, None, widths=(2, 2))
    assert decode._use_cuda(None, cuda, geom, 4, None, widths=(4, 2))
    assert decode._use_cuda(None, cuda, geom, 4, None, widths=(4, 4))
    assert decode._use_cuda(None, cuda, geom, 4, None, widths=(8, 3))
    assert not decode._use_cuda(None, cuda, geom, 4, None, widths=(4, 8))


def _check_query_dtypes_and_shared_rotation(pool, batch, rot, q, against_triton=False):
    """The CUDA kernel with float32 / float16 queries, one rotation shared by the heads or none (keys stored
    unrotated), against the float64 reference (and Triton)."""
    from oscar_kv.kernels.decode import int2_decode

    q = q.to(DEV)
    for r in (rot[:1], None):
        want = ref.decode_reference(pool, 0, q, batch, r, None)
        for dtype in (torch.float32, torch.float16):
            out = int2_decode(q.to(dtype), pool, 0, batch, r, backend="cuda")
            assert out.dtype == dtype
            assert rel_err(out, want) < 1e-2, (dtype, r is None)
            if against_triton:
                assert rel_err(out, int2_decode(q.to(dtype), pool, 0, batch, r, backend="triton")) < 3e-3


@pytest.mark.skipif(not GPU, reason="the CUDA INT2 kernel runs on a GPU only")
@pytest.mark.parametrize("d,page_size", [(128, 16), (128, 32), (64, 16), (64, 32)])
def test_cuda_int2_decode_matches_reference_and_triton(d, page_size):
    """The one-launch CUDA decode (int2_cuda.py: rotation, window, history, merge), head dim 128 and 64, against the float64 reference
    and the all-Triton path: GQA 1 / 3 / 4 / 8 / 12 / 16 (two query groups above 8), a 128K sequence among short ones (empty, sink-only, window-only),
    a prefix hit with extra INT2 pages (short recent window), histories that end mid-step (16-token tails),
    shuffled pages, NaN-poisoned output, per-head / shared / no rotation, float32 / bfloat16 / float16 queries,
    split counts from 1 to many per sequence, CTAs without INT2 tokens, and repeated calls (the merge counters
    must return to zero)."""
    from oscar_kv.kernels import int2_cuda
    from oscar_kv.kernels.common import LOG2E
    from oscar_kv.kernels.decode import int2_decode

    geom = PoolGeometry(num_layers=1, num_kv_heads=4, head_dim=d, group_size=d, page_size=page_size,
                        sink_size=64, recent_size=256)
    gen = torch.Generator().manual_seed(31 + page_size + d)
    seq_lens = [0, 7, 64, 64 + 256 + 3 * page_size + 5, 1000, 5003, 131072 + 77, 9000]
    steady = [geom.int2_pages_for(n) for n in seq_lens]
    steady[-1] = (9000 - 64 - 40) // page_size  # prefix hit: more INT2 pages, a 40-odd-token recent window
    pool, batch, rot = build_pool(geom, seq_lens, gen, int2_pages=steady)
    for gqa in (1, 3, 4, 8, 12, 16):  # above 8: query groups of 6 and 8
        q = torch.randn(len(seq_lens), 4 * gqa, d, generator=gen).to(DEV, torch.bfloat16)
        want = ref.decode_reference(pool, 0, q, batch, rot, None)
        out = torch.full_like(q, float("nan"))
        int2_decode(q, pool, 0, batch, rot, backend="cuda", out=out)
        assert not out.isnan().any(), gqa
        assert out[0].abs().max() == 0  # empty sequence
        assert rel_err(out, want) < 1e-2, gqa
        tri = int2_decode(q, pool, 0, batch, rot, backend="triton")
        # two approximations of the reference, each ~2^-9 from it (bfloat16 outputs; at D = 128, P = 32, GQA 1 the
        # CUDA and Triton kernels measured 0.0027 and 0.0024 from the reference and 0.0044 from each other)
        assert rel_err(out, tri) < 5e-3, gqa
        for plan in cuda_plans(d):  # one long split per sequence, and many short ones
            o2 = int2_decode(q, pool, 0, batch, rot, backend="cuda", **plan)
            assert rel_err(o2, want) < 1e-2, (gqa, plan)
        again = int2_decode(q, pool, 0, batch, rot, backend="cuda")
        assert torch.equal(again, int2_decode(q, pool, 0, batch, rot, backend="cuda")), gqa
        # more CTAs than the history needs: some with no INT2 tokens (window sub-tiles and the merge still run)
        _, chunk = int2_cuda.split_plan(int(batch.int2_pages.max()) * page_size, 1, page_size, 12, 1)
        o3 = torch.full_like(q, float("nan"))
        int2_cuda.decode(q, rot, pool.layer(0), geom, batch, o3, 40, chunk, LOG2E / d ** 0.5)
        assert rel_err(o3, want) < 1e-2, gqa
    _check_query_dtypes_and_shared_rotation(pool, batch, rot, torch.randn(len(seq_lens), 16, d, generator=gen),
                                            against_triton=True)


@pytest.mark.skipif(not GPU, reason="the CUDA INT2 kernel runs on a GPU only")
@pytest.mark.parametrize("d,sink,live,scale,rotary", [(128, 64, 32, 20.0, None), (128, 48, 3, 900.0, None),
                                                        (128, 64, 12, 300.0, None), (64, 64, 32, 20.0, None),
                                                        (64, 48, 8, 900.0, None), (128, 64, 32, 20.0, "partial"),
                                                        (128, 48, 3, 900.0, "interleaved"),
                                                        (64, 48, 8, 300.0, "partial")])
def test_cuda_int2_decode_adds_the_position_aware_key_offset(d, sink, live, scale, rotary):
    """Per-position key centering in the one-launch CUDA kernel (rope_terms): against the float32 reference and
    the Triton kernel, for 8 .. 32 visited pairs, |mu_pre| up to 900 (a k_proj bias: the term is hundreds of
    logit units, so float16 operands alone would not do), a sink that ends mid 32-token step (48), window-only
    and long sequences, GQA 4 / 8, under a page bound far past the history (CUDA graphs' buckets).  ``rotary``:
    partial rotary, RoPE on the first 3/4 of each head in rotate-half pairs (Phi-4-mini) or on the first half
    in interleaved pairs (GLM-4); the prologue reads each pair's channels by the layout (pair_lo / pair_hi)."""
    from oscar_kv.kernels.decode import int2_decode

    geom = PoolGeometry(num_layers=1, num_kv_heads=4, head_dim=d, group_size=d, page_size=16,
                        sink_size=sink, recent_size=256)
    gen = torch.Generator().manual_seed(41 + live + d)
    seq_lens = [7, sink + 100, sink + 256 + 16 * 5 + 3, 20000 + 16 * 3 + 5, 131072 + 77]
    pool, batch, rot = build_pool(geom, seq_lens, gen)
    rotary_dim = {None: None, "partial": 3 * d // 4, "interleaved": d // 2}[rotary]
    rope = rope_case(4, d, max(seq_lens), gen, live=live, scale=scale, rotary_dim=rotary_dim,
                     interleaved=rotary == "interleaved")
    for gqa in (3, 8) if d == 64 else (4, 8):
        q = torch.randn(len(seq_lens), 4 * gqa, d, generator=gen).to(DEV, torch.bfloat16)
        want = ref.decode_reference(pool, 0, q, batch, rot, None, rope=rope)
        out = torch.full_like(q, float("nan"))
        int2_decode(q, pool, 0, batch, rot, rope=rope, backend="cuda", out=out,
                    max_int2_pages=int(batch.int2_pages.max()) + 999, max_seq_len=max(seq_lens))
        assert not out.isnan().any()
        assert rel_err(out, want) < 1e-2, gqa
        tri = int2_decode(q, pool, 0, batch, rot, rope=rope, backend="triton")
        assert rel_err(out, tri) < 5e-3, gqa
        for plan in cuda_plans(d, rope):
            o2 = int2_decode(q, pool, 0, batch, rot, rope=rope, backend="cuda", **plan)
            assert rel_err(o2, want) < 1e-2, (gqa, plan)
    assert rel_err(ref.decode_reference(pool, 0, q, batch, rot, None), want) > 0.1  # the term matters


@pytest.mark.skipif(not GPU, reason="the CUDA INT2 kernel runs on a GPU only")
@pytest.mark.parametrize("d,widths", [(d, w) for d in (128, 64) for w in ((2, 2), (3, 2), (4, 2), (5, 2), (8, 2))] + [
    (128, (2, 3)), (128, (4, 3)), (128, (8, 3)), (128, (3, 4)), (128, (5, 3)),  # values at 3 and 4 bits (VBITS)
    (64, (2, 3)), (64, (3, 3)), (64, (4, 4)), (64, (8, 4)), (64, (5, 4))], ids=width_ids)
def test_cuda_decode_reads_3_and_4_bit_keys(d, widths):
    """The CUDA kernel's key and value variants (int2_decode.cu, KBITS and VBITS: the INT3 high-bit plane, the INT4
    upper bytes and the INT8 key bytes turned into the INT2 variant's MMA operands) beside INT2, head dim 128 and 64,
    against the float64 reference and the Triton kernel: GQA 1 / 3 / 8, a 128K sequence among short ones (empty,
    sink-only, window-only), a prefix hit with extra INT2 pages (short recent window), a history that ends mid-step,
    shuffled pages, split counts from 1 to many, CTAs without INT2 tokens; key and value rows of D * bits / 8 bytes
    (their own page strides).  The engine's choice takes CUDA for these layers."""
    from oscar_kv.kernels import int2_cuda
    from oscar_kv.kernels.common import LOG2E
    from oscar_kv.kernels.decode import int2_decode, int2_kernel_choice

    geom = PoolGeometry(num_layers=1, num_kv_heads=4, head_dim=d, group_size=d, page_size=16, sink_size=64,
                        recent_size=256, k_bits=widths[:1], v_bits=widths[1:])
    gen = torch.Generator().manual_seed(51 + d + widths[0] + 10 * (widths[1] - 2))
    seq_lens = [0, 7, 64, 64 + 256 + 3 * 16 + 5, 5003, 131072 + 77, 9000]
    steady = [geom.int2_pages_for(n) for n in seq_lens]
    steady[-1] = (9000 - 64 - 40) // 16  # prefix hit: more INT2 pages, a 40-odd-token recent window
    pool, batch, rot = build_pool(geom, seq_lens, gen, int2_pages=steady)
    assert pool.k_codes.shape[-1] == d * widths[0] // 8 and pool.v_codes.shape[-1] == d * widths[1] // 8
    for gqa in (1, 3, 8):
        assert int2_kernel_choice(torch.device(DEV), geom, gqa, widths=widths) == ("cuda", None)
        q = torch.randn(len(seq_lens), 4 * gqa, d, generator=gen).to(DEV, torch.bfloat16)
        want = ref.decode_reference(pool, 0, q, batch, rot, None)
        out = torch.full_like(q, float("nan"))
        int2_decode(q, pool, 0, batch, rot, backend="cuda", out=out)
        assert not out.isnan().any(), gqa
        assert out[0].abs().max() == 0  # empty sequence
        assert rel_err(out, want) < 1e-2, gqa
        for plan in cuda_plans(d):  # one long split per sequence, and many short ones
            o2 = int2_decode(q, pool, 0, batch, rot, backend="cuda", **plan)
            assert rel_err(o2, want) < 1e-2, (gqa, plan)
    tri = int2_decode(q, pool, 0, batch, rot, backend="triton")
    assert rel_err(out, tri) < 3e-3
    _, chunk = int2_cuda.split_plan(int(batch.int2_pages.max()) * 16, 1, 16, 12, 1)
    o3 = torch.full_like(q, float("nan"))  # more CTAs than the history needs (widths read off the code rows)
    int2_cuda.decode(q, rot, pool.layer(0), geom, batch, o3, 40, chunk, LOG2E / d ** 0.5)
    assert rel_err(o3, want) < 1e-2
    q = torch.randn(len(seq_lens), 8, d, generator=gen).to(DEV)
    want = ref.decode_reference(pool, 0, q, batch, None, None)  # no rotation, float32 queries
    assert rel_err(int2_decode(q, pool, 0, batch, None, backend="cuda"), want) < 1e-2


@pytest.mark.skipif(not GPU, reason="the CUDA INT2 kernel runs on a GPU only")
@pytest.mark.parametrize("d,sink,live,scale,widths", [
    (*case, w) for w in ((3, 2), (4, 2), (5, 2), (8, 2))
    for case in ((128, 64, 32, 20.0), (128, 48, 3, 900.0), (64, 48, 12, 300.0))
] + [(128, 64, 32, 20.0, (2, 4)), (128, 48, 3, 900.0, (8, 3)), (128, 64, 12, 300.0, (4, 3)),
     (64, 48, 12, 300.0, (3, 3)), (128, 64, 12, 300.0, (5, 3)),
     (64, 48, 8, 300.0, (4, 2)), (64, 48, 8, 300.0, (5, 2))], ids=width_ids)  # head dim 64, 8 pairs: 3 CTAs per SM
def test_cuda_decode_of_3_and_4_bit_keys_adds_the_position_aware_key_offset(d, sink, live, scale, widths):
    """Per-position key centering (rope_terms) in the 3- and 4-bit key and value variants: 8 .. 32 visited pairs,
    |mu_pre| up to 900, a sink that ends mid-step, window-only and long sequences, GQA 3 / 8, a page bound past the
    history."""
    from oscar_kv.kernels.decode import int2_decode

    geom = PoolGeometry(num_layers=1, num_kv_heads=4, head_dim=d, group_size=d, page_size=16, sink_size=sink,
                        recent_size=256, k_bits=widths[:1], v_bits=widths[1:])
    gen = torch.Generator().manual_seed(61 + live + d + widths[0] + 10 * (widths[1] - 2))
    seq_lens = [7, sink + 100, sink + 256 + 16 * 5 + 3, 20000 + 16 * 3 + 5, 131072 + 77]
    pool, batch, rot = build_pool(geom, seq_lens, gen)
    rope = rope_case(4, d, max(seq_lens), gen, live=live, scale=scale)
    for gqa in (3, 8):
        q = torch.randn(len(seq_lens), 4 * gqa, d, generator=gen).to(DEV, torch.bfloat16)
        want = ref.decode_reference(pool, 0, q, batch, rot, None, rope=rope)
        out = torch.full_like(q, float("nan"))
        int2_decode(q, pool, 0, batch, rot, rope=rope, backend="cuda", out=out,
                    max_int2_pages=int(batch.int2_pages.max()) + 999, max_seq_len=max(seq_lens))
        assert not out.isnan().any()
        assert rel_err(out, want) < 1e-2, gqa
        o2 = int2_decode(q, pool, 0, batch, rot, rope=rope, backend="cuda", cuda_split_target=1)
        assert rel_err(o2, want) < 1e-2, gqa
    tri = int2_decode(q, pool, 0, batch, rot, rope=rope, backend="triton")
    assert rel_err(out, tri) < 5e-3
    assert rel_err(ref.decode_reference(pool, 0, q, batch, rot, None), want) > 0.1  # the term matters


@pytest.mark.skipif(not GPU, reason="the CUDA INT2 kernel runs on a GPU only")
@pytest.mark.parametrize("group,widths,live,window", [
    (128, (2, 2), None, None), (256, (2, 2), None, None),  # Gemma 3's layouts: two metadata groups per head, or one
    (128, (3, 2), None, None), (128, (4, 2), None, None), (128, (8, 2), None, None),
    (128, (2, 2), 16, None), (256, (4, 2), 32, None),  # per-position key centering (RoPE term)
    (128, (2, 2), None, 1024), (128, (2, 2), 8, 1024), (128, (3, 2), 32, 512),  # sliding windows (5 of 6 layers)
    # values at 3 and 4 bits (Gemma 3 270M's calibration default: K4V3 x 10, K8V3 x 5, K3V3 x 1, ...)
    (128, (4, 3), None, None), (128, (8, 3), 8, 512), (256, (3, 4), None, 1024), (128, (2, 4), 32, None),
    (128, (5, 2), None, None), (128, (5, 3), 16, 512), (256, (5, 2), 8, None),  # 5-bit keys (Gemma's layers 5, 11)
], ids=width_ids)
def test_cuda_decode_head_dim_256(group, widths, live, window):
    """Head dim 256 in the CUDA kernel (int2_decode.cu, D = 256: NG = 2 metadata groups at G = 128, two logit and
    value accumulators per group; 2 CTAs per SM; 16-token steps where 32 would spill) against the float64 reference
    and the Triton kernel: keys at 2, 3, 4 or 8 bits, values at 2, 3 or 4, the RoPE term over 8 .. 32 pairs, sliding
    windows, GQA 1 / 4 / 8 / 16 (two query groups), a 32K sequence among short ones (empty, sink-only, window-only), a
    prefix hit with a short recent window, split counts from 1 to many, CTAs without INT2 tokens, per-head / shared /
    no rotation, float32 / float16 queries.  The engine's choice takes CUDA for these layers."""
    from oscar_kv.kernels import int2_cuda
    from oscar_kv.kernels.common import LOG2E
    from oscar_kv.kernels.decode import int2_decode, int2_kernel_choice

    d = 256
    geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=d, group_size=group, page_size=16, sink_size=64,
                        recent_size=256, k_bits=widths[:1], v_bits=widths[1:],
                        layer_windows=(window,) if window else None)
    gen = torch.Generator().manual_seed(91 + group + widths[0] + 10 * (widths[1] - 2) + (live or 0) + (window or 0))
    seq_lens = [0, 7, 64, 64 + 256 + 3 * 16 + 5, 5003, 32768 + 77, 9000]
    steady = [geom.int2_pages_for(n) for n in seq_lens]
    steady[-1] = (9000 - 64 - 40) // 16  # prefix hit: more INT2 pages, a 40-odd-token recent window
    pool, batch, rot = build_pool(geom, seq_lens, gen, int2_pages=steady)
    assert pool.k_scale.shape[-1] == pool.k_zero.shape[-1] == d // group
    rope = None if live is None else rope_case(2, d, max(seq_lens), gen, live=live, scale=300.0)
    for gqa in (1, 4, 8, 16) if live is None and window is None else (4, 16):
        assert int2_kernel_choice(torch.device(DEV), geom, gqa, rope, widths=widths) == ("cuda", None), gqa
        q = torch.randn(len(seq_lens), 2 * gqa, d, generator=gen).to(DEV, torch.bfloat16)
        want = ref.decode_reference(pool, 0, q, batch, rot, None, rope=rope, window=window)
        out = torch.full_like(q, float("nan"))
        int2_decode(q, pool, 0, batch, rot, rope=rope, backend="cuda", window=window, out=out,
                    max_int2_pages=int(batch.int2_pages.max()) + 999, max_seq_len=max(seq_lens))
        assert not out.isnan().any(), gqa
        assert out[0].abs().max() == 0  # empty sequence
        assert rel_err(out, want) < 1e-2, gqa
        for b in range(1, len(seq_lens)):
            assert rel_err(out[b], want[b]) < 1e-2, (gqa, b)
        tri = int2_decode(q, pool, 0, batch, rot, rope=rope, backend="triton", window=window)
        assert rel_err(out, tri) < 5e-3, gqa  # two approximations of the reference
        for target in (1, 16):  # one long split per sequence, and many short ones
            o2 = int2_decode(q, pool, 0, batch, rot, rope=rope, backend="cuda", window=window,
                             cuda_split_target=target)
            assert rel_err(o2, want) < 1e-2, (gqa, target)
        again = int2_decode(q, pool, 0, batch, rot, rope=rope, backend="cuda", window=window)
        assert torch.equal(again, int2_decode(q, pool, 0, batch, rot, rope=rope, backend="cuda", window=window))
    if window is None:  # more CTAs than the history needs: some with no INT2 tokens (window sub-tiles, merge)
        _, chunk = int2_cuda.split_plan(int(batch.int2_pages.max()) * 16, 1, 16, 12, 1)
        o3 = torch.full_like(q, float("nan"))
        int2_cuda.decode(q, rot, pool.layer(0), geom, batch, o3, 40, chunk, LOG2E / d ** 0.5, rope=rope)
        assert rel_err(o3, want) < 1e-2
    if live is None and window is None:
        _check_query_dtypes_and_shared_rotation(pool, batch, rot, torch.randn(len(seq_lens), 8, d, generator=gen))
    if rope is not None:
        assert rel_err(ref.decode_reference(pool, 0, q, batch, rot, None, window=window), want) > 0.1  # it matters


def test_cuda_head_dim_256_host_side(monkeypatch):
    """int2_cuda's host side at head dim 256 (runs anywhere): groups of 256 or 128 are taken and G = 64 is refused
    (Triton runs it) with the head dim and group in the reason; 2 CTAs per SM for every key width and RoPE term; the
    16-token steps at D = 256 only; the defines NG and STEP16 reach the D = 256 source only (the
    D = 64 / 128 sources stay what they were); the split plan's chunks stay whole rounds; a pool whose metadata rows
    do not hold the groups is refused before the launch."""
    from oscar_kv.kernels import int2_cuda

    assert 256 in int2_cuda.HEAD_DIMS
    for d, g, ok in ((256, 256, True), (256, 128, True), (256, 64, False), (128, 128, True), (128, 64, False),
                     (64, 64, True), (64, 32, False), (512, 512, False)):
        geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=d, group_size=g, page_size=16, sink_size=16,
                            recent_size=32)
        why = int2_cuda.shape_error(geom, 4, None)
        assert (why is None) == ok, (d, g, why)
        if not ok:
            assert f"head dim {d} / group {g}" in why
            assert why == int2_cuda.unsupported(torch.device("cuda"), geom, 4, None)  # before any device check
    geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=256, group_size=128)
    assert int2_cuda.shape_error(geom, 4, None, widths=(3, 8)) == int2_cuda.width_error(3, 8) is not None
    assert int2_cuda.shape_error(geom, 4, None, widths=(8, 3)) is None
    assert "65 query heads" in int2_cuda.shape_error(geom, 65, None)
    for kbits in int2_cuda.KEY_BITS:
        for pairs in (0, 8, 16, 32):
            for vbits in int2_cuda.VALUE_BITS:
                assert int2_cuda.min_blocks(pairs, 256, kbits, vbits=vbits) == 2
            assert int2_cuda.step16(256, kbits, pairs, False)
        assert int2_cuda.step16(256, kbits, 0, True)
        assert not int2_cuda.step16(128, kbits, 8, True) and not int2_cuda.step16(64, kbits, 0, True)
    assert int2_cuda.min_blocks(0, 128, 2) == 3 and int2_cuda.min_blocks(0, 64, 2) == 4  # unchanged
    assert int2_cuda.min_blocks(8, 128, 2) == 2 and int2_cuda.min_blocks(0, 128, 8) == 2 == int2_cuda.min_blocks(0, 128, 5)
    for vbits in (3, 4):  # values at 3 or 4 bits: 2 CTAs per SM at D = 128 (faster, E23), 3 at D = 64 (no spill)
        assert [int2_cuda.min_blocks(0, 128, k, vbits=vbits) for k in (2, 3, 4, 8)] == [2, 2, 2, 2]
        assert [int2_cuda.min_blocks(r, 128, 3, vbits=vbits) for r in (8, 16, 32)] == [2, 2, 2]
        assert [int2_cuda.min_blocks(r, 64, k, vbits=vbits) for r in (0, 16) for k in (2, 8)] == [3] * 4
    # head dim 64, the term over 8 pairs: 3 CTAs for keys wider than 2 bits (run H1), 4 for INT2 keys and elsewhere
    assert [int2_cuda.min_blocks(8, 64, k) for k in (2, 3, 4, 5, 8)] == [4, 3, 3, 3, 3]
    assert [int2_cuda.min_blocks(r, 64, 4) for r in (0, 16, 32)] == [4, 4, 4]

    sources = []
    monkeypatch.setattr(int2_cuda.torch.cuda, "_compile_kernel", lambda src, name: sources.append(src) or name,
                        raising=False)
    monkeypatch.setattr(int2_cuda.torch.cuda, "device", lambda index: __import__("contextlib").nullcontext())
    compile_ = int2_cuda._kernel.__wrapped__  # not the cached one
    compile_(0, 256, 16, 4, 4, 2, 1, 1, rope_pairs=8, kbits=2, groups=2)
    compile_(0, 256, 16, 4, 4, 2, 1, 1, kbits=2, groups=1)
    compile_(0, 128, 16, 4, 4, 3, 1, 1, kbits=2)
    compile_(0, 256, 16, 4, 4, 2, 1, 1, kbits=8, groups=2, vbits=3)
    compile_(0, 64, 16, 4, 4, 3, 1, 1, kbits=2, vbits=4)
    head = [src[: src.index("//")] for src in sources]
    assert "#define D 256\n" in head[0] and "#define NG 2\n" in head[0] and "#define STEP16 1\n" in head[0]
    assert "#define NG 1\n" in head[1] and "#define STEP16 1\n" in head[1]
    assert "#define D 128\n" in head[2] and "#define NG" not in head[2] and "STEP16" not in head[2]
    assert all("VBITS" not in h for h in head[:3])  # the INT2-value sources stay what they were
    assert "#define KBITS 8\n" in head[3] and "#define VBITS 3\n" in head[3] and "#define NG 2\n" in head[3]
    assert "#define D 64\n" in head[4] and "#define VBITS 4\n" in head[4] and "#define KBITS 2\n" in head[4]

    for tokens in (16, 4096 + 48, 32768 + 16):  # 16-token steps: the chunks are whole rounds of them too
        splits, chunk = int2_cuda.split_plan(tokens, 2, 16, 132, int2_cuda.min_blocks(0, 256))
        assert chunk % int2_cuda.TOKENS_PER_ROUND == 0 and chunk % (16 * int2_cuda.NUM_WARPS) == 0
        assert (splits - 1) * chunk < tokens <= splits * chunk

    geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=256, group_size=64, page_size=16, sink_size=16,
                        recent_size=32)
    pool, batch, rot = build_pool(geom, [100], torch.Generator().manual_seed(12))
    q = torch.randn(1, 4, 256)
    with pytest.raises(ValueError, match="group 64"):
        int2_cuda.decode(q, rot, pool.layer(0), geom, batch, torch.empty_like(q), 1, 128, 0.1)
    geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=256, group_size=128, page_size=16, sink_size=16,
                        recent_size=32)
    layer = pool.layer(0)  # G = 64 rows: 4 scales and zero points per token where the geometry says 2
    with pytest.raises(ValueError, match="zero-point rows of 4"):
        int2_cuda.decode(q, rot, layer, geom, batch, torch.empty_like(q), 1, 128, 0.1)


def test_cuda_decode_checks_the_layer_widths_before_launching():
    """int2_cuda.decode (runs anywhere: the checks come before the launch) reads the widths off the code rows or
    takes the layer's: values at 8 bits are refused, and so are widths that do not match the rows."""
    from oscar_kv.kernels import int2_cuda

    for widths, error in (((3, 8), "K3V8"), ((2, 8), "K2V8")):
        geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=64, group_size=64, page_size=16, sink_size=16,
                            recent_size=32, k_bits=widths[:1], v_bits=widths[1:])
        pool, batch, rot = build_pool(geom, [100], torch.Generator().manual_seed(8))
        q = torch.randn(1, 4, 64)
        with pytest.raises(ValueError, match=error):
            int2_cuda.decode(q, rot, pool.layer(0), geom, batch, torch.empty_like(q), 1, 128, 0.1)
        assert error in int2_cuda.unsupported(torch.device("cuda"), geom, 2, None, torch.bfloat16, widths)
    geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=64, group_size=64, page_size=16, sink_size=16,
                        recent_size=32, k_bits=(3,), v_bits=(2,))
    pool, batch, rot = build_pool(geom, [100], torch.Generator().manual_seed(9))
    with pytest.raises(ValueError, match="not K4V2"):
        int2_cuda.decode(q, rot, pool.layer(0), geom, batch, torch.empty_like(q), 1, 128, 0.1, widths=(4, 2))
    with pytest.raises(ValueError, match="not K3V3"):
        int2_cuda.decode(q, rot, pool.layer(0), geom, batch, torch.empty_like(q), 1, 128, 0.1, widths=(3, 3))


@pytest.mark.skipif(not GPU, reason="the CUDA INT2 kernel runs on a GPU only")
def test_cuda_int2_backend_refuses_what_it_does_not_support():
    from oscar_kv.kernels.decode import int2_decode

    geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=128, group_size=64, page_size=16,
                        sink_size=16, recent_size=32)
    pool, batch, rot = build_pool(geom, [500], torch.Generator().manual_seed(2))
    q = torch.randn(1, 8, 128, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group 64"):
        int2_decode(q, pool, 0, batch, rot, backend="cuda")
    int2_decode(q, pool, 0, batch, rot)  # auto falls back to Triton


def test_cuda_split_plan_covers_the_history_in_whole_steps():
    """int2_cuda.split_plan (host side, runs anywhere): chunks of whole 32-token steps per warp, at most
    MAX_PAGES pages, covering every token, and no more CTAs than one wave when the history allows."""
    from oscar_kv.kernels import int2_cuda

    for tokens in (16, 512, 4096 + 48, 131072 - 320, 1 << 20, 1 << 23):
        for pairs in (1, 8, 64, 256):
            splits, chunk = int2_cuda.split_plan(tokens, pairs, 16, 132, 3)
            assert chunk % int2_cuda.TOKENS_PER_ROUND == 0
            assert chunk <= int2_cuda.MAX_PAGES * 16
            assert (splits - 1) * chunk < tokens <= splits * chunk
            if tokens <= int2_cuda.MAX_PAGES * 16:
                assert splits * pairs <= max(pairs, 3 * 132)
                # the merge is weighed: no chunk shorter than sqrt(MERGE_BALANCE_TOKENS x tokens) unless one split
                assert splits == 1 or chunk ** 2 >= int2_cuda.MERGE_BALANCE_TOKENS * tokens
    assert int2_cuda.split_plan(0, 8, 16, 132, 3) == (1, int2_cuda.TOKENS_PER_ROUND)
    # batch 1 at 32K over 4 (sequence, KV head) pairs: ~30 splits of ~1K tokens, not one wave of 85 (E23: 24.9 us
    # against 29.8); head dim 256 keeps one wave
    assert int2_cuda.split_plan(32768 - 320, 4, 16, 132, 3) == (29, 1152)
    assert int2_cuda.split_plan(32768 - 320, 4, 16, 132, 2, head_dim=256) == (64, 512)


def test_cuda_cta_plan_takes_8_warps_for_short_chunks():
    """int2_cuda.cta_plan (host side, runs anywhere): CTAs of WIDE_WARPS warps where the 4-warp plan's chunks are at
    most WIDE_MAX_CHUNK tokens and the variant has them, chunks of whole 32-token steps for every warp and at most
    WIDE_MAX_PAGES pages; the 4-warp plan otherwise.  decode.int2_decode refuses 8 warps where none were built."""
    from oscar_kv.kernels import int2_cuda

    w = int2_cuda.WIDE_WARPS
    # GLM-4 at 32K batch 1 (2 KV heads x 2 query groups): 4-warp chunks of 1152 tokens -> 8 warps, one CTA per SM
    warps, splits, chunk = int2_cuda.cta_plan(32768 - 320, 4, 16, 132, 2, 128, wide=True)
    assert warps == w and chunk % (32 * w) == 0 and splits * 4 <= 132 and (splits - 1) * chunk < 32768 - 320
    assert int2_cuda.cta_plan(32768 - 320, 4, 16, 132, 2, 128, wide=False) == (4, 29, 1152)
    # Qwen3-8B at 32K batch 8 (64 pairs): 4-warp chunks of 8192 tokens stay at 4 warps
    assert int2_cuda.cta_plan(32768 - 320, 64, 16, 132, 2, 128, wide=True)[0] == int2_cuda.NUM_WARPS
    for tokens in (16, 512, 3840, 32768 - 320, 1 << 20):
        for pairs in (1, 4, 8, 32, 256):
            warps, splits, chunk = int2_cuda.cta_plan(tokens, pairs, 16, 132, 2, 128, wide=True)
            assert chunk % (32 * warps) == 0 and chunk <= int2_cuda.max_pages(warps) * 16
            assert (splits - 1) * chunk < tokens <= splits * chunk
            assert (warps == w) == (int2_cuda.split_plan(tokens, pairs, 16, 132, 2)[1] <= int2_cuda.WIDE_MAX_CHUNK)
    assert int2_cuda.wide_error(128, 8) is None and int2_cuda.wide_error(128, 0) is None
    for why in (int2_cuda.wide_error(64, 0), int2_cuda.wide_error(256, 0), int2_cuda.wide_error(128, 16),
                int2_cuda.wide_error(128, 0, split=object())):
        assert why is not None and "8 warps" in why


def test_cuda_decode_compiles_both_cta_shapes_at_first_use(monkeypatch):
    """int2_cuda.decode (host side, runs anywhere: compiles and launches recorded) asks for the variant's other CTA
    shape too where it has 8-warp CTAs, so the engine's warm-up, which plans on short histories, leaves no compile
    for a long or batched request; where it has none, only the 4-warp variant."""
    from oscar_kv.kernels import int2_cuda

    asked, launched = [], []
    monkeypatch.setattr(int2_cuda, "_kernel", lambda *args: asked.append(args[-1]) or args[-1])
    monkeypatch.setattr(int2_cuda, "launch_cuda", lambda kernel, grid, block, **kw: launched.append((kernel, block)))
    monkeypatch.setattr(int2_cuda, "_index", lambda device: 0)
    monkeypatch.setattr(int2_cuda, "_counters", lambda device, pairs: torch.zeros(pairs, dtype=torch.int32))
    monkeypatch.setattr(int2_cuda, "stream_evict_first", lambda *args: False)
    for d, warps, want in ((128, 8, [8, 4]), (128, 4, [4, 8]), (64, 4, [4])):
        geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=d, group_size=d, page_size=16, sink_size=16,
                            recent_size=32)
        pool, batch, rot = build_pool(geom, [700], torch.Generator().manual_seed(5))
        q = torch.randn(1, 4, d, dtype=torch.bfloat16)
        asked.clear(), launched.clear()
        int2_cuda.decode(q, rot, pool.layer(0), geom, batch, torch.empty_like(q), 1, 32 * warps * 4, 0.1, warps=warps)
        assert asked == want and launched == [(warps, (32 * warps, 1, 1))], (d, warps)


def test_cuda_code_loads_are_evict_first_only_for_streams_of_about_two_l2s(monkeypatch):
    """int2_cuda.stream_evict_first (host side): the H100's 50 MB L2 -> 128K tokens at batch 1 (76 MB of INT2
    history) streams as evict_first, batch 8 (600 MB) with the normal priority."""
    from oscar_kv.kernels import int2_cuda

    monkeypatch.setattr(int2_cuda, "_l2_bytes", lambda device_index: 50 << 20)
    per_pair = 49 * 2688 * 72  # splits x chunk x bytes per token, 128K tokens (C25)
    assert int2_cuda.stream_evict_first(8 * per_pair, 0)
    assert not int2_cuda.stream_evict_first(64 * per_pair, 0)
    assert int2_cuda.stream_evict_first(100 << 20, 0) and not int2_cuda.stream_evict_first((100 << 20) + 1, 0)


def test_cuda_rotation_operand_is_cached_per_tensor_version():
    """int2_cuda.rotation_operand (host side): float16 R^T per head, converted once per tensor and version; an
    in-place change to R (a new calibration loaded into the same buffer) gives a fresh copy, never a stale one."""
    from oscar_kv.kernels import int2_cuda

    r = random_orthogonal(3, 16, torch.Generator().manual_seed(5))
    rt = int2_cuda.rotation_operand(r)
    assert rt.dtype == torch.float16 and rt.is_contiguous() and rt.shape == (3, 16, 16)
    assert torch.allclose(rt.float(), r.transpose(-1, -2), atol=1e-3)
    assert int2_cuda.rotation_operand(r) is rt  # cached
    r.mul_(-1)  # in place: same address, new version
    again = int2_cuda.rotation_operand(r)
    assert again is not rt and torch.allclose(again.float(), r.transpose(-1, -2), atol=1e-3)
    assert int2_cuda.rotation_operand(r[:1]).shape == (1, 16, 16)  # a view of the first head: its own entry


def test_cuda_decode_rejects_bad_arguments_before_launching():
    """int2_cuda.decode checks what it is handed (runs anywhere: the checks come before the launch)."""
    from oscar_kv.kernels import int2_cuda

    geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=128, group_size=128, page_size=16,
                        sink_size=16, recent_size=32)
    pool, batch, rot = build_pool(geom, [100], torch.Generator().manual_seed(6))
    q = torch.randn(1, 8, 128)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="k_rotation must be"):
        int2_cuda.decode(q, rot[:, :64, :64], pool.layer(0), geom, batch, out, 1, 128, 0.1)
    with pytest.raises(ValueError, match="splits"):
        int2_cuda.decode(q, rot, pool.layer(0), geom, batch, out, int2_cuda.MAX_SPLITS + 1, 128, 0.1)
    gen = torch.Generator().manual_seed(7)
    wide = rope_case(2, 128, 100, gen, device="cpu")  # all 64 pairs: more than the kernel's shared tables hold
    with pytest.raises(ValueError, match="pairs"):
        int2_cuda.decode(q, rot, pool.layer(0), geom, batch, out, 1, 128, 0.1, rope=wide)
    assert "64 pairs" in int2_cuda.unsupported(torch.device("cuda"), geom, 4, wide)


def test_cuda_backend_is_refused_off_the_gpu():
    from oscar_kv.kernels import int2_cuda
    from oscar_kv.kernels.decode import _use_cuda

    geom = PoolGeometry(num_layers=1, num_kv_heads=8, head_dim=128, group_size=128)
    assert int2_cuda.unsupported(torch.device("cpu"), geom, 4, None) == "not a CUDA device"
    assert not _use_cuda("auto", torch.device("cpu"), geom, 4, None)
    with pytest.raises(ValueError, match="backend must be"):
        _use_cuda("cudnn", torch.device("cpu"), geom, 4, None)
    if not GPU:
        with pytest.raises(ValueError, match="not a CUDA device"):
            _use_cuda("cuda", torch.device("cpu"), geom, 4, None)
    from oscar_kv.kernels.decode import int2_kernel_choice

    assert int2_kernel_choice(torch.device("cpu"), geom, 4) == ("triton", "not a CUDA device")
    assert int2_kernel_choice(torch.device("cpu"), geom, 4, backend="triton")[0] == "triton"


@pytest.mark.skipif(GPU, reason="checks the refusal on a machine without CUDA")
def test_int2_kernel_environment_switch(monkeypatch):
    """OSCAR_KV_INT2_KERNEL picks the backend when the caller does not: 'cuda' on the CPU is refused clearly."""
    from oscar_kv.kernels.decode import int2_decode

    geom = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=128, group_size=128, page_size=16,
                        sink_size=16, recent_size=32)
    pool, batch, rot = build_pool(geom, [100], torch.Generator().manual_seed(4))
    q = torch.randn(1, 8, 128)
    monkeypatch.setenv("OSCAR_KV_INT2_KERNEL", "cuda")
    with pytest.raises(ValueError, match="cannot run this call: not a CUDA device"):
        int2_decode(q, pool, 0, batch, rot)
    monkeypatch.setenv("OSCAR_KV_INT2_KERNEL", "triton")
    assert int2_decode(q, pool, 0, batch, rot).isfinite().all()


def test_cuda_kernel_compile_failure_is_a_reason_not_a_crash(monkeypatch):
    """A machine whose NVRTC cannot build the CUDA kernel gets a warning and the Triton kernel under 'auto'."""
    from oscar_kv.kernels import int2_cuda

    def fail(*args, **kwargs):
        raise RuntimeError("libnvrtc.so.13: cannot open shared object file")

    monkeypatch.setattr(int2_cuda, "_kernel", fail)
    monkeypatch.setattr(int2_cuda.torch.cuda, "_compile_kernel", fail, raising=False)  # CPU torch builds lack it
    monkeypatch.setattr(int2_cuda.torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(int2_cuda.torch.version, "hip", None)
    with pytest.warns(UserWarning, match="did not compile"):
        why = int2_cuda._device_error(12345, 128, 16, 4, 4)  # an index no real device has: not cached elsewhere
    assert why.startswith("NVRTC compilation failed") and "libnvrtc" in why
