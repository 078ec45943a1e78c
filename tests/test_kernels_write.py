"""Fused write path and page migration vs the torch reference: codes, float16 scales and uint8 zero points bit for
bit."""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from oscar_kv.kernels import reference as ref  # noqa: E402
from oscar_kv.kernels.layout import POOL_TENSORS, PagedKVPool, PoolGeometry, clip_indices, metadata_slot  # noqa: E402
from oscar_kv.quant import fraction_bits, unpack_codes  # noqa: E402

from kernel_utils import DEV, GPU, assert_pools_equal  # noqa: E402


def outliers(n, h, d, gen, dtype=torch.float32):
    x = torch.randn(n, h, d, generator=gen)
    for hh in range(h):
        ch = torch.randperm(d, generator=gen)[:3]
        x[:, hh, ch] *= torch.empty(3).uniform_(10, 50, generator=gen)
    if n > 2:
        x[1, 0] = 0.37  # a constant row: scale 0
    return x.to(DEV, dtype)


def signed_permutation(h, d, gen):
    r = torch.zeros(h, d, d)
    for hh in range(h):
        perm = torch.randperm(d, generator=gen)
        sign = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
        r[hh, torch.arange(d), perm] = sign
    return r.to(DEV)


def pools(geom, nq, nw):
    a = PagedKVPool.allocate(geom, nq, nw, device=DEV)
    b = PagedKVPool.allocate(geom, nq, nw, device=DEV)
    return a, b


def assert_metadata_close(a, b, rtol):
    """Keys whose float32 rows differ from the reference's in the order of their sums: a group's range moves by
    ulps, which can move its zero point to the other rounding of t (quant.grid_metadata) and its scale a little."""
    assert torch.allclose(a.k_scale.float(), b.k_scale.float(), rtol=rtol, atol=1e-4)
    assert (a.k_zero.int() - b.k_zero.int()).abs().max() <= 1
    assert (a.k_zero != b.k_zero).float().mean() < 0.05


# head dim 256 (Gemma): the write kernel rotates in column slices there (kernels/write.py)
CASES = [(64, 64, 16), (128, 32, 32), (256, 256, 16)] + ([(128, 128, 16), (128, 64, 64), (256, 64, 32)] if GPU else [])
MODES = ["prerotated", "signed-perm", "bf16-input", "rescaled"]
# keys and values at their own widths (PoolGeometry.k_bits / v_bits): each pair at head dim 64 and 128, the modes
# taking turns (INT2 runs every case and mode above)
WIDTHS = [(3, 2), (4, 2), (3, 3), (2, 4), (4, 4), (8, 2), (8, 4), (5, 2), (5, 3)]
WIDTH_CASES = [(d, 32, 16, MODES[(i + j) % len(MODES)], w) for i, w in enumerate(WIDTHS)
               for j, d in enumerate((64, 128))]


@pytest.mark.parametrize("d,g,p,mode,widths", [(d, g, p, mode, (2, 2)) for d, g, p in CASES for mode in MODES]
                         + WIDTH_CASES)
def test_write_bit_exact(d, g, p, mode, widths):
    from oscar_kv.kernels.write import write_kv

    gen = torch.Generator().manual_seed(d + g + p)
    h, layers = 2, 2
    geom = PoolGeometry(num_layers=layers, num_kv_heads=h, head_dim=d, group_size=g, page_size=p,
                        sink_size=p, recent_size=p, k_bits=(widths[0],) * layers, v_bits=(widths[1],) * layers)
    nq = nw = 8 if not GPU else 512
    t = 45 if not GPU else 5000
    slots = torch.randperm(nq * p, generator=gen)[:t]
    to_win = torch.rand(t, generator=gen) < 0.3
    win = torch.where(to_win, slots, -1).int().to(DEV)
    q2 = torch.where(to_win, -1, slots).int().to(DEV)
    k = outliers(t, h, d, gen, torch.bfloat16 if mode == "bf16-input" else torch.float32)
    v = outliers(t, h, d, gen, torch.bfloat16 if mode == "bf16-input" else torch.float32)
    rot = mean = None
    if mode != "prerotated":
        rot = signed_permutation(h, d, gen)
        mean = torch.randn(h, d, generator=gen).to(DEV)
    ck = clip_indices(torch.tensor([0.96, 1.0]), d, (h,)).to(DEV)
    cv = clip_indices(torch.tensor([0.92, 0.5]), d, (h,)).to(DEV)
    rescale = (0.5, 1.0) if mode == "rescaled" else (0.0, 0.0)
    a, b = pools(geom, nq, nw)
    ref.write_reference(a, 1, k, v, win, q2, rot, mean, ck, cv, rescale=rescale)
    write_kv(b, 1, k, v, win, q2, rot, mean, ck, cv, rescale=rescale)
    assert_pools_equal(a, b)
    assert a.k_codes.shape[-1] == d * widths[0] // 8 and a.v_codes.shape[-1] == d * widths[1] // 8
    if widths != (2, 2):  # the reference is quant.py's: the codes of the quantized slots read back to its levels
        levels = [torch.unique(unpack_codes(codes[1].flatten(0, -2), bits)) for codes, bits in
                  ((a.k_codes, widths[0]), (a.v_codes, widths[1]))]
        assert [int(x.max()) for x in levels] == [(1 << bits) - 1 for bits in widths]


def _one_sided_rows(d, g, gen):
    """[9, 2, d] rows whose groups (of g channels) lie on one side of zero or are zero: all positive, all negative,
    all +0.0, all -0.0, positive / negative with one exact zero (lo = 0, hi = 0), groups of each kind in one row,
    a row of tiny values (float16 subnormal scales) and one straddling zero."""
    ng = d // g
    pos = torch.rand(2, d, generator=gen) * 3 + 0.1
    rows = [pos, -pos.flip(-1), torch.zeros(2, d), -torch.zeros(2, d), pos.clone(), -pos]
    rows[4][:, 5] = 0.0
    rows[5][:, 7] = 0.0
    kinds = torch.stack([pos, -pos, torch.zeros(2, d), torch.randn(2, d, generator=gen)])  # [4, 2, d]
    rows.append(kinds.view(4, 2, ng, g)[torch.arange(ng) % 4, :, torch.arange(ng)].permute(1, 0, 2).reshape(2, d))
    rows.append(pos * 1e-6)
    rows.append(torch.randn(2, d, generator=gen))
    return torch.stack(rows).to(DEV)


@pytest.mark.parametrize("widths,rescale", [((2, 2), (0.0, 0.0)), ((2, 3), (1.0, 0.5)), ((3, 4), (0.0, 0.0)),
                                            ((4, 8), (0.25, 1.0)), ((8, 2), (0.0, 0.0)), ((5, 4), (0.5, 0.0))])
def test_write_one_sided_and_zero_groups(widths, rescale):
    """Groups that do not straddle zero and zero rows, written and migrated: the reference's codes, scales and zero
    points bit for bit, and the grid rule's ends: an all-positive group has zero point 0, an all-negative one 2^F L
    (the top level is its minimum), a zero group scale +0.0, zero point 0 and codes 0."""
    from oscar_kv.kernels.write import migrate_pages, write_kv

    gen = torch.Generator().manual_seed(sum(widths))
    d, g, p, h = 64, 16, 16, 2
    geom = PoolGeometry(num_layers=1, num_kv_heads=h, head_dim=d, group_size=g, page_size=p, sink_size=p,
                        recent_size=p, k_bits=widths[:1], v_bits=widths[1:])
    x = _one_sided_rows(d, g, gen)
    t = x.shape[0]
    q2 = torch.arange(t, dtype=torch.int32, device=DEV)
    win = torch.full((t,), -1, dtype=torch.int32, device=DEV)
    ck = clip_indices(1.0, d, (h,)).to(DEV)
    cv = clip_indices(torch.tensor([1.0, 0.75]), d, (h,)).to(DEV)  # a clip keeps each row on its side of zero
    a, b = pools(geom, 1, 1)
    ref.write_reference(a, 0, x, x.neg(), win, q2, None, None, ck, cv, rescale=rescale)
    write_kv(b, 0, x, x.neg(), win, q2, None, None, ck, cv, rescale=rescale)
    assert_pools_equal(a, b)
    for side, bits, sign in (("k", widths[0], 1), ("v", widths[1], -1)):
        slots = metadata_slot(torch.arange(p), p)  # token order
        zero = getattr(b, f"{side}_zero")[0, 0][:, slots].transpose(0, 1)[:t]  # [t, h, NG]
        scale = getattr(b, f"{side}_scale")[0, 0][:, slots].transpose(0, 1)[:t]
        codes = getattr(b, f"{side}_codes")[0, 0].transpose(0, 1)[:t]
        top = ((1 << bits) - 1) << fraction_bits(bits)
        assert bool((zero[0] == (0 if sign > 0 else top)).all()) and bool((zero[1] == (top if sign > 0 else 0)).all())
        assert bool((zero[4] == (0 if sign > 0 else top)).all()) and bool((zero[5] == (top if sign > 0 else 0)).all())
        for r in (2, 3):  # +0.0 and -0.0 rows
            assert bool((scale[r].view(torch.int16) == 0).all()) and bool((zero[r] == 0).all())
            assert bool((codes[r] == 0).all())
        assert bool((scale[6, :, 2::4].view(torch.int16) == 0).all())  # the zero groups of the mixed row
    # the same rows through migration: window pages quantized whole
    w = torch.zeros(1, 1, h, p, d, device=DEV)
    w[0, 0, :, :t] = x.transpose(0, 1)
    ck2, cv2 = ck.view(1, h), cv.view(1, h)
    a, b = pools(geom, 1, 1)
    for pool in (a, b):
        pool.k_win.copy_(w)
        pool.v_win.copy_(w.neg())
    src = dst = torch.zeros(1, dtype=torch.int32, device=DEV)
    ref.migrate_reference(a, src, dst, ck2, cv2, rescale=rescale)
    migrate_pages(b, src, dst, ck2, cv2, rescale=rescale)
    assert_pools_equal(a, b)


def _alternating_slots(d, h, p, t, gen):
    """A one-layer geometry and t tokens over 8 pages, alternately bound for window and INT2 slots."""
    geom = PoolGeometry(num_layers=1, num_kv_heads=h, head_dim=d, group_size=64, page_size=p, sink_size=p,
                        recent_size=p)
    slots = torch.randperm(8 * p, generator=gen)[:t]
    win = torch.where(torch.arange(t) % 2 == 0, slots, -1).int().to(DEV)
    q2 = torch.where(torch.arange(t) % 2 == 0, -1, slots).int().to(DEV)
    return geom, win, q2


@pytest.mark.parametrize("d", [64, 256])
def test_write_random_rotation_close(d):
    """With a dense rotation the float32 sums differ in order: codes may flip at rounding ties only."""
    from oscar_kv.kernels.write import write_kv

    gen = torch.Generator().manual_seed(1)
    h, p, t = 2, 16, 40
    geom, win, q2 = _alternating_slots(d, h, p, t, gen)
    qm, _ = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))
    rot = qm.float().to(DEV)
    k, v = outliers(t, h, d, gen), outliers(t, h, d, gen)
    ck = cv = clip_indices(0.96, d, (h,)).to(DEV)
    a, b = pools(geom, 8, 8)
    ref.write_reference(a, 0, k, v, win, q2, rot, None, ck, cv)
    write_kv(b, 0, k, v, win, q2, rot, None, ck, cv)
    assert (a.k_codes != b.k_codes).float().mean() < 0.01
    assert_metadata_close(a, b, rtol=1e-2)
    assert torch.allclose(a.k_win.float(), b.k_win.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(a.v_codes, b.v_codes)


@pytest.mark.parametrize("p,rescale,d,widths", [(16, (0.0, 0.0), 64, (2, 2)), (32, (0.0, 0.0), 64, (2, 2)),
                                                (16, (1.0, 0.25), 64, (2, 2)), (16, (1.0, 0.25), 256, (2, 2))]
                         + [(16, (1.0, 0.25) if i % 2 else (0.0, 0.0), (64, 128)[i % 2], w)
                            for i, w in enumerate(WIDTHS)]
                         + ([(64, (0.0, 0.0), 64, (2, 2)), (64, (0.5, 0.0), 64, (2, 2)), (32, (0.0, 0.0), 256, (2, 2))]
                            if GPU else []))
def test_migrate_bit_exact(p, rescale, d, widths):
    """One launch for every layer of a stacked pool, keys and values each at the pool's width."""
    from oscar_kv.kernels.write import migrate_pages

    gen = torch.Generator().manual_seed(p)
    h, layers = 2, 3
    geom = PoolGeometry(num_layers=layers, num_kv_heads=h, head_dim=d, group_size=d // 2, page_size=p, sink_size=p,
                        recent_size=p, k_bits=(widths[0],) * layers, v_bits=(widths[1],) * layers)
    nq, nw = 6, 6
    a, b = pools(geom, nq, nw)
    w = outliers(layers * nw * h * p, 1, d, gen).view(layers, nw, h, p, d).to(torch.bfloat16)
    for pool in (a, b):
        pool.k_win.copy_(w)
        pool.v_win.copy_(w.flip(-1))
    src = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEV)
    dst = torch.tensor([1, 5, 3], dtype=torch.int32, device=DEV)
    ck = clip_indices(torch.tensor([[0.96], [1.0], [0.9]]), d, (layers, h)).to(DEV)
    cv = clip_indices(0.92, d, (layers, h)).to(DEV)
    ref.migrate_reference(a, src, dst, ck, cv, rescale=rescale)
    migrate_pages(b, src, dst, ck, cv, rescale=rescale)
    assert_pools_equal(a, b)


def test_a_stacked_pool_holds_one_width_per_side():
    """PagedKVPool stacks its layers: it allocates (and migrate_pages quantizes) one key width and one value width for
    all of them; layers at different widths are one-layer pools each (the engine's PoolView.layer_pool)."""
    from oscar_kv.kernels.write import migrate_pages

    geom = PoolGeometry(num_layers=2, num_kv_heads=1, head_dim=64, group_size=64, page_size=16, sink_size=16,
                        recent_size=16, k_bits=(3, 4), v_bits=(2, 2))
    assert geom.kernel_error() is None  # the per-layer kernels read both layers
    with pytest.raises(ValueError, match="one key width and one value width, not K3V2 x 1, K4V2 x 1"):
        PagedKVPool.allocate(geom, 1, 1)
    one = PagedKVPool.allocate(dataclasses.replace(geom, k_bits=(3, 3)), 1, 1)
    mixed = PagedKVPool(geom, *(getattr(one, n) for n in POOL_TENSORS))
    idx = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="migrate each layer's pool"):
        migrate_pages(mixed, torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), idx, idx)


@pytest.mark.parametrize("d,rotary", [(64, None), (64, "half"), (64, "interleaved"), (256, None)])
def test_write_position_aware_centering(d, rotary):
    """Keys centered per position (rope.py) inside the write kernel: the kernel's float32 offset against the
    reference's; with a signed permutation every stored row matches and codes flip at rounding ties only.
    ``rotary``: RoPE on the first 3/4 of each head only (rotate-half pairs as Phi-4-mini, or interleaved as GLM);
    mu_pre is nonzero on the pass-through channels too (their offset is mu_pre itself)."""
    from oscar_kv.kernels.write import write_kv
    from oscar_kv.rope import RotaryLayout, apply_rope

    gen = torch.Generator().manual_seed(5)
    h, p, t = 2, 16, 40
    layout = RotaryLayout(d, 3 * d // 4 if rotary else d, rotary == "interleaved")
    geom, win, q2 = _alternating_slots(d, h, p, t, gen)
    positions = torch.randint(0, 30000, (t,), generator=gen).double()
    r = layout.rotary_dim
    angles = positions[:, None] * layout.pair_frequencies(10000.0 ** (-torch.arange(0, r, 2).double() / r))[None]
    cos, sin = (layout.spread(f(angles)).float().to(DEV) for f in (torch.cos, torch.sin))
    mu_pre = (torch.randn(h, d, generator=gen) * 8).to(DEV)
    rot = signed_permutation(h, d, gen)
    mean = torch.randn(h, d, generator=gen).to(DEV)
    base = outliers(t, h, d, gen)
    k = base + apply_rope(mu_pre[None], cos[:, None], sin[:, None], layout)
    v = outliers(t, h, d, gen)
    ck = cv = clip_indices(0.96, d, (h,)).to(DEV)
    a, b = pools(geom, 8, 8)
    given = None if rotary is None else layout
    ref.write_reference(a, 0, k, v, win, q2, rot, mean, ck, cv, k_rope=(mu_pre, cos, sin), rope_layout=given)
    write_kv(b, 0, k, v, win, q2, rot, mean, ck, cv, k_rope=(mu_pre, cos, sin), rope_layout=given)
    assert torch.allclose(a.k_win.float(), b.k_win.float(), rtol=2 ** -7, atol=1e-6)
    assert (a.k_codes != b.k_codes).float().mean() < 0.01
    assert_metadata_close(a, b, rtol=1e-3)
    # the offset is really removed: window rows are (k - offset - mean) @ R, i.e. the rotated outlier rows
    w = win.long() >= 0
    sl = win.long()[w]
    expected = torch.einsum("thd,hde->the", base[w].double() - mean.double(), rot.double())
    assert torch.allclose(b.k_win[0, sl // p, :, sl % p].double(), expected, rtol=2 ** -7, atol=1e-3)
