"""Would an 8-bit zero point cost accuracy?  The metadata study behind issue 34's bit targets (run Z1).

Since run Z3, quant.py stores the ``grid`` variant (below); this script keeps the format it replaced as its own
reference, "today" in its output.  Before, a quantized group stored a float16 scale and a float16 minimum: 32 bits a
group, 0.25 bits per element at G = 128 and 0.5 at G = 64 (head dim 64).  Storing the minimum as an 8-bit zero point z in units of the scale
(minimum = -scale * z / 2^F, F = 8 - bits fractional bits below 8 bits, 0 at 8) costs 24 bits a group:
-0.0625 bits per element at G = 128, -0.125 at G = 64.

Two ways to build it, both measured here against today's format, on each layer's probe keys and values with the
artifact's rotations, centering, clips and rescale, by calibrate's own measures (allocation.key_logit_noise in
nats^2, allocation.value_output_noise):
  * ``offset``: round z and keep the scale.  The zero point's rounding (up to 2^-F-1 of a step) is one offset shared
    by every channel of the group, so a query sees it times the sum of its components: where the rotation lays the
    queries' energy along the all-ones direction that is up to D times a channel's share of the noise.
  * ``grid``: fit the grid to the group.  The range is widened to hold 0, z is the floor or the ceiling
    of 2^F (-min / scale), whichever needs the smaller scale, and the scale grows until the grid [-s z / 2^F,
    s (levels - z / 2^F)] covers the group.  No shared offset is left; the cost is the scale's growth, at most a
    factor 1 / (1 - 2^(1-F) / levels) (1.0105 at 2 bits): about +2% of noise from that (run Z1 saw up to +3.2%).

    python3 benchmarks/zero_point_study.py --model smollm2-135m --output OUT.json [--device cuda]
    python3 benchmarks/zero_point_study.py --model qwen2.5-coder-1.5b --calib-tokens 4096 --output OUT.json

Prints the median and largest noise ratio (variant / today) over layers and KV heads, per width unclipped (rounding
alone) and at each layer's own width and clips (`chosen`); the layers whose key noise the variant would lift past
the tolerance at their width; and the bits per element with each format.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from oscar_kv.activations import capture_samples, per_head
from oscar_kv.allocation import KEY_WIDTHS, VALUE_WIDTHS, key_logit_noise, value_output_noise
from oscar_kv.calibrate import calibrate
from oscar_kv.calibration_text import calibration_sequences
from oscar_kv.calibration_settings import CalibrationSettings
from oscar_kv.corpus import load_calibration_text
from oscar_kv.memory import bits_per_element
from oscar_kv.models import load_model
from oscar_kv.probe import PROBE_SINK
from oscar_kv.quant import METADATA_DTYPE, RESCALE_RANGE, check_rescale, clip_rows
from oscar_kv.rotation import rotate

VARIANTS = ("offset", "grid")
FLOAT16_MINIMUM_GROUP_BITS = 32  # the format before the zero point: float16 scale + float16 minimum
ZERO_POINT_GROUP_BITS = 24  # float16 scale + 8-bit zero point (memory.GROUP_METADATA_BITS)


def rescaled_metadata(exact, codes, scale, minimum, strength):
    """Scale and float16 minimum times 1 + g (alpha - 1), alpha = <x, x> / <x, x_hat> per group: the rescale of the
    float16-minimum format (quant.rescaled_scale is today's)."""
    x = exact.double()
    x_hat = codes.double() * scale.double().unsqueeze(-1) + minimum.double().unsqueeze(-1)
    num, den = (x * x).sum(-1), (x * x_hat).sum(-1)
    alpha = torch.where(den > 0, num / den.clamp_min(1e-300), torch.ones_like(num)).clamp(*RESCALE_RANGE)
    alpha = (1.0 + check_rescale(strength) * (alpha - 1.0)).float()
    return tuple((alpha * m.float()).clamp(-65504.0, 65504.0).to(METADATA_DTYPE) for m in (scale, minimum))


def fraction_bits(bits: int) -> int:
    """F: the zero point's fractional bits, the most that keep 2^F * (2^bits - 1) within a byte."""
    return 8 - bits if bits < 8 else 0


def zero_point_fake_quantize(x: torch.Tensor, bits: int, group_size: int, clip_ratio, rescale: float,
                             variant: str) -> torch.Tensor:
    """quant.fake_quantize with the minimum stored as an 8-bit zero point (module docstring's ``variant``).
    x: [..., D]; returns float32 [..., D]."""
    d = x.shape[-1]
    xf = clip_rows(x.float(), clip_ratio)
    groups = xf.reshape(*xf.shape[:-1], d // group_size, group_size)
    lo, hi = groups.amin(-1).double(), groups.amax(-1).double()
    levels, frac = (1 << bits) - 1, 1 << fraction_bits(bits)
    z_max = frac * levels
    if variant == "offset":
        scale = (hi - lo) / levels
        z = (-lo / scale.clamp_min(1e-30) * frac).round().clamp(0, z_max)
    else:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
        t = -lo / ((hi - lo) / levels).clamp_min(1e-30) * frac

        def needed(z):  # the least scale whose grid holds [lo, hi] with this zero point
            below = torch.where(z > 0, -lo * frac / z.clamp_min(1), torch.where(lo < 0, torch.inf, 0.0))
            above = torch.where(z < z_max, hi / (levels - z / frac), torch.where(hi > 0, torch.inf, 0.0))
            return torch.maximum(below, above)

        z_floor, z_ceil = t.floor().clamp(0, z_max), t.ceil().clamp(0, z_max)
        s_floor, s_ceil = needed(z_floor), needed(z_ceil)
        z = torch.where(s_floor <= s_ceil, z_floor, z_ceil)
        scale = torch.minimum(s_floor, s_ceil)
    scale = scale.to(METADATA_DTYPE)
    offset = z / frac
    safe = torch.where(scale.double() > 0, scale.double(), torch.ones_like(offset))
    codes = (groups.double() / safe.unsqueeze(-1) + offset.unsqueeze(-1)).round().clamp(0, levels)
    if rescale:  # as quant.rescaled_metadata: the scale times 1 + g (alpha - 1); the zero point stays
        minimum = (-scale.double() * offset).to(METADATA_DTYPE)
        scale, _ = rescaled_metadata(x.float().reshape(groups.shape), codes, scale, minimum, rescale)
    out = scale.double().unsqueeze(-1) * (codes - offset.unsqueeze(-1))
    return out.reshape(xf.shape).float()


def float16_minimum_fake_quantize(x: torch.Tensor, bits: int, group_size: int, clip_ratio, rescale: float):
    """Today's format (quant.quantize_rows' arithmetic, codes left unpacked) at any width, 5 and 6 bits included,
    which no kernel stores: how much a width between 4 and 8 would cut a layer's key noise.  x: [..., D]."""
    d = x.shape[-1]
    groups = clip_rows(x.float(), clip_ratio).reshape(*x.shape[:-1], d // group_size, group_size)
    levels = (1 << bits) - 1
    minimum = groups.amin(-1).to(METADATA_DTYPE)
    scale = ((groups.amax(-1) - minimum.float()) / levels).to(METADATA_DTYPE)
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(scale.float()))
    codes = ((groups - minimum.float().unsqueeze(-1)) / safe.unsqueeze(-1)).round().clamp(0, levels)
    if rescale:
        scale, minimum = rescaled_metadata(x.float().reshape(groups.shape), codes, scale, minimum, rescale)
    out = codes * scale.float().unsqueeze(-1) + minimum.float().unsqueeze(-1)
    return out.reshape(x.shape)


def between_widths(rot, sample, layer: int, widths=(5, 6)) -> dict[str, float]:
    """{width: the worst KV head's key logit noise} at 5 and 6 bits, with the layer's clips (fitted at its width)."""
    rows, clip, rescale, r = side_rows(rot, sample, layer, "k")
    c_rot = query_moments(rot, sample, r)
    return {str(b): float(key_logit_noise(rows, float16_minimum_fake_quantize(
        rows, b, rot.group_size, clip.to(rows.device), rescale), c_rot, sample.scale).max()) for b in widths}


def side_rows(rot, sample, layer: int, side: str):
    """(rows past the sink as the cache stores them before quantizing [Hkv, T, D], clip [Hkv, 1], rescale,
    rotation [Hkv, D, D])."""
    heads = rot.geometry.num_kv_heads
    if side == "k":
        r = per_head(rot.k_rotation[layer], heads, sample.device)
        rows = rotate(sample.k - sample.key_offset(rot.k_mean[layer], rot.k_rope_mean[layer]), r)
        return rows[:, PROBE_SINK:], rot.k_clip[layer][:, None].float(), rot.k_rescale, r
    r = per_head(rot.v_rotation[layer], heads, sample.device)
    rows = rotate(sample.v - rot.v_mean[layer][:, None, :].float().to(sample.device), r)
    return rows[:, PROBE_SINK:], rot.v_clip[layer][:, None].float(), rot.v_rescale, r


def query_moments(rot, sample, r: torch.Tensor) -> torch.Tensor:
    """The probe's own C_Q per KV head in the rotated basis, float64 [Hkv, D, D]."""
    heads = rot.geometry.num_kv_heads
    q = sample.q.double()
    q = q.reshape(heads, -1, q.shape[-1])  # a KV head's query group is contiguous (GQA)
    c_q = q.transpose(-1, -2) @ q / q.shape[1]
    return r.double().transpose(-1, -2) @ c_q @ r.double()


def noise(rot, sample, layer: int, side: str, bits: int, clipped: bool) -> dict[str, torch.Tensor]:
    """{"today" | variant: float64 [Hkv]} at ``bits``, with the artifact's clips for this layer and side (fitted at
    the layer's own width) or unclipped."""
    rows, clip, rescale, r = side_rows(rot, sample, layer, side)
    clip = clip.to(rows.device) if clipped else 1.0
    stored = {"today": float16_minimum_fake_quantize(rows, bits, rot.group_size, clip, rescale)}
    for variant in VARIANTS:
        stored[variant] = zero_point_fake_quantize(rows, bits, rot.group_size, clip, rescale, variant)
    if side == "k":
        c_rot = query_moments(rot, sample, r)
        return {name: key_logit_noise(rows, s, c_rot, sample.scale).cpu() for name, s in stored.items()}
    return {name: value_output_noise(rows, s).cpu() for name, s in stored.items()}


def study(model_name: str, settings: CalibrationSettings, probe_tokens: int, device: str) -> dict:
    t0 = time.perf_counter()
    model, tokenizer = load_model(model_name, device=device)
    rot = calibrate(model, tokenizer, settings, progress=False)
    # the held-back text after the same fitting text, longer than calibrate's own probe
    probe_settings = replace(settings, probe_tokens=probe_tokens)
    _, probe_ids, _ = calibration_sequences(model, tokenizer, probe_settings, load_calibration_text(None)[0])
    probe = capture_samples(model, probe_ids)
    print(f"{model_name}: calibrated in {time.perf_counter() - t0:.0f} s: {rot.width_summary()}", flush=True)
    g = rot.geometry
    widths = {"k": KEY_WIDTHS, "v": VALUE_WIDTHS}
    table: dict = {side: {str(b): {name: [] for name in ("today", *VARIANTS)} for b in widths[side]} for side in "kv"}
    chosen: dict = {side: {name: [] for name in ("today", *VARIANTS)} for side in "kv"}
    wide: dict = {}  # layers at 8-bit keys: their key noise at 5 and 6 bits
    for layer in range(g.num_layers):
        sample = probe[layer].to(device)
        for side, layer_bits in zip("kv", rot.side_bits(layer)):
            for b in widths[side]:  # unclipped: rounding alone, where the metadata's format shows most
                for name, values in noise(rot, sample, layer, side, b, clipped=False).items():
                    table[side][str(b)][name].append(values.tolist())
            for name, values in noise(rot, sample, layer, side, layer_bits, clipped=True).items():
                chosen[side][name].append(values.tolist())
        if rot.side_bits(layer)[0] == 8:
            wide[str(layer)] = between_widths(rot, sample, layer)
    summary = {}
    for side in "kv":
        for b, by_name in [*table[side].items(), ("chosen", chosen[side])]:
            today = torch.tensor(by_name["today"]).flatten()
            for variant in VARIANTS:
                ratio = torch.tensor(by_name[variant]).flatten() / today.clamp_min(1e-30)
                summary[f"{side}{b} {variant}"] = {"median": float(ratio.median()), "max": float(ratio.max()),
                                                   "today_median": float(today.median())}
    # calibrate compares a layer's worst KV head with the tolerance
    chosen = {side: {name: [max(heads) for heads in rows] for name, rows in by_name.items()}
              for side, by_name in chosen.items()}
    tolerance = settings.key_noise
    crossings = {variant: [layer for layer, (a, b) in enumerate(zip(chosen["k"]["today"], chosen["k"][variant]))
                           if tolerance is not None and a <= tolerance < b] for variant in VARIANTS}
    context = min(getattr(model.config, "max_position_embeddings", 32768) or 32768, 32768)
    kb, vb = rot.k_bits.tolist(), rot.v_bits.tolist()
    bits = {str(ctx): {"today": bits_per_element(ctx, g.head_dim, rot.group_size, k_bits=kb, v_bits=vb,
                                                 group_bits=FLOAT16_MINIMUM_GROUP_BITS),
                       "zero point": bits_per_element(ctx, g.head_dim, rot.group_size, k_bits=kb, v_bits=vb,
                                                      group_bits=ZERO_POINT_GROUP_BITS)}
            for ctx in sorted({context, 32768})}
    return {"model": model_name, "widths": rot.width_summary(), "head_dim": g.head_dim, "group_size": rot.group_size,
            "probe_tokens": int(probe_ids.shape[1]), "ratios": summary, "chosen_key_noise": chosen["k"],
            "chosen_value_noise": chosen["v"], "tolerance_crossings": crossings, "bits_per_element": bits,
            "eight_bit_layers_at_5_6_bits": wide}


def report(result: dict) -> str:
    lines = [f"## {result['model']} (D = {result['head_dim']}, G = {result['group_size']}, {result['widths']}, "
             f"probe {result['probe_tokens']} tokens)",
             "| side / width (unclipped; `chosen`: each layer's width and clips) | today median | offset: median / max "
             "ratio | grid: median / max ratio |", "|---|---|---|---|"]
    names = sorted({key.split()[0] for key in result["ratios"]},
                   key=lambda s: (s[0] != "k", int(s[1:]) if s[1:].isdigit() else 99))
    for name in names:
        off, grid = result["ratios"][f"{name} offset"], result["ratios"][f"{name} grid"]
        lines.append(f"| {name} | {off['today_median']:.4g} | {off['median']:.4f} / {off['max']:.4f} | "
                     f"{grid['median']:.4f} / {grid['max']:.4f} |")
    for variant, layers in result["tolerance_crossings"].items():
        lines.append(f"- {variant}: layers whose key noise would pass the tolerance at their width: {layers or 'none'}")
    for layer, by_width in result["eight_bit_layers_at_5_6_bits"].items():
        lines.append(f"- layer {layer} (8-bit keys): key noise at 5 / 6 bits {by_width['5']:.4g} / {by_width['6']:.4g}")
    for ctx, b in result["bits_per_element"].items():
        lines.append(f"- bits per element at {ctx}: today {b['today']:.3f}, zero point {b['zero point']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="a model name load_model takes (repeatable)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calib-tokens", type=int, default=CalibrationSettings.calib_tokens)
    parser.add_argument("--probe-tokens", type=int, default=2048, help="held-back tokens the noise is measured on")
    parser.add_argument("--output", type=Path, required=True, help="JSON file")
    args = parser.parse_args(argv)
    # The tolerance's widths (calibrate's default without the KL check, which widened nothing on Qwen2.5 or SmolLM2:
    # runs D10, D17): the study compares metadata formats, not allocations.
    settings = replace(CalibrationSettings(), calib_tokens=args.calib_tokens, max_kl=None)
    results = []
    for name in args.model:
        results.append(study(name, settings, args.probe_tokens, args.device))
        print(report(results[-1]), flush=True)
        args.output.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
