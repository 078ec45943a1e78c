"""Attention of a prefill chunk over contiguous keys and values: T queries over N keys, the last T of them the
chunk's own, query i seeing keys <= N - T + i (causal aligned to the lower right), GQA.

Two computations (``prefill_attention_choice`` picks one per device and shape; the engine reports it at start-up):

* ``split`` (default): the history keys [0, N - T) with no mask and the chunk's keys with a causal mask (square,
  so upper-left and lower-right alignment agree) as two attention calls that also return each row's log-sum-exp,
  merged exactly: out = o_hist * w + o_chunk * (1 - w), w = sigmoid(lse_hist - lse_chunk), the history's share
  of the softmax mass.  On CUDA both calls run cuDNN's fused attention, which on the H100 takes an unmasked or a
  square causal call at 550-660 TFLOP/s but a lower-right mask at 230-280; on the CPU, torch's flash op.
* ``flash``: one SDPA flash (FA2) call with the lower-right mask, ~350 TFLOP/s on the H100
  (benchmarks/NOTES.md, runs E7 and P5).

A sliding-window layer (``window``: query i sees only the last ``window`` keys up to its own) takes neither: each
query row has its own lower bound, so the history is no longer unmasked.  On CUDA it runs FA2 with its sliding
window (``_flash_attention_forward``'s window_size_left: key blocks outside the band are skipped), elsewhere SDPA
with the band as a boolean mask.

The log-sum-exp outputs come from the backends' private ATen ops (``_scaled_dot_product_cudnn_attention``,
``_scaled_dot_product_flash_attention_for_cpu``): public SDPA does not return them.  The first call per device and
shape runs a small probe of the cuDNN op, so a build without it gets flash and the reason, never a crash.
"""

from __future__ import annotations

import functools

import torch

from .tuning import kernel_choice

PREFILL_ATTENTION_ENV = "OSCAR_KV_PREFILL_ATTENTION"  # "auto" (default) | "split" | "flash"


def prefill_attention_choice(device: torch.device, dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int,
                             backend: str | None = None) -> tuple[str, str | None]:
    """("split", None) or ("flash", why not split) for chunks of this shape.  ``backend``: "auto" (split where it
    runs), "split" (raises where it cannot) or "flash"; default: $OSCAR_KV_PREFILL_ATTENTION, else "auto"."""
    def why_not() -> str | None:
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cudnn_error(index, dtype, q_heads, kv_heads, head_dim)

    return kernel_choice(PREFILL_ATTENTION_ENV, backend, "split", "flash", why_not, "the split prefill attention")


@functools.lru_cache(maxsize=None)
def _cudnn_error(device_index: int, dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why cuDNN's attention cannot take this shape (None: it can), from SDPA's own check and one small call
    compared with the math backend."""
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention

    dev = torch.device("cuda", device_index)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, q_heads, 64, head_dim, device=dev, dtype=dtype, generator=gen)
    k, v = (torch.randn(1, kv_heads, 192, head_dim, device=dev, dtype=dtype, generator=gen) for _ in range(2))
    if not can_use_cudnn_attention(SDPAParams(q, k, v, None, 0.0, False, True), False):
        return f"cuDNN attention does not take {dtype} with {q_heads} / {kv_heads} heads of dim {head_dim}"
    try:
        got = chunk_attention(q, k, v, head_dim ** -0.5, "split").float()
    except Exception as e:  # an old cuDNN, or a build without the op: reported, never fatal under "auto"
        return f"cuDNN attention failed: {e!r:.300}"
    want = _lower_right(q.float(), k.float(), v.float(), head_dim ** -0.5)
    err = ((got - want).norm() / want.norm()).item()
    if not err < 1e-2:
        return f"cuDNN attention disagreed with the math backend (relative error {err:.2e})"
    return None


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, kernel: str,
                    window: int | None = None) -> torch.Tensor:
    """Attention of a chunk of T queries over N >= T keys ending with the chunk's own, causal to the lower right.

    Args:
        q, k, v: the queries, keys and values (any strides with a unit stride in D).
        sm_scale: the softmax scale.
        kernel: "split" or "flash" (prefill_attention_choice); not used with a window.
        window: a sliding window: query i (key index N - T + i) sees keys j with N - T + i - window < j; None or
            0: the whole causal past.
    Shapes:
        q: [1, Hq, T, D]; k, v: [1, H, N, D], Hq a multiple of H.
    Returns:
        [1, Hq, T, D] in q's dtype.
    """
    t, n = q.shape[2], k.shape[2]
    if window and window < n:  # (a window of at least N keys masks nothing)
        return _band(q, k, v, sm_scale, window)
    if kernel == "flash":
        return _lower_right(q, k, v, sm_scale)
    hist = n - t
    out, lse = _attention_lse(q, k[:, :, hist:], v[:, :, hist:], True, sm_scale)
    if hist == 0:
        return out
    out_h, lse_h = _attention_lse(q, k[:, :, :hist], v[:, :, :hist], False, sm_scale)
    share = torch.sigmoid(lse_h.float() - lse.float()).reshape(*q.shape[:3], 1)
    return torch.lerp(out.float(), out_h.float(), share).to(q.dtype)


def _attention_lse(q, k, v, causal: bool, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [1, Hq, T, D], natural log-sum-exp of each row's scaled logits [1, Hq, T])."""
    if q.device.type == "cuda":
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                 scale=sm_scale)
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=sm_scale)
    return out[0], out[1]


def _lower_right(q, k, v, sm_scale: float) -> torch.Tensor:
    """One SDPA call with the lower-right causal mask: flash on CUDA (it takes that mask and GQA without copies;
    it never falls back silently), the math backend elsewhere."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention

    t, n = q.shape[2], k.shape[2]
    if q.device.type != "cuda" or q.dtype == torch.float32:
        return scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(t, n), scale=sm_scale,
                                            enable_gqa=True)
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    params = SDPAParams(q, k, v, None, 0.0, False, True)
    if not can_use_flash_attention(params, False):
        can_use_flash_attention(params, True)  # warns why
        raise RuntimeError(f"flash attention cannot run this prefill chunk (q {tuple(q.shape)}, k {tuple(k.shape)}, "
                           f"{q.dtype}); see the warning above")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(t, n), scale=sm_scale,
                                            enable_gqa=True)


def band_mask(t: int, n: int, window: int, device) -> torch.Tensor:
    """bool [T, N]: query i (key index N - T + i) sees key j iff N - T + i - window < j <= N - T + i."""
    diag = torch.arange(t, device=device)[:, None] + (n - t)
    j = torch.arange(n, device=device)[None, :]
    return (j <= diag) & (j > diag - window)


def _band(q, k, v, sm_scale: float, window: int) -> torch.Tensor:
    """chunk_attention with a sliding window: FA2's own window on CUDA where SDPA's flash backend takes the call
    (float16 / bfloat16, head dim <= 256, sm80+), SDPA with band_mask elsewhere."""
    t, n = q.shape[2], k.shape[2]
    if q.device.type == "cuda" and _flash_takes(q, k, v):
        # FA2 aligns its window to the lower right, as here: query i sees keys in [i + N - T - left, i + N - T]
        out = torch.ops.aten._flash_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, t, n, 0.0, True, False,
            scale=sm_scale, window_size_left=window - 1, window_size_right=0)[0]
        return out.transpose(1, 2)
    from torch.nn.functional import scaled_dot_product_attention

    return scaled_dot_product_attention(q, k, v, attn_mask=band_mask(t, n, window, q.device), scale=sm_scale,
                                        enable_gqa=True)


def _flash_takes(q, k, v) -> bool:
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, True, True), False)
