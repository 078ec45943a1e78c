"""Sweep of the decode kernel's position-aware path at 128K (H100): tile size, warps, register cap vs plain INT2.
Run on the device: PYTHONPATH=src python3 benchmarks/rope_sweep.py (NOTES.md, run R2)."""
import torch, itertools
from oscar_kv.bench.attention import _mixed_batch, _fill_pool, _orthogonal, _bench_call, GEOMETRY
from oscar_kv.kernels.decode import int2_decode
from oscar_kv.kernels.layout import PagedKVPool, PoolGeometry
from oscar_kv.rope import KernelRope
dev = torch.device("cuda")
geom = PoolGeometry(num_layers=1, num_kv_heads=8, head_dim=128, group_size=128, page_size=16, sink_size=64, recent_size=256)
gen = torch.Generator().manual_seed(0)
for ctx, bs in ((131072, 1), (131072, 8)):
    batch, nq, nw = _mixed_batch(geom, bs, ctx, dev, gen)
    pool = PagedKVPool.allocate(geom, nq, nw, device=dev); _fill_pool(pool)
    q = torch.randn(bs, 32, 128, device=dev, dtype=torch.bfloat16); rot = _orthogonal(8, 128, dev)
    mp = geom.int2_pages_for(ctx)
    rope = KernelRope(torch.randn(8, 128, device=dev) * 20, *KernelRope.tables(1e6 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128), 1.0, ctx, dev))
    base = _bench_call(lambda: int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp))
    print(f"ctx {ctx} bs {bs}: int2 {base*1e3:.1f} us", flush=True)
    for bn, nr, nw_ in itertools.product((64, 128, 256), (128, None), (4, 8)):
        try:
            t = _bench_call(lambda: int2_decode(q, pool, 0, batch, rot, rope=rope, max_int2_pages=mp, block_n=bn, maxnreg=nr, num_warps=nw_))
            print(f"  rope block_n {bn} maxnreg {nr} warps {nw_}: {t*1e3:.1f} us ({t/base:.2f}x)", flush=True)
        except Exception as e:
            print(f"  rope block_n {bn} maxnreg {nr} warps {nw_}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)
    del pool
