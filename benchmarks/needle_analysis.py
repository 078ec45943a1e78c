"""Why OSCAR loses the needle at long context: one haystack prefill per sample, every scheme and variant
stored from it, the question asked through each (evaluate/needle.py), and per-head attention reports.

    python3 benchmarks/needle_analysis.py --model qwen2.5-coder-1.5b --rotations A --device cuda \
        --contexts 8192,16384,32768 --samples 10 --output runs/needle

Writes OUTPUT/needle.json (per context: each variant's hit rate, first-digit accuracy, answer NLL; per
layer/head report means) and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from oscar_kv.artifacts import Rotations
from oscar_kv.cache import CacheSettings
from oscar_kv.evaluate import needle, tasks
from oscar_kv.evaluate.harness import evaluation_text
from oscar_kv.evaluate.schemes import Scheme, standard_scheme
from oscar_kv.models import AttentionGeometry, load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rotations", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--contexts", default="2048")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--multikey", type=int, default=0, help="multi-key samples per context (4 keyed needles)")
    ap.add_argument("--int4-heads", type=float, default=0.2, help="share of KV heads given INT4 keys in that variant")
    ap.add_argument("--output", default="runs/needle")
    ap.add_argument("--compare", action="append", default=[], metavar="NAME=DIR",
                    help="another artifact scored as variant NAME (repeatable)")
    ap.add_argument("--variants", default="", help="comma-separated variants to score (default: all)")
    args = ap.parse_args()

    model, tokenizer = load_model(args.model, args.device)
    geometry = AttentionGeometry.of(model.config)
    rot = Rotations.load(args.rotations, geometry)
    base = CacheSettings("int2")
    schemes = {name: standard_scheme(name, geometry, rot, base) for name in ("bf16", "oscar", "kivi-2")}
    schemes["oscar-int4"] = Scheme("oscar-int4", rot, replace(base, kv_cache_dtype="int4"))
    no_clip = copy.deepcopy(rot)
    no_clip.k_clip[:] = 1.0
    schemes["oscar-no-key-clip"] = Scheme("oscar-no-key-clip", no_clip, base)
    for strength in (0.0, 0.5, 1.0):  # the keys' clip shrink undone in part or whole (quant.py)
        if strength != rot.k_rescale:
            other = copy.deepcopy(rot)
            other.k_rescale = strength
            schemes[f"oscar-key-rescale-{strength:g}"] = Scheme(f"oscar-key-rescale-{strength:g}", other, base)
    g64 = copy.deepcopy(rot)
    g64.group_size = max(rot.group_size // 2, 8)
    schemes["oscar-half-group"] = Scheme("oscar-half-group", g64, base)
    for tokens in (32, 64):  # keys per channel over groups of tokens (KIVI's axis) in OSCAR's rotated space
        schemes[f"oscar-channel-keys-{tokens}"] = Scheme(f"oscar-channel-keys-{tokens}", rot,
                                                          replace(base, key_axis="channel", page_size=tokens))
    for spec in args.compare:
        name, directory = spec.split("=", 1)
        schemes[name] = Scheme(name, Rotations.load(directory, geometry), base)
    wanted = set(filter(None, args.variants.split(",")))
    if wanted:  # the stored forms a wanted variant is made of
        needs = wanted | {"bf16", "oscar"} | ({"oscar-int4"} if "oscar-int4-retrieval-keys" in wanted else set())
        schemes = {k: v for k, v in schemes.items() if k in needs}
    text = evaluation_text(None)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"model": args.model, "rotations": args.rotations, "contexts": {}}
    hkv = geometry.num_kv_heads
    for ctx in [int(c) for c in args.contexts.split(",")]:
        t0 = time.perf_counter()
        rows: dict[str, list] = {}
        reports: dict[str, list] = {}
        prompts = []
        numbers = tasks.needle_numbers(args.samples, 1000 + ctx)
        for i, number in enumerate(numbers):
            start = (i * 7919 * 13) % max(len(text) - ctx * 8, 1)
            depth = (i + 0.5) / args.samples
            prompts.append(("single", tasks.niah_prompt(tokenizer, text[start:start + ctx * 8], ctx, depth, number)))
        for i in range(args.multikey):
            start = (i * 104729) % max(len(text) - ctx * 8, 1)
            prompts.append(("multikey", tasks.multikey_prompt(tokenizer, text[start:start + ctx * 8], ctx, ctx + i)))
        for kind, prompt in prompts:
            kv = tasks.haystack_kv(model, prompt.haystack)
            stored = {name: needle.stored_haystack(model, s, kv, len(prompt.question)) for name, s in schemes.items()}
            del kv
            exact, oscar = stored["bf16"], stored["oscar"]
            queries = needle.answering_queries(model, prompt)
            rep = needle.head_report(queries, exact, oscar, prompt)
            # retrieval heads: the KV heads whose query heads put the most exact mass on the needle
            score = rep["needle_exact"].reshape(len(queries), hkv, -1).mean(-1)  # [L, Hkv]
            k = max(1, round(args.int4_heads * score.numel()))
            top = torch.zeros_like(score, dtype=torch.bool).flatten()
            top[score.flatten().topk(k).indices] = True
            top = top.reshape(score.shape)
            variants = {
                "bf16": exact,
                "oscar": oscar,
                "oscar-keys-only": exact.mixed(oscar, keys_from_other=True),
                "oscar-values-only": exact.mixed(oscar, values_from_other=True),
                "oscar-bias": replace(oscar, logit_bias=needle.variance_bias(rep, hkv)),
            }
            if "oscar-int4" in stored:
                variants["oscar-int4-retrieval-keys"] = oscar.mixed(stored["oscar-int4"], keys_from_other=top)
            variants.update({name: stored[name] for name in schemes if name not in variants})
            if wanted:
                variants = {k: v for k, v in variants.items() if k in wanted or k in ("bf16", "oscar")}
            for name in ("oscar-keys-only", "oscar-values-only", "oscar-bias", "oscar-no-key-clip",
                         *[c.split("=")[0] for c in args.compare]):
                if name in variants:
                    reports.setdefault(name, []).append(needle.head_report(queries, exact, variants[name], prompt))
            reports.setdefault("oscar", []).append(rep)
            for name, st in variants.items():
                s = needle.answer_score(model, tokenizer, st, prompt)
                rows.setdefault(f"{kind}:{name}", []).append(
                    {"nll": s.nll, "first": s.first_digit_correct, "hit": s.hit, "text": s.text})
            del stored, variants
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        summary = {name: {"hit": sum(r["hit"] for r in v) / len(v), "first": sum(r["first"] for r in v) / len(v),
                          "nll": sum(r["nll"] for r in v) / len(v), "n": len(v)} for name, v in rows.items()}
        head_means = {name: {k: torch.stack([r[k] for r in reps]).mean(0).tolist() for k in reps[0]}
                      for name, reps in reports.items()}
        results["contexts"][str(ctx)] = {"summary": summary, "samples": rows, "heads": head_means,
                                         "seconds": round(time.perf_counter() - t0, 1)}
        (out_dir / "needle.json").write_text(json.dumps(results, indent=1) + "\n")
        print(f"\n== context {ctx} ({time.perf_counter() - t0:.0f} s)")
        print(f"{'variant':40s} {'hit':>6s} {'first':>6s} {'nll':>7s}")
        for name, m in summary.items():
            print(f"{name:40s} {m['hit']:6.2f} {m['first']:6.2f} {m['nll']:7.3f}")
        for name, h in head_means.items():
            ne, ns = torch.tensor(h["needle_exact"]), torch.tensor(h["needle_stored"])
            he, hs = torch.tensor(h["history_exact"]), torch.tensor(h["history_stored"])
            sd, nd = torch.tensor(h["delta_std"]), torch.tensor(h["needle_delta"])
            err = torch.tensor(h["out_error"])
            best = ne.flatten().topk(min(8, ne.numel())).indices
            print(f"  {name}: needle mass of the 8 top heads exact {ne.flatten()[best].mean():.3f} -> stored "
                  f"{ns.flatten()[best].mean():.3f}; history mass {he.mean():.3f} -> {hs.mean():.3f}; "
                  f"logit err std {sd.mean():.3f} (top heads {sd.flatten()[best].mean():.3f}); needle logit err "
                  f"{nd.flatten()[best].mean():+.3f}; out err {err.mean():.3f}")


if __name__ == "__main__":
    main()
