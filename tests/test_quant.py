import pytest
import torch

from oscar_kv.errors import ConfigError
from oscar_kv.quant import (clip_rows, dequantize_rows, fake_quantize, fraction_bits, grid_metadata, pack_codes,
                            quantize_rows, unpack_codes)


def outlier_rows(n=256, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[:, 3] *= 40  # a massive outlier channel, as keys have
    x[:, 77] += 25
    return x


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (5, 7, 128), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape[-1] == 128 * bits // 8 and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_int3_is_an_int2_plane_then_a_high_bit_plane():
    codes = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7] * 2], dtype=torch.uint8)  # D = 16
    packed = pack_codes(codes, 3)
    assert packed.shape[-1] == 6  # 4 bytes of low bit pairs + 2 bytes of high bits
    assert torch.equal(packed[:, :4], pack_codes(codes & 3, 2))
    # the high-bit plane: byte j holds channel j + 2k in bit k (channels 4-7 and 12-15 have it set)
    assert packed[:, 4:].tolist() == [[0b11001100, 0b11001100]]


def test_int5_is_an_int4_plane_then_a_high_bit_plane():
    codes = torch.arange(16, dtype=torch.uint8).view(1, 16) * 2 + torch.tensor([0, 1] * 8, dtype=torch.uint8)
    codes = codes.clamp(max=31)  # D = 16: codes 0, 3, 4, 7, ..., 31 (channels 8-15 reach the fifth bit)
    packed = pack_codes(codes, 5)
    assert packed.shape[-1] == 10  # 8 bytes of nibbles + 2 bytes of high bits
    # the INT4 plane: byte j holds channel j in the low nibble, channel j + 8 in the high nibble
    assert torch.equal(packed[:, :8], pack_codes(codes & 15, 4))
    assert packed[0, 1].item() == (codes[0, 1] & 15) | ((codes[0, 9] & 15) << 4)
    # the high-bit plane: byte j holds channel j + 2k in bit k (channels 8-15 have it set)
    assert packed[:, 8:].tolist() == [[0b11110000, 0b11110000]]
    assert torch.equal(unpack_codes(packed, 5), codes)


def test_int2_bit_layout_is_stride_packed():
    codes = torch.tensor([[0, 1, 2, 3, 3, 2, 1, 0]], dtype=torch.uint8)
    # byte 0 holds channels 0, 2, 4, 6 (codes 0, 2, 3, 1) in bit pairs 0-1, 2-3, 4-5, 6-7
    assert pack_codes(codes, 2).tolist() == [[0 | 2 << 2 | 3 << 4 | 1 << 6, 1 | 3 << 2 | 2 << 4 | 0 << 6]]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("group", [32, 128])
def test_reconstruction_error_is_within_half_a_step(bits, group):
    x = outlier_rows()
    q = quantize_rows(x, bits, group)
    assert q.scale.dtype == torch.float16 and q.zero.dtype == torch.uint8 and q.minimum.dtype == torch.float32
    assert q.scale.shape == (256, 128 // group)
    xh = dequantize_rows(q)
    step = q.scale.float().repeat_interleave(group, -1)
    assert ((x - xh).abs() <= step / 2 + 1e-2 * step + 1e-3).all()
    assert q.nbytes() == 256 * (128 * bits // 8 + 3 * 128 // group)  # float16 scale + uint8 zero point


def test_more_bits_less_error():
    x = outlier_rows()
    errs = [float((fake_quantize(x, b, 128) - x).norm()) for b in (2, 3, 4, 5, 8)]
    # steps shrink with the levels: 3 -> 7 -> 15 -> 31 -> 255
    assert errs[0] > 1.8 * errs[1] and errs[1] > 2 * errs[2] and errs[2] > 1.9 * errs[3] and errs[3] > 7 * errs[4]


def test_clip_clamps_the_largest_magnitudes_symmetrically():
    x = outlier_rows(n=16, d=128)
    c = clip_rows(x, 0.96)  # index floor(0.96 * 128) = 122: the 5 largest |x| are clamped to the 6th
    tau = x.abs().sort(-1).values[:, 122:123]
    assert torch.equal(c, torch.clamp(x, -tau, tau))
    assert torch.equal(clip_rows(x, 1.0), x)
    per_row = clip_rows(x, torch.full((16,), 0.96))
    assert torch.equal(per_row, c)


def test_clipping_helps_outlier_rows_at_int2():
    x = torch.randn(512, 128, generator=torch.Generator().manual_seed(1))
    x[torch.arange(512), torch.randint(0, 128, (512,))] *= 12  # one random spike per row
    plain = (fake_quantize(x, 2, 128) - x).norm()
    clipped = (fake_quantize(x, 2, 128, clip_ratio=0.96) - x).norm()
    assert clipped < 0.8 * plain


def test_constant_rows_are_exact():
    x = torch.full((4, 64), 1.5)
    assert torch.equal(fake_quantize(x, 2, 64), x)


def test_non_finite_input_is_rejected():
    x = outlier_rows(n=4)
    x[1, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_rows(x, 2, 128)


def test_group_must_divide_head_dim():
    with pytest.raises(ValueError, match="divide"):
        quantize_rows(torch.randn(2, 128), 2, 48)
    with pytest.raises(ValueError, match="bits"):
        quantize_rows(torch.randn(2, 128), 6, 128)
    for bits in (3, 5):  # the high-bit plane packs 8 channels a byte
        with pytest.raises(ValueError, match=f"multiple of 8 for {bits}-bit packing"):
            quantize_rows(torch.randn(2, 12), bits, 12)


@pytest.mark.parametrize("group", [32, 128])
def test_rescale_restores_each_group_along_itself(group):
    """Clipping shrinks a row's projection on itself (the logit of the query aligned with it); the rescaled
    metadata give it back within float16 rounding, with the same codes."""
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.5, 2, 128)  # rotated-like
    plain = quantize_rows(x, 2, group, clip_ratio=0.9)
    scaled = quantize_rows(x, 2, group, clip_ratio=0.9, rescale=1.0)
    half = quantize_rows(x, 2, group, clip_ratio=0.9, rescale=0.5)
    assert torch.equal(plain.codes, scaled.codes)
    xg = x.reshape(x.shape[0], -1, group)

    def along(q):
        return (dequantize_rows(q).reshape_as(xg) * xg).sum(-1) / (xg * xg).sum(-1)

    assert along(plain).mean() < 0.95  # the shrink the rescale exists for
    assert (along(scaled) - 1).abs().max() < 2e-3
    shrink = 1 - along(plain)
    assert torch.allclose(1 - along(half), shrink / 2, atol=2e-3)  # half of it taken back
    with pytest.raises(ValueError, match="strength"):
        quantize_rows(x, 2, group, clip_ratio=0.9, rescale=1.5)


def test_rescale_is_bounded_and_leaves_constant_rows_exact():
    x = torch.zeros(3, 64)
    x[0] = 1.5  # constant row: exact before and after
    x[1, 0] = 1e-3  # nearly empty row
    x[2] = torch.linspace(-1, 1, 64)
    q = quantize_rows(x, 2, 64, clip_ratio=0.5, rescale=1.0)
    assert torch.isfinite(q.scale.float()).all() and torch.isfinite(q.minimum.float()).all()
    assert torch.equal(dequantize_rows(q)[0], x[0])
    unscaled = quantize_rows(x, 2, 64, clip_ratio=0.5)
    ratio = q.scale.float()[2] / unscaled.scale.float()[2]
    assert 1.0 < ratio <= 2.0  # clipped at half the row: a large but bounded correction


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_the_zero_point_grid_covers_every_group(bits):
    """Within half a step everywhere, whether the group straddles zero, lies above it or below it (zero point 0 or
    its largest), and a zero row is stored as zeros."""
    torch.manual_seed(1)
    x = torch.randn(64, 128)
    x[16:32] = x[16:32].abs() + 0.5  # groups wholly above zero
    x[32:48] = -x[32:48].abs() - 0.5  # wholly below
    x[48:] = 0.0
    x[:, ::7] = 0.0
    q = quantize_rows(x, bits, 64)
    xh = dequantize_rows(q)
    assert torch.equal(xh[48:], torch.zeros_like(xh[48:]))
    step = q.scale.float().repeat_interleave(64, -1)
    assert ((x - xh).abs() <= step / 2 + 1e-3 * step).all()
    z = q.zero.long()
    assert int(z.max()) <= (2 ** bits - 1) * 2 ** fraction_bits(bits) <= 255
    assert (z[16:32] == 0).all() and (z[32:48] == (2 ** bits - 1) * 2 ** fraction_bits(bits)).all()


def test_grid_metadata_takes_the_zero_point_needing_the_smaller_scale():
    """Worked example at 2 bits (F = 6, 192 units): [-1, 2] puts zero at t = 192 / 3 = 64 exactly, scale 1; on
    [-1, 2.1] t = 61.9..., the floor 61 needs scale max(64 / 61, 134.4 / 131) = 1.0492, the ceiling 62 needs
    max(64 / 62, 134.4 / 130) = 1.0338: the ceiling wins."""
    scale, zero = grid_metadata(torch.tensor([-1.0, -1.0]), torch.tensor([2.0, 2.1]), 2)
    assert zero.tolist() == [64.0, 62.0]
    assert scale[0].item() == 1.0 and scale[1].item() == pytest.approx(134.4 / 130, rel=1e-6)


@pytest.mark.parametrize("bits", [3, 5])
def test_minimum_is_exact_in_float32(bits):
    q = quantize_rows(torch.randn(32, 64) * 100, bits, 32)
    exact = -(q.scale.double() * q.zero.double()) * 2.0 ** -fraction_bits(bits)
    assert torch.equal(q.minimum.double(), exact)


@pytest.mark.parametrize("bits", [2, 4])
def test_float_minimum_spans_the_group_not_zero(bits):
    # KIVI's own format: a group far from 0 (a biased key channel) keeps all its levels, where the zero point's grid
    # must reach 0 and spends them on the empty [0, 100)
    x = 100 + torch.rand(16, 32, generator=torch.Generator().manual_seed(0))
    step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / (2**bits - 1)
    q = quantize_rows(x, bits, 32, float_minimum=True)
    assert q.zero.dtype == torch.float16 and q.scale.dtype == torch.float16
    err = (dequantize_rows(q) - x).abs()
    assert (err <= step / 2 + 0.05).all()  # + the float16 minimum's rounding at 100 (0.03)
    assert (fake_quantize(x, bits, 32) - x).abs().max() > 4 * err.max()
    # a float16 minimum and scale: 4 metadata bytes a group
    assert q.nbytes() == q.codes.numel() + 4 * 16
    with pytest.raises(ConfigError):
        quantize_rows(x, bits, 32, rescale=0.5, float_minimum=True)
