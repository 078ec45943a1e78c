"""How calibration scores an artifact on the held-back probe: each layer's attention error, and the clip ratios
fitted to it.  Shared by the key-centering choice and the validation table (calibrate.py) and the width choice
(width_choice.py).
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from .activations import LayerSample, clip_candidate_errors, quantized_attention_error
from .artifacts import Rotations

CLIP_CANDIDATES = (1.0, 0.98, 0.96, 0.94, 0.92, 0.90, 0.88, 0.85, 0.80)
# How the held-back probe is scored: every position, every key past the sink INT2.  Scoring it as served
# instead (4096 tokens, recent window exact, the last 256 queries) chose harsher key clips on Qwen2.5 that shrank
# the needle's logit more (-1.5 -> -1.7 nats at the retrieval heads) and did not retrieve better
# (benchmarks/NOTES.md, "Long context"); the attention-output error favours clipping that retrieval pays for.
PROBE_QUERIES = None
PROBE_SINK, PROBE_RECENT = 64, 0


def layer_error(rot: Rotations, sample: LayerSample, layer: int, k_clip=None, v_clip=None, **kwargs) -> float:
    """The probe's attention error of ``layer`` with each side stored at the artifact's width (16: at 2, as the
    validation table compares schemes at INT2; split keys at their SplitWidth)."""
    k_bits, v_bits = (b if b < 16 else 2 for b in rot.side_bits(layer))
    k_bits = rot.key_split(layer) or k_bits
    return quantized_attention_error(
        sample, rot.k_rotation[layer], rot.v_rotation[layer],
        sample.key_offset(rot.k_mean[layer], rot.k_rope_mean[layer]), rot.v_mean[layer],
        rot.k_clip[layer] if k_clip is None else k_clip, rot.v_clip[layer] if v_clip is None else v_clip,
        bits=k_bits, value_bits=v_bits, group_size=rot.group_size, sink_size=PROBE_SINK, recent_size=PROBE_RECENT,
        queries=PROBE_QUERIES, rescale=(rot.k_rescale, rot.v_rescale), **kwargs)


def fit_clip_ratios(rot: Rotations, probe: list[LayerSample], progress: bool = True,
                    sides: tuple[str, ...] = ("k", "v")) -> None:
    """Set ``rot``'s k_clip / v_clip in place: per layer (and KV head when rotations are per head), the ratio of
    CLIP_CANDIDATES that minimizes the attention output error on the held-back ``probe`` (one LayerSample per
    layer) with that side stored at its width (k_bits / v_bits; a layer at 16 bits keeps its clips), keys and
    values separately.  ``sides``: which of "k" and "v" to fit."""
    hkv = rot.geometry.num_kv_heads
    per_head = rot.scope == "per-head"
    candidates = torch.tensor(CLIP_CANDIDATES)
    for layer in tqdm(range(rot.geometry.num_layers), desc="fitting clip ratios", disable=not progress):
        sample = probe[layer]
        offset = sample.key_offset(rot.k_mean[layer], rot.k_rope_mean[layer])
        for which, bits in zip(("k", "v"), rot.side_bits(layer)):
            if which not in sides or bits == 16:
                continue
            errors = torch.stack([clip_candidate_errors(
                sample, h, rot.k_rotation[layer], rot.v_rotation[layer], offset, rot.v_mean[layer], which,
                candidates, bits, rot.group_size, PROBE_SINK, PROBE_RECENT, PROBE_QUERIES,
                getattr(rot, f"{which}_rescale")) for h in range(hkv)])
            clips = getattr(rot, f"{which}_clip")
            if per_head:
                clips[layer] = candidates[errors.argmin(-1)]
            else:  # one clip for the layer's heads
                clips[layer, :] = candidates[errors.sum(0).argmin()]

