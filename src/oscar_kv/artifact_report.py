"""What ``oscar-kv inspect`` prints about an artifact: its geometry and settings, the eigen-spectra, the width map
calibration chose (with every check it measured) and the validation table."""

from __future__ import annotations

import json
from pathlib import Path

from .artifacts import Rotations


def describe(rot: Rotations, directory: Path) -> str:
    """The whole report of the artifact ``rot`` loaded from ``directory``."""
    from .calibrate import format_error_table

    lines: list[str] = []
    out = lines.append
    m = rot.manifest
    g = rot.geometry
    out(f"artifact  {directory}  (format {m['format_version']}, sha256 {m['sha256'][:16]}...)")
    out(f"model     {m.get('model', '?')}  fingerprint {m.get('fingerprint', '?')}")
    out(f"geometry  {g.model_type}: {g.num_layers} layers, {g.num_attention_heads} query heads, "
        f"{g.num_kv_heads} KV heads, head dim {g.head_dim}")
    out(f"rotations {rot.scope}, group size {rot.group_size}, layer widths {rot.width_summary()}")
    out(f"clip      K {rot.k_clip.min():.2f}-{rot.k_clip.max():.2f}, V {rot.v_clip.min():.2f}-{rot.v_clip.max():.2f}; "
        f"rescale: keys {rot.k_rescale:g}, values {rot.v_rescale:g}")
    out(f"centering keys {rot.key_centering}: |mu_K| mean {rot.k_mean.norm(dim=-1).mean():.3f}, |mu_pre| mean "
        f"{rot.k_rope_mean.norm(dim=-1).mean():.3f}; |mu_V| mean {rot.v_mean.norm(dim=-1).mean():.3f}")
    if rot.key_centering == "rope":
        layout = rot.rotary_layout
        lo, hi = layout.parts(rot.k_rope_mean)
        live = (lo != 0) | (hi != 0)
        partial = "" if layout.rotary_dim == g.head_dim else f" (RoPE on {layout.rotary_dim} of {g.head_dim} channels)"
        out(f"          mu_pre kept in at most {int(live.sum(-1).max())} of {layout.rotated_pairs} channel "
            f"pairs per head{partial}")
    choice = m.get("calibration", {}).get("key_centering_choice")
    if choice:
        out(f"          key centering chosen: {json.dumps(choice)}")
    out("calibration " + json.dumps(m.get("calibration", {})))
    out("\neigen-spectrum per layer (top eigenvalue share of the trace; top-8 share)")
    out("layer   K top1   K top8   V top1   V top8")
    for i in range(g.num_layers):
        cells = []
        for which in ("k", "v"):
            lam = getattr(rot, f"{which}_eigenvalues")[i].clamp_min(0).mean(0)
            total = float(lam.sum()) or 1.0
            cells += [float(lam[0]) / total, float(lam[:8].sum()) / total]
        out(f"{i:5d}  " + "  ".join(f"{c:7.3f}" for c in cells))
    widths = m.get("calibration", {}).get("widths")
    if widths:
        out(width_map(widths))
    validation = m.get("validation")
    if validation:
        out(f"\nvalidation: INT2 attention relative error per layer (held-back {validation['probe_tokens']} tokens)")
        out(format_error_table(validation["attention_relative_error"]))
    return "\n".join(lines)


def width_map(widths: dict) -> str:
    """The manifest's width record as a per-layer bit map with each candidate width's key logit noise."""
    by_width = widths["key_noise_by_width"]
    at = ", ".join(f"{b:.3f} at {n}" for n, b in widths.get("bits_per_element_at", {}).items())
    v_by_width = widths.get("value_noise_by_width", {})  # absent in artifacts from before values were allocated
    lines = [f"\nwidths: {widths['bits_per_element']:.3f} bits per element at {widths['seq_len']} tokens ({at}); "
             f"{widths['reason']}",
             "layer  K  V  key logit noise (nats^2) at " + ", ".join(f"{w} bits" for w in by_width)
             + (" | value output noise at " + ", ".join(f"{w} bits" for w in v_by_width) if v_by_width else "")
             + "  chosen"]
    measured = widths.get("kl_by_step")
    if measured:  # the --max-kl check: every point of the widening path it measured, in bits order
        on = f"{widths['kl_probe_tokens']} held-back tokens" if "kl_probe_tokens" in widths else "held-back text"
        points = sorted(measured.values(), key=lambda p: p["bits_per_element"])
        targets = [f"{widths['max_kl']:g}, on {on}"] if widths.get("max_kl") is not None else []
        if widths.get("max_answer_kl") is not None:
            answered = f", {widths['needle_prompts_answered']} answered" if "needle_prompts_answered" in widths else ""
            # "auto" scores every prompt wherever the check runs (it is skipped below half answered)
            answered += ", all scored" if widths.get("needle_probe_scored") in ("all", "auto") else ""
            stored = ", haystacks stored" if widths.get("needle_probe_haystack") == "stored" else ""
            targets.append(f"answer KL {widths['max_answer_kl']:g}, on needle prompts of "
                           f"{widths.get('needle_probe_tokens', '?')} tokens{answered}{stored}")
        shown = [(name, label) for name, label in (("kl", "KL"), ("answer_kl", "answer KL")) if name in points[0]]
        lines.insert(1, f"KL check (target {'; '.join(targets)}): " + ", ".join(
            f"{p['bits_per_element']:.3f} bits -> " + ", ".join(f"{label} {p[name]:.4f}" for name, label in shown)
            for p in points))
        chosen = [p for p in points if p["bits_per_element"] == widths["bits_per_element"] and "kl_by_position" in p]
        if chosen:  # does KL still grow at the probe's end? (a longer context then has more)
            lines.insert(2, "  at the chosen widths, KL by position (positions up to): " + ", ".join(
                f"{end} {v:.4f}" for end, v in chosen[0]["kl_by_position"].items()))
    if "needle_prompts_answered" in widths and widths.get("max_answer_kl") is None:  # too few for the check
        lines.insert(1, f"answer KL check skipped: the model answers {widths['needle_prompts_answered']} needle prompts "
                        f"of {widths['needle_probe_tokens']} tokens (the check needs half)")
    widest = max(map(int, by_width))
    labels = widths.get("k_widths", widths["k_bits"])  # split keys (calibrate --key-formats split): "4x32+2"
    formats = widths.get("key_formats")
    if formats:  # calibrate --key-formats auto: both paths through the KL check
        lines.insert(1, f"key formats auto: {formats['chosen']} ({formats['reason']}): " + "; ".join(
            f"{name} {p['bits_per_element']:.3f} bits" + "".join(f", {k.replace('_', ' ').replace('kl', 'KL')} "
                                                                 f"{p[k]:.4f}" for k in ("kl", "answer_kl") if k in p)
            for name, p in formats["paths"].items()))
    if "k_widths" in widths:
        lines.insert(1, "split keys: NxM+B stores M channels at N bits and the rest at B (the bar: the narrow part's "
                        "bits, then + for the wide part's)")
    pad = max(len(str(k)) for k in labels)
    for i, (k, v) in enumerate(zip(widths["k_bits"], widths["v_bits"])):
        noise = "  ".join(f"{by_width[w][i]:8.4f}" for w in by_width)
        if v_by_width:
            noise += "  |" + "  ".join(f"{v_by_width[w][i]:8.4f}" for w in v_by_width)
        label = str(labels[i])
        wide = int(label.split("x")[0]) - k if "x" in label else 0
        bar = "#" * k + "+" * wide + "." * max(widest - k - wide, 0)
        lines.append(f"{i:5d}  {label:>{pad}}  {v}  {noise}  {bar} {widths['key_noise'][i]:.4f}")
    return "\n".join(lines)
