"""What the position-aware key term costs in the one-launch CUDA INT2 decode kernel (issue 23): per context,
batch, visited pair count R and |mu_pre| scale, the kernel with keys centered per position against the same
call with constant centering, for the shipped int2_decode.cu and other versions of it (--sources), interleaved
in one run.  Each output is checked against the Triton kernel (the tested reference path).  GPU only.

    python3 benchmarks/rope_term_sweep.py [--contexts 32768,131072] [--batch-sizes 1,8,32] [--pairs 8,16,32]
                                          [--scales 20,900] [--sources A.cu,B.cu] [--output DIR]
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cuda_int2_sweep import SHIPPED, _source  # noqa: E402

from oscar_kv.bench.synthetic import int2_case, layer_geometry, use_head_dim  # noqa: E402
from oscar_kv.bench.timing import _bench_call  # noqa: E402
from oscar_kv.kernels import int2_cuda  # noqa: E402
from oscar_kv.kernels.decode import int2_decode  # noqa: E402
from oscar_kv.rope import KernelRope, keep_pairs, random_pairs  # noqa: E402


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--pairs", default="8,16,32")
    ap.add_argument("--scales", default="20,900")
    ap.add_argument("--sources", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-blocks", type=int, default=None,
                    help="CTAs per SM the per-position kernels are compiled for (default: int2_cuda.min_blocks(R))")
    ap.add_argument("--output", default=None)
    ap.add_argument("--head-dim", type=int, choices=(64, 128), default=128)
    a = ap.parse_args()
    dev = torch.device("cuda")
    use_head_dim(a.head_dim)
    geom = layer_geometry()
    h, d = geom.num_kv_heads, geom.head_dim
    inv_freq = 1e6 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # Qwen3's RoPE base
    sources = [SHIPPED] + [s for s in a.sources.split(",") if s]
    names = [Path(s).stem for s in sources]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for ctx in map(int, a.contexts.split(",")):
        for bs in map(int, a.batch_sizes.split(",")):
            pool, batch, q, rot, mp = int2_case(geom, ctx, bs, dev, gen)
            const = lambda: int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp, backend="cuda")  # noqa: E731
            for r in map(int, a.pairs.split(",")):
                for scale in map(float, a.scales.split(",")):
                    mu = keep_pairs(torch.randn(h, d, generator=gen) * scale, random_pairs(h, d // 2, r, gen))
                    rope = KernelRope.build(mu.to(dev), inv_freq, 1.0, ctx)
                    def call():
                        table = "ROPE_MIN_BLOCKS_D64" if d == 64 else "ROPE_MIN_BLOCKS"
                        shipped = getattr(int2_cuda, table)
                        if a.min_blocks:
                            setattr(int2_cuda, table, {r: a.min_blocks})
                        try:
                            return int2_decode(q, pool, 0, batch, rot, rope=rope, max_int2_pages=mp, max_seq_len=ctx,
                                               backend="cuda")
                        finally:
                            setattr(int2_cuda, table, shipped)
                    want = int2_decode(q, pool, 0, batch, rot, rope=rope, max_int2_pages=mp, max_seq_len=ctx,
                                       backend="triton")
                    errs = {}
                    for s, n in zip(sources, names):
                        with _source(s):
                            errs[n] = rel(call(), want)
                    best = {}
                    for _ in range(a.rounds):  # interleaved: constant, then each source
                        best["constant"] = min(best.get("constant", 1e9), 1e3 * _bench_call(const))
                        for s, n in zip(sources, names):
                            with _source(s):
                                best[n] = min(best.get(n, 1e9), 1e3 * _bench_call(call))
                    row = dict(context=ctx, batch=bs, pairs=r, scale=scale, us=best, err_vs_triton=errs)
                    rows.append(row)
                    print(f"ctx {ctx:>6} bs {bs:>2} R {r:>2} |mu| {scale:>4.0f}: constant {best['constant']:7.1f} us | " +
                          " | ".join(f"{n} {best[n]:7.1f} ({best[n] / best['constant']:.2f}x, err {errs[n]:.1e})"
                                     for n in names), flush=True)
            del pool
            torch.cuda.empty_cache()
    if a.output:
        os.makedirs(a.output, exist_ok=True)
        with open(os.path.join(a.output, "rope_term_sweep.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
