"""The prefill chunk's attention: history and chunk as two calls merged by log-sum-exp, against one call with
the lower-right causal mask in float32 (kernels/chunk_attention.py)."""

import pytest
import torch

from oscar_kv.kernels.chunk_attention import PREFILL_ATTENTION_ENV, chunk_attention, prefill_attention_choice

from kernel_utils import GPU


def _reference(q, k, v, scale, window=None):
    """float32 attention with an explicit lower-right causal mask (and sliding window), GQA by repetition."""
    t, n = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    logits = (q.float() @ k.transpose(-1, -2)) * scale
    allowed = torch.arange(n)[None, :].to(q.device) <= torch.arange(t)[:, None].to(q.device) + (n - t)
    if window:
        allowed &= torch.arange(n)[None, :].to(q.device) > torch.arange(t)[:, None].to(q.device) + (n - t) - window
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1) @ v


def _case(t, n, hq, h, d, dtype, device, seed=0, token_major=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, t, d, generator=gen)
    k, v = (torch.randn(1, h, n, d, generator=gen) for _ in range(2))
    k = k * 2 + torch.randn(d, generator=gen) * 3  # a shared key direction: softmax mass uneven over positions
    if token_major:  # the materialized scratch's layout: [n, H, D] rows seen as [1, H, n, D]
        q, k, v = (x[0].transpose(0, 1).contiguous().transpose(0, 1)[None] for x in (q, k, v))
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


@pytest.mark.parametrize("t,n", [(5, 5), (5, 23), (16, 100), (1, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_matches_the_lower_right_mask(t, n, dtype):
    q, k, v = _case(t, n, 4, 2, 16, dtype, "cpu")
    want = _reference(q, k, v, 0.25)
    got = chunk_attention(q, k, v, 0.25, "split")
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (got.float() - want).abs().max().item() < tol
    flash = chunk_attention(q, k, v, 0.25, "flash")
    assert (flash.float() - want).abs().max().item() < tol


@pytest.mark.parametrize("t,n,window", [(5, 5, 2), (5, 23, 1), (16, 100, 20), (16, 100, 7), (1, 40, 9),
                                        (16, 100, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sliding_window_masks_the_band(t, n, window, dtype):
    """Query i (key index n - t + i) sees keys in (n - t + i - window, n - t + i]; either kernel choice (the band
    ignores it); a window of at least n keys is the plain lower-right causal attention."""
    q, k, v = _case(t, n, 4, 2, 16, dtype, "cpu")
    want = _reference(q, k, v, 0.25, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for kernel in ("split", "flash"):
        got = chunk_attention(q, k, v, 0.25, kernel, window)
        assert got.dtype == dtype and got.shape == q.shape
        assert (got.float() - want).abs().max().item() < tol, kernel
    if window < n:
        assert (_reference(q, k, v, 0.25) - want).abs().max().item() > 0.1  # the window matters


def test_choice_follows_the_environment(monkeypatch):
    cpu = torch.device("cpu")
    assert prefill_attention_choice(cpu, torch.float16, 4, 2, 16) == ("split", None)
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "flash")
    kernel, why = prefill_attention_choice(cpu, torch.float16, 4, 2, 16)
    assert kernel == "flash" and PREFILL_ATTENTION_ENV in why
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "fast")
    with pytest.raises(ValueError, match="auto, split, flash"):
        prefill_attention_choice(cpu, torch.float16, 4, 2, 16)


@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("t,n", [(64, 64), (256, 1000), (1000, 5000), (37, 301)])
def test_cudnn_split_matches_the_reference_on_cuda(t, n):
    dev = torch.device("cuda")
    assert prefill_attention_choice(dev, torch.float16, 32, 8, 128) == ("split", None)
    q, k, v = _case(t, n, 32, 8, 128, torch.float16, dev, seed=t, token_major=True)
    want = _reference(q, k, v, 128 ** -0.5)
    for kernel in ("split", "flash"):
        got = chunk_attention(q, k, v, 128 ** -0.5, kernel).float()
        err = ((got - want).norm() / want.norm()).item()
        assert err < 2e-3, (kernel, err)


@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("t,n,window", [(64, 64, 16), (256, 1279, 1024), (1000, 5000, 1024), (37, 301, 100),
                                        (300, 4396, 4096)])
def test_sliding_window_on_cuda(t, n, window):
    """FA2's own sliding window (lower-right aligned) against the float32 reference: float16 and bfloat16, GQA 4."""
    dev = torch.device("cuda")
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = _case(t, n, 32, 8, 128, dtype, dev, seed=t, token_major=True)
        want = _reference(q, k, v, 128 ** -0.5, window)
        got = chunk_attention(q, k, v, 128 ** -0.5, "split", window).float()
        err = ((got - want).norm() / want.norm()).item()
        assert err < (2e-3 if dtype == torch.float16 else 1e-2), (dtype, err)
