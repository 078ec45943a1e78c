"""Teacher-forced simulation of the cache's decode semantics in one forward pass.

Feeding a text token by token through ``OscarCache`` is exact but slow.  Because every token is
quantized independently of the others (per-token rows; KIVI's per-channel keys per aligned page),
the stored form of each key is fixed once it leaves the recent window, so one full-sequence
forward can reproduce decoding: query i sees key p quantized iff p is in the quantized history
after token i was appended, i.e. S0 <= p < S0 + n(i) with
    n(i) = max(0, floor((i + 1 - S0 - W) / P)) * P
and exact (window dtype) otherwise.  ``tests/test_evaluate.py`` checks this against the real cache.
"""

from __future__ import annotations

import torch

from ..activations import attention_override
from ..cache import OscarCache, OscarCacheLayer
from ..quant import dequantize_rows, quantize_rows

SIM_KEY = "oscar_kv_simulated"
_active: list[OscarCache] = []


def quantized_history_end(positions: torch.Tensor, layer: OscarCacheLayer) -> torch.Tensor:
    """For queries at ``positions``, one past the last quantized key position (S0 when none)."""
    s = layer.settings
    if not layer.quantizes:
        return torch.zeros_like(positions)
    n = ((positions + 1 - s.sink_size - s.recent_size).clamp_min(0) // s.page_size) * s.page_size
    return s.sink_size + n


def stored_forms(layer: OscarCacheLayer, keys: torch.Tensor, values: torch.Tensor):
    """(exact keys, quantized keys, exact values, quantized values) in the cache's rotated space.

    ``keys`` are post-RoPE [B, Hkv, T, D]; ``values`` already folded.  The quantized forms are
    computed from the window-dtype copies, as the cache quantizes its stored BF16 rows.
    """
    wdt = layer.settings.window_dtype
    k_exact = layer.rotate_keys(keys, torch.arange(keys.shape[2], device=keys.device)).to(wdt).float()
    v_exact = values.to(wdt).float()
    if not layer.quantizes:
        k_exact = layer.restore_offsets(k_exact)
        return k_exact, k_exact, v_exact, v_exact
    t = keys.shape[2]
    s0, p = layer.settings.sink_size, layer.settings.page_size
    usable = max(t - s0, 0) // p * p  # whole pages after the sink (all the cache ever quantizes)
    k_q, v_q = k_exact.clone(), v_exact.clone()
    if usable:
        body = slice(s0, s0 + usable)
        k_q[:, :, body] = layer._dequantize_keys(layer._quantize_keys(k_exact[:, :, body], layer.k_clip[None, :, None]),
                                                 torch.float32)
        v_q[:, :, body] = dequantize_rows(quantize_rows(v_exact[:, :, body], layer.bits, layer.group_size,
                                                        layer.v_clip[None, :, None]))
    return layer.restore_offsets(k_exact), layer.restore_offsets(k_q), v_exact, v_q


def simulated_attention_from_forms(layer: OscarCacheLayer, query: torch.Tensor, forms, start: int = 0) -> torch.Tensor:
    """Causal attention of ``query`` [B, Hq, T, D] (positions start..) under decode semantics -> [B, Hq, T, D]."""
    k_e, k_q, v_e, v_q = forms
    b, hq, t, d = query.shape
    hkv = k_e.shape[1]
    g = hq // hkv
    scaling = d**-0.5
    q = layer.rotate_queries(query).reshape(b, hkv, g * t, d)
    pos_q = torch.arange(start, start + t, device=query.device)
    pos_k = torch.arange(k_e.shape[2], device=query.device)
    end = quantized_history_end(pos_q, layer)
    use_q = (pos_k[None, :] >= layer.settings.sink_size) & (pos_k[None, :] < end[:, None])  # [T, N]
    causal = pos_k[None, :] <= pos_q[:, None]
    out = torch.empty(b, hkv, g * t, d)
    for h in range(hkv):  # one KV head at a time keeps the T x T tensors small
        qh = q[:, h]
        logits = torch.where(use_q.repeat(g, 1), qh @ k_q[:, h].transpose(-1, -2), qh @ k_e[:, h].transpose(-1, -2))
        logits = logits * scaling
        logits = logits.masked_fill(~causal.repeat(g, 1), float("-inf"))
        probs = torch.softmax(logits, -1)
        mask_q = use_q.repeat(g, 1).float()
        out[:, h] = (probs * (1 - mask_q)) @ v_e[:, h] + (probs * mask_q) @ v_q[:, h]
    return out.reshape(b, hq, t, d)


def _simulated_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    layer = _active[-1].layers[module.layer_idx]
    forms = stored_forms(layer, key, value)
    out = simulated_attention_from_forms(layer, query, forms)
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


def simulating(model, cache: OscarCache):
    """Within the block, full-sequence forwards (no past) of a prepared model simulate ``cache``."""
    return attention_override(model, SIM_KEY, _simulated_attention, cache, _active)


@torch.no_grad()
def simulated_logits(model, cache: OscarCache, input_ids: torch.Tensor) -> torch.Tensor:
    with simulating(model, cache):
        return model(input_ids, use_cache=False).logits
