"""What one measurement of calibrate's answer KL check costs with the needle probe's haystacks decoded through the
simulated cache against stored exactly (CalibrationSettings.needle_probe_haystack), on one model and artifact.

    python3 benchmarks/needle_probe_cost.py --model smollm2-135m --lengths 2048,4096 --prompts 4

The artifact is data-free (Hadamard rotations, every layer INT2): the cost does not depend on the widths, and no
calibration runs first.  Prints, per length and haystack form, the model's own answers' seconds (the stored form's
exact prefills among them), two measurements' seconds and the answer KL.
"""

from __future__ import annotations

import argparse
import time

import torch

from oscar_kv.artifacts import Rotations
from oscar_kv.calibration_text import needle_probe
from oscar_kv.calibration_settings import NEEDLE_HAYSTACKS, CalibrationSettings
from oscar_kv.corpus import load_calibration_text
from oscar_kv.models import AttentionGeometry, load_model
from oscar_kv.width_choice import answered_needles, needle_measure


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="2048,4096", help="needle prompt lengths, comma-separated")
    parser.add_argument("--prompts", type=int, default=4, help="the first N of the probe's prompts")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model, device=args.device, dtype=torch.float32)  # as calibrate's checks run
    geometry = AttentionGeometry.of(model.config)
    artifact = Rotations.data_free(geometry, "hadamard", min(geometry.head_dim, 128))
    texts, _ = load_calibration_text()
    for length in map(int, args.lengths.split(",")):
        settings = CalibrationSettings(needle_probe_tokens=length)
        prompts = needle_probe(tokenizer, texts, settings, model.config.max_position_embeddings)[:args.prompts]
        for haystack in NEEDLE_HAYSTACKS:
            t0 = time.perf_counter()
            answered, _ = answered_needles(model, prompts, haystack=haystack)
            setup, times = time.perf_counter() - t0, []
            if not answered:
                print(f"{length} tokens: the model answers none of {len(prompts)} prompts", flush=True)
                break
            measure = needle_measure(model, answered)
            for _ in range(2):
                t0 = time.perf_counter()
                kl = measure(artifact)["answer_kl"]
                times.append(time.perf_counter() - t0)
            print(f"{length} tokens, {len(answered)} of {len(prompts)} prompts answered: {haystack}: the answers "
                  f"{setup:.1f} s, measurement {times[0]:.1f} / {times[1]:.1f} s, answer KL {kl:.4f}", flush=True)


if __name__ == "__main__":
    main()
