"""A/B of CUDA decode kernel sources on the call the engine makes by default: Qwen3-8B's attention, the synthetic
calibrated-like artifact (keys centered per position over 8 RoPE pairs: "R8"), and the same call with constant
centering ("R0"); every (context, batch) point times each source in interleaved rounds (best of ``--rounds``,
CUDA-graph replays after an L2 flush, PDL off as in bench attention) and checks its output against the first
source's.  GPU only.

    python3 benchmarks/cuda_int2_ab.py --sources OLD.cu,src/oscar_kv/kernels/int2_decode.cu [--key-bits 4x16+2]
        [--contexts 32768,131072] [--batch-sizes 1,8,32] [--rounds 3] [--min-blocks N] [--head-dim 64]
        [--output FILE.json]
    python3 benchmarks/cuda_int2_ab.py --profile-calls 5 --contexts 131072 --batch-sizes 8   # for ncu: the shipped
        # kernel's R8 call, 5 times, nothing else (ncu -k regex:oscar_int2_decode --launch-skip 3 --launch-count 1 ...)
    python3 benchmarks/cuda_int2_ab.py --stamps [--no-flush] ...   # instead of times: each source's phases

``--stamps`` prints, per call and source, when the CTAs reach each phase of the kernel (cuda_int2_sweep.PHASES: us
from the first CTA's start, median / max over CTAs; best of 3 flushed calls by the merged time) from a separately
compiled variant with %globaltimer stamps (cuda_int2_sweep.phases).  The stamps themselves slow the kernel (a stamped call took 23.8 us where
the plain one took ~15), so read them as where the time goes, not as times; ``--no-flush`` leaves L2 warm (code and
data), which shows what the flush's DRAM misses cost each phase.

``--min-blocks`` compiles and plans the R8 and split-key variants for that many CTAs per SM (int2_cuda.min_blocks'
budgets otherwise).  ``--head-dim 64`` times Llama-3.2-1B's attention instead of Qwen3-8B's.

The replays here run one kernel after another, so its code stays in the SMs' instruction caches; in a decode step
the layer's other kernels run between two attention calls.  Time a change to code that runs once per call (the
prologue, the combine, the merge) end to end as well, with cuda_int2_e2e_ab.py: the rolled merge was 0.990x here and
0.946x of the step there at 32K batch 1 (benchmarks/NOTES.md, run H2).  ``git show REV:src/oscar_kv/kernels/int2_decode.cu > OLD.cu`` gives an older source.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_int2_sweep import _source, phases  # noqa: E402

from oscar_kv.bench.attention import prepare_artifact  # noqa: E402
from oscar_kv.bench.synthetic import (GEOMETRY, _fill_pool, _ints, _mixed_batch, add_width_arguments,  # noqa: E402
                                      layer_geometry, use_head_dim)
from oscar_kv.bench.timing import _bench_call  # noqa: E402
from oscar_kv.kernels import int2_cuda, pdl  # noqa: E402
from oscar_kv.kernels.decode import int2_decode  # noqa: E402
from oscar_kv.kernels.layout import PagedKVPool  # noqa: E402
from oscar_kv.rope import KernelRope  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", default=str(int2_cuda.SOURCE), help="comma list of .cu files; the first is the reference")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-blocks", type=int, default=None)
    ap.add_argument("--profile-calls", type=int, default=0, help="only run the shipped R8 call this many times")
    ap.add_argument("--output", default=None)
    ap.add_argument("--stamps", action="store_true", help="print each source's kernel phases instead of its time")
    ap.add_argument("--no-flush", action="store_true", help="--stamps without the L2 flush before each call")
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128),
                    help="64: Llama-3.2-1B's attention (32 query / 8 KV heads, synthetic.use_head_dim); 128: Qwen3-8B's")
    add_width_arguments(ap)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_int2_ab.py needs a CUDA GPU")
    if a.min_blocks:
        int2_cuda.ROPE_MIN_BLOCKS = int2_cuda.ROPE_MIN_BLOCKS_D64 = int2_cuda.WIDE_KEYS_ROPE_MIN_BLOCKS_D64 = {
            8: a.min_blocks}
        int2_cuda.SPLIT_MIN_BLOCKS = {**int2_cuda.SPLIT_MIN_BLOCKS, 128: a.min_blocks}
    pdl.set_enabled(False)  # as bench attention: each call timed alone
    use_head_dim(a.head_dim)
    dev = torch.device("cuda")
    contexts, batches = _ints(a.contexts), _ints(a.batch_sizes)
    sources = a.sources.split(",")
    art, record = prepare_artifact(None, 8, a, max(contexts))
    geom = layer_geometry(art.key_widths()[0], int(art.v_bits[0]))
    hq, d = GEOMETRY["num_q_heads"], geom.head_dim
    rot = art.k_rotation[0].float().to(dev)
    inv_freq = 1e6 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # Qwen3's RoPE base, as bench attention
    print(f"{torch.cuda.get_device_name()}; widths {record['label']}", flush=True)
    rows = []
    for ctx in contexts:
        rope = KernelRope.build(art.k_rope_mean[0].float().to(dev), inv_freq, 1.0, ctx)
        for bs in batches:
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(bs, hq, d, device=dev, dtype=torch.bfloat16)
            batch, nq, nw = _mixed_batch(geom, bs, ctx, dev, gen)
            pool = PagedKVPool.allocate(geom, nq, nw, device=dev)
            _fill_pool(pool)
            mp = geom.int2_pages_for(ctx)
            for kind, rp in (("R8", rope), ("R0", None)):
                def call(rp=rp):
                    return int2_decode(q, pool, 0, batch, rot, rope=rp, max_int2_pages=mp, max_seq_len=ctx,
                                       backend="cuda")
                if a.profile_calls:
                    for _ in range(a.profile_calls):
                        call()
                    torch.cuda.synchronize()
                    break
                if a.stamps:
                    for s in sources:
                        with _source(s):
                            ph = stamped_phases(call, not a.no_flush)
                        rows.append(dict(context=ctx, batch=bs, centering=kind, widths=record["label"], source=s,
                                         stamps_us=ph))
                        print(f"{kind} ctx {ctx} bs {bs} {Path(s).name}: "
                              + ", ".join(f"{n} {m:.1f}/{x:.1f}" for n, (m, x) in ph.items()), flush=True)
                    continue
                outs, best = {}, {}
                for s in sources:
                    with _source(s):
                        outs[s] = call().float()
                for _ in range(a.rounds):
                    for s in sources:
                        with _source(s):
                            us = 1e3 * _bench_call(call)
                        best[s] = min(best.get(s, us), us)
                ref = outs[sources[0]]
                row = dict(context=ctx, batch=bs, centering=kind, widths=record["label"],
                           us={s: best[s] for s in sources},
                           rel_err={s: ((outs[s] - ref).norm() / ref.norm()).item() for s in sources})
                rows.append(row)
                print(f"{kind} ctx {ctx} bs {bs}: " + ", ".join(
                    f"{Path(s).name} {best[s]:.1f} us ({best[s] / best[sources[0]]:.3f}x, err {row['rel_err'][s]:.1e})"
                    for s in sources), flush=True)
            pool = None  # (the pool of the next point is allocated after this one is freed)
            torch.cuda.empty_cache()
    if a.output:
        with open(a.output, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), min_blocks=a.min_blocks, head_dim=a.head_dim, rows=rows), f,
                      indent=1)


def stamped_phases(call, flush: bool) -> dict:
    """{phase: (median, max) us from the first CTA's start} of ``call`` run with int2_cuda.decode's stamps, the best
    of three calls (after a compile) by when the merge ends."""
    decode = int2_cuda.decode
    box = {}

    def stamped(q, k_rotation, layer, geom, batch, out, splits, chunk, qk_scale, **kw):
        pairs = geom.num_kv_heads * int2_cuda.query_groups(q.shape[1] // geom.num_kv_heads)
        box["ts"] = torch.zeros(q.shape[0], pairs, splits, 16, dtype=torch.int64, device=q.device)
        return decode(q, k_rotation, layer, geom, batch, out, splits, chunk, qk_scale, stamps=box["ts"], **kw)

    scratch = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    best = None
    int2_cuda.decode = stamped
    try:
        for i in range(4):
            if flush:
                scratch.zero_()
            call()
            torch.cuda.synchronize()
            if i == 0:
                continue
            ph = phases(box["ts"])
            if best is None or ph["merged"][1] < best["merged"][1]:
                best = ph
    finally:
        int2_cuda.decode = decode
    return best


if __name__ == "__main__":
    main()
