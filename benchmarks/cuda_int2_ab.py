"""A/B of CUDA decode kernel sources on the call the engine makes by default: Qwen3-8B's attention, the synthetic
calibrated-like artifact (keys centered per position over 8 RoPE pairs: "R8"), and the same call with constant
centering ("R0"); every (context, batch) point times each source in interleaved rounds (best of ``--rounds``,
CUDA-graph replays after an L2 flush, PDL off as in bench attention) and checks its output against the first
source's.  GPU only.

    python3 benchmarks/cuda_int2_ab.py --sources OLD.cu,src/oscar_kv/kernels/int2_decode.cu [--key-bits 4x16+2]
        [--contexts 32768,131072] [--batch-sizes 1,8,32] [--rounds 3] [--min-blocks N] [--output FILE.json]
    python3 benchmarks/cuda_int2_ab.py --profile-calls 5 --contexts 131072 --batch-sizes 8   # for ncu: the shipped
        # kernel's R8 call, 5 times, nothing else (ncu -k regex:oscar_int2_decode --launch-skip 3 --launch-count 1 ...)

``--min-blocks`` compiles and plans the R8 and split-key variants for that many CTAs per SM (int2_cuda.min_blocks'
budgets otherwise).  ``git show REV:src/oscar_kv/kernels/int2_decode.cu > OLD.cu`` gives an older source.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_int2_sweep import _source  # noqa: E402

from oscar_kv.bench.attention import prepare_artifact  # noqa: E402
from oscar_kv.bench.synthetic import (GEOMETRY, _fill_pool, _ints, _mixed_batch, add_width_arguments,  # noqa: E402
                                      layer_geometry)
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
    add_width_arguments(ap)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_int2_ab.py needs a CUDA GPU")
    if a.min_blocks:
        int2_cuda.ROPE_MIN_BLOCKS = {8: a.min_blocks}
        int2_cuda.SPLIT_MIN_BLOCKS = {**int2_cuda.SPLIT_MIN_BLOCKS, 128: a.min_blocks}
    pdl.set_enabled(False)  # as bench attention: each call timed alone
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
            json.dump(dict(device=torch.cuda.get_device_name(), min_blocks=a.min_blocks, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
