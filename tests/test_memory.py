import pytest

from oscar_kv.memory import bits_per_element, kv_bytes


def test_paper_figure_at_128k():
    # (320 * 16 + 130752 * (2 + 32/128)) / 131072
    assert bits_per_element(131072, 128, 128) == pytest.approx(2.2836, abs=1e-4)


def test_short_sequences_are_all_window():
    assert bits_per_element(300, 128, 128) == 16.0
    assert bits_per_element(320, 128, 128) == 16.0


def test_smaller_groups_cost_more_metadata():
    assert bits_per_element(131072, 128, 64) > bits_per_element(131072, 128, 128)
    assert bits_per_element(10**9, 64, 64) == pytest.approx(2.5, abs=1e-4)


def test_layer_policy_is_averaged_in():
    mixed = bits_per_element(131072, 128, 128, layer_bits=[2, 2, 2, 4])
    assert mixed == pytest.approx((3 * bits_per_element(131072, 128, 128) + bits_per_element(131072, 128, 128, bits=4)) / 4)
    assert bits_per_element(131072, 128, 128, bits=16) == 16.0


def test_kv_bytes_reflects_the_7x_saving():
    args = dict(num_layers=36, num_kv_heads=8, head_dim=128)
    ratio = kv_bytes(131072, bits=16, **args) / kv_bytes(131072, **args)
    assert 6.9 < ratio < 7.1


def test_rejects_empty_sequences():
    with pytest.raises(ValueError):
        bits_per_element(0, 128)
