"""Decode attention for one attention geometry (query heads, KV heads, head dim, group; P = 16): the CUDA kernel at
each split target (CTAs per SM in its split plan), with the default target once more under the one-wave plan
(int2_cuda.MERGE_BALANCE_TOKENS = 0: no cap on the splits for the merge), the CUDA kernel without the query rotation,
the Triton INT2 kernel and the Triton BF16 kernel over the same tokens; then (unless --no-stamps) the CUDA kernel's
phases inside one call (%globaltimer stamps, after an L2 flush) at the first context, batch 1.  GPU only.

    python3 benchmarks/cuda_geometry_sweep.py --q-heads 32 --kv-heads 2    # GLM-4-9B's attention (GQA 16)
    python3 benchmarks/cuda_geometry_sweep.py --q-heads 4 --kv-heads 1 --head-dim 256    # Gemma 3 270M's

Microseconds per call (CUDA graph replays, L2 flushed between them: bench/timing.py).  Above 8 query heads per KV
head the CUDA kernel runs query groups (int2_cuda.query_groups), so the pairs it plans for are KV heads x groups.
"""

import argparse

import torch

from cuda_int2_sweep import _fmt_phases, stamp_phases  # this folder's (the script's directory is on sys.path)
from oscar_kv.bench import synthetic as syn
from oscar_kv.bench.timing import _bench_call
from oscar_kv.kernels import int2_cuda
from oscar_kv.kernels.bf16_decode import bf16_decode
from oscar_kv.kernels.decode import int2_decode


def sweep(ctx: int, bs: int, targets, dev, gen) -> str:
    geom = syn.layer_geometry(2, 2)
    pool, batch, q, rot, mp = syn.int2_case(geom, ctx, bs, dev, gen)
    row = [f"ctx {ctx} bs {bs}"]
    for tgt in targets:
        us = 1e3 * _bench_call(lambda: int2_decode(q, pool, 0, batch, rot, backend="cuda", max_int2_pages=mp,
                                                    cuda_split_target=tgt))
        row.append(f"cuda t{tgt} {us:.1f}")
    balance = int2_cuda.MERGE_BALANCE_TOKENS
    try:
        int2_cuda.MERGE_BALANCE_TOKENS = 0
        us = 1e3 * _bench_call(lambda: int2_decode(q, pool, 0, batch, rot, backend="cuda", max_int2_pages=mp))
    finally:
        int2_cuda.MERGE_BALANCE_TOKENS = balance
    row.append(f"cuda one-wave {us:.1f}")
    us = 1e3 * _bench_call(lambda: int2_decode(q, pool, 0, batch, None, backend="cuda", max_int2_pages=mp))
    row.append(f"cuda norot {us:.1f}")
    us = 1e3 * _bench_call(lambda: int2_decode(q, pool, 0, batch, rot, backend="triton", max_int2_pages=mp))
    row.append(f"triton {us:.1f}")
    del pool
    pages = -(-ctx // geom.page_size)
    kw = torch.randn(bs * pages, geom.num_kv_heads, geom.page_size, geom.head_dim, device=dev, dtype=torch.bfloat16)
    vw = torch.randn_like(kw)
    bt = torch.arange(bs * pages, device=dev, dtype=torch.int32).view(bs, pages)
    sl = torch.full((bs,), ctx, device=dev, dtype=torch.int32)
    us = 1e3 * _bench_call(lambda: bf16_decode(q, kw, vw, bt, sl, None, page_size=geom.page_size, max_seq_len=ctx))
    row.append(f"bf16 triton {us:.1f}")
    return " | ".join(row)


def stamps(ctx: int, target: int, dev, gen) -> str:
    geom = syn.layer_geometry(2, 2)
    pool, batch, q, rot, mp = syn.int2_case(geom, ctx, 1, dev, gen)
    phases = stamp_phases(q, pool, batch, rot, geom, mp, dev, per_sm=target)
    return f"stamps (median/max us from the first CTA's start), target {target}: " + _fmt_phases(phases)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=None, help="quantization group (default: the head dim)")
    ap.add_argument("--targets", default="1,2,3,4", help="CUDA CTAs per SM in the split plan")
    ap.add_argument("--no-stamps", action="store_true", help="skip the phase stamps")
    args = ap.parse_args()
    syn.GEOMETRY.update(num_q_heads=args.q_heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                        group_size=args.group_size or args.head_dim)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    targets = [int(t) for t in args.targets.split(",")]
    for ctx in contexts:
        for bs in map(int, args.batch_sizes.split(",")):
            print(sweep(ctx, bs, targets, dev, gen), flush=True)
            torch.cuda.empty_cache()
    for target in () if args.no_stamps else (int2_cuda.min_blocks(head_dim=args.head_dim), 1):
        print(stamps(contexts[0], target, dev, gen), flush=True)


if __name__ == "__main__":
    main()
