"""Which side (keys or values) and which layers (windowed or global) cost a model its accuracy at low widths.

One calibration with the library's defaults, then the kl task on the same windows for width variants, each with its
clips refitted at its widths (benchmarks/protocol.py's ``with_widths``): every layer at K8V8 / K4V4 / K4V8 / K8V4,
and on models with sliding-window layers, the default's widths with the windowed or the global layers at K8V8, and
values at 4 bits on either.  Run D1 in benchmarks/NOTES.md is its output on Gemma 3 270M.

    python3 benchmarks/width_diagnosis.py --model gemma3-270m --contexts 8192,32768 --device cuda --output /tmp/diag
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from protocol import held_back_probe, with_widths  # noqa: E402

from oscar_kv.calibrate import calibrate  # noqa: E402
from oscar_kv.calibration_settings import CalibrationSettings  # noqa: E402
from oscar_kv.evaluate.harness import EvalConfig, run_eval  # noqa: E402
from oscar_kv.models import layer_windows, load_model  # noqa: E402


def variants(k_bits: list[int], v_bits: list[int], windows) -> dict[str, tuple[list[int], list[int]]]:
    """Name -> (key widths, value widths) per layer, from the default's widths."""
    n = len(k_bits)
    out = {f"k{k}v{v}": ([k] * n, [v] * n) for k, v in ((8, 8), (4, 4), (4, 8), (8, 4))}
    local = [w is not None for w in windows]
    if any(local) and not all(local):
        def where(mask, wide, k, v):
            return [wide if m else b for m, b in zip(mask, k)], [wide if m else b for m, b in zip(mask, v)]
        glob = [not m for m in local]
        out["windowed-k8v8"] = where(local, 8, k_bits, v_bits)
        out["global-k8v8"] = where(glob, 8, k_bits, v_bits)
        out["windowed-v4"] = (k_bits, [4 if m else b for m, b in zip(local, v_bits)])
        out["global-v4"] = (k_bits, [4 if m else b for m, b in zip(glob, v_bits)])
    out["v4"] = (k_bits, [4] * n)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device)
    settings = CalibrationSettings()
    default = calibrate(model, tokenizer, settings, progress=False)
    print(f"calibrated in {time.perf_counter() - t0:.0f} s: {default.width_summary()}", flush=True)
    probe = held_back_probe(model, tokenizer, settings)
    named = variants(default.k_bits.tolist(), default.v_bits.tolist(), layer_windows(model.config))
    compare = {f"oscar-{name}": with_widths(default, k, v, probe) for name, (k, v) in named.items()}
    contexts = [int(c) for c in args.contexts.split(",")]
    config = EvalConfig(methods=["bf16", "oscar"], tasks=["kl"], context_lengths=contexts, ablations=False,
                        compare=compare)
    results = run_eval(model, tokenizer, default, config, args.output, progress=False)
    rows = {m: {k: row.get(k, {}) for k in ("bits_per_element", "kl", "top1_agreement")}
            for m, row in results["methods"].items()}
    (args.output / "diagnosis.json").write_text(json.dumps({"default": default.width_summary(), "rows": rows}, indent=1))
    for method, row in rows.items():
        print(method, json.dumps(row), flush=True)
    print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
