"""One layer's codec: the map between the model's keys and values and the form the KV cache stores.

Built once from a rotation artifact (``layer_codecs``) and shared by everything that writes or reads a
cache: the generate() cache (cache.py), the engine (engine/), the evaluation and the kernels' references.
Stored form, per KV head:
  keys    (k - mu_K - RoPE_p(mu_pre)) @ R_K   rotated here (post-RoPE keys cannot be folded into k_proj); the
          RoPE_p term is zero unless the artifact centers keys per position (rope.py)
  values  (v - mu_V) @ R_V                    already so when they arrive: folded into v_proj (folding.py)
Queries are rotated by the same R_K, so q @ R_K . stored key is the logit of the centered key.  The constant
mean cancels in softmax; the per-position offset does not, and attention adds it back (``restore_offsets``).
Rows leaving the BF16 windows are clipped per KV head and quantized per token x head x group of channels
(quant.py); KIVI-style keys instead per channel over pages of tokens (``key_page``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from .artifacts import ArtifactError, Rotations
from .config import KV_CACHE_BITS
from .errors import ConfigError
from .models import AttentionGeometry
from .quant import (QuantizedRows, SplitRows, SplitWidth, dequantize_rows, dequantize_split, quantize_rows,
                    quantize_split)
from .rope import RopeTable, RopeUnsupported, kernel_pairs, layer_rope_tables
from .kernels import split_keys
from .rotation import rotate


@dataclass
class LayerCodec:
    """One layer's rotation, means, per-position offsets, clips, bits and group.

    Shapes: k_rotation [H | 1, D, D] float32; k_mean, k_rope_mean [Hkv, D]; k_clip, v_clip [Hkv]; rope_pairs
    [Hkv, R] int32.  Rows handed to ``quantize_*`` carry the KV head in dim 1 ([B, Hkv, T, D] or [N, Hkv, D]).
    """

    k_bits: int  # of the quantized history's keys; 16: nothing is quantized
    group_size: int  # channels sharing one scale / zero point
    k_rotation: torch.Tensor
    k_mean: torch.Tensor
    k_clip: torch.Tensor  # clip ratio of each KV head's rows
    v_clip: torch.Tensor
    k_rescale: float = 0.0  # quant.quantize_rows' rescale strength per side
    v_rescale: float = 0.0
    k_rope_mean: torch.Tensor | None = None  # mu_pre of position-aware centering, None: constant centering only
    rope: RopeTable | None = None  # this layer's cos / sin (with k_rope_mean), shared by the layers of its RoPE
    rope_pairs: torch.Tensor | None = None  # rope.kernel_pairs(k_rope_mean), found once: finding them syncs the device
    # KIVI: keys quantized per channel over pages of this many tokens, unclipped; keys and values in KIVI's own format
    # (a float16 scale and minimum a group, quant.quantize_rows(float_minimum=True))
    key_page: int | None = None
    # keys are stored as they come (identity rotation, no centering: a BF16 cache without an artifact), so the
    # kernels skip the rotation (computed once here: testing it on the device syncs)
    keys_as_is: bool = dataclasses.field(init=False, default=False)
    v_bits: int | None = None  # of the quantized history's values; None: as the keys
    # keys at two widths (quant.SplitWidth; its ``bits`` is k_bits): the rotation puts the queries' top
    # eigen-directions first (rotation.compose_split); None: every channel at k_bits
    k_split: SplitWidth | None = None

    def __post_init__(self):
        if self.v_bits is None:
            self.v_bits = self.k_bits
        if (self.k_bits == 16) != (self.v_bits == 16):
            raise ConfigError(f"keys at {self.k_bits} bits and values at {self.v_bits}: a layer quantizes both or neither")
        if self.k_split is not None and (self.k_split.bits != self.k_bits or self.key_page is not None):
            raise ConfigError(f"split keys {self.k_split} need k_bits {self.k_split.bits} and per-token rows")
        eye = torch.eye(self.k_rotation.shape[-1], device=self.k_rotation.device)
        self.keys_as_is = (self.k_rope_mean is None and not bool(self.k_mean.any())
                           and bool((self.k_rotation == eye).all()))
        if self.k_rope_mean is not None:
            if self.rope is None:
                raise RopeUnsupported("position-aware key centering needs the model's RoPE table")
            if self.rope_pairs is None:
                self.rope_pairs = kernel_pairs(self.k_rope_mean, self.rope.layout)

    @property
    def quantizes(self) -> bool:
        return self.k_bits < 16

    @property
    def num_kv_heads(self) -> int:
        return self.k_mean.shape[0]

    def keep_heads(self, heads: slice) -> "LayerCodec":
        """The codec of KV heads ``heads`` only (a tensor-parallel rank's block, parallel.py)."""
        parts = {name: getattr(self, name)[heads] for name in ("k_mean", "k_clip", "v_clip", "k_rope_mean", "rope_pairs")
                 if getattr(self, name) is not None}
        if self.k_rotation.shape[0] > 1:  # one rotation per head, not one shared by all
            parts["k_rotation"] = self.k_rotation[heads]
        return dataclasses.replace(self, **parts)

    def to(self, device) -> "LayerCodec":
        parts = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **parts)

    # ---- rotation ------------------------------------------------------------------------------
    def rotate_keys(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Stored keys of post-RoPE keys ``k`` [B, Hkv, T, D] at ``positions`` [T]: float32 (k - offset_p) @ R_K.
        Float64 makes each token's result independent of how many tokens are rotated together, so the stored
        codes do not depend on chunking."""
        centered = k.double() - self.k_mean[None, :, None, :].double()
        if self.k_rope_mean is not None:
            centered = centered - self.rope.offsets(self.k_rope_mean, positions).double()
        return rotate(centered, self.k_rotation.double()).float()

    def restore_offsets(self, keys: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Stored keys [B, Hkv, N, D] of positions first..first+N-1 -> the same keys with the position-aware offset
        added back (rotated), so that a rotated query's dot with them is the logit of the original key."""
        if self.k_rope_mean is None:
            return keys  # a constant offset cancels in softmax
        n = keys.shape[2]
        offsets = self.rope.offsets(self.k_rope_mean, torch.arange(first, first + n, device=keys.device))
        return keys + rotate(offsets, self.k_rotation.float())[None]

    def rotate_queries(self, q: torch.Tensor) -> torch.Tensor:
        """float32 q @ R_K of each query head's KV head; q is [B, Hq, T, D]."""
        b, hq, t, d = q.shape
        grouped = q.float().reshape(b, self.num_kv_heads, (hq // self.num_kv_heads) * t, d)
        return rotate(grouped, self.k_rotation).reshape(b, hq, t, d)

    def model_space_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Stored keys [Hkv, N, D] of positions 0..N-1 back in the model's space (post-RoPE, mean restored)."""
        restored = self.restore_offsets(keys[None])[0]
        return rotate(restored, self.k_rotation.to(keys.device).transpose(-1, -2)) + self.k_mean[:, None].to(keys.device)

    # ---- quantization --------------------------------------------------------------------------
    def quantize_keys(self, rows: torch.Tensor) -> QuantizedRows | SplitRows:
        """Rotated keys as the history stores them; per channel over pages: rows [B, Hkv, N, D], N whole pages."""
        if self.k_split is not None:
            return quantize_split(rows, self.k_split, _clip_per_row(self.k_clip, rows), self.k_rescale)
        if self.key_page is None:
            return quantize_rows(rows, self.k_bits, self.group_size, _clip_per_row(self.k_clip, rows), self.k_rescale)
        b, h, n, d = rows.shape
        p = self.key_page
        pages = rows.reshape(b, h, n // p, p, d).transpose(-1, -2)  # [B, H, pages, D, P]: a row is one channel
        return quantize_rows(pages, self.k_bits, p, float_minimum=True)

    def quantize_values(self, rows: torch.Tensor) -> QuantizedRows:
        return quantize_rows(rows, self.v_bits, self.group_size, _clip_per_row(self.v_clip, rows), self.v_rescale,
                             float_minimum=self.key_page is not None)

    def dequantize_keys(self, q: QuantizedRows | SplitRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if isinstance(q, SplitRows):
            return dequantize_split(q, dtype)
        x = dequantize_rows(q, dtype)
        if self.key_page is None:
            return x
        b, h, pages, d, p = x.shape
        return x.transpose(-1, -2).reshape(b, h, pages * p, d)

    def dequantize_values(self, q: QuantizedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_rows(q, dtype)

    def stored_rows(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    which: str) -> QuantizedRows | SplitRows:
        """Rows of ``which`` ("k" or "v") read back from a pool: packed codes, scales and zero points (split keys
        as kernels/split_keys.py lays them out)."""
        if which == "k" and self.k_split is not None:
            return split_keys.unpack(codes, scale, zero, self.k_split, self._head_dim(codes))
        bits = self.k_bits if which == "k" else self.v_bits
        return QuantizedRows(codes, scale, zero, bits, self.group_size)

    def store_codes(self, pages: torch.Tensor, index: tuple, codes: torch.Tensor, which: str) -> None:
        """Write rows of codes (``pool_rows``) into a pool's pages [N, H, P, bytes] of ``which`` at ``index``
        (split keys: each page's plain rows, then its tails, kernels/split_keys.py)."""
        if which == "k" and self.k_split is not None:
            split_keys.store_rows(pages, index, codes, self.k_split, self._head_dim(pages))
        else:
            pages[index] = codes

    def load_codes(self, pages: torch.Tensor, index: tuple, which: str) -> torch.Tensor:
        """Rows of codes read from a pool's pages at ``index`` (``store_codes``' inverse)."""
        if which == "k" and self.k_split is not None:
            return split_keys.load_rows(pages, index, self.k_split, self._head_dim(pages))
        return pages[index]

    def _head_dim(self, pages: torch.Tensor) -> int:
        return split_keys.head_dim_of(self.k_split, pages.shape[-1])

    @staticmethod
    def pool_rows(q: QuantizedRows | SplitRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scale, zero) of quantized rows as a pool stores them (split keys: kernels/split_keys.py; their
        scale and zero point fill group 0)."""
        if isinstance(q, SplitRows):
            return split_keys.pack(q)
        return q.codes, q.scale, q.zero


def stored_attention(q_rot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                     mask: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Attention in the stored space, float32: what the kernels compute, in torch.

    Args:
        q_rot: rotated queries (``LayerCodec.rotate_queries``).
        keys, values: as stored, keys with their offsets restored (``restore_offsets``).
        scaling: the softmax scale of the logits.
        mask: applied to the logits before softmax; None: every key is seen.
    Shapes:
        q_rot: [B, Hq, T, D]; keys, values: [B, Hkv, N, D]; the logits ``mask`` takes: [B, Hkv, Hq / Hkv, T, N].
    Returns:
        [B, Hq, T, D] in the operands' dtype.
    """
    b, hq, t, d = q_rot.shape
    hkv, n = keys.shape[1], keys.shape[2]
    logits = (q_rot.reshape(b, hkv, (hq // hkv) * t, d) @ keys.transpose(-1, -2)) * scaling
    logits = logits.reshape(b, hkv, hq // hkv, t, n)
    if mask is not None:
        logits = mask(logits)
    probs = torch.softmax(logits, dim=-1).reshape(b, hkv, -1, n)
    return (probs @ values).reshape(b, hq, t, d)


def _clip_per_row(clip: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Clip ratios [Hkv] shaped to broadcast over ``rows``' leading dims (the KV head in dim 1)."""
    return clip.view(clip.shape[0], *[1] * (rows.dim() - 3))


def validated_artifact(model, rotations: Rotations | None) -> Rotations:
    """``rotations`` checked against the model's attention geometry; None: identity rotations, no centering
    (keys stored as they come)."""
    geometry = AttentionGeometry.of(model.config)
    if rotations is None:
        rotations = Rotations.data_free(geometry, "identity")
    rotations.validate(geometry)
    return rotations


def _split_at(split: SplitWidth | None, least: int) -> SplitWidth | None:
    """A layer's split keys when the cache's precision is at most its narrow part's; None when it is wider (the layer
    then stores every channel at that precision; the rotation stays, as any rotation may)."""
    return split if split is not None and least <= split.bits else None


def shared_ropes(codecs: list["LayerCodec"]) -> list[RopeTable]:
    """The RoPE tables of the codecs that center keys per position (one object per RoPE the layers use)."""
    return list({id(c.rope): c.rope for c in codecs if c.k_rope_mean is not None}.values())


def layer_codecs(model, rotations: Rotations, kv_cache_dtype: str, group_size: int | None = None,
                 key_page: int | None = None) -> list[LayerCodec]:
    """Every layer's codec from a validated artifact (``validated_artifact``).

    Args:
        model: the model the artifact is for (its RoPE, when the artifact centers keys per position).
        rotations: the artifact.
        kv_cache_dtype: the history's precision; a layer (keys or values) the artifact keeps wider keeps its own bits.
        group_size: channels per scale / zero point (default: the artifact's).
        key_page: quantize keys per channel over pages of this many tokens (KIVI) instead of per token.
    Returns:
        One LayerCodec per layer, tensors float32 on the artifact's device.
    """
    bits = KV_CACHE_BITS[kv_cache_dtype]
    geometry = rotations.geometry
    group_size = group_size or rotations.group_size
    if geometry.head_dim % group_size:
        raise ConfigError(f"group_size {group_size} must divide the head dim {geometry.head_dim}", "group_size")
    ropes = (layer_rope_tables(model, geometry.head_dim) if rotations.key_centering == "rope"
             else [None] * geometry.num_layers)
    if ropes[0] is not None and ropes[0].layout != rotations.rotary_layout:
        raise ArtifactError(f"the artifact centers keys for RoPE {rotations.rotary_layout.as_dict()}, the model's is "
                            f"{ropes[0].layout.as_dict()} (recalibrate for this model)")
    codecs = []
    def width(stored: int) -> int:
        return 16 if bits == 16 or stored == 16 else max(bits, stored)

    for i in range(geometry.num_layers):
        k_rope_mean = rotations.k_rope_mean[i].float()
        k_bits, v_bits = rotations.side_bits(i)
        codecs.append(LayerCodec(
            width(k_bits), group_size,
            # contiguous once here: the write kernel takes R_K contiguous, and would copy it per layer and step
            rotations.k_rotation[i].float().contiguous(), rotations.k_mean[i].float(), rotations.k_clip[i].float(),
            rotations.v_clip[i].float(), rotations.k_rescale, rotations.v_rescale,
            k_rope_mean if k_rope_mean.abs().max() > 0 else None, ropes[i], key_page=key_page, v_bits=width(v_bits),
            k_split=None if key_page else _split_at(rotations.key_split(i), bits)))
    return codecs
