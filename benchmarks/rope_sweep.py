"""Cost of the decode kernel's position-aware term vs the number of RoPE pairs it visits (H100, 128K).
Run on the device: PYTHONPATH=src python3 benchmarks/rope_sweep.py (NOTES.md, runs R2 and R4)."""
import torch

from oscar_kv.bench.synthetic import _fill_pool, _mixed_batch, _orthogonal, _rope_mean
from oscar_kv.bench.timing import _bench_call
from oscar_kv.kernels.decode import int2_decode
from oscar_kv.kernels.layout import PagedKVPool, PoolGeometry
from oscar_kv.rope import KernelRope

dev = torch.device("cuda")
geom = PoolGeometry(num_layers=1, num_kv_heads=8, head_dim=128, group_size=128, page_size=16, sink_size=64,
                    recent_size=256)
gen = torch.Generator().manual_seed(0)
inv_freq = 1e6 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128)
for ctx, bs in ((131072, 1), (131072, 8), (32768, 1)):
    batch, nq, nw = _mixed_batch(geom, bs, ctx, dev, gen)
    pool = PagedKVPool.allocate(geom, nq, nw, device=dev)
    _fill_pool(pool)
    q = torch.randn(bs, 32, 128, device=dev, dtype=torch.bfloat16)
    rot = _orthogonal(8, 128, dev)
    mp = geom.int2_pages_for(ctx)
    base = _bench_call(lambda: int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp))
    print(f"ctx {ctx} bs {bs}: int2 {base * 1e3:.1f} us", flush=True)
    for pairs in (8, 16, 32, 64):
        rope = KernelRope.build(_rope_mean(8, 128, gen, pairs).to(dev), inv_freq, 1.0, ctx)
        for cap in (128, None):
            t = _bench_call(lambda: int2_decode(q, pool, 0, batch, rot, rope=rope, max_int2_pages=mp, maxnreg=cap))
            print(f"  rope, {pairs:2d} pairs, register cap {cap}: {t * 1e3:.1f} us ({t / base:.2f}x)", flush=True)
    del pool
