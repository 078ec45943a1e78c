"""The KV schemes the harness compares, all at the same windows unless an ablation says otherwise.

Standard names (DESIGN.md): bf16, int4, naive-int2, quarot-int2, kivi-2, oscar.  Ablations are
OSCAR variants fitted from the same calibration statistics (one pass over the model), so only the
ablated choice differs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch

from ..artifacts import DEFAULT_K_CLIP, DEFAULT_V_CLIP, Rotations
from ..cache import CacheSettings
from ..calibrate import Statistics, fit_rotations
from ..calibration_settings import CalibrationSettings
from ..errors import ConfigError
from ..rotation import compose
from ..memory import GROUP_METADATA_BITS, bits_per_element
from ..models import AttentionGeometry
from ..probe import fit_clip_ratios

STANDARD = ("bf16", "int4", "naive-int2", "quarot-int2", "kivi-2", "oscar")
# OSCAR with KIVI-2's 128 BF16 tokens (64 sink + 64 recent): fewer bits than kivi-2 at every length
EQUAL_WINDOWS = "oscar-w128"
KIVI_GROUP = 32  # KIVI: keys per channel over groups of 32 tokens
KIVI_RESIDUAL = 128  # KIVI: full-precision residual of the most recent tokens
# KIVI's own format stores a float16 scale and zero point a group; its bits count that, while its simulation here
# quantizes with ours (quant.py: within 0.6% of that noise at the median, benchmarks/NOTES.md run Z1)
KIVI_GROUP_BITS = 32


@dataclass
class Scheme:
    """A named KV scheme: the rotations it stores with and the cache settings it runs at."""

    name: str
    rotations: Rotations | None  # None: unrotated, uncentered
    settings: CacheSettings = field(default_factory=CacheSettings)
    description: str = ""

    def bits_per_element(self, seq_len: int, geometry: AttentionGeometry) -> float:
        """Mean stored bits per K/V element over a sequence of ``seq_len`` tokens (memory.bits_per_element)."""
        s = self.settings
        group = s.group_size or (self.rotations.group_size if self.rotations else min(geometry.head_dim, 128))
        rot = self.rotations
        kivi = s.key_axis == "channel"
        return bits_per_element(seq_len, geometry.head_dim, group, s.bits, s.sink_size, s.recent_size,
                                k_bits=rot.key_widths() if rot is not None else None,
                                v_bits=rot.v_bits.tolist() if rot is not None else None,
                                key_group_size=s.page_size if kivi else None,
                                group_bits=KIVI_GROUP_BITS if kivi else GROUP_METADATA_BITS)


def standard_scheme(name: str, geometry: AttentionGeometry, oscar: Rotations, base: CacheSettings) -> Scheme:
    """One of the STANDARD schemes, or EQUAL_WINDOWS, by name; ConfigError for another name.

    Args:
        name: the scheme's name.
        geometry: the model's attention geometry (for the data-free rotations).
        oscar: the artifact under evaluation (its group size is every scheme's).
        base: the cache settings the schemes share unless they change them.
    """
    group = oscar.group_size
    if name == "bf16":
        return Scheme(name, None, replace(base, kv_cache_dtype="bf16"), "every token at 16 bits (reference)")
    if name == "int4":
        return Scheme(name, Rotations.data_free(geometry, "identity", group), replace(base, kv_cache_dtype="int4"),
                      "per-token asymmetric INT4, no rotation")
    if name == "naive-int2":
        return Scheme(name, Rotations.data_free(geometry, "identity", group), base, "per-token INT2, no rotation")
    if name == "quarot-int2":
        return Scheme(name, Rotations.data_free(geometry, "hadamard", group, DEFAULT_K_CLIP, DEFAULT_V_CLIP), base,
                      "Hadamard rotation, same clipping as OSCAR")
    if name == "kivi-2":
        return Scheme(name, Rotations.data_free(geometry, "identity", group),
                      replace(base, sink_size=0, recent_size=KIVI_RESIDUAL, page_size=KIVI_GROUP, key_axis="channel"),
                      f"per-channel keys over {KIVI_GROUP}-token groups, per-token values, {KIVI_RESIDUAL}-token FP16 residual")
    artifact = f"the artifact {oscar.source or 'given'} ({oscar.width_summary()})"
    if name == "oscar":
        return Scheme(name, oscar, base, artifact)
    if name == EQUAL_WINDOWS:
        return Scheme(name, oscar, replace(base, sink_size=KIVI_RESIDUAL // 2, recent_size=KIVI_RESIDUAL // 2),
                      f"{artifact} with KIVI-2's {KIVI_RESIDUAL} BF16 tokens (half sink, half recent)")
    raise ConfigError(f"unknown method {name!r}; methods are {', '.join(STANDARD + (EQUAL_WINDOWS,))}")


def with_value_covariance(oscar: Rotations, c_s: torch.Tensor) -> Rotations:
    """A copy of ``oscar`` whose value rotations are refitted from another covariance [L, H, D, D]."""
    rot = copy.deepcopy(oscar)
    composition = oscar.manifest.get("calibration", {}).get("composition", "oscar")
    for layer in range(c_s.shape[0]):
        for h in range(c_s.shape[1]):
            r, lam = compose(c_s[layer, h], c_s.shape[-1], oscar.group_size, composition)
            rot.v_rotation[layer, h], rot.v_eigenvalues[layer, h] = r.float(), lam.float()
    return rot


def with_fitted_clips(oscar: Rotations, probe) -> Rotations:
    """A copy of ``oscar`` with clip ratios fitted on ``probe`` (probe.fit_clip_ratios)."""
    rot = copy.deepcopy(oscar)
    fit_clip_ratios(rot, probe, progress=False)
    return rot


def ablation_schemes(stats: Statistics, calibration: CalibrationSettings, oscar: Rotations,
                     base: CacheSettings, proxy_c_s: torch.Tensor | None = None, probe=None) -> list[Scheme]:
    """OSCAR variants that each change one choice, fitted from the same statistics.

    Args:
        stats: the calibration statistics the artifact was fitted from (recomputed by the harness).
        calibration: the artifact's calibration settings.
        oscar: the artifact.
        base: the cache settings the variants share unless they change them.
        proxy_c_s: the authors' logit-squared value covariance; None: no such variant.
        probe: held-back activations (one LayerSample per layer) for fitting clip ratios; None: no clip variant.
    Shapes:
        proxy_c_s: [L, Hkv, D, D].
    """

    def fitted(name, description, settings_change=None, group=None, cache=base):
        settings = replace(calibration, **(settings_change or {}))
        rot = fit_rotations(stats, settings, group or oscar.group_size)
        if settings.clip == "fixed" and oscar.manifest.get("calibration", {}).get("clip") == "fit" and not settings_change:
            rot.k_clip, rot.v_clip = oscar.k_clip.clone(), oscar.v_clip.clone()
        return Scheme(name, rot, cache, description)

    half = max(oscar.group_size // 2, 8)
    out = [
        Scheme("oscar-no-windows", oscar, replace(base, sink_size=0, recent_size=0), "no BF16 sink or recent window"),
        fitted("oscar-no-key-centering", "keys not centered", {"key_centering": "off"}),
        fitted("oscar-no-centering", "neither keys nor values centered", {"key_centering": "off", "center_values": False}),
        fitted("oscar-u-only", "eigenbasis U alone, no Hadamard", {"composition": "u"}),
        fitted("oscar-per-layer", "one rotation per layer (covariances averaged over heads)", {"rotation_scope": "per-layer"}),
        fitted("oscar-no-clip", "no clipping", {"k_clip": 1.0, "v_clip": 1.0}),
        fitted(f"oscar-g{half}", f"group size {half} (U.P_br.H_G)", group=half),
        fitted(f"oscar-g{half}-no-pbr", f"group size {half} without bit-reversal placement (U.H_G)",
               {"composition": "u_h"}, group=half),
    ]
    if stats.rope is not None:
        other = "constant" if oscar.key_centering == "rope" else "rope"
        out.append(fitted(f"oscar-{other}-key-centering", {"rope": "keys centered per position: k_p - RoPE_p(mu_pre)",
                                                         "constant": "keys centered by one post-RoPE mean"}[other],
                          {"key_centering": other}))
    for strength in (0.0, 1.0):  # no rescale, and the whole shrink undone (quant.py)
        if strength != oscar.k_rescale:
            other = copy.deepcopy(oscar)
            other.k_rescale = strength
            out.append(Scheme(f"oscar-key-rescale-{strength:g}", other, base,
                              f"key rows' clip shrink undone at strength {strength:g} (the artifact: {oscar.k_rescale:g})"))
    if proxy_c_s is not None and oscar.scope == "per-head":
        out.append(Scheme("oscar-logit-proxy-cs", with_value_covariance(oscar, proxy_c_s), base,
                          "value rotation from the authors' proxy: sum_t (k_t^T C_Q k_t) v_t v_t^T"))
    if probe is not None:
        fitted_clip = calibration.clip == "fit"
        name = "oscar-fixed-clip" if fitted_clip else "oscar-fit-clip"
        rot = fitted("", "", {"clip": "fixed"}).rotations if fitted_clip else with_fitted_clips(oscar, probe)
        out.append(Scheme(name, rot, base, "clip ratios fixed at 0.96/0.92" if fitted_clip
                          else "clip ratios fitted per layer and head on held-back text"))
    return out
