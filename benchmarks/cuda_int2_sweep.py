"""INT2 decode attention at 128K (Qwen3-8B geometry): the one-launch CUDA decode vs the all-Triton path,
over the CUDA kernel's knobs (CTAs per SM in the split plan, register budget), and what the in-kernel query
rotation costs (the same call without a rotation).  GPU only.

    python3 benchmarks/cuda_int2_sweep.py [--contexts 131072] [--batch-sizes 1,8,32] [--sources A.cu,B.cu]
                                          [--output DIR] [--stamps]

--sources times other versions of int2_decode.cu (same kernel signature) against the shipped one in the same
run, interleaved: an A/B comparison free of the run-to-run spread between machines.
--stamps also times the phases of each CTA inside one call (%globaltimer stamps from a separately compiled
variant, after an L2 flush): when CTAs start, have their query, finish the window, the INT2 loop, the partial,
and, in the last CTA of each (sequence, KV head), when the merge starts, has its loads and math done, and ends.
"""

import argparse
import contextlib
import functools
import json
import os
from pathlib import Path

import torch

from oscar_kv.bench.floors import copy_bandwidth, int2_bytes
from oscar_kv.bench.synthetic import int2_case, layer_geometry, use_head_dim
from oscar_kv.bench.timing import _bench_call
from oscar_kv.kernels import int2_cuda
from oscar_kv.kernels.common import LOG2E, num_sms
from oscar_kv.kernels.decode import int2_decode

# stamp slot -> phase, in time order (slots 10-15: warp 0 after its n-th INT2 step; 8, 9 and 7: the merging
# CTAs only)
PHASES = ((0, "start"), (1, "prologue"), (2, "query"), (3, "window"), (10, "step 1"), (11, "step 2"), (12, "step 4"),
          (13, "step 8"), (14, "step 16"), (15, "step 64"), (4, "int2 loop"), (5, "partial"), (6, "counted"),
          (8, "merge start"), (9, "merge math"), (7, "merged"))


def phases(ts: torch.Tensor) -> dict:
    """{phase: (median, max) us from the first CTA's start over the CTAs that reached it} of a call's stamps
    ([..., 16] int64 %globaltimer ns, 0 where a CTA did not reach the slot)."""
    t = ts.view(-1, 16).double()
    t0 = t[:, 0].min()
    res = {}
    for k, name in PHASES:
        col = t[:, k][t[:, k] > 0] - t0
        if col.numel():  # (a phase a call does not reach, e.g. step 64 of a short chunk, is left out)
            res[name] = (col.median().item() / 1e3, col.max().item() / 1e3)
    return res


def stamp_phases(q, pool, batch, rot, geom, mp, dev, per_sm: int | None = None) -> dict:
    """Microseconds from the first CTA's start to each phase: median and max over CTAs (merge: last CTAs), with the
    split plan for ``per_sm`` CTAs per SM (default: the kernel's min_blocks).  Above 8 query heads per KV head a
    (sequence, KV head) has several query groups' CTAs (int2_cuda.query_groups)."""
    pairs = geom.num_kv_heads * int2_cuda.query_groups(q.shape[1] // geom.num_kv_heads)
    ns, chunk = int2_cuda.split_plan(mp * geom.page_size, q.shape[0] * pairs, geom.page_size, num_sms(dev),
                                     per_sm or int2_cuda.min_blocks(0, geom.head_dim))
    ts = torch.zeros(q.shape[0], pairs, ns, 16, dtype=torch.int64, device=dev)
    out = torch.empty_like(q)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    for _ in range(3):  # compile, then the flushed call that counts
        flush.zero_()
        ts.zero_()
        int2_cuda.decode(q, rot, pool.layer(0), geom, batch, out, ns, chunk, LOG2E / geom.head_dim ** 0.5,
                         stamps=ts)
    torch.cuda.synchronize()
    res = phases(ts)
    t = ts.view(-1, 16).double()
    t0 = t[:, 0].min()
    # CTAs with a BF16 window sub-tile (split < the window's sub-tiles) against the others: partial written
    t_len, nq = int(batch.seq_lens[0]), int(batch.int2_pages[0])
    sink_end = min(t_len, geom.sink_pages * geom.page_size)
    r0 = min(geom.sink_pages * geom.page_size + nq * geom.page_size, t_len)
    n_win = -(-sink_end // 16) + -(-(t_len - r0) // 16)
    part = (t[:, 5] - t0).view(q.shape[0], pairs, ns) / 1e3
    res["partial, CTAs with / without window"] = (part[:, :, :n_win].median().item(),
                                                  part[:, :, n_win:].median().item() if n_win < ns else 0.0)
    return res


SHIPPED = str(int2_cuda.SOURCE)
_COMPILE = int2_cuda._kernel.__wrapped__  # the uncached compile of the shipped module


@contextlib.contextmanager
def _source(src: str):
    """int2_cuda.decode runs the kernel compiled from ``src`` inside the block."""
    shipped = int2_cuda._kernel
    int2_cuda._kernel = _kernel_from(src)
    try:
        yield
    finally:
        int2_cuda._kernel = shipped


@functools.lru_cache(maxsize=None)
def _kernel_from(src: str):
    """int2_cuda._kernel for another source file, compiled once per argument set."""
    @functools.lru_cache(maxsize=None)
    def kernel(*args, **kwargs):
        int2_cuda.SOURCE = Path(src)
        try:
            return _COMPILE(*args, **kwargs)
        finally:
            int2_cuda.SOURCE = Path(SHIPPED)
    return kernel


def compare_sources(sources, q, rot, pool, geom, batch, ns, chunk) -> dict:
    """Each kernel source's time for the same call, best of 3 rounds that alternate the sources, and its
    output's relative error against the first source's (a variant must stay correct)."""
    def call():
        return int2_cuda.decode(q, rot, pool.layer(0), geom, batch, torch.empty_like(q), ns, chunk,
                                LOG2E / geom.head_dim ** 0.5)

    outs, best = {}, {}
    for src in sources:
        with _source(src):
            outs[src] = call().float()
    for _ in range(3):
        for src in sources:
            with _source(src):
                us = 1e3 * _bench_call(call)
            best[src] = min(best.get(src, us), us)
    ref = outs[sources[0]]
    return {src: dict(us=best[src], err_vs_shipped=((outs[src] - ref).norm() / ref.norm()).item()) for src in sources}


def _fmt_phases(phases: dict) -> str:
    return ", ".join(f"{k} {m:.1f}/{x:.1f}" for k, (m, x) in phases.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--targets", default="3")
    ap.add_argument("--sources", default="")
    ap.add_argument("--min-blocks", default="3")
    ap.add_argument("--output", default=None)
    ap.add_argument("--stamps", action="store_true")
    ap.add_argument("--head-dim", type=int, choices=(64, 128), default=128)
    a = ap.parse_args()
    dev = torch.device("cuda")
    use_head_dim(a.head_dim)
    geom = layer_geometry()
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
                int2_cuda.MIN_BLOCKS = int2_cuda.MIN_BLOCKS_D64 = mb
                for tgt in map(int, a.targets.split(",")):
                    fn = lambda: int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp, backend="cuda",  # noqa: E731
                                             cuda_split_target=tgt)
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    ms = _bench_call(fn)
                    row["cuda"][f"mb{mb}_t{tgt}"] = dict(us=ms * 1e3, bw=nbytes / (ms * 1e-3) / bw, err_vs_triton=err)
                    line += f" mb{mb}/t{tgt} {ms * 1e3:6.1f} ({100 * nbytes / (ms * 1e-3) / bw:4.1f}%, {err:.1e})"
            print(line, flush=True)
            # the default call, and the same without the query rotation (its in-kernel cost)
            int2_cuda.MIN_BLOCKS = int2_cuda.MIN_BLOCKS_D64 = int(a.min_blocks.split(",")[0])
            ns, chunk = int2_cuda.split_plan(mp * geom.page_size, bs * geom.num_kv_heads, geom.page_size,
                                             num_sms(dev), int2_cuda.min_blocks(0, geom.head_dim))
            parts = dict(
                full=_bench_call(lambda: int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp, backend="cuda")),
                unrotated=_bench_call(lambda: int2_decode(q, pool, 0, batch, None, max_int2_pages=mp, backend="cuda")))
            row["parts_us"] = {k: v * 1e3 for k, v in parts.items()}
            print("   parts (us): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items()) +
                  f" (splits {ns})", flush=True)
            if a.stamps:
                row["stamps_us"] = stamp_phases(q, pool, batch, rot, geom, mp, dev)
                print("   phases, us from the first CTA's start (median / max over CTAs): " +
                      _fmt_phases(row["stamps_us"]), flush=True)
            if a.sources:
                row["sources_us"] = compare_sources([SHIPPED] + a.sources.split(","), q, rot, pool, geom, batch, ns,
                                                    chunk)
                if a.stamps:  # the phases of each other source as well
                    for src in a.sources.split(","):
                        with _source(src):
                            ph = stamp_phases(q, pool, batch, rot, geom, mp, dev)
                        row["sources_us"][src]["stamps_us"] = ph
                        print(f"   phases of {Path(src).name}: " + _fmt_phases(ph), flush=True)
                print("   sources (us, best of 3 interleaved rounds): " + ", ".join(
                    f"{Path(k).name} {v['us']:.1f} (err {v['err_vs_shipped']:.1e})" for k, v in row["sources_us"].items()),
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
