"""INT2 decode attention at 128K (Qwen3-8B geometry): the CUDA history kernel vs the all-Triton kernel,
over the CUDA kernel's knobs (CTAs per SM in the split plan, register budget).  GPU only.

    python3 benchmarks/cuda_int2_sweep.py [--contexts 131072] [--batch-sizes 1,8,32] [--output DIR]
"""

import argparse
import json
import os

import torch

from oscar_kv.bench.attention import GEOMETRY, _bench_call, copy_bandwidth, int2_bytes, int2_case
from oscar_kv.kernels import int2_cuda
from oscar_kv.kernels.decode import LOG2E, _merge, _num_sms, int2_decode, rotate_query
from oscar_kv.kernels.layout import PoolGeometry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--targets", default="3,6")
    ap.add_argument("--min-blocks", default="3")
    ap.add_argument("--output", default=None)
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
            # parts of the default call: query rotation, history kernel alone, merge alone
            int2_cuda.MIN_BLOCKS = int(a.min_blocks.split(",")[0])
            hq = q.shape[1]
            ns, chunk = int2_cuda.split_plan(mp * geom.page_size, bs * geom.num_kv_heads, geom.page_size,
                                             _num_sms(dev), int2_cuda.MIN_BLOCKS)
            qr = rotate_query(q, rot, geom.num_kv_heads)
            po = torch.zeros(bs, hq, ns + 1, geom.head_dim, device=dev)
            pl = torch.zeros(bs, hq, ns + 1, device=dev)
            out = torch.empty_like(q)
            parts = dict(
                full=_bench_call(lambda: int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp, backend="cuda")),
                rotate=_bench_call(lambda: rotate_query(q, rot, geom.num_kv_heads)),
                history=_bench_call(lambda: int2_cuda.history(qr, pool.layer(0), geom, batch, po, pl, ns, chunk,
                                                              LOG2E / geom.head_dim ** 0.5)),
                merge=_bench_call(lambda: _merge(po, pl, out)))
            row["parts_us"] = {k: v * 1e3 for k, v in parts.items()}
            print("   parts (us): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items()) + f" (splits {ns})",
                  flush=True)
            rows.append(row)
            del pool
            torch.cuda.empty_cache()
    if a.output:
        os.makedirs(a.output, exist_ok=True)
        with open(os.path.join(a.output, "cuda_int2_sweep.json"), "w") as f:
            json.dump(dict(copy_bandwidth_GBps=bw / 1e9, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
