"""Decode attention for one attention geometry (query heads, KV heads; head dim 128, group 128, P = 16): the CUDA
kernel at each split target (CTAs per SM in its split plan), the CUDA kernel without the in-kernel query rotation,
the Triton INT2 kernel and the Triton BF16 kernel over the same tokens; then (unless --no-stamps) the CUDA kernel's
phases inside one call (%globaltimer stamps, after an L2 flush) at the first context, batch 1.  GPU only.

    python3 benchmarks/cuda_geometry_sweep.py --q-heads 32 --kv-heads 2    # GLM-4-9B's attention (GQA 16)

Microseconds per call (CUDA graph replays, L2 flushed between them: bench/timing.py).  Above 8 query heads per KV
head the CUDA kernel runs query groups (int2_cuda.query_groups), so the pairs it plans for are KV heads x groups.
"""

import argparse

import torch

from oscar_kv.bench import synthetic as syn
from oscar_kv.bench.timing import _bench_call
from oscar_kv.kernels import int2_cuda
from oscar_kv.kernels.common import LOG2E, num_sms
from oscar_kv.kernels.decode import bf16_decode, int2_decode

STAMPED = {0: "start", 1: "prologue", 2: "query", 3: "window", 10: "step 1", 4: "loop", 5: "partial", 6: "counted",
           8: "merge start", 9: "merge math", 7: "merged"}


def sweep(ctx: int, bs: int, targets, dev, gen) -> str:
    geom = syn.layer_geometry(2, 2)
    pool, batch, q, rot, mp = syn.int2_case(geom, ctx, bs, dev, gen)
    row = [f"ctx {ctx} bs {bs}"]
    for tgt in targets:
        us = 1e3 * _bench_call(lambda: int2_decode(q, pool, 0, batch, rot, backend="cuda", max_int2_pages=mp,
                                                    cuda_split_target=tgt))
        row.append(f"cuda t{tgt} {us:.1f}")
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
    pairs = geom.num_kv_heads * int2_cuda.query_groups(q.shape[1] // geom.num_kv_heads)
    ns, chunk = int2_cuda.split_plan(mp * geom.page_size, pairs, geom.page_size, num_sms(dev), target)
    ts = torch.zeros(1, pairs, ns, 16, dtype=torch.int64, device=dev)
    out = torch.empty_like(q)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    for _ in range(3):  # compile, then the flushed call that counts
        flush.zero_()
        ts.zero_()
        int2_cuda.decode(q, rot, pool.layer(0), geom, batch, out, ns, chunk, LOG2E / geom.head_dim ** 0.5, stamps=ts)
    torch.cuda.synchronize()
    t = ts.view(-1, 16).double()
    t0 = t[:, 0].min()
    parts = []
    for k, name in STAMPED.items():
        col = t[:, k][t[:, k] > 0] - t0
        if col.numel():
            parts.append(f"{name} {col.median().item() / 1e3:.1f}/{col.max().item() / 1e3:.1f}")
    return f"stamps (median/max us) target {target}, {ns} splits of {chunk}: " + ", ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--targets", default="1,2,3,4", help="CUDA CTAs per SM in the split plan")
    ap.add_argument("--no-stamps", action="store_true", help="skip the phase stamps")
    args = ap.parse_args()
    syn.GEOMETRY.update(num_q_heads=args.q_heads, num_kv_heads=args.kv_heads)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    targets = [int(t) for t in args.targets.split(",")]
    for ctx in contexts:
        for bs in map(int, args.batch_sizes.split(",")):
            print(sweep(ctx, bs, targets, dev, gen), flush=True)
            torch.cuda.empty_cache()
    for target in () if args.no_stamps else (int2_cuda.min_blocks(), 1):
        print(stamps(contexts[0], target, dev, gen), flush=True)


if __name__ == "__main__":
    main()
