"""Split key widths against plain ones by calibration's own measure (benchmarks/NOTES.md, run S1).

Calibrates ``--model`` with ``--key-formats split`` and the key noise tolerance alone (no KL checks), then reads the
manifest's per-layer key logit noise of every plain and split width and prints, per tolerance, the keys' mean stored
bits (codes and scale / zero point, windows not counted) that the widening reaches with plain widths alone and with
split widths among them, and how many layers' fronts hold a plain 3- or 4-bit width.

    python3 benchmarks/split_noise.py --model qwen2.5-coder-1.5b [--device cuda] [--probe-tokens 512]
"""

from __future__ import annotations

import argparse

from oscar_kv.allocation import allocate_key_widths, split_widths, stored_bits, widening_paths
from oscar_kv.calibrate import calibrate
from oscar_kv.calibration_settings import CalibrationSettings
from oscar_kv.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--probe-tokens", type=int, default=512)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, device=args.device)
    settings = CalibrationSettings(key_formats="split", max_kl=None, max_answer_kl=None, value_bits=2,
                                   probe_tokens=args.probe_tokens)
    rot = calibrate(model, tokenizer, settings, progress=True)
    widths = rot.manifest["calibration"]["widths"]
    g = rot.geometry
    d, group = g.head_dim, rot.group_size
    plain = {int(w): n for w, n in widths["key_noise_by_width"].items()}
    split = {w: widths["split_key_noise_by_width"][str(w)] for w in split_widths(d)}
    layers = g.num_layers
    fronts = widening_paths({**plain, **split}, layers, d, group)
    on_front = sum(any(w in (3, 4) for w in path) for path in fronts)
    print(f"{args.model}: {on_front} of {layers} layers have a plain 3- or 4-bit width on their bits-vs-noise front")
    for tolerance in (0.05, 0.1, 0.2, 0.3, 0.5):
        line = [f"tolerance {tolerance:g} nats^2:"]
        for name, table in (("plain", plain), ("with split", {**plain, **split})):
            choice = allocate_key_widths(table, [2] * layers, tolerance, None, widths["seq_len"], d, group)
            mean = sum(stored_bits(w, d, group) for w in choice.k_bits) / layers
            line.append(f"{name} keys {mean:.3f} bits")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
