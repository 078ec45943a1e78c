"""Shared by the kernel tests: the device, the error measure and realistic random inputs."""

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEV == "cuda"


def rel_err(out, want):
    return ((out.float() - want.float()).norm() / want.float().norm()).item()


def assert_pools_equal(a, b):
    """Two pools (layout.PagedKVPool) hold the same codes, scales and zero points bit for bit, and the same windows
    (on the GPU bit for bit; under the interpreter, which truncates float32 -> bfloat16, one ulp apart at most; NaN
    where neither was written)."""
    for name in ("k_codes", "v_codes", "k_scale", "v_scale", "k_zero", "v_zero"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name  # scales: bits
    for name in ("k_win", "v_win"):
        x, y = getattr(a, name), getattr(b, name)
        if GPU:  # round-to-nearest-even float32 -> bfloat16 on both sides
            assert torch.equal(x.view(torch.int16), y.view(torch.int16)), name
        else:
            assert torch.allclose(x.float(), y.float(), rtol=2 ** -7, atol=0, equal_nan=True), name


def outlier_rows(n, h, d, gen, device=DEV, scale=1.0):
    """Random rows with a few channels 10-50x larger (realistic KV outliers)."""
    x = torch.randn(n, h, d, generator=gen) * scale
    for hh in range(h):
        ch = torch.randperm(d, generator=gen)[:3]
        x[:, hh, ch] *= torch.empty(3).uniform_(10, 50, generator=gen)
    return x.to(device)


def relaid_metadata(pool, name):
    """A copy of ``pool`` (layout.PagedKVPool) whose tensor ``name`` holds the same values in a layout the kernels do
    not address: "v_zero" with other strides (heads and pages swapped), "k_zero" as float16 (the old metadata dtype)."""
    import dataclasses

    t = getattr(pool, name)
    t = t.transpose(2, 3).contiguous().transpose(2, 3) if name == "v_zero" else t.half()
    return dataclasses.replace(pool, **{name: t})


def random_orthogonal(h, d, gen):
    qm, _ = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))
    return qm.float()


def rope_case(h, d, n, gen, device=DEV, base=10000.0, scale=20.0, live=None, rotary_dim=None, interleaved=False):
    """rope.KernelRope as the kernels take it: a large pre-RoPE key mean (as a k_proj bias gives) and the
    standard RoPE angles p * base^(-2i/r) for positions < n.  ``live``: that many random channel pairs per
    head are nonzero, as calibration keeps them (None: all).  ``rotary_dim``, ``interleaved``: partial rotary
    (rope.RotaryLayout; mu_pre zero on the pass-through channels, as calibration leaves it); None: RoPE over all d."""
    from oscar_kv.rope import KernelRope, RotaryLayout, keep_pairs, random_pairs

    r = rotary_dim or d
    layout = RotaryLayout(d, r, interleaved)
    inv_freq = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    mu = torch.randn(h, d, generator=gen) * scale
    keep = random_pairs(h, r // 2, live, gen) if live is not None else torch.ones(h, r // 2, dtype=torch.bool)
    mu = keep_pairs(mu, torch.nn.functional.pad(keep, (0, (d - r) // 2)), layout)
    return KernelRope.build(mu.to(device), inv_freq, 1.0, n, layout if rotary_dim or interleaved else None)
