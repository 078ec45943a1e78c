"""Tensor parallel vs one GPU on a real-size random-weight model: greedy tokens and logits, written as JSON.

    python benchmarks/tp_equality.py --arch qwen3-8b --out tp1.json                  # one GPU
    torchrun --nproc-per-node 2 benchmarks/tp_equality.py --arch qwen3-8b --tp 2 --out tp2.json
    python benchmarks/tp_equality.py --compare tp1.json tp2.json

Same seed, same weights, same prompts (one past the sink and recent windows, so INT2 pages exist; two that
share a prefix), bf16 and int2 caches.  The row-parallel all-reduce adds partial sums in another order than
one GPU's matmul, so logits differ by rounding; the comparison reports how much, and where the greedy tokens
first part.  ``--dtype float32 --attention-backend torch`` shrinks that rounding (the torch reference path
accepts float32; the Triton kernels read bf16).
"""

import argparse
import gc
import json
import sys

import torch

from oscar_kv import parallel
from oscar_kv.artifacts import DEFAULT_K_CLIP, DEFAULT_V_CLIP, Rotations
from oscar_kv.bench.models import TokenIdsOnly, build_model
from oscar_kv.engine import EngineConfig, LLMEngine, SamplingParams
from oscar_kv.models import AttentionGeometry


def run(args, tp: parallel.TensorParallel, scheme: str) -> dict | None:
    device = parallel.local_device(args.device, tp.size)
    torch.manual_seed(args.seed)
    model, _ = build_model(args.arch, args.layers, torch.device(device), getattr(torch, args.dtype))
    rot = Rotations.data_free(AttentionGeometry.of(model.config), "hadamard", k_clip=DEFAULT_K_CLIP,
                              v_clip=DEFAULT_V_CLIP) if scheme == "int2" else None
    config = EngineConfig(kv_cache_dtype=scheme, max_model_len=8192, kv_cache_memory=4.0,
                          attention_backend=args.attention_backend)
    engine = LLMEngine(model, TokenIdsOnly(), rot, config, tp)
    if not tp.is_driver:
        engine.follow()
        return None
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.float().cpu()))
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, model.config.vocab_size, (3000,), generator=g).tolist()
    prompts = [base, base[:1200] + [5, 6, 7], base[:300]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    int2_pages = 0
    while engine.has_work():
        engine.step()
        int2_pages = max(int2_pages, max(s.int2_pages for s in seqs))
    hook.remove()
    engine.shutdown()
    return dict(outputs=[s.output_ids for s in seqs], int2_pages=int2_pages,
                first_logits=logits[0])  # the first sampling step's rows (saved beside the JSON)


def compare(a_path: str, b_path: str) -> None:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    logits_a, logits_b = (torch.load(p + ".logits.pt") for p in (a_path, b_path))
    for scheme in a["schemes"]:
        x, y = a["schemes"][scheme], b["schemes"][scheme]
        la, lb = logits_a[scheme], logits_b[scheme]
        rel = float((la - lb).norm() / la.norm())
        parts = []
        for i, (p, q) in enumerate(zip(x["outputs"], y["outputs"])):
            same = next((k for k, (s, t) in enumerate(zip(p, q)) if s != t), len(p))
            parts.append(f"request {i}: {same}/{len(p)} tokens equal")
        print(f"{scheme}: first-step logits relative difference {rel:.2e}, argmax equal "
              f"{bool((la.argmax(-1) == lb.argmax(-1)).all())}; " + "; ".join(parts)
              + f"; INT2 pages {x['int2_pages']} / {y['int2_pages']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="model weights: bfloat16 (as served) or float32 (with "
                    "--attention-backend torch: no bf16 rounding to amplify)")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
        return 0
    tp = parallel.init(args.tp, args.device)
    result = {"arch": args.arch, "tp": args.tp, "dtype": args.dtype, "attention_backend": args.attention_backend,
              "schemes": {}}
    with torch.no_grad():
        for scheme in ("bf16", "int2"):
            result["schemes"][scheme] = run(args, tp, scheme)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if tp.is_driver:
        torch.save({k: v.pop("first_logits") for k, v in result["schemes"].items()}, args.out + ".logits.pt")
        with open(args.out, "w") as f:
            json.dump(result, f)
    parallel.shutdown(tp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
