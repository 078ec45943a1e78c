"""Does the needle probe's stored haystack need float32 K/V, or would bfloat16 (half the memory: a longer probe where
memory decides its length) measure the same answer KL?  On one model, per answered prompt of calibrate's needle
probe: the answer KL of artifacts through the cache holding the haystack's float32 K/V against the same K/V rounded to
bfloat16, each against its own unquantized reference, and the two references' KL to each other (what the rounding
alone moves).

    python3 benchmarks/stored_kv_precision.py --model smollm2-135m --lengths 1024,2048

Artifacts: the embedded model's shipped one (its calibrated widths) where there is one, and a data-free Hadamard
INT2 one (every layer at 2 bits: a large answer KL).
"""

from __future__ import annotations

import argparse

import torch

from oscar_kv.artifacts import Rotations, load_shipped
from oscar_kv.cache import CacheSettings, unprepare_model
from oscar_kv.calibration_settings import CalibrationSettings
from oscar_kv.calibration_text import needle_probe
from oscar_kv.corpus import load_calibration_text
from oscar_kv.evaluate.schemes import standard_scheme
from oscar_kv.evaluate.tasks import answer_log_probs, haystack_kv, kl_divergence
from oscar_kv.models import AttentionGeometry, load_model
from oscar_kv.width_choice import answered_needles


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="1024,2048", help="needle prompt lengths, comma-separated")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model, device=args.device, dtype=torch.float32)  # as calibrate's checks run
    geometry = AttentionGeometry.of(model.config)
    artifacts = {"hadamard-int2": Rotations.data_free(geometry, "hadamard", min(geometry.head_dim, 128))}
    shipped = load_shipped(args.model, model)
    if shipped is not None:
        artifacts["shipped"] = shipped
    exact = standard_scheme("bf16", geometry, Rotations.data_free(geometry, "identity"), CacheSettings())
    texts, _ = load_calibration_text()
    for length in map(int, args.lengths.split(",")):
        prompts = needle_probe(tokenizer, texts, CalibrationSettings(needle_probe_tokens=length),
                               model.config.max_position_embeddings)
        answered, _ = answered_needles(model, prompts)
        rows = {name: ([], []) for name in artifacts}
        floors = []
        for prompt in (needle.prompt for needle in answered):
            ids = prompt.ids[0].tolist()
            question, answer = ids[prompt.question_start:prompt.answer_start], ids[prompt.answer_start:]
            kv32 = haystack_kv(model, ids[:prompt.question_start])
            kv16 = [(k.bfloat16().float(), v.bfloat16().float()) for k, v in kv32]
            ref32 = answer_log_probs(model, exact, kv32, question, answer)
            ref16 = answer_log_probs(model, exact, kv16, question, answer)
            floors.append(float(kl_divergence(ref32, ref16).mean()))
            for name, rot in artifacts.items():
                scheme = standard_scheme("oscar", geometry, rot, CacheSettings())
                rows[name][0].append(float(kl_divergence(ref32, answer_log_probs(model, scheme, kv32, question,
                                                                                   answer)).mean()))
                rows[name][1].append(float(kl_divergence(ref16, answer_log_probs(model, scheme, kv16, question,
                                                                                   answer)).mean()))
                unprepare_model(model)
        mean = lambda values: sum(values) / len(values)
        print(f"{length} tokens, {len(answered)} of {len(prompts)} answered: references' KL float32 vs bfloat16 K/V "
              f"{mean(floors):.2e} (largest {max(floors):.2e})", flush=True)
        for name, (k32, k16) in rows.items():
            print(f"  {name}: answer KL float32 K/V {mean(k32):.5f}, bfloat16 K/V {mean(k16):.5f} (ratio "
                  f"{mean(k16) / mean(k32):.3f}); per prompt " + ", ".join(f"{a:.4f}/{b:.4f}" for a, b in zip(k32, k16)),
                  flush=True)


if __name__ == "__main__":
    main()
