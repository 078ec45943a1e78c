"""Teacher-forced simulation of the cache's decode semantics in one forward pass.

Feeding a text token by token through ``OscarCache`` is exact but slow.  Because every token is
quantized independently of the others (per-token rows; KIVI's per-channel keys per aligned page),
the stored form of each key is fixed once it leaves the recent window, so one full-sequence
forward can reproduce decoding: query i sees key p quantized iff p is in the quantized history
after token i was appended and p < i, i.e. S0 <= p < min(S0 + n(i), i) with
    n(i) = max(0, floor((i + 1 - S0 - W) / P)) * P
and exact (window dtype) otherwise.  ``tests/test_evaluate.py`` checks this against the real cache.
"""

from __future__ import annotations

import torch

from ..activations import attention_override
from ..cache import OscarCache, OscarCacheLayer

SIM_KEY = "oscar_kv_simulated"
_active: list[OscarCache] = []


def quantized_history_end(positions: torch.Tensor, layer: OscarCacheLayer) -> torch.Tensor:
    """For queries at ``positions``, one past the last quantized key position (S0 when none).  A query's
    own key is always exact (the cache attends to the step's keys as computed): without a recent window
    its page may already be quantized."""
    s = layer.settings
    if not layer.codec.quantizes:
        return torch.zeros_like(positions)
    n = ((positions + 1 - s.sink_size - s.recent_size).clamp_min(0) // s.page_size) * s.page_size
    return torch.minimum(s.sink_size + n, positions.clamp_min(s.sink_size))


def stored_forms(layer: OscarCacheLayer, keys: torch.Tensor, values: torch.Tensor):
    """(exact keys, quantized keys, exact values, quantized values) in the cache's rotated space.

    ``keys`` are post-RoPE [B, Hkv, T, D]; ``values`` already folded.  The quantized forms are
    computed from the window-dtype copies, as the cache quantizes its stored BF16 rows.
    """
    wdt = layer.settings.window_dtype
    if not layer.is_initialized:  # moves the layer's codec to the keys' device
        layer.lazy_initialization(keys, values)
    codec = layer.codec
    k_exact = codec.rotate_keys(keys, torch.arange(keys.shape[2], device=keys.device)).to(wdt).float()
    v_exact = values.to(wdt).float()
    if not codec.quantizes:
        k_exact = codec.restore_offsets(k_exact)
        return k_exact, k_exact, v_exact, v_exact
    t = keys.shape[2]
    s0, p = layer.settings.sink_size, layer.settings.page_size
    usable = max(t - s0, 0) // p * p  # whole pages after the sink (all the cache ever quantizes)
    k_q, v_q = k_exact.clone(), v_exact.clone()
    if usable:
        body = slice(s0, s0 + usable)
        k_q[:, :, body] = codec.dequantize_keys(codec.quantize_keys(k_exact[:, :, body]))
        v_q[:, :, body] = codec.dequantize_values(codec.quantize_values(v_exact[:, :, body]))
    return codec.restore_offsets(k_exact), codec.restore_offsets(k_q), v_exact, v_q


QUERY_BLOCK = 256  # queries per block: the logits of one block are [g, QUERY_BLOCK, keys]


def simulated_attention_from_forms(layer: OscarCacheLayer, query: torch.Tensor, forms, start: int = 0,
                                   scaling: float | None = None) -> torch.Tensor:
    """Causal attention of ``query`` [B, Hq, T, D] (positions start..) under decode semantics -> [B, Hq, T, D],
    over the keys and values of ``forms`` (stored_forms), at the layer's softmax ``scaling`` (None: D^-0.5) and, on a
    sliding-window layer, over the keys of the window only (positions (p - window, p], as the cache reads them).

    Query i sees keys [S0, h(i)) in their quantized form and all others exact, h(i) = max(S0, history end).
    h grows with i, so within a block of queries the keys split into [0, S0) exact | [S0, h_min) quantized |
    [h_min, h_max) a band where the form depends on the query | [h_max, ...) exact: each key segment is
    multiplied once and only the band needs a per-query choice (the cost is one causal attention)."""
    k_e, k_q, v_e, v_q = forms
    b, hq, t, d = query.shape
    hkv, n_keys = k_e.shape[1], k_e.shape[2]
    g = hq // hkv
    s0 = layer.settings.sink_size if layer.codec.quantizes else 0
    q = layer.codec.rotate_queries(query).reshape(b, hkv, g, t, d) * (d**-0.5 if scaling is None else scaling)
    window = layer.window
    dev = query.device
    pos_q = torch.arange(start, start + t)
    hist = quantized_history_end(pos_q, layer).clamp_min(s0)  # [T] on the CPU: segment bounds are host ints
    hist_dev, pos_dev = hist.to(dev), pos_q.to(dev)
    out = torch.empty(b, hkv, g, t, d, device=dev)
    for i0 in range(0, t, QUERY_BLOCK):
        i1 = min(i0 + QUERY_BLOCK, t)
        n = min(n_keys, start + i1)  # keys past the block's last query are never seen
        a, h0, h1 = min(s0, n), min(int(hist[i0]), n), min(int(hist[i1 - 1]), n)
        band = torch.arange(h0, h1, device=dev)[None, :] < hist_dev[i0:i1, None]  # [nb, h1 - h0]: quantized for this query
        qb = q[:, :, :, i0:i1]  # [B, Hkv, g, nb, D]

        def dot(keys, lo, hi):
            return qb @ keys[:, :, None, lo:hi].transpose(-1, -2)

        # the segments cover keys [0, n) in order: column index = key position
        logits = torch.cat([dot(k_e, 0, a), dot(k_q, a, h0), torch.where(band, dot(k_q, h0, h1), dot(k_e, h0, h1)),
                            dot(k_e, h1, n)], -1)
        c = start + i0  # keys from the block's first query on may lie in a query's future
        logits[..., c:n].masked_fill_(torch.arange(c, n, device=dev)[None, :] > pos_dev[i0:i1, None], float("-inf"))
        if window is not None:  # and a sliding window hides the keys at or before p - window
            logits.masked_fill_(torch.arange(n, device=dev)[None, :] <= pos_dev[i0:i1, None] - window, float("-inf"))
        probs = torch.softmax(logits, -1)
        p_band = probs[..., h0:h1]
        out[:, :, :, i0:i1] = (probs[..., :a] @ v_e[:, :, None, :a] + probs[..., a:h0] @ v_q[:, :, None, a:h0]
                               + (p_band * band) @ v_q[:, :, None, h0:h1] + (p_band * ~band) @ v_e[:, :, None, h0:h1]
                               + probs[..., h1:n] @ v_e[:, :, None, h1:n])
    return out.reshape(b, hq, t, d)


def _simulated_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    layer = _active[-1].layers[module.layer_idx]
    forms = stored_forms(layer, key, value)
    out = simulated_attention_from_forms(layer, query, forms, scaling=scaling)
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


def simulating(model, cache: OscarCache):
    """Within the block, full-sequence forwards (no past) of a prepared model simulate ``cache``."""
    return attention_override(model, SIM_KEY, _simulated_attention, cache, _active)


@torch.no_grad()
def simulated_logits(model, cache: OscarCache, input_ids: torch.Tensor) -> torch.Tensor:
    """The logits [B, T, V] of one forward of ``input_ids`` [B, T] under ``cache``'s decode semantics."""
    with simulating(model, cache):
        return model(input_ids, use_cache=False).logits
