import pytest
import torch

from oscar_kv.rotation import (COMPOSITIONS, bit_reversal_order, bit_reversal_placement, block_hadamard,
                               channel_importance, compose, hadamard, orthogonality_error)


def random_covariance(d, seed=0, decay=0.9):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    lam = decay ** torch.arange(d, dtype=torch.float64) * 10
    return q @ torch.diag(lam) @ q.T


@pytest.mark.parametrize("n", [1, 2, 8, 64, 128])
def test_hadamard_is_orthogonal_and_symmetric(n):
    h = hadamard(n)
    assert orthogonality_error(h) < 1e-12
    assert torch.equal(h, h.T)
    assert torch.allclose(h.abs(), torch.full_like(h, n**-0.5))


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        hadamard(96)


@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize("d,g", [(64, 64), (64, 16), (128, 32)])
def test_every_composition_is_orthogonal(composition, d, g):
    r, lam = compose(random_covariance(d), d, g, composition)
    assert r.shape == (d, d)
    assert orthogonality_error(r) < 1e-10


@pytest.mark.parametrize("d", [32, 64, 128])
def test_full_hadamard_gives_every_channel_the_mean_eigenvalue(d):
    cov = random_covariance(d, seed=d)
    r, lam = compose(cov, d, d, "oscar")
    imp = channel_importance(r, cov)
    assert torch.allclose(imp, torch.full_like(imp, float(torch.trace(cov)) / d), rtol=1e-9, atol=1e-9)
    assert torch.all(lam[:-1] >= lam[1:]), "eigenvalues are returned in descending order"


def test_bit_reversal_order_is_a_permutation():
    for d in (2, 8, 64, 128):
        order = bit_reversal_order(d)
        assert sorted(order.tolist()) == list(range(d))
    assert bit_reversal_order(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]


@pytest.mark.parametrize("d,g", [(64, 16), (128, 32), (128, 64)])
def test_bit_reversal_gives_each_group_one_direction_per_importance_level(d, g):
    lam = torch.rand(d, dtype=torch.float64)
    p = bit_reversal_placement(lam)
    assert torch.equal(p.sum(0), torch.ones(d, dtype=torch.float64)) and torch.equal(p.sum(1), torch.ones(d, dtype=torch.float64))
    rank_of = torch.empty(d, dtype=torch.long)
    rank_of[torch.argsort(lam, descending=True)] = torch.arange(d)
    placed_rank = rank_of[p.argmax(0)]  # rank of the eigen-direction placed at each channel
    groups = d // g
    for grp in range(groups):
        levels = sorted((placed_rank[grp * g:(grp + 1) * g] // groups).tolist())
        assert levels == list(range(g)), f"group {grp} should hold one direction of each of the {g} levels"


def test_placement_balances_group_importance_where_contiguous_groups_do_not():
    d, g = 128, 32
    cov = random_covariance(d, decay=0.95)
    spread = {}
    for comp in ("oscar", "u_h"):
        r, _ = compose(cov, d, g, comp)
        per_group = channel_importance(r, cov).reshape(d // g, g).sum(1)
        spread[comp] = float(per_group.std() / per_group.mean())
    assert spread["oscar"] < 0.1 * spread["u_h"], spread


def test_block_hadamard_mixes_only_inside_groups():
    h = block_hadamard(64, 16)
    assert torch.count_nonzero(h[:16, 16:]) == 0
    assert orthogonality_error(h) < 1e-12
