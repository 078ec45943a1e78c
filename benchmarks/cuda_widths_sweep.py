"""The CUDA decode kernel's width variants (K2V2, K4V2, K4V3, K8V3, ...) against the Triton kernel at the same widths,
128K tokens, Qwen3-8B attention geometry (8 KV heads, GQA 4, D = 128; --head-dim 256: Gemma-3-12B's 16 query / 8 KV
heads, two groups of 128), constant centering, random codes.  GPU only.

    python3 benchmarks/cuda_widths_sweep.py [--contexts 131072] [--batch-sizes 1,8] [--min-blocks 3,2] [--widths 2,8,4:3]

Per (width, batch): microseconds per call (10 calls in a CUDA graph, median of 20 replays; no L2 flush: the history is
>= 1.5 L2s at 128K), the history bytes over the time (GB/s), for the CUDA kernel at each CTAs-per-SM budget (--min-blocks: the
launch bounds and the split plan, int2_cuda.min_blocks) and for Triton.
"""

import argparse
import statistics

import torch

from oscar_kv.kernels import int2_cuda
from oscar_kv.kernels.decode import int2_decode
from oscar_kv.kernels.layout import PagedKVPool, PoolGeometry, plan_batch


def case(kbits: int, vbits: int, context: int, batch: int, dev, head_dim: int = 128):
    geom = PoolGeometry(num_layers=1, num_kv_heads=8, head_dim=head_dim, group_size=128, page_size=16, sink_size=64,
                        recent_size=256, k_bits=(kbits,), v_bits=(vbits,))
    gen = torch.Generator().manual_seed(kbits)
    pb, nq, nw = plan_batch(geom, [context] * batch, generator=gen)
    pool = PagedKVPool.allocate(geom, nq, nw, device=dev)
    for t in (pool.k_codes, pool.v_codes, pool.k_zero, pool.v_zero):
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=dev))
    for t in (pool.k_scale, pool.v_scale):
        t.uniform_(0.01, 0.05)
    for t in (pool.k_win, pool.v_win):
        t.normal_()
    q = torch.randn(batch, 32 if head_dim == 128 else 16, head_dim, device=dev, dtype=torch.bfloat16)
    rot = torch.linalg.qr(torch.randn(8, head_dim, head_dim, device=dev))[0]
    return geom, pool, pb.to(dev), q, rot


def timed(fn, calls: int = 10, reps: int = 20) -> float:
    """Microseconds per call: ``calls`` calls captured in one CUDA graph (no host time between them), the median
    over ``reps`` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile, and the merge counters of this stream
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--min-blocks", default="3,2")
    ap.add_argument("--widths", default="2,3,4", help="key widths, or KEY:VALUE pairs (values default to 2)")
    ap.add_argument("--head-dim", type=int, default=128, choices=(128, 256))
    args = ap.parse_args()
    dev = torch.device("cuda")
    shipped = int2_cuda.min_blocks
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batch_sizes.split(",")):
            for pair in args.widths.split(","):
                kbits, vbits = (int(w) for w in (pair.split(":") + ["2"])[:2])
                geom, pool, pb, q, rot = case(kbits, vbits, context, batch, dev, args.head_dim)
                mp = int(pb.int2_pages.max())
                hist = batch * 8 * mp * 16 * geom.quant_bytes_per_token(0)
                row = [f"K{kbits}V{vbits} ctx {context} bs {batch}"]
                for mb in map(int, args.min_blocks.split(",")):
                    int2_cuda.min_blocks = lambda r=0, d=128, k=2, vbits=2, mb=mb: mb  # noqa: E731
                    try:
                        us = timed(lambda: int2_decode(q, pool, 0, pb, rot, backend="cuda", max_int2_pages=mp))
                    finally:
                        int2_cuda.min_blocks = shipped
                    row.append(f"cuda mb{mb} {us:7.1f} us {hist / us / 1e3:6.0f} GB/s")
                us = timed(lambda: int2_decode(q, pool, 0, pb, rot, backend="triton", max_int2_pages=mp))
                row.append(f"triton {us:7.1f} us {hist / us / 1e3:6.0f} GB/s")
                print(" | ".join(row), flush=True)
                del pool


if __name__ == "__main__":
    main()
