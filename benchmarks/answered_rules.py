"""Which needle probe prompts count as answered, read over the whole prompt (a float32 forward: the decoded probe's
rule) or through the unquantized cache holding the stored haystack (the stored probe's rule, calibrate's default)?

    python3 benchmarks/answered_rules.py --model smollm2-135m --length 1024

Runs calibrate's needle probe prompts at --length with the model's weights in float32 (as calibrate's checks run) and
prints, per rule, the prompts answered and the seconds, and the KL between the two rules' references per prompt both
answer (benchmarks/NOTES.md, "The stored probe's haystacks prefilled once").
"""

from __future__ import annotations

import argparse
import time

from oscar_kv.calibrate import float32_weights
from oscar_kv.calibration_settings import NEEDLE_HAYSTACKS, CalibrationSettings
from oscar_kv.calibration_text import needle_probe
from oscar_kv.corpus import load_calibration_text
from oscar_kv.evaluate.tasks import kl_divergence
from oscar_kv.models import load_model
from oscar_kv.width_choice import answered_needles


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=1024, help="the needle prompts' tokens")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model, device=args.device)
    texts, _ = load_calibration_text()
    prompts = needle_probe(tokenizer, texts, CalibrationSettings(needle_probe_tokens=args.length), args.length)
    answered = {}
    with float32_weights(model):
        for haystack in NEEDLE_HAYSTACKS:
            t0 = time.perf_counter()
            answered[haystack] = answered_needles(model, prompts, haystack=haystack)[0]
            which = [i for i, p in enumerate(prompts) if any(p is a.prompt for a in answered[haystack])]
            print(f"{haystack}: answered {which} of {len(prompts)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    decoded, stored = ({a.prompt.ids.data_ptr(): a for a in answered[h]} for h in NEEDLE_HAYSTACKS)
    kls = [float(kl_divergence(decoded[k].reference, stored[k].reference).mean()) for k in decoded if k in stored]
    print("KL(whole prompt's reference || stored cache's) per prompt both answer:", [f"{kl:.1e}" for kl in kls])


if __name__ == "__main__":
    main()
