"""Scratch A/B: CUDA decode kernel CTAs of 4 warps vs 8 (int2_cuda.cta_plan), several geometries, b1..b8."""
import argparse, json, sys
from pathlib import Path
import torch
from oscar_kv.bench.attention import prepare_artifact
from oscar_kv.bench.synthetic import GEOMETRY, _fill_pool, _mixed_batch, add_width_arguments, layer_geometry
from oscar_kv.bench.timing import _bench_call
from oscar_kv.kernels import int2_cuda, pdl
from oscar_kv.kernels.common import num_sms
from oscar_kv.kernels.decode import int2_decode
from oscar_kv.kernels.layout import PagedKVPool
from oscar_kv.rope import KernelRope

ap = argparse.ArgumentParser(); add_width_arguments(ap)
ap.add_argument("--configs", default="glm,qwen3,mistral")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--out", default="/tmp/warps_ab.json")
a = ap.parse_args()
pdl.set_enabled(False)
dev = torch.device("cuda")
CONFIGS = {
    "glm": dict(kv=2, window=None, points=[(4096, 1), (32768, 16), (131072, 4), (131072, 8)]),
    "qwen3": dict(kv=8, window=None, points=[(4096, 1), (32768, 2), (32768, 4), (131072, 2), (131072, 4)]),
    "mistral": dict(kv=8, window=4096, points=[(32768, 1), (32768, 8), (32768, 16)]),
}
rows = []
for name in a.configs.split(","):
    cfg = CONFIGS[name]
    GEOMETRY["num_kv_heads"] = cfg["kv"]
    ctxs = [c for c, _ in cfg["points"]]
    art, record = prepare_artifact(None, 8, a, max(ctxs))
    geom = layer_geometry(art.key_widths()[0], int(art.v_bits[0]))
    hq, d, h = GEOMETRY["num_q_heads"], geom.head_dim, geom.num_kv_heads
    rot = art.k_rotation[0].float().to(dev)[:h]
    inv_freq = 1e6 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    for ctx, bs in cfg["points"]:
        rope = KernelRope.build(art.k_rope_mean[0].float().to(dev)[:h], inv_freq, 1.0, ctx)
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(bs, hq, d, device=dev, dtype=torch.bfloat16)
        batch, nq, nw = _mixed_batch(geom, bs, ctx, dev, gen)
        pool = PagedKVPool.allocate(geom, nq, nw, device=dev)
        _fill_pool(pool)
        mp = geom.int2_pages_for(ctx)
        for kind, rp in (("R8", rope), ("R0", None)):
            variants = {"w4": dict(cuda_warps=4), "w8": dict(cuda_warps=8), "w8r1": dict(cuda_warps=8, rounds=1),
                        "w4r1": dict(cuda_warps=4, rounds=1)}
            def call(v, rp=rp):
                kw = dict(v); bal = kw.pop("balance", 32)
                int2_cuda.MERGE_BALANCE_TOKENS = bal
                int2_cuda.MIN_ROUNDS = kw.pop("rounds", 2)
                try:
                    return int2_decode(q, pool, 0, batch, rot, rope=rp, max_int2_pages=mp, max_seq_len=ctx,
                                       backend="cuda", window=cfg["window"], **kw)
                finally:
                    int2_cuda.MERGE_BALANCE_TOKENS = 32
                    int2_cuda.MIN_ROUNDS = 2
            # the plans
            hist = mp * geom.page_size
            if cfg["window"]:
                from oscar_kv.kernels.common import window_tokens
                hist = window_tokens(hist, cfg["window"], geom.page_size)
            programs = bs * h * int2_cuda.query_groups(hq // h)
            per_sm = int2_cuda.min_blocks(8 if rp is not None else 0, d)
            plan4 = int2_cuda.split_plan(hist, programs, geom.page_size, num_sms(dev), per_sm, d)
            planA = int2_cuda.cta_plan(hist, programs, geom.page_size, num_sms(dev), per_sm, d, True)
            outs = {k: call(v).float() for k, v in variants.items()}
            best = {}
            for _ in range(a.rounds):
                for k, v in variants.items():
                    us = 1e3 * _bench_call(lambda v=v: call(v))
                    best[k] = min(best.get(k, us), us)
            ref = outs["w4"]
            err = {k: ((o - ref).norm() / ref.norm()).item() for k, o in outs.items()}
            row = dict(config=name, ctx=ctx, bs=bs, kind=kind, plan4=plan4, auto_plan=planA, us=best, err=err)
            rows.append(row)
            print(f"{name} {kind} ctx {ctx} bs {bs} plan4 {plan4} auto {planA}: " +
                  ", ".join(f"{k} {best[k]:.1f} ({best[k]/best['w4']:.3f}x, {err[k]:.0e})" for k in variants), flush=True)
        pool = None
        torch.cuda.empty_cache()
json.dump(rows, open(a.out, "w"), indent=1)
