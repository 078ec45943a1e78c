"""The accuracy protocol (issue "Long-context retrieval that holds on every model"): every real model we can run,
every candidate calibration, one table.

For each model (loaded once): calibrate with the library's defaults (the `default` candidate), derive each other
candidate's key widths from the noise that calibration measured per width (key clips refitted at each layer's width
on the same held-back text), then score BF16, KIVI-2 and every candidate on the same prompts (`oscar-kv eval` with `--compare`): bits per element,
KL and top-1 against BF16, NIAH and multi-key NIAH, per context length.  Writes one results.json per model (the eval
contract) and protocol.md / protocol.json with every row.

    python3 benchmarks/protocol.py --device cuda --output runs/protocol \\
        --model smollm2-135m:4096,8192 --model qwen2.5-coder-1.5b:8192,16384,32768 --model gemma3-270m:8192,32768 \
        --model qwen2.5-coder-1.5b@yarn4:65536,131072

A model name with ``@yarnF`` is loaded with YaRN rope scaling by F (``models.loading.with_yarn``), calibrated and
scored at the extended lengths.  ``--tasks`` adds ``longgen`` (greedy generation through each cache,
``--gen-tokens``) to the default kl, niah, niah_multikey.

Candidates (``--candidates``, comma-separated): ``default`` (what ``oscar-kv calibrate`` writes: the tolerance, the KL
check and the answer KL check), ``k2`` / ``k3`` / ``k4`` / ``k5`` / ``k8`` (every layer's keys at that width; ``k4v3``,
``k4v4``: values wider too), ``bX`` (widths chosen by the key noise under a budget of X bits per element at the model's
context, no tolerance), ``nX`` (tolerance X nats^2, no budget), ``mX`` (the default tolerance and ``--max-kl X``, no
answer KL check: widened past the tolerance until the KL measured on held-back text is at most X), ``aX`` (the default
with ``--max-answer-kl X``: widened until the needle probe's answer KL is at most X), ``tX`` (``calibrate --key-noise
X``: keys and values allocated at tolerance X, then the default's checks; ``t0``: no tolerance), ``fX`` (``--key-noise 0 --max-kl X``, no
answer KL check: no tolerance, the fewest widenings from the narrowest widths whose KL is at most X), ``split`` (the
default with ``--key-formats split``: split key widths among the candidates; ``splitX``: at tolerance X, ``split0``:
none), ``auto`` (the default with ``--key-formats auto``: the plain and the split widths each through the checks, the
fewer bits kept), ``kvX`` (``calibrate --kv-bits X --key-noise 0 --max-kl 0 --max-answer-kl 0``: keys and values
allocated by their noise within X bits per element at the model's context, plain widths, no check: a point of the
Pareto curve at a given budget, such as KIVI-2's own bits), ``kvsX`` (the same with split key widths among the
candidates), ``probe`` / ``probeX`` (the default with ``--needle-probe-haystack decoded``: every haystack token of
the answer KL check's prompts through the cache, prompts of min(context, 16K) or X tokens; ``probeX-plain``: plain key
widths only, half the measurements) and ``stored`` / ``storedX`` (``--needle-probe-haystack stored``, today's default:
haystacks prefilled exactly and stored, only question and answer through the cache, as `eval` scores needles;
prompts of the context or X tokens; ``-plain`` as for probeX; scored with ``--needle-probe-scored answered``, the
default before run D65) and ``every`` / ``everyX`` (as ``stored`` / ``storedX`` with ``--needle-probe-scored all``:
the answer KL over every probe prompt, answered or not, however few are answered; today's default, ``auto``, scores
so only where half are).  The first candidate is the `oscar` row.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import replace
import re
import sys
import time
from pathlib import Path

import torch

from oscar_kv.activations import capture_samples
from oscar_kv.allocation import allocate_key_widths
from oscar_kv.artifacts import Rotations
from oscar_kv.calibrate import calibrate
from oscar_kv.calibration_text import calibration_sequences
from oscar_kv.calibration_settings import CalibrationSettings
from oscar_kv.corpus import load_calibration_text
from oscar_kv.evaluate.harness import EvalConfig, run_eval
from oscar_kv.memory import bits_per_element
from oscar_kv.models import load_model
from oscar_kv.probe import fit_clip_ratios

METRICS = ("bits_per_element", "kl", "top1_agreement", "niah", "niah_multikey", "niah_multikey_answer_kl",
           "niah_multikey_answer_nll", "gen_kl", "gen_first_divergence")


def candidate_widths(name: str, default: Rotations, seq_len: int) -> tuple[list[int], list[int]] | None:
    """The (key, value) widths per layer of a candidate name (module docstring), from the default artifact's
    measured noise; None for the default itself."""
    layers = default.geometry.num_layers
    if name == "default":
        return None
    match = re.fullmatch(r"k([23458])(?:v([2348]))?", name)
    if match:
        return [int(match[1])] * layers, [int(match[2] or 2)] * layers
    if name[0] in "mfta":
        raise ValueError("mX, fX, tX and aX candidates are calibrated, not derived (run_model)")
    recorded = default.manifest["calibration"]["widths"]
    noise = {int(w): n for w, n in recorded["key_noise_by_width"].items()}
    tolerance, budget = (None, float(name[1:])) if name[0] == "b" else (float(name[1:]), None)
    if name[0] not in "bn":
        raise SystemExit(f"unknown candidate {name!r}")
    g = default.geometry
    return allocate_key_widths(noise, default.v_bits.tolist(), tolerance, budget, seq_len, g.head_dim,
                               default.group_size).k_bits, default.v_bits.tolist()


def held_back_probe(model, tokenizer, settings: CalibrationSettings):
    """The probe calibrate() holds back (the same text and length), for refitting clips."""
    _, probe_ids, _ = calibration_sequences(model, tokenizer, settings, load_calibration_text(None)[0])
    return capture_samples(model, probe_ids)


def with_widths(default: Rotations, k_bits: list[int], v_bits: list[int], probe) -> Rotations:
    """The default artifact with these widths, the clips of each side refitted at each layer's width."""
    rot = copy.deepcopy(default)
    rot.set_bits(k_bits, v_bits)
    fit_clip_ratios(rot, probe, progress=False, sides=("k",) if v_bits == default.v_bits.tolist() else ("k", "v"))
    return rot


def run_model(spec: str, contexts: list[int], candidates: list[str], args, out: Path) -> list[dict]:
    t0 = time.perf_counter()
    name, _, yarn = spec.partition("@yarn")
    model, tokenizer = load_model(name, device=args.device, yarn_factor=float(yarn) if yarn else None)
    directory = out / spec
    settings = CalibrationSettings()
    print(f"{spec}: loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    calibrated = [n for n in candidates if n[0] in "mfta" or n.startswith(("split", "kv", "probe", "stored", "every"))]  # each calibrates on
    # its own ("auto" starts with "a", so it calibrates on its own too)
    default = calibrate(model, tokenizer, settings, progress=False) if set(candidates) - set(calibrated) else None
    derived = set(candidates) - set(calibrated) - {"default"}
    max_len = default.manifest["calibration"]["widths"]["seq_len"] if default else None
    # derived widths are plain ones: a split layer's keys are stored in its split rotation, so they come from the
    # default's plain path (the default's checks over plain widths alone) where the default chose split keys
    base = default
    if derived and default.has_split_keys:
        base = calibrate(model, tokenizer, replace(settings, key_formats="plain"), progress=False)
    probe = held_back_probe(model, tokenizer, settings) if derived else None
    artifacts = {}
    for name in candidates:
        if name[0] in "mf":  # a KL target (f: without the tolerance): calibrate measures the KL itself
            kl_settings = replace(settings, max_kl=float(name[1:]), max_answer_kl=None,
                                  **({"key_noise": None} if name[0] == "f" else {}))
            rot = calibrate(model, tokenizer, kl_settings, progress=False)
        elif name[0] == "t":  # calibrate's own allocation at another tolerance: values widen with the keys
            # t0: no tolerance (as `calibrate --key-noise 0`): the fewest widenings that meet the default's checks
            rot = calibrate(model, tokenizer, replace(settings, key_noise=float(name[1:]) or None), progress=False)
        elif name == "auto":  # the default's checks over both key formats, the fewer bits that meet them kept
            rot = calibrate(model, tokenizer, replace(settings, key_formats="auto"), progress=False)
        elif name[0] == "a":  # the default with another answer KL target
            rot = calibrate(model, tokenizer, replace(settings, max_answer_kl=float(name[1:])), progress=False)
        elif name.startswith("kv"):  # the noise's allocation within a budget, no tolerance and no check
            budget = replace(settings, kv_bits=float(name[3:] if name.startswith("kvs") else name[2:]),
                             key_noise=None, max_kl=None, max_answer_kl=None,
                             key_formats="split" if name.startswith("kvs") else "plain")
            rot = calibrate(model, tokenizer, budget, progress=False)
        elif name.startswith(("probe", "stored", "every")):  # the default's needle probe: another length, haystacks
            # stored, every prompt scored
            kind = re.match("probe|stored|every", name).group()
            length, _, formats = name[len(kind):].partition("-")
            rot = calibrate(model, tokenizer, replace(settings, needle_probe_tokens=int(length) if length else None,
                                                      needle_probe_haystack="decoded" if kind == "probe" else "stored",
                                                      needle_probe_scored="all" if kind == "every" else "answered",
                                                      key_formats=formats or settings.key_formats), progress=False)
        elif name.startswith("split"):  # the default's checks over plain and split key widths
            tolerance = {"key_noise": float(name[5:]) or None} if name[5:] else {}
            rot = calibrate(model, tokenizer, replace(settings, key_formats="split", **tolerance), progress=False)
        else:
            widths = candidate_widths(name, base, max_len)
            rot = default if widths is None else with_widths(base, *widths, probe)
        rot.save(directory / f"artifact_{name}")
        artifacts[name] = rot
        max_len = max_len or rot.manifest["calibration"]["widths"]["seq_len"]
        bits = bits_per_element(max_len, rot.geometry.head_dim, rot.group_size, k_bits=rot.key_widths(),
                                v_bits=rot.v_bits.tolist())
        print(f"{spec} {name}: {rot.width_summary()} ({bits:.3f} bits at {max_len})", flush=True)
    print(f"{spec}: calibrated in {time.perf_counter() - t0:.0f} s"
          + (f"; default: {default.manifest['calibration']['widths']['reason']}" if default else ""), flush=True)
    first, *rest = candidates
    config = EvalConfig(methods=[*filter(None, args.baselines.split(",")), "oscar"], tasks=args.tasks.split(","), gen_tokens=args.gen_tokens,
                        text=args.text,
                        context_lengths=contexts, niah_samples=args.niah_samples, ablations=False,
                        compare={f"oscar-{name}": artifacts[name] for name in rest})
    t0 = time.perf_counter()
    results = run_eval(model, tokenizer, artifacts[first], config, directory / "eval", progress=False)
    print(f"{spec}: evaluated in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for method, row in results["methods"].items():
        for ctx in map(str, contexts):
            rows.append({"model": spec, "context": int(ctx),
                         "method": f"oscar-{first}" if method == "oscar" else method,
                         **{m: row.get(m, {}).get(ctx) for m in METRICS}})
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    fmt = {"bits_per_element": "{:.3f}", "kl": "{:.4f}", "top1_agreement": "{:.3f}", "niah": "{:.2f}",
           "niah_multikey": "{:.2f}", "niah_multikey_answer_kl": "{:.4f}", "niah_multikey_answer_nll": "{:.3f}",
           "gen_kl": "{:.4f}", "gen_first_divergence": "{:.0f}"}
    heads = {"bits_per_element": "bits", "kl": "KL", "top1_agreement": "top-1", "niah": "NIAH",
             "niah_multikey": "multi-key", "niah_multikey_answer_kl": "multi-key answer KL",
             "niah_multikey_answer_nll": "multi-key answer NLL", "gen_kl": "gen KL", "gen_first_divergence": "gen tokens before divergence"}
    shown = [m for m in METRICS if any(r.get(m) is not None for r in rows)]
    lines = ["| model | context | method | " + " | ".join(heads[m] for m in shown) + " |",
             "|---|---|---|" + "---|" * len(shown)]
    for r in rows:
        cells = ["-" if r[m] is None else fmt[m].format(r[m]) for m in shown]
        lines.append(f"| {r['model']} | {r['context']} | {r['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, metavar="NAME:CTX,CTX",
                        help="a model and its context lengths (repeatable)")
    parser.add_argument("--candidates", default="default,k2,k3,k4")
    parser.add_argument("--niah-samples", type=int, default=10)
    parser.add_argument("--tasks", default="kl,niah,niah_multikey", help="eval tasks (longgen: also --gen-tokens)")
    parser.add_argument("--gen-tokens", type=int, default=1024)
    parser.add_argument("--text", default=None, help="evaluation text (eval --text): 'stdlib:' for contexts past the "
                        "shipped corpus's ~43K tokens")
    parser.add_argument("--baselines", default="bf16,kivi-2",
                        help="methods scored beside the candidates (bf16 always: the KL's reference; 'bf16' alone skips "
                        "KIVI-2, whose rows repeat on the same prompts)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    candidates = args.candidates.split(",")
    rows = []
    for entry in args.model:
        spec, _, ctxs = entry.partition(":")
        t0 = time.perf_counter()
        try:
            rows += run_model(spec, [int(c) for c in ctxs.split(",")], candidates, args, args.output)
        except Exception as exc:  # one model's failure must not lose the others' rows
            print(f"{spec} FAILED: {type(exc).__name__}: {exc}", flush=True)
            continue
        print(f"{spec}: {time.perf_counter() - t0:.0f} s", flush=True)
        (args.output / "protocol.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.output / "protocol.md").write_text(markdown(rows))
    sys.stdout.write(markdown(rows))


if __name__ == "__main__":
    main()
