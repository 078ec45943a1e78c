"""Run by tests/test_parallel.py, alone (--tp 1) or under torchrun (--tp N): the engine's greedy outputs for a
fixed set of prompts, written by rank 0 as JSON.  The prompts cover chunked prefill, continuous batching, a
shared prefix (prefix cache hits) and histories long enough to migrate pages into INT2."""

import argparse
import json

import torch

from oscar_kv import parallel
from oscar_kv.artifacts import Rotations
from oscar_kv.engine import EngineConfig, LLMEngine, SamplingParams
from oscar_kv.models import load_model


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, vocab, (700,), generator=g).tolist()
    return [base[:40], base, base[:500] + [3, 1, 4], torch.randint(0, vocab, (380,), generator=g).tolist()]


def run(model_dir: str, rotations: str | None, dtype: str, tp: parallel.TensorParallel, max_tokens: int = 12):
    model, tokenizer = load_model(model_dir, dtype=torch.float64)  # float64: sums in any order agree
    rot = Rotations.load(rotations) if rotations else None
    config = EngineConfig(kv_cache_dtype=dtype, max_model_len=1024, kv_cache_memory=0.05, max_num_batched_tokens=160)
    engine = LLMEngine(model, tokenizer, rot, config, tp)
    if not tp.is_driver:
        engine.follow()
        _second_engine(model, tokenizer, rot, config, tp)
        return None
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(f"r{i}", ids, params) for i, ids in enumerate(prompts(model.config.vocab_size))]
    int2_pages = [0] * len(seqs)
    while engine.has_work():
        engine.step()
        int2_pages = [max(n, s.int2_pages) for n, s in zip(int2_pages, seqs)]
    engine.shutdown()
    return dict(outputs=[s.output_ids for s in seqs], int2_pages=int2_pages,
                kv_heads_per_rank=engine.pool.geometry.num_kv_heads,
                second_engine=_second_engine(model, tokenizer, rot, config, tp))


def _second_engine(model, tokenizer, rot, config, tp) -> str:
    """A second engine on the same model: fine in one process; refused clearly once the model is sharded."""
    try:
        LLMEngine(model, tokenizer, rot, config, tp)
        return "built"
    except ValueError as exc:
        return str(exc)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rotations")
    ap.add_argument("--dtype", default="int2")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tp = parallel.init(args.tp, "cpu")
    result = run(args.model, args.rotations, args.dtype, tp)
    if result is not None:
        with open(args.out, "w") as f:
            json.dump(result, f)
    parallel.shutdown(tp)
