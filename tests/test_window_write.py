"""The decode step's window write (kernels/window_write.py) against the reference writer and write_kv."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from oscar_kv.kernels import reference as ref  # noqa: E402
from oscar_kv.kernels.layout import PagedKVPool, PoolGeometry, clip_indices  # noqa: E402

from kernel_utils import DEV, GPU, assert_pools_equal, outlier_rows  # noqa: E402


def decode_case(d, h, t, gen, padded=True):
    """A one-layer pool and t decode tokens, each on its own window slot (one padded row -1 when ``padded``, as a
    captured batch bucket has)."""
    p = 16
    geom = PoolGeometry(num_layers=1, num_kv_heads=h, head_dim=d, group_size=64, page_size=p, sink_size=p,
                        recent_size=p)
    win = torch.randperm(8 * p, generator=gen)[:t]
    if padded:
        win[t // 2] = -1
    k = outlier_rows(t, h, d, gen).to(torch.bfloat16)
    v = outlier_rows(t, h, d, gen, scale=0.5).to(torch.bfloat16)
    q2 = torch.full((t,), -1, dtype=torch.int32)
    ck = cv = clip_indices(0.96, d, (h,)).to(DEV)
    pools = [PagedKVPool.allocate(geom, 8, 8, device=DEV, fill_nan=True) for _ in range(3)]
    return pools, k, v, win.int().to(DEV), q2.to(DEV), ck, cv


def rope_inputs(d, h, t, layout, gen):
    positions = torch.randint(0, 30000, (t,), generator=gen).double()
    r = layout.rotary_dim
    angles = positions[:, None] * layout.pair_frequencies(10000.0 ** (-torch.arange(0, r, 2).double() / r))[None]
    cos, sin = (layout.spread(f(angles)).float().to(DEV) for f in (torch.cos, torch.sin))
    return (torch.randn(h, d, generator=gen) * 8).to(DEV), cos, sin


# (head dim, rotation, constant mean, RoPE centering: None / "half" / "partial" / "interleaved")
CASES = [(64, "dense", True, None), (128, "dense", False, "half"), (128, "perm", True, "interleaved"),
         (64, None, True, "partial"), (256, "dense", True, "half"), (128, None, False, None)]


@pytest.mark.parametrize("d,rotation,mean,rope", CASES, ids=lambda c: str(c))
def test_window_write_stores_what_write_kv_stores(d, rotation, mean, rope):
    from oscar_kv.kernels.window_write import write_window
    from oscar_kv.kernels.write import write_kv
    from oscar_kv.rope import RotaryLayout

    gen = torch.Generator().manual_seed(d)
    h, t = 2, 5
    (a, b, c), k, v, win, q2, ck, cv = decode_case(d, h, t, gen)
    if rotation == "dense":
        rot = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0].float().to(DEV)
    elif rotation == "perm":  # every product exact: the sums' order cannot matter
        rot = torch.zeros(h, d, d)
        for hh in range(h):
            rot[hh, torch.arange(d), torch.randperm(d, generator=gen)] = 1.0
        rot = rot.to(DEV)
    else:
        rot = None
    mu = torch.randn(h, d, generator=gen).to(DEV) if mean else None
    layout = kw = None
    if rope is not None:
        layout = RotaryLayout(d, 3 * d // 4 if rope == "partial" else d, rope == "interleaved")
        kw = rope_inputs(d, h, t, layout, gen)
    given = layout if rope in ("partial", "interleaved") else None
    ref.write_reference(a, 0, k, v, win, q2, rot, mu, ck, cv, k_rope=kw, rope_layout=given)
    write_kv(b, 0, k, v, win, q2, rot, mu, ck, cv, k_rope=kw, rope_layout=given)
    write_window(c, 0, k, v, win, rot, mu, k_rope=kw, rope_layout=given)
    if rotation != "dense":
        assert_pools_equal(b, c)
    else:  # float32 sums in another order: one BF16 rounding apart at most
        assert torch.allclose(b.k_win.float(), c.k_win.float(), rtol=2 ** -7, atol=1e-6, equal_nan=True)
        assert torch.equal(b.v_win.view(torch.int16), c.v_win.view(torch.int16))
    # against the float64 reference, as write_kv is held (test_kernels_write.py)
    assert torch.allclose(a.k_win.float(), c.k_win.float(), rtol=2 ** -7, atol=1e-3, equal_nan=True)
    written = win.long()[win >= 0]
    assert not c.k_win[0, written // 16, :, written % 16].isnan().any()  # every slot written, the padded row not
    assert int(c.k_win.isnan().logical_not().sum()) == len(written) * h * d


@pytest.mark.skipif(not GPU, reason="timing-free check of the CUDA launch with PDL")
def test_window_write_under_a_cuda_graph_equals_eager():
    from oscar_kv.kernels.window_write import write_window

    gen = torch.Generator().manual_seed(7)
    d, h, t = 128, 8, 8
    (a, b, _), k, v, win, _, _, _ = decode_case(d, h, t, gen)
    rot = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0].float().to(DEV)
    write_window(a, 0, k, v, win, rot, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_window(b, 0, k, v, win, rot, None)
    graph.replay()
    torch.cuda.synchronize()
    assert_pools_equal(a, b)
