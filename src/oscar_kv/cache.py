"""The mixed-precision KV cache for transformers' ``generate()``: BF16 sink + INT2 history + BF16 recent.

Everything is stored in the rotated, centered space of the artifact:
  keys   (k - mu_K - RoPE_p(mu_pre)) @ R_K   (rotated here, at write time; post-RoPE keys cannot be
         folded; the RoPE_p term is zero unless the artifact centers keys per position, rope.py)
  values (v - mu_V) @ R_V   (already so when they arrive: folded into v_proj, see folding.py)
Per layer and sequence the positions are laid out as
  [0, s)          sink, window dtype (BF16 by default)
  [s, s + n)      history, packed INT2 codes + float16 scale/min (quant.py), nothing else kept
  [s + n, T)      recent window, window dtype; it holds between W and W + P - 1 tokens and hands
                  its oldest P tokens (one page) to the history whenever it reaches W + P.
Attention (``oscar_attention``) rotates the query, dequantizes the history inside the call and
attends to the tokens of the current forward exactly (as a fused prefill kernel does).
Constant centering needs no correction term: every stored key is centered, so q.mu_K adds the same
constant to all logits of a query and cancels in softmax; likewise the values' mean is restored by
o_proj's bias.  The position-aware offset does not cancel: attention adds it back exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .artifacts import Rotations
from .config import KV_CACHE_DTYPES, KVCacheDtype
from .errors import ConfigError
from .folding import fold_values, restore_model
from .memory import KVFootprint
from .models import AttentionGeometry
from .quant import QuantizedRows, dequantize_rows, quantize_rows
from .rope import RopeTable, kernel_pairs, key_offsets

ATTENTION_KEY = "oscar_kv"


@dataclass(frozen=True)
class CacheSettings:
    """How tokens are stored.  ``kv_cache_dtype='bf16'`` keeps every token in the window dtype."""

    kv_cache_dtype: KVCacheDtype = "int2"
    sink_size: int = 64
    recent_size: int = 256
    page_size: int = 16
    window_dtype: torch.dtype = torch.bfloat16
    # "token": one scale/min per token x head x channel group (OSCAR).  "channel": KIVI-style keys,
    # one scale/min per channel over each page of tokens (values stay per token).
    key_axis: str = "token"

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
                              "kv_cache_dtype")
        if self.key_axis not in ("token", "channel"):
            raise ValueError("key axis must be 'token' or 'channel'")
        if self.sink_size < 0 or self.recent_size < 0 or self.page_size < 1:
            raise ValueError("sink and recent sizes must be >= 0 and the page size >= 1")

    @property
    def bits(self) -> int:
        return {"bf16": 16, "int2": 2, "int4": 4, "int8": 8}[self.kv_cache_dtype]


class OscarCacheLayer(CacheLayerMixin):
    """One layer's storage.  ``update`` returns the layer itself; ``oscar_attention`` reads it."""

    is_compileable = False
    is_sliding = False

    def __init__(self, settings: CacheSettings, bits: int, group_size: int, k_rotation: torch.Tensor,
                 k_mean: torch.Tensor, k_clip: torch.Tensor, v_clip: torch.Tensor,
                 k_rope_mean: torch.Tensor | None = None, rope: RopeTable | None = None,
                 k_rescale: float = 0.0, v_rescale: float = 0.0):
        super().__init__()
        self.settings, self.bits, self.group_size = settings, bits, group_size
        self.k_rescale, self.v_rescale = k_rescale, v_rescale  # quant.quantize_rows' rescale strength per side
        self.k_rotation, self.k_mean = k_rotation, k_mean  # [H|1, D, D] fp32, [Hkv, D] fp32
        # position-aware centering (rope.py): mu_pre [Hkv, D] and the model's cos/sin, or None
        self.k_rope_mean = k_rope_mean if k_rope_mean is not None and k_rope_mean.abs().max() > 0 else None
        if self.k_rope_mean is not None and rope is None:
            raise ValueError("position-aware key centering needs the model's RoPE table")
        self.rope = rope
        # the pairs the INT2 kernels visit (rope.kernel_pairs), found once: finding them syncs the device
        self.rope_pairs = kernel_pairs(self.k_rope_mean) if self.k_rope_mean is not None else None
        self.k_clip, self.v_clip = k_clip, v_clip  # [Hkv] (broadcast over batch and tokens)
        self.sink_k = self.sink_v = self.recent_k = self.recent_v = None
        self.hist_k: QuantizedRows | None = None
        self.hist_v: QuantizedRows | None = None
        self.seq_len = 0
        self.chunk = None  # (keys, values, start) of the forward in flight, read once by attention

    def keep_heads(self, heads: slice) -> None:
        """Keep only KV heads ``heads`` (a tensor-parallel rank's block, parallel.py); a full slice is a no-op."""
        for name in ("k_mean", "k_clip", "v_clip", "k_rope_mean", "rope_pairs"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[heads])
        if self.k_rotation.shape[0] > 1:  # one rotation per head, not one shared by all
            self.k_rotation = self.k_rotation[heads]

    # ---- transformers' layer protocol ----------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        b, h, _, d = key_states.shape
        empty = key_states.new_zeros((b, h, 0, d), dtype=self.settings.window_dtype)
        self.sink_k, self.sink_v, self.recent_k, self.recent_v = empty, empty.clone(), empty.clone(), empty.clone()
        self.k_rotation = self.k_rotation.to(key_states.device)
        self.k_mean = self.k_mean.to(key_states.device)
        if self.k_rope_mean is not None:
            self.k_rope_mean = self.k_rope_mean.to(key_states.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        positions = torch.arange(self.seq_len, self.seq_len + key_states.shape[2], device=key_states.device)
        keys = self.rotate_keys(key_states, positions)
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
    @property
    def quantizes(self) -> bool:
        return self.bits < 16

    def rotate_keys(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(k - offset_p) @ R_K per KV head for keys [B, H, T, D] at ``positions`` [T].  Float64 makes
        each token's result independent of how many tokens are rotated together, so the stored codes
        do not depend on chunking."""
        centered = k.double() - self.k_mean[None, :, None, :].double()
        if self.k_rope_mean is not None:
            centered = centered - key_offsets(self.k_rope_mean, *self.rope(positions)).double()
        rot = self._per_head(self.k_rotation, k.shape[1]).double()
        return torch.einsum("bhtd,hde->bhte", centered, rot).float()

    def restore_offsets(self, keys: torch.Tensor) -> torch.Tensor:
        """Stored keys [B, H, N, D] of positions 0..N-1 -> the same keys with the position-aware offset
        added back (rotated), so that q_rot . key equals the logit of the original key."""
        if self.k_rope_mean is None:
            return keys  # a constant offset cancels in softmax
        n = keys.shape[2]
        offsets = key_offsets(self.k_rope_mean, *self.rope(torch.arange(n, device=keys.device)))
        rot = self._per_head(self.k_rotation, keys.shape[1]).float()
        return keys + torch.einsum("htd,hde->hte", offsets, rot)[None]

    def rotate_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q @ R_K of each query head's KV head; q is [B, Hq, T, D]."""
        b, hq, t, d = q.shape
        hkv = self.k_mean.shape[0]
        grouped = q.float().reshape(b, hkv, hq // hkv, t, d)
        return torch.einsum("bhgtd,hde->bhgte", grouped, self._per_head(self.k_rotation, hkv)).reshape(b, hq, t, d)

    @staticmethod
    def _per_head(r: torch.Tensor, heads: int) -> torch.Tensor:
        return r.expand(heads, *r.shape[1:]) if r.shape[0] == 1 else r

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        wdt = self.settings.window_dtype
        keys, values = keys.to(wdt), values.to(wdt)
        room = max(self.settings.sink_size - self.sink_k.shape[2], 0) if self.quantizes else 0
        if room:
            self.sink_k = torch.cat([self.sink_k, keys[:, :, :room]], 2)
            self.sink_v = torch.cat([self.sink_v, values[:, :, :room]], 2)
            keys, values = keys[:, :, room:], values[:, :, room:]
        self.recent_k = torch.cat([self.recent_k, keys], 2)
        self.recent_v = torch.cat([self.recent_v, values], 2)
        self.seq_len += self.chunk[0].shape[2]
        if self.quantizes:
            self._migrate()

    def _migrate(self) -> None:
        """Move whole pages from the front of the recent window into the quantized history."""
        s = self.settings
        n = (self.recent_k.shape[2] - s.recent_size) // s.page_size * s.page_size
        if n <= 0:
            return
        clip_k = self.k_clip[None, :, None]
        clip_v = self.v_clip[None, :, None]
        new_k = self._quantize_keys(self.recent_k[:, :, :n].float(), clip_k)
        new_v = quantize_rows(self.recent_v[:, :, :n].float(), self.bits, self.group_size, clip_v, self.v_rescale)
        self.hist_k = new_k if self.hist_k is None else _cat_rows(self.hist_k, new_k)
        self.hist_v = new_v if self.hist_v is None else _cat_rows(self.hist_v, new_v)
        self.recent_k, self.recent_v = self.recent_k[:, :, n:].contiguous(), self.recent_v[:, :, n:].contiguous()

    def _quantize_keys(self, keys: torch.Tensor, clip: torch.Tensor) -> QuantizedRows:
        if self.settings.key_axis == "token":
            return quantize_rows(keys, self.bits, self.group_size, clip, self.k_rescale)
        # per channel over each page: rows are (page, channel) of length page_size; no clipping
        b, h, n, d = keys.shape
        p = self.settings.page_size
        pages = keys.reshape(b, h, n // p, p, d).transpose(-1, -2)  # [B, H, pages, D, P]
        return quantize_rows(pages, self.bits, p)

    def _dequantize_keys(self, q: QuantizedRows, dtype: torch.dtype) -> torch.Tensor:
        x = dequantize_rows(q, dtype)
        if self.settings.key_axis == "token":
            return x
        b, h, pages, d, p = x.shape
        return x.transpose(-1, -2).reshape(b, h, pages * p, d)

    @property
    def history_len(self) -> int:
        return 0 if self.hist_v is None else self.hist_v.codes.shape[2]

    def segments_before(self, end: int, dtype: torch.dtype = torch.float32):
        """Keys and values of positions [0, end) as stored (history dequantized), concatenated in order."""
        ks, vs, start = [], [], 0
        parts = [(self.sink_k, self.sink_v, None)]
        if self.hist_k is not None:
            parts.append((self.hist_k, self.hist_v, "q"))
        parts.append((self.recent_k, self.recent_v, None))
        for k, v, kind in parts:
            length = v.codes.shape[2] if kind else k.shape[2]
            take = min(max(end - start, 0), length)
            if take:
                sl = (slice(None), slice(None), slice(0, take))
                if kind:
                    ks.append(self._dequantize_keys(k, dtype)[:, :, :take])
                    vs.append(dequantize_rows(v.select(sl), dtype))
                else:
                    ks.append(k[:, :, :take].to(dtype))
                    vs.append(v[:, :, :take].to(dtype))
            start += length
        return ks, vs

    def footprint(self) -> KVFootprint:
        window = sum(t.numel() * t.element_size() for t in (self.sink_k, self.sink_v, self.recent_k, self.recent_v)
                     if t is not None)
        quantized = 0 if self.hist_k is None else self.hist_k.nbytes() + self.hist_v.nbytes()
        b, h, d = (self.sink_k.shape[0], self.sink_k.shape[1], self.sink_k.shape[3]) if self.sink_k is not None else (0, 0, 0)
        return KVFootprint(window_bytes=window, quantized_bytes=quantized, elements=2 * b * h * d * self.seq_len)


def _cat_rows(a: QuantizedRows, b: QuantizedRows) -> QuantizedRows:
    return QuantizedRows(torch.cat([a.codes, b.codes], 2), torch.cat([a.scale, b.scale], 2),
                         torch.cat([a.minimum, b.minimum], 2), a.bits, a.group_size)


class OscarCache(Cache):
    """A transformers ``Cache`` for ``model.generate(..., past_key_values=OscarCache(model, rotations))``.

    Constructing it prepares the model once (folds R_V / mu_V into v_proj / o_proj and selects the
    ``oscar_kv`` attention).  Without ``rotations`` the keys are stored unrotated and uncentered.
    """

    def __init__(self, model, rotations: Rotations | None = None, settings: CacheSettings | None = None, **kwargs):
        settings = settings or CacheSettings(**kwargs)
        geometry = AttentionGeometry.of(model.config)
        if rotations is None:
            rotations = Rotations.data_free(geometry, "identity")
        rotations.validate(geometry)
        prepare_model(model, rotations)
        self.settings, self.rotations = settings, rotations
        rope = RopeTable(model, geometry.head_dim) if rotations.key_centering == "rope" else None
        layers = []
        for i in range(geometry.num_layers):
            bits = settings.bits if settings.bits == 16 else max(settings.bits, int(rotations.layer_bits[i]))
            layers.append(OscarCacheLayer(settings, bits, rotations.group_size, rotations.k_rotation[i].float(),
                                          rotations.k_mean[i].float(), rotations.k_clip[i].float(),
                                          rotations.v_clip[i].float(), rotations.k_rope_mean[i].float(), rope,
                                          rotations.k_rescale, rotations.v_rescale))
        super().__init__(layers=layers)

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
    """Restore the original weights and SDPA attention."""
    restore_model(model)
    model.set_attn_implementation("sdpa")


def _mask_for_cache(*args, **kwargs):
    # Always materialize the mask: the attention below has no is_causal shortcut.
    kwargs.pop("allow_is_causal_skip", None)
    return sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)


def register_attention() -> None:
    AttentionInterface.register(ATTENTION_KEY, oscar_attention)
    AttentionMaskInterface.register(ATTENTION_KEY, _mask_for_cache)


def oscar_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Reference attention over an ``OscarCacheLayer`` (torch, float32).  Returns [B, T, Hq, D]."""
    if not isinstance(key, OscarCacheLayer):  # a forward without our cache: plain tensors, exact SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    layer = key
    chunk_k, chunk_v, start = layer.chunk
    layer.chunk = None
    b, hq, t, d = query.shape
    hkv = chunk_k.shape[1]
    scaling = d**-0.5 if scaling is None else scaling
    ks, vs = layer.segments_before(start)
    keys = layer.restore_offsets(torch.cat(ks + [chunk_k.float()], 2))  # [B, Hkv, N, D]
    values = torch.cat(vs + [chunk_v.float()], 2)
    q = layer.rotate_queries(query).reshape(b, hkv, (hq // hkv) * t, d)
    logits = (q @ keys.transpose(-1, -2)) * scaling  # [B, Hkv, g*T, N]
    logits = logits.reshape(b, hkv, hq // hkv, t, -1)
    n = keys.shape[2]
    if attention_mask is None:
        pos_q = torch.arange(start, start + t, device=query.device)
        allowed = torch.arange(n, device=query.device)[None, :] <= pos_q[:, None]
        logits = logits.masked_fill(~allowed, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        logits = logits.masked_fill(~attention_mask[:, :, None, :, -n:], torch.finfo(torch.float32).min)
    else:
        logits = logits + attention_mask[:, :, None, :, -n:].float()
    probs = torch.softmax(logits, dim=-1).reshape(b, hkv, -1, n)
    out = (probs @ values).reshape(b, hq, t, d)
    return out.transpose(1, 2).to(query.dtype).contiguous(), None
