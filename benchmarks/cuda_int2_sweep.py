"""INT2 decode attention at 128K (Qwen3-8B geometry): the one-launch CUDA decode vs the all-Triton path,
over the CUDA kernel's knobs (CTAs per SM in the split plan, register budget), and what the in-kernel query
rotation costs (the same call without a rotation).  GPU only.

    python3 benchmarks/cuda_int2_sweep.py [--contexts 131072] [--batch-sizes 1,8,32] [--output DIR] [--stamps]

--stamps also times the phases of each CTA inside one call (%globaltimer stamps from a separately compiled
variant, after an L2 flush): when CTAs start, have their query, finish the window, the INT2 loop, the partial,
and when the last one has merged.
"""

import argparse
import json
import os

import torch

from oscar_kv.bench.attention import GEOMETRY, _bench_call, copy_bandwidth, int2_bytes, int2_case
from oscar_kv.kernels import int2_cuda
from oscar_kv.kernels.decode import LOG2E, _num_sms, int2_decode

PHASES = ("start", "prologue", "query", "window", "int2 loop", "partial", "counted", "merged")


def stamp_phases(q, pool, batch, rot, geom, mp, dev) -> dict:
    """Microseconds from the first CTA's start to each phase: median and max over CTAs (merged: last CTAs)."""
    ns, chunk = int2_cuda.split_plan(mp * geom.page_size, q.shape[0] * geom.num_kv_heads, geom.page_size,
                                     _num_sms(dev), int2_cuda.MIN_BLOCKS)
    ts = torch.zeros(q.shape[0], geom.num_kv_heads, ns, 8, dtype=torch.int64, device=dev)
    out = torch.empty_like(q)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    for _ in range(3):  # compile, then the flushed call that counts
        flush.zero_()
        ts.zero_()
        int2_cuda.decode(q, rot, pool.layer(0), geom, batch, out, ns, chunk, LOG2E / geom.head_dim ** 0.5,
                         stamps=ts)
    torch.cuda.synchronize()
    t = ts.view(-1, 8).double()
    t0 = t[:, 0].min()
    res = {}
    for k, name in enumerate(PHASES):
        col = t[:, k][t[:, k] > 0] - t0
        res[name] = (col.median().item() / 1e3, col.max().item() / 1e3)
    return res
from oscar_kv.kernels.layout import PoolGeometry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--targets", default="3,6")
    ap.add_argument("--min-blocks", default="3")
    ap.add_argument("--output", default=None)
    ap.add_argument("--stamps", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cuda")
    geom = PoolGeometry(num_layers=1, num_kv_heads=GEOMETRY["num_kv_heads"], head_dim=GEOMETRY["head_dim"],
                        group_size=GEOMETRY["group_size"], page_size=GEOMETRY["page_size"],
                        sink_size=GEOMETRY["sink_size"], recent_size=GEOMETRY["recent_size"])
    bw = copy_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for ctx in map(int, a.contexts.split(",")):
        for bs in map(int, a.batch_sizes.split(",")):
            pool, batch, q, rot, mp = int2_case(geom, ctx, bs, dev, gen)
            nbytes = int2_bytes(geom, bs, ctx)
            tri = _bench_call(lambda: int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp, backend="triton"))
            ref = int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp, backend="triton").float()
            row = dict(context=ctx, batch=bs, triton_us=tri * 1e3, cuda={})
            line = f"ctx {ctx:>7} bs {bs:>3}: triton {tri * 1e3:7.1f} us |"
            for mb in map(int, a.min_blocks.split(",")):
                int2_cuda.MIN_BLOCKS = mb
                for tgt in map(int, a.targets.split(",")):
                    fn = lambda: int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp, backend="cuda",  # noqa: E731
                                             cuda_split_target=tgt)
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    ms = _bench_call(fn)
                    row["cuda"][f"mb{mb}_t{tgt}"] = dict(us=ms * 1e3, bw=nbytes / (ms * 1e-3) / bw, err_vs_triton=err)
                    line += f" mb{mb}/t{tgt} {ms * 1e3:6.1f} ({100 * nbytes / (ms * 1e-3) / bw:4.1f}%, {err:.1e})"
            print(line, flush=True)
            # the default call, and the same without the query rotation (its in-kernel cost)
            int2_cuda.MIN_BLOCKS = int(a.min_blocks.split(",")[0])
            ns, _ = int2_cuda.split_plan(mp * geom.page_size, bs * geom.num_kv_heads, geom.page_size,
                                         _num_sms(dev), int2_cuda.MIN_BLOCKS)
            parts = dict(
                full=_bench_call(lambda: int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp, backend="cuda")),
                unrotated=_bench_call(lambda: int2_decode(q, pool, 0, batch, None, max_int2_pages=mp, backend="cuda")))
            row["parts_us"] = {k: v * 1e3 for k, v in parts.items()}
            print("   parts (us): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items()) +
                  f" (splits {ns})", flush=True)
            if a.stamps:
                row["stamps_us"] = stamp_phases(q, pool, batch, rot, geom, mp, dev)
                print("   phases, us from the first CTA's start (median / max over CTAs): " + ", ".join(
                    f"{k} {m:.1f}/{x:.1f}" for k, (m, x) in row["stamps_us"].items()), flush=True)
            rows.append(row)
            del pool
            torch.cuda.empty_cache()
    if a.output:
        os.makedirs(a.output, exist_ok=True)
        with open(os.path.join(a.output, "cuda_int2_sweep.json"), "w") as f:
            json.dump(dict(copy_bandwidth_GBps=bw / 1e9, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
