"""Capture per-layer attention activations with a registered attention function, and measure
how much a KV quantization scheme perturbs each layer's attention output.

The capture function sees post-RoPE (and post-QK-norm) queries and keys, raw values and the
attention output, exactly as the model's attention computes them, then delegates to SDPA.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .errors import NonFiniteActivations
from .exact_attention import exact_attention
from .models import AttentionGeometry
from .rotation import rotate

CAPTURE_KEY = "oscar_kv_capture"
_active: list = []  # the observer of the forward in flight (a stack, so captures can nest)


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out, weights = exact_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                   **kwargs)
    if _active:
        for name, t in (("queries", query), ("keys", key), ("values", value), ("attention outputs", out)):
            if not torch.isfinite(t).all():
                raise NonFiniteActivations(f"layer {module.layer_idx}: the model produced NaN/Inf {name}; "
                                           "check the model weights and the dtype (try float32)")
        _active[-1](module.layer_idx, query, key, value, out.transpose(1, 2))
    return out, weights


@contextlib.contextmanager
def attention_override(model, key: str, function, state, stack: list):
    """Within the block, ``model`` runs attention through ``function`` (registered as ``key``, with
    the standard SDPA mask) and ``state`` is on top of ``stack`` for it to read."""
    AttentionInterface.register(key, function)
    AttentionMaskInterface.register(key, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(key)
    stack.append(state)
    try:
        yield
    finally:
        stack.pop()
        model.set_attn_implementation(previous)


def observing(model, observer):
    """Within the block, every attention call of ``model`` reports (layer, q, k, v, out) to ``observer``.

    q/out are [B, Hq, T, D], k/v [B, Hkv, T, D]; q and k post-RoPE, v as projected.
    """
    return attention_override(model, CAPTURE_KEY, _capture_attention, observer, _active)


@dataclass
class LayerSample:
    """Activations of one sequence at one layer (batch 1), float32 (captured to the CPU; ``to`` moves them)."""

    q: torch.Tensor  # [Hq, T, D]
    k: torch.Tensor  # [Hkv, T, D]
    v: torch.Tensor  # [Hkv, T, D]
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [T, D] of positions 0..T-1
    rope_layout: object = None  # rope.RotaryLayout of the tables (None: rotate-half over all D channels)
    scaling: float | None = None  # the softmax scale of the layer's logits (None: D^-0.5)
    window: int | None = None  # the layer's sliding window (models.layer_windows), None: it sees every position

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5 if self.scaling is None else self.scaling

    @property
    def device(self) -> torch.device:
        return self.k.device

    def to(self, device) -> LayerSample:
        """This sample with its activations and RoPE tables on ``device`` (calibration scores its probe where the
        model runs: the clip and width choices are most of a calibration's time on a host CPU)."""
        rope = None if self.rope is None else tuple(t.to(device) for t in self.rope)
        return dataclasses.replace(self, q=self.q.to(device), k=self.k.to(device), v=self.v.to(device), rope=rope)

    def key_offset(self, k_mean: torch.Tensor, k_rope_mean: torch.Tensor | None = None) -> torch.Tensor:
        """What centering subtracts from each key: [Hkv, 1, D] (constant) or [Hkv, T, D] (position-aware), on the
        sample's device."""
        offset = k_mean[:, None, :].float().to(self.device)
        if k_rope_mean is not None and k_rope_mean.abs().max() > 0:
            from .rope import RopeUnsupported, key_offsets

            if self.rope is None:
                raise RopeUnsupported("position-aware centering needs the model's RoPE tables")
            offset = offset + key_offsets(k_rope_mean.to(self.device), *self.rope, self.rope_layout)
        return offset


def run_layers(model, input_ids: torch.Tensor) -> None:
    """Run the decoder layers on ``input_ids`` without the LM head: observers need the attention calls only,
    and the head is a fifth of a small model's forward (49K x 576 for SmolLM2)."""
    body = getattr(model, "model", None)
    (body if body is not None else model)(input_ids.to(model.device), use_cache=False)


@torch.no_grad()
def capture_samples(model, input_ids: torch.Tensor) -> list[LayerSample]:
    """Run one sequence (``input_ids`` [1, T]) and keep every layer's q, k, v: one LayerSample per layer, with
    its softmax scale and sliding window, and the layer's RoPE tables of positions 0..T-1 when the model's RoPE
    allows position-aware centering."""
    from .models import layer_windows
    from .rope import RopeUnsupported, layer_rope_tables

    samples: dict[int, LayerSample] = {}
    try:
        tables = layer_rope_tables(model, AttentionGeometry.of(model.config).head_dim)
        positions = torch.arange(input_ids.shape[1])
        ropes = {id(t): t(positions) for t in tables}  # once per table: layers of one RoPE share it
        rope = [(ropes[id(t)], t.layout) for t in tables]
    except RopeUnsupported:
        rope = None
    windows = layer_windows(model.config)
    scalings = [getattr(layer.self_attn, "scaling", None) for layer in model.model.layers]

    def keep(layer, q, k, v, out):
        tables, layout = rope[layer] if rope is not None else (None, None)
        samples[layer] = LayerSample(q[0].float().cpu(), k[0].float().cpu(), v[0].float().cpu(), tables, layout,
                                     scalings[layer], windows[layer])

    with observing(model, keep):
        run_layers(model, input_ids)
    return [samples[i] for i in range(len(samples))]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                     window: int | None = None) -> torch.Tensor:
    """Exact causal attention, q [Hq, T, D], k/v [Hkv, T, D] (GQA) -> [Hq, T, D], float32, at softmax ``scale``
    (None: D^-0.5) and, with a sliding ``window``, over the keys at positions (p - window, p] only."""
    hq, hkv, t = q.shape[0], k.shape[0], k.shape[1]
    pos = torch.arange(t, device=q.device)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed = allowed & (pos[None, :] > pos[:, None] - window)
    return torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(hq // hkv, 0), v.float().repeat_interleave(hq // hkv, 0),
        attn_mask=allowed, scale=scale)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """|approx - exact| / |exact| over all elements."""
    return float((approx - exact).norm() / exact.norm().clamp_min(1e-12))


def _on(sample: LayerSample, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The artifact's tensors (rotations, means, clips: on the CPU) where the sample's activations are."""
    return tuple(t.to(sample.device) for t in tensors)


def per_head(rotation: torch.Tensor, heads: int, device: torch.device | None = None) -> torch.Tensor:
    """A layer's rotation [1 or Hkv, D, D] (per layer or per head) as float32 [Hkv, D, D] on ``device``, one per KV
    head."""
    r = rotation.float().to(device)
    return r.expand(heads, *r.shape[1:]) if r.shape[0] == 1 else r


def _served_windows(t: int, nq: int, sink_size: int, recent_size: int, window: int | None = None,
                    device: torch.device | None = None):
    """For the last ``nq`` of ``t`` positions: (sink end, end of the keys any scored query sees quantized,
    unseen [nq, T], quantized [nq, T]): key j is INT2 for the query at p iff sink <= j and p - j >= recent_size;
    unseen: later keys, and with a sliding ``window`` the keys at or before p - window."""
    s = min(sink_size, t)
    pos = torch.arange(t - nq, t, device=device)[:, None]
    key = torch.arange(t, device=device)[None, :]
    unseen = key > pos
    if window is not None:
        unseen = unseen | (key <= pos - window)
    return s, max(t - recent_size, s), unseen, (key >= s) & (key <= pos - recent_size)


def quantized_attention_error(sample: LayerSample, k_rotation, v_rotation, k_mean, v_mean, k_clip, v_clip,
                              bits: int = 2, group_size: int | None = None,
                              quantize_keys: bool = True, quantize_values: bool = True, sink_size: int = 64,
                              recent_size: int = 0, queries: int | None = None,
                              rescale: tuple[float, float] = (0.0, 0.0), value_bits: int | None = None) -> float:
    """Relative error of one layer's attention output when its K/V are stored quantized.

    Args:
        sample: the layer's exact q, k, v.
        k_rotation, v_rotation: the layer's rotations.
        k_mean: the key offset, constant or per position (``LayerSample.key_offset``); attention adds it back
            exactly.
        v_mean: the value mean (added back to the output).
        k_clip, v_clip: clip ratios per KV head.
        bits, group_size: the quantizer's (group_size None: the head dim); ``bits`` the keys' width.
        quantize_keys, quantize_values: False keeps that side exact.
        sink_size: the first tokens stay exact.
        recent_size: so do the most recent keys of each query (the cache's recent window; 0: every key past the
            sink is quantized, the query's own too).
        queries: score only the last that many positions (on a long probe: the queries whose attention reaches
            far back, where retrieval happens); None scores every position.
        rescale: quant.quantize_rows' strength for keys and values.
        value_bits: the values' width (None: ``bits``).
    Shapes:
        k_rotation, v_rotation: [H | 1, D, D]; k_mean: [Hkv, D] or [Hkv, T, D]; v_mean: [Hkv, D];
        k_clip, v_clip: [Hkv].
    Returns:
        |out - exact| / |exact| over the scored queries.
    """
    from .quant import fake_quantize, fake_quantize_width  # local: quant is the lower layer

    hq, hkv = sample.q.shape[0], sample.k.shape[0]
    t = sample.k.shape[1]
    nq = t if queries is None else min(queries, t)
    k_mean, v_mean, k_clip, v_clip = _on(sample, k_mean, v_mean, k_clip, v_clip)
    rk, rv = per_head(k_rotation, hkv, sample.device), per_head(v_rotation, hkv, sample.device)
    offset = k_mean[:, None] if k_mean.dim() == 2 else k_mean
    k_rot = rotate(sample.k - offset, rk)
    v_rot = rotate(sample.v - v_mean[:, None], rv)
    q = sample.q[:, t - nq:]
    q_rot = rotate(q.reshape(hkv, (hq // hkv) * nq, q.shape[-1]), rk).reshape_as(q)
    s, last, future, quantized = _served_windows(t, nq, sink_size, recent_size, sample.window, sample.device)
    k_q, v_q = k_rot.clone(), v_rot.clone()
    if quantize_keys:
        k_q[:, s:last] = fake_quantize_width(k_rot[:, s:last], bits, group_size, k_clip[:, None].float(), rescale[0])
    if quantize_values:
        v_q[:, s:last] = fake_quantize(v_rot[:, s:last], bits if value_bits is None else value_bits, group_size,
                                       v_clip[:, None].float(), rescale[1])
    full_offset = rotate(offset.expand_as(sample.k), rk)
    head_of = torch.arange(hq, device=sample.device) // (hq // hkv)
    scale = sample.scale

    exact = torch.softmax(torch.einsum("hqd,hkd->hqk", q, sample.k[head_of]).mul(scale)
                          .masked_fill(future, float("-inf")), -1) @ sample.v[head_of]
    z_e = torch.einsum("hqd,hkd->hqk", q_rot, (k_rot + full_offset)[head_of])
    z_q = torch.einsum("hqd,hkd->hqk", q_rot, (k_q + full_offset)[head_of])
    z = torch.where(quantized, z_q, z_e).mul(scale).masked_fill(future, float("-inf"))
    p = torch.softmax(z, -1)
    out_rot = (p * quantized) @ v_q[head_of] + (p * ~quantized) @ v_rot[head_of]
    out = rotate(out_rot, rv[head_of].transpose(-1, -2)) + v_mean[head_of][:, None]
    return relative_error(out, exact)


CANDIDATE_BATCH_ELEMENTS = 1 << 26  # logits held at once by clip_candidate_errors (256 MB of float32)


def clip_candidate_errors(sample: LayerSample, head: int, k_rotation, v_rotation, k_offset, v_mean, which: str,
                          candidates: torch.Tensor, bits: int = 2, group_size: int | None = None,
                          sink_size: int = 64, recent_size: int = 0, queries: int | None = None,
                          rescale: float = 0.0) -> torch.Tensor:
    """For KV head ``head`` of one layer: the attention-output error of its query group for every clip ratio in
    ``candidates``, all in one pass.

    Args:
        sample, k_rotation, v_rotation, v_mean, bits, group_size, sink_size, recent_size, queries: as
            ``quantized_attention_error``.
        head: the KV head.
        k_offset: the key offset (``k_mean`` there).
        which: "k" quantizes only the keys, "v" only the values.
        candidates: the clip ratios to try.
        rescale: quant.quantize_rows' strength for the side quantized.
    Shapes:
        candidates: [C]; the rest as ``quantized_attention_error``.
    Returns:
        float32 [C]: squared error norms (comparable across candidates; the other heads' errors do not depend on
        this head's clip).
    """
    from .quant import fake_quantize

    hq, hkv = sample.q.shape[0], sample.k.shape[0]
    g, t = hq // hkv, sample.k.shape[1]
    nq = t if queries is None else min(queries, t)
    k_offset, v_mean = _on(sample, k_offset, v_mean)
    rk = per_head(k_rotation, hkv, sample.device)[head]
    rv = per_head(v_rotation, hkv, sample.device)[head]
    off = (k_offset[:, None] if k_offset.dim() == 2 else k_offset)[head].expand(t, -1)
    k_rot = (sample.k[head] - off) @ rk  # [T, D]
    v_rot = (sample.v[head] - v_mean[head]) @ rv
    q_rot = sample.q[head * g:(head + 1) * g, t - nq:] @ rk  # [g, nq, D]
    off_rot = off @ rk
    s, last, future, quantized = _served_windows(t, nq, sink_size, recent_size, sample.window, sample.device)
    scale = sample.scale
    z_exact = (q_rot @ (k_rot + off_rot).T * scale).masked_fill(future, float("-inf"))  # [g, nq, T]
    p_exact = torch.softmax(z_exact, -1)
    exact = p_exact @ v_rot  # rotated, centered space: the error's norm is the same as in the model's
    per_candidate = g * nq * t
    if len(candidates) > 1 and len(candidates) * per_candidate > CANDIDATE_BATCH_ELEMENTS:  # bound the logits' memory
        step = max(1, CANDIDATE_BATCH_ELEMENTS // per_candidate)
        return torch.cat([clip_candidate_errors(sample, head, k_rotation, v_rotation, k_offset, v_mean, which,
                                                candidates[i:i + step], bits, group_size, sink_size, recent_size,
                                                queries, rescale) for i in range(0, len(candidates), step)])
    c = candidates.reshape(-1, 1).float().to(sample.device)

    def clipped(x):  # [C, n, D]: x clipped at each candidate's quantile of |x| per row (one sort for all)
        sorted_abs = x.abs().sort(-1).values
        idx = (c.double() * x.shape[-1]).floor().clamp(0, x.shape[-1] - 1).long()  # as quant.clip_rows
        tau = sorted_abs[:, idx[:, 0]].permute(1, 0)[..., None]  # [C, n, 1]
        return torch.maximum(torch.minimum(x, tau), -tau)

    if which == "k":
        body = fake_quantize(clipped(k_rot[s:last]), bits, group_size, rescale=rescale, exact=k_rot[s:last])
        z_body = torch.einsum("gqd,cnd->cgqn", q_rot, body + off_rot[s:last]) * scale
        z = z_exact.expand(len(c), -1, -1, -1).clone()
        z[..., s:last] = torch.where(quantized[:, s:last], z_body, z_exact[..., s:last])
        out = torch.softmax(z, -1) @ v_rot
    else:
        body = fake_quantize(clipped(v_rot[s:last]), bits, group_size, rescale=rescale, exact=v_rot[s:last])
        p_q = p_exact[..., s:last] * quantized[:, s:last]
        out = exact + torch.einsum("gqn,cnd->cgqd", p_q, body) - p_q @ v_rot[s:last]
    return ((out - exact) ** 2).sum((1, 2, 3)).cpu()
