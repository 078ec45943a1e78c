"""The mixed-precision KV cache for transformers' ``generate()``: BF16 sink + INT2 history + BF16 recent.

Everything is stored in the rotated, centered form of each layer's codec (codec.py): keys are rotated here,
at write time; values arrive so (folded into v_proj).  Per layer and sequence the positions are laid out as
  [0, s)          sink, window dtype (BF16 by default)
  [s, s + n)      history, packed INT2 codes + float16 scale and uint8 zero point (quant.py), nothing else kept
  [s + n, T)      recent window, window dtype; it holds between W and W + P - 1 tokens and hands
                  its oldest P tokens (one page) to the history whenever it reaches W + P.
Attention (``oscar_attention``) rotates the query, dequantizes the history inside the call and
attends to the tokens of the current forward exactly (as a fused prefill kernel does).  The values' mean
is restored by o_proj's bias; the keys' constant mean cancels in softmax, their per-position offset is
added back (codec.LayerCodec.restore_offsets).  Every layer stores every token; a sliding-window layer
(models.layer_windows) reads, and dequantizes, only the positions its window reaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .artifacts import Rotations
from .codec import LayerCodec, layer_codecs, stored_attention, validated_artifact
from .config import CacheConfig
from .exact_attention import exact_attention, use_exact_attention
from .folding import fold_values, restore_model
from .memory import KVFootprint
from .models import layer_windows
from .quant import QuantizedRows, SplitRows, cat_rows

ATTENTION_KEY = "oscar_kv"


@dataclass
class CacheSettings(CacheConfig):
    """The generate() cache's settings: CacheConfig's (dtype, windows, page, group size) plus how this cache holds
    them in torch.  ``kv_cache_dtype='bf16'`` keeps every token in the window dtype."""

    window_dtype: torch.dtype = torch.bfloat16
    # "token": one scale / zero point per token x head x channel group (OSCAR).  "channel": KIVI-style keys,
    # one per channel over each page of tokens (values stay per token).
    key_axis: Literal["token", "channel"] = "token"


class OscarCacheLayer(CacheLayerMixin):
    """One layer's storage.  ``update`` returns the layer itself; ``oscar_attention`` reads it."""

    is_compileable = False
    is_sliding = False  # every layer keeps every position: masks span them all (a sliding one adds its band)

    def __init__(self, settings: CacheSettings, codec: LayerCodec, window: int | None = None):
        super().__init__()
        self.settings, self.codec = settings, codec
        self.window = window  # this layer's sliding window (models.layer_windows), None: it sees every position
        self.sink_k = self.sink_v = self.recent_k = self.recent_v = None
        self.hist_k: QuantizedRows | SplitRows | None = None
        self.hist_v: QuantizedRows | None = None
        self.seq_len = 0
        self.chunk = None  # (keys, values, start) of the forward in flight, read once by attention

    # ---- transformers' layer protocol ----------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        b, h, _, d = key_states.shape
        empty = key_states.new_zeros((b, h, 0, d), dtype=self.settings.window_dtype)
        self.sink_k, self.sink_v, self.recent_k, self.recent_v = empty, empty.clone(), empty.clone(), empty.clone()
        self.codec = self.codec.to(key_states.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        positions = torch.arange(self.seq_len, self.seq_len + key_states.shape[2], device=key_states.device)
        keys = self.codec.rotate_keys(key_states, positions)
        self.chunk = (keys, value_states, self.seq_len)
        self._append(keys, value_states)
        return self, self

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.sink_k = self.sink_v = self.recent_k = self.recent_v = None
        self.hist_k = self.hist_v = None
        self.seq_len, self.chunk = 0, None

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("beam search is not supported by the INT2 cache")

    # ---- storage -------------------------------------------------------------------------------
    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        wdt = self.settings.window_dtype
        keys, values = keys.to(wdt), values.to(wdt)
        room = max(self.settings.sink_size - self.sink_k.shape[2], 0) if self.codec.quantizes else 0
        if room:
            self.sink_k = torch.cat([self.sink_k, keys[:, :, :room]], 2)
            self.sink_v = torch.cat([self.sink_v, values[:, :, :room]], 2)
            keys, values = keys[:, :, room:], values[:, :, room:]
        self.recent_k = torch.cat([self.recent_k, keys], 2)
        self.recent_v = torch.cat([self.recent_v, values], 2)
        self.seq_len += self.chunk[0].shape[2]
        if self.codec.quantizes:
            self._migrate()

    def _migrate(self) -> None:
        """Move whole pages from the front of the recent window into the quantized history."""
        s = self.settings
        n = (self.recent_k.shape[2] - s.recent_size) // s.page_size * s.page_size
        if n <= 0:
            return
        new_k = self.codec.quantize_keys(self.recent_k[:, :, :n].float())
        new_v = self.codec.quantize_values(self.recent_v[:, :, :n].float())
        self.hist_k = new_k if self.hist_k is None else cat_rows(self.hist_k, new_k, 2)
        self.hist_v = new_v if self.hist_v is None else cat_rows(self.hist_v, new_v, 2)
        self.recent_k, self.recent_v = self.recent_k[:, :, n:].contiguous(), self.recent_v[:, :, n:].contiguous()

    @property
    def history_len(self) -> int:
        return 0 if self.hist_v is None else self.hist_v.codes.shape[2]

    def segments_before(self, end: int, dtype: torch.dtype = torch.float32):
        """Keys and values of positions [0, end) as stored (history dequantized), concatenated in order."""
        return self.segments(0, end, dtype)

    def segments(self, lo: int, end: int, dtype: torch.dtype = torch.float32):
        """Keys and values of positions [lo, end) as stored, in order: lists of [B, H, n, D] parts.  Only the
        history rows in the range are dequantized (whole key pages with KIVI-style keys)."""
        ks, vs, start = [], [], 0
        parts = [(self.sink_k, self.sink_v, False)]
        if self.hist_k is not None:
            parts.append((self.hist_k, self.hist_v, True))
        parts.append((self.recent_k, self.recent_v, False))
        for k, v, quantized in parts:
            length = v.codes.shape[2] if quantized else k.shape[2]
            a, b = min(max(lo - start, 0), length), min(max(end - start, 0), length)
            if b > a:
                if quantized:
                    ks.append(self._dequantized_keys(k, a, b, dtype))
                    vs.append(self.codec.dequantize_values(v.select(_tokens(a, b)), dtype))
                else:
                    ks.append(k[:, :, a:b].to(dtype))
                    vs.append(v[:, :, a:b].to(dtype))
            start += length
        return ks, vs

    def _dequantized_keys(self, rows: QuantizedRows | SplitRows, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """History keys [a, b) dequantized; KIVI-style keys are quantized per page, so whole pages are read."""
        p = self.codec.key_page
        if p is None:
            return self.codec.dequantize_keys(rows.select(_tokens(a, b)), dtype)
        first = a // p
        pages = self.codec.dequantize_keys(rows.select(_tokens(first, -(-b // p))), dtype)
        return pages[:, :, a - first * p:b - first * p]

    def footprint(self) -> KVFootprint:
        window = sum(t.numel() * t.element_size() for t in (self.sink_k, self.sink_v, self.recent_k, self.recent_v)
                     if t is not None)
        quantized = 0 if self.hist_k is None else self.hist_k.nbytes() + self.hist_v.nbytes()
        b, h, d = (self.sink_k.shape[0], self.sink_k.shape[1], self.sink_k.shape[3]) if self.sink_k is not None else (0, 0, 0)
        return KVFootprint(window_bytes=window, quantized_bytes=quantized, elements=2 * b * h * d * self.seq_len)


def _tokens(a: int, b: int) -> tuple:
    """The index of token rows [a, b) of [B, H, T, ...] tensors."""
    return slice(None), slice(None), slice(a, b)


class OscarCache(Cache):
    """A transformers ``Cache`` for ``model.generate(..., cache=OscarCache(model, rotations))`` (``past_key_values=``
    before transformers 5.24; hf_compat.cache_kwargs picks the name).

    Constructing it prepares the model once (folds R_V / mu_V into v_proj / o_proj and selects the
    ``oscar_kv`` attention).  Without ``rotations`` the keys are stored unrotated and uncentered.
    """

    def __init__(self, model, rotations: Rotations | None = None, settings: CacheSettings | None = None, **kwargs):
        settings = settings or CacheSettings(**kwargs)
        rotations = validated_artifact(model, rotations)
        prepare_model(model, rotations)
        self.settings, self.rotations = settings, rotations
        key_page = settings.page_size if settings.key_axis == "channel" else None
        codecs = layer_codecs(model, rotations, settings.kv_cache_dtype, settings.group_size, key_page=key_page)
        windows = layer_windows(model.config)
        super().__init__(layers=[OscarCacheLayer(settings, codec, window) for codec, window in zip(codecs, windows)])

    def footprint(self) -> KVFootprint:
        total = KVFootprint(0, 0, 0)
        for layer in self.layers:
            if layer.is_initialized:
                total = total + layer.footprint()
        return total


def prepare_model(model, rotations: Rotations) -> None:
    """Fold the artifact's value transform into the model and route attention through the cache."""
    register_attention()
    fold_values(model, rotations.v_rotation, rotations.v_mean, tag=rotations)
    if model.config._attn_implementation != ATTENTION_KEY:
        model.set_attn_implementation(ATTENTION_KEY)


def unprepare_model(model) -> None:
    """Restore the original weights and exact attention."""
    restore_model(model)
    use_exact_attention(model)


def _mask_for_cache(*args, **kwargs):
    # Always materialize the mask: the attention below has no is_causal shortcut.
    kwargs.pop("allow_is_causal_skip", None)
    return sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)


def register_attention() -> None:
    AttentionInterface.register(ATTENTION_KEY, oscar_attention)
    AttentionMaskInterface.register(ATTENTION_KEY, _mask_for_cache)


def oscar_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Reference attention over an ``OscarCacheLayer`` (torch, float32).  Returns [B, T, Hq, D].

    A query at position p sees the keys at positions (p - window, p] of a sliding-window layer, [0, p] otherwise;
    transformers' mask (sliding for such layers) holds the same band, and padding."""
    if not isinstance(key, OscarCacheLayer):  # a forward without our cache: plain tensors, exact attention
        return exact_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit softcapping (Gemma 2) is not supported by the oscar_kv cache")
    layer = key
    chunk_k, chunk_v, start = layer.chunk
    layer.chunk = None
    t = query.shape[2]
    scaling = query.shape[3]**-0.5 if scaling is None else scaling
    window = layer.window
    # the oldest position any query of this chunk sees: nothing before it is read or dequantized
    lo = 0 if window is None else max(start - window + 1, 0)
    ks, vs = layer.segments(lo, start)
    keys = layer.codec.restore_offsets(torch.cat(ks + [chunk_k.float()], 2), first=lo)  # [B, Hkv, N, D]
    values = torch.cat(vs + [chunk_v.float()], 2)
    n = keys.shape[2]  # positions lo .. start + t - 1

    def band(logits, fill):
        pos_q = torch.arange(start, start + t, device=query.device)[:, None]
        pos_k = torch.arange(lo, lo + n, device=query.device)[None, :]
        allowed = pos_k <= pos_q
        if window is not None:
            allowed = allowed & (pos_k > pos_q - window)
        return logits.masked_fill(~allowed, fill)

    def mask(logits):
        if attention_mask is None:
            return band(logits, float("-inf"))
        fill = torch.finfo(torch.float32).min
        if window is not None and t > 1:  # the model's mask has the band already; this keeps it if a mask lacks it
            logits = band(logits, fill)
        if attention_mask.dtype == torch.bool:
            return logits.masked_fill(~attention_mask[:, :, None, :, -n:], fill)
        return logits + attention_mask[:, :, None, :, -n:].float()

    out = stored_attention(layer.codec.rotate_queries(query), keys, values, scaling, mask)
    return out.transpose(1, 2).to(query.dtype).contiguous(), None
