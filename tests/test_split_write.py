"""Split key rows (quant.SplitWidth, kernels/split_keys.py) through the fused write path and page migration vs the
torch reference: key codes with their tails, float16 scales, uint8 zero points and values bit for bit."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from oscar_kv.kernels import reference as ref, split_keys  # noqa: E402
from oscar_kv.kernels.layout import POOL_TENSORS, PagedKVPool, PoolGeometry, clip_indices, metadata_slot  # noqa: E402
from oscar_kv.quant import SplitWidth, dequantize_split  # noqa: E402

from kernel_utils import DEV, GPU, assert_pools_equal, outlier_rows  # noqa: E402

# (head dim, split width, group size of the pool, value bits): every width at both rescale settings (the tests'
# parameters); a group size below D leaves the layer's other groups untouched (they stay NaN / 255 in both pools)
CASES = [(128, SplitWidth(2, 16, 4), 128, 2), (128, SplitWidth(2, 16, 8), 64, 4), (128, SplitWidth(2, 32, 5), 128, 2),
         (128, SplitWidth(2, 64, 3), 32, 3), (128, SplitWidth(3, 16, 4), 128, 2), (64, SplitWidth(2, 8, 4), 64, 2),
         (64, SplitWidth(2, 16, 5), 32, 4), (64, SplitWidth(2, 32, 8), 64, 8)]
PARAMS = [pytest.param(*case, rescale, id=f"D{case[0]}-{case[1]}-G{case[2]}-V{case[3]}-r{rescale}")
          for case in CASES for rescale in (0.0, 0.5)]


def geometry(d, width, g, v_bits, layers=2, h=2, p=16):
    return PoolGeometry(num_layers=layers, num_kv_heads=h, head_dim=d, group_size=g, page_size=p, sink_size=p,
                        recent_size=p, k_bits=(width.bits,) * layers, v_bits=(v_bits,) * layers,
                        k_split=(width,) * layers)


def pools(geom, nq, nw):
    """Twin pools, scales and windows NaN and zero points 255 where nothing was written."""
    return tuple(PagedKVPool.allocate(geom, nq, nw, device=DEV, fill_nan=True) for _ in range(2))


def split_rows(n, h, d, width, gen):
    """[n, h, d] float32 rows with outliers, and rows that probe the parts' edges: a zero row, a row whose first part
    is zero, one whose second part is -0.0, one whose first part is constant (a one-sided group), and one whose
    outlier sits in the first part only (a wide range there, a narrow one in the rest)."""
    x = outlier_rows(n, h, d, gen, device="cpu")
    m = width.hi_dims
    x[1, 0] = 0.0
    x[2, 1, :m] = 0.0
    x[3, 0, m:] = -0.0
    x[4, 1, :m] = 0.75
    x[5, 0] = torch.randn(d, generator=gen)
    x[5, 0, m // 2] = 40.0
    return x.to(DEV)


def assert_unclipped_rows_read_back(pool, layer, width, slots, rows, head):
    """The stored rows in split_keys.py's layout, read back on their own: row_bytes long, and an unclipped head's rows
    (no rescale) within half a step (plus the float16 scale's rounding) of each part's scale."""
    d, p = pool.geometry.head_dim, pool.geometry.page_size
    s = slots.long()
    assert pool.k_codes.shape[-1] == split_keys.row_bytes(width, d)
    meta = metadata_slot(s % p, p)
    codes = split_keys.load_rows(pool.k_codes[layer], (s // p, head, s % p), width, d)
    stored = split_keys.unpack(codes, pool.k_scale[layer, s // p, head, meta],
                               pool.k_zero[layer, s // p, head, meta], width, d)
    err = (dequantize_split(stored) - rows[:, head]).abs()
    step = torch.cat([stored.hi.scale.float().expand(-1, width.hi_dims),
                      stored.lo.scale.float().expand(-1, d - width.hi_dims)], -1)
    assert bool((err <= 0.6 * step + 1e-6).all())


@pytest.mark.parametrize("d,width,g,v_bits,rescale", PARAMS)
def test_split_write_bit_exact(d, width, g, v_bits, rescale):
    """write_kv into INT2 slots (and a few window slots) of a split layer: the reference's pool bit for bit, with one
    head clipping each part and the other not."""
    from oscar_kv.kernels.write import write_kv

    gen = torch.Generator().manual_seed(d + width.hi_dims + width.hi_bits)
    h, p, t, nq, nw = 2, 16, 20 if not GPU else 2000, 3 if not GPU else 256, 2 if not GPU else 256
    geom = geometry(d, width, g, v_bits, h=h, p=p)
    slots = torch.randperm(nq * p, generator=gen)[:t]
    to_win = torch.arange(t) % 5 == 4
    win = torch.where(to_win, slots % (nw * p), -1).int().to(DEV)
    q2 = torch.where(to_win, -1, slots).int().to(DEV)
    k, v = split_rows(t, h, d, width, gen), outlier_rows(t, h, d, gen)
    ck = split_keys.clip_indices(torch.tensor([0.9, 1.0]), width, d, (h,)).to(DEV)
    cv = clip_indices(torch.tensor([1.0, 0.92]), d, (h,)).to(DEV)
    a, b = pools(geom, nq, nw)
    ref.write_reference(a, 1, k, v, win, q2, None, None, ck, cv, rescale=(rescale, rescale))
    write_kv(b, 1, k, v, win, q2, None, None, ck, cv, rescale=(rescale, rescale))
    assert_pools_equal(a, b)
    if rescale == 0:
        quantized = q2 >= 0
        assert_unclipped_rows_read_back(b, 1, width, q2[quantized], k[quantized], head=1)


def test_split_write_rotated_and_centered():
    """Keys centered and rotated (a signed permutation: exact) in the kernel, then split: bit for bit."""
    from oscar_kv.kernels.write import write_kv

    gen = torch.Generator().manual_seed(7)
    d, h, p, t, width = 64, 2, 16, 20, SplitWidth(2, 16, 4)
    geom = geometry(d, width, d, 2, layers=1, h=h, p=p)
    rot = torch.zeros(h, d, d)
    for hh in range(h):
        rot[hh, torch.arange(d), torch.randperm(d, generator=gen)] = torch.randint(0, 2, (d,), generator=gen) * 2.0 - 1
    rot, mean = rot.to(DEV), torch.randn(h, d, generator=gen).to(DEV)
    k, v = split_rows(t, h, d, width, gen), outlier_rows(t, h, d, gen)
    q2 = torch.randperm(2 * p, generator=gen)[:t].int().to(DEV)
    win = torch.full((t,), -1, dtype=torch.int32, device=DEV)
    ck = split_keys.clip_indices(0.95, width, d, (h,)).to(DEV)
    cv = clip_indices(1.0, d, (h,)).to(DEV)
    a, b = pools(geom, 2, 1)
    ref.write_reference(a, 0, k, v, win, q2, rot, mean, ck, cv, rescale=(1.0, 0.0))
    write_kv(b, 0, k, v, win, q2, rot, mean, ck, cv, rescale=(1.0, 0.0))
    assert_pools_equal(a, b)


@pytest.mark.parametrize("d,width,g,v_bits,rescale", PARAMS)
def test_split_migrate_bit_exact(d, width, g, v_bits, rescale):
    """migrate_pages of a stacked pool whose layers all store split keys: every layer, one launch, bit for bit; the
    layers clip differently (one below 1 on both parts, one not at all)."""
    from oscar_kv.kernels.write import migrate_pages

    gen = torch.Generator().manual_seed(d * width.hi_bits + width.hi_dims)
    h, p, layers, nq, nw = 2, 16, 2, 3, 3
    geom = geometry(d, width, g, v_bits, layers=layers, h=h, p=p)
    a, b = pools(geom, nq, nw)
    w = split_rows(layers * nw * p, h, d, width, gen).view(layers, nw, p, h, d).transpose(2, 3).to(torch.bfloat16)
    for pool in (a, b):
        pool.k_win.copy_(w)
        pool.v_win.copy_(w.flip(-1))
    src = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    dst = torch.tensor([1, 2], dtype=torch.int32, device=DEV)
    ck = split_keys.clip_indices(torch.tensor([[0.9], [1.0]]), width, d, (layers, h)).to(DEV)
    cv = clip_indices(torch.tensor([[1.0], [0.9]]), d, (layers, h)).to(DEV)
    ref.migrate_reference(a, src, dst, ck, cv, rescale=(rescale, rescale))
    migrate_pages(b, src, dst, ck, cv, rescale=(rescale, rescale))
    assert_pools_equal(a, b)
    assert bool(torch.isnan(b.k_scale[:, 0].float()).all())  # an INT2 page nothing migrated into stays unwritten


def test_split_keys_need_clip_index_pairs():
    """A split layer takes each part's clip index: [Hkv, 2] in write_kv, [L, Hkv, 2] in migrate_pages (ValueError
    otherwise, before any launch); a stacked pool whose layers differ only in their split migrates layer by layer."""
    from oscar_kv.kernels.write import migrate_pages, write_kv

    d, h, p, width = 64, 2, 16, SplitWidth(2, 16, 4)
    geom = geometry(d, width, d, 2, layers=2, h=h, p=p)
    pool = PagedKVPool.allocate(geom, 1, 1, device=DEV, fill_nan=True)
    k = torch.randn(2, h, d, device=DEV)
    slot = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    win = torch.full((2,), -1, dtype=torch.int32, device=DEV)
    plain = clip_indices(1.0, d, (h,)).to(DEV)
    for bad in (plain, split_keys.clip_indices(1.0, width, d, (1, h)).to(DEV)):
        with pytest.raises(ValueError, match=r"split keys \(4x16\+2\): clip_k_idx must be int32 \[2, 2\]"):
            write_kv(pool, 0, k, k, win, slot, None, None, bad, plain)
    page = torch.zeros(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"clip_k_idx must be int32 \[2, 2, 2\]"):
        migrate_pages(pool, page, page, plain.expand(2, h), plain.expand(2, h))
    assert bool(torch.isnan(pool.k_scale.float()).all())  # nothing was written
    # layers at one k_bits, one of them split: one migration launch cannot quantize both
    mixed = PoolGeometry(num_layers=2, num_kv_heads=h, head_dim=d, group_size=d, page_size=p, sink_size=p,
                         recent_size=p, k_bits=(2, 2), k_split=(width, None))
    stacked = PagedKVPool(mixed, *(getattr(pool, name) for name in POOL_TENSORS))
    with pytest.raises(ValueError, match="migrate each layer's pool"):
        migrate_pages(stacked, page, page, split_keys.clip_indices(1.0, width, d, (2, h)), plain.expand(2, h))


def test_split_keys_with_a_wider_part_not_a_power_of_two_are_refused():
    """The kernels cut the wider part out of a row as one power-of-two block: a pool of 24 such channels is refused
    (PoolGeometry.kernel_error, so the engine says so at start-up), not mis-stored."""
    d, h, p, width = 64, 1, 16, SplitWidth(2, 24, 4)
    geom = geometry(d, width, d, 2, layers=1, h=h, p=p)
    assert "power of two" in geom.kernel_error()
    with pytest.raises(ValueError, match="power of two"):
        PagedKVPool.allocate(geom, 1, 1, device=DEV, fill_nan=True)
