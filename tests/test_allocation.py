"""The width allocation: the key logit noise it measures, and the rule that widens the noisiest layers first."""

import pytest
import torch

from oscar_kv.allocation import allocate_key_widths, key_logit_noise, value_output_noise
from oscar_kv.memory import bits_per_element

GEOMETRY = dict(seq_len=32768, head_dim=128, group_size=128)


def test_key_logit_noise_is_the_mean_squared_logit_error_over_queries_and_keys():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 300, 16, generator=g) * torch.linspace(3, 0.1, 16)  # [Hkv, queries, D]: uneven energy
    keys = torch.randn(2, 50, 16, generator=g)
    stored = keys + 0.1 * torch.randn(2, 50, 16, generator=g)
    c_q = q.transpose(1, 2) @ q / q.shape[1]
    scale = 16 ** -0.5
    direct = ((q @ (keys - stored).transpose(1, 2)) * scale).pow(2).mean((1, 2))
    assert torch.allclose(key_logit_noise(keys, stored, c_q, scale), direct.double(), rtol=1e-4)
    # an error along the queries' weakest direction costs far less than the same error along the strongest
    weak, strong = keys.clone(), keys.clone()
    weak[..., -1] += 1.0
    strong[..., 0] += 1.0
    assert (key_logit_noise(keys, weak, c_q, scale) * 100 < key_logit_noise(keys, strong, c_q, scale)).all()


NOISE = {2: [0.5, 2.0, 0.2, 8.0], 3: [0.12, 0.5, 0.05, 2.0], 4: [0.03, 0.12, 0.01, 0.5]}


def test_tolerance_gives_each_layer_the_fewest_bits_within_it():
    choice = allocate_key_widths(NOISE, [2] * 4, tolerance=0.13, budget=None, **GEOMETRY)
    # layer 3 cannot reach the tolerance: it goes to the widest width and the others still get theirs
    assert choice.k_bits == [3, 4, 3, 4]
    assert choice.noise == [0.12, 0.12, 0.05, 0.5]
    assert "widest width" in choice.reason and "layer 3" in choice.reason
    assert choice.bits_per_element == pytest.approx(bits_per_element(k_bits=[3, 4, 3, 4], v_bits=[2] * 4,
                                                                     **GEOMETRY), abs=1e-4)


def test_a_reachable_tolerance_stops_as_soon_as_every_layer_is_within_it():
    choice = allocate_key_widths(NOISE, [2] * 4, tolerance=2.0, budget=None, **GEOMETRY)
    assert choice.k_bits == [2, 2, 2, 3] and "within 2 nats^2" in choice.reason


def test_budget_widens_the_noisiest_layer_first_and_never_overspends():
    k2 = bits_per_element(k_bits=[2] * 4, v_bits=[2] * 4, **GEOMETRY)
    one_step = bits_per_element(k_bits=[2, 2, 2, 3], v_bits=[2] * 4, **GEOMETRY) - k2  # each widening costs the same
    choice = allocate_key_widths(NOISE, [2] * 4, tolerance=None, budget=k2 + 3.5 * one_step, **GEOMETRY)
    # noisiest first: layer 3 (8.0 -> 2.0), layer 3 again (2.0 -> 0.5) ties with layer 1 (2.0): layer 1 then 3
    assert sum(b - 2 for b in choice.k_bits) == 3 and choice.k_bits[3] >= 3
    assert choice.bits_per_element <= k2 + 3.5 * one_step + 1e-4
    assert "budget" in choice.reason
    assert max(choice.noise) == pytest.approx(0.5)


def test_budget_and_tolerance_together_stop_at_whichever_comes_first():
    loose = allocate_key_widths(NOISE, [2] * 4, tolerance=2.0, budget=16.0, **GEOMETRY)
    assert loose.k_bits == [2, 2, 2, 3]
    k2 = bits_per_element(k_bits=[2] * 4, v_bits=[2] * 4, **GEOMETRY)
    tight = allocate_key_widths(NOISE, [2] * 4, tolerance=0.01, budget=k2, **GEOMETRY)
    assert tight.k_bits == [2] * 4 and "budget" in tight.reason


def test_impossible_requests_are_clear_errors():
    with pytest.raises(ValueError, match="below the narrowest allocation"):
        allocate_key_widths(NOISE, [2] * 4, tolerance=None, budget=2.0, **GEOMETRY)
    with pytest.raises(ValueError, match="tolerance, a bit budget or a step count"):
        allocate_key_widths(NOISE, [2] * 4, tolerance=None, budget=None, **GEOMETRY)


def test_steps_walk_the_path_the_tolerance_walks():
    """--max-kl searches the widening path by step count: step n is the tolerance's allocation after n widenings."""
    full = allocate_key_widths(NOISE, [2] * 4, tolerance=0.0, budget=None, **GEOMETRY)
    previous = allocate_key_widths(NOISE, [2] * 4, tolerance=None, budget=None, steps=0, **GEOMETRY)
    assert previous.k_bits == [2] * 4
    for n in range(1, 9):
        step = allocate_key_widths(NOISE, [2] * 4, tolerance=None, budget=None, steps=n, **GEOMETRY)
        assert sum(step.k_bits) == sum(previous.k_bits) + 1  # one layer, one width wider
        assert step.bits_per_element > previous.bits_per_element
        previous = step
    assert previous.k_bits == full.k_bits == [4] * 4


def test_value_output_noise_is_the_error_relative_to_the_values_spread():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(2, 64, 16, generator=g) * torch.tensor([1.0, 3.0])[:, None, None]
    error = 0.1 * torch.randn(2, 64, 16, generator=g)
    noise = value_output_noise(values, values + error)
    assert torch.allclose(noise, (error.pow(2).sum((1, 2)) / values.pow(2).sum((1, 2))).double(), rtol=1e-5)
    assert noise[0] > 5 * noise[1], "the same error is a smaller share of wider values"


VALUE_NOISE = {2: [0.6, 0.05, 0.05, 0.05], 3: [0.2, 0.01, 0.01, 0.01], 4: [0.05, 0.002, 0.002, 0.002]}


def test_values_widen_in_one_noisiest_first_order_with_the_keys():
    choice = allocate_key_widths(NOISE, [2] * 4, tolerance=0.55, budget=None, value_noise=VALUE_NOISE, **GEOMETRY)
    # above 0.55: keys of layers 1 (2.0) and 3 (8.0 -> 2.0 -> 0.5) and layer 0's values (0.6); nothing else
    assert choice.k_bits == [2, 3, 2, 4] and choice.v_bits == [3, 2, 2, 2]
    assert choice.value_noise == [0.2, 0.05, 0.05, 0.05] and choice.steps == 4
    assert "key and value noise is within 0.55" in choice.reason
    assert choice.bits_per_element == pytest.approx(bits_per_element(k_bits=[2, 3, 2, 4], v_bits=[3, 2, 2, 2],
                                                                     **GEOMETRY), abs=1e-4)
    # step by step, the path widens whichever part is noisiest: layer 3's keys (8.0), then its keys again and
    # layer 1's keys (2.0 each), then layer 0's values (0.6)
    sides = []
    for n in range(1, 5):
        step = allocate_key_widths(NOISE, [2] * 4, tolerance=None, budget=None, steps=n, value_noise=VALUE_NOISE,
                                   **GEOMETRY)
        sides.append("v" if step.v_bits != [2] * 4 else "k")
    assert sides == ["k", "k", "k", "v"]
    fixed = allocate_key_widths(NOISE, [3] * 4, tolerance=0.55, budget=None, **GEOMETRY)
    assert fixed.v_bits == [3] * 4 and fixed.value_noise is None, "without value noise the values stay as given"
