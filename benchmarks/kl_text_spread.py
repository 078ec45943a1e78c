"""How far one text's KL is from another's, for one artifact: the spread behind `--max-kl`'s probe-vs-evaluation gap.

`calibrate --max-kl X` stops at the fewest widenings whose KL on *one* held-back text (calibration_text.kl_probe) is at most
X; `oscar-kv eval`'s kl task scores *one* other text per length (EvalConfig.kl_docs = 1).  Gemma 3 270M at
`--max-kl 0.05` scored 0.0545 on the evaluation text at 32K (run D15).  This script scores the same artifact on the
probe text and on several evaluation documents of the same length, so the text-to-text spread is seen directly:

    python3 benchmarks/kl_text_spread.py --model smollm2-135m --length 8192 --docs 4 --output OUT.json
    python3 benchmarks/kl_text_spread.py --model M --artifact DIR --length 32768 --device cuda --output OUT.json

Without ``--artifact`` it uses the model's shipped artifact, else calibrates with the defaults.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from oscar_kv.artifacts import Rotations, load_shipped
from oscar_kv.calibrate import calibrate
from oscar_kv.calibration_text import kl_probe
from oscar_kv.calibration_settings import CalibrationSettings
from oscar_kv.corpus import load_calibration_text
from oscar_kv.evaluate.harness import _documents, evaluation_text
from oscar_kv.models import load_model
from oscar_kv.width_choice import kl_measure


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--artifact", type=Path, help="an artifact directory (default: shipped, else calibrate)")
    parser.add_argument("--length", type=int, default=8192, help="tokens per text (the probe's and each document's)")
    parser.add_argument("--docs", type=int, default=4, help="evaluation documents (eval's kl task scores the first)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model, device=args.device)
    settings = CalibrationSettings()
    rot = Rotations.load(args.artifact) if args.artifact else load_shipped(args.model, model)
    rot = rot or calibrate(model, tokenizer, settings, progress=False)
    texts = {"probe": kl_probe(tokenizer, load_calibration_text(None)[0], settings, args.length)}
    all_ids = tokenizer(evaluation_text(None), return_tensors="pt").input_ids
    for i, doc in enumerate(_documents(all_ids, args.length, args.docs)):
        texts[f"eval doc {i}"] = doc
    scores = {}
    for name, ids in texts.items():
        t0 = time.perf_counter()
        scores[name] = kl_measure(model, ids)(rot)  # a fresh reference per text
        print(f"{name}: KL {scores[name]['kl']:.5f} ({ids.shape[1]} tokens, {time.perf_counter() - t0:.0f} s)",
              flush=True)
    docs = [s["kl"] for name, s in scores.items() if name != "probe"]
    summary = {"probe": scores["probe"]["kl"], "docs_mean": statistics.mean(docs),
               "docs_stdev": statistics.stdev(docs) if len(docs) > 1 else 0.0, "docs_max": max(docs),
               "max_over_probe": max(docs) / scores["probe"]["kl"]}
    print(json.dumps(summary, indent=1))
    args.output.write_text(json.dumps({"model": args.model, "length": args.length, "widths": rot.width_summary(),
                                       "scores": scores, "summary": summary}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
