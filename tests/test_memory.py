import pytest

from oscar_kv.memory import bits_per_element, kv_bytes


def test_int2_at_128k():
    # (320 * 16 + 130752 * (2 + 24/128)) / 131072: a float16 scale and an 8-bit zero point per group
    assert bits_per_element(131072, 128, 128) == pytest.approx(2.2212, abs=1e-4)
    # the paper's 2.28 with its float16 minimum (32 metadata bits a group)
    assert bits_per_element(131072, 128, 128, group_bits=32) == pytest.approx(2.2836, abs=1e-4)


def test_short_sequences_are_all_window():
    assert bits_per_element(300, 128, 128) == 16.0
    assert bits_per_element(320, 128, 128) == 16.0


def test_smaller_groups_cost_more_metadata():
    assert bits_per_element(131072, 128, 64) > bits_per_element(131072, 128, 128)
    assert bits_per_element(10**9, 64, 64) == pytest.approx(2.375, abs=1e-4)


def test_layer_policy_is_averaged_in():
    mixed = bits_per_element(131072, 128, 128, k_bits=[2, 2, 2, 4])
    assert mixed == pytest.approx((3 * bits_per_element(131072, 128, 128) + bits_per_element(131072, 128, 128, bits=4)) / 4)
    assert bits_per_element(131072, 128, 128, bits=16) == 16.0


def test_keys_and_values_count_at_their_own_widths():
    # K3V2 at 32K, D = G = 128: (320 * 16 + 32448 * (3.1875 + 2.1875) / 2) / 32768
    k3v2 = bits_per_element(32768, 128, 128, k_bits=[3, 3], v_bits=[2, 2])
    assert k3v2 == pytest.approx((320 * 16 + 32448 * 2.6875) / 32768)
    assert k3v2 == pytest.approx((bits_per_element(32768, 128, 128, bits=3) + bits_per_element(32768, 128, 128)) / 2)
    # D = G = 64: 0.375 bit of metadata per element on each side
    assert bits_per_element(10**9, 64, 64, k_bits=[4], v_bits=[2]) == pytest.approx(3.375, abs=1e-4)
    # 5-bit keys: (5 + 2) / 2 + 0.1875 at D = G = 128 past the windows
    assert bits_per_element(10**9, 128, 128, k_bits=[5], v_bits=[2]) == pytest.approx(3.6875, abs=1e-4)
    with pytest.raises(ValueError):
        bits_per_element(4096, 64, k_bits=[2, 2], v_bits=[2])


def test_kv_bytes_reflects_the_7x_saving():
    args = dict(num_layers=36, num_kv_heads=8, head_dim=128)
    ratio = kv_bytes(131072, bits=16, **args) / kv_bytes(131072, **args)
    assert 7.1 < ratio < 7.3  # 16 / 2.2212


def test_rejects_empty_sequences():
    with pytest.raises(ValueError):
        bits_per_element(0, 128)
