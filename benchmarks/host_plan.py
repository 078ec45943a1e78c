"""Host time of one decode step's plan at long context, without any model forward (CPU pool, tiny geometry).

    PYTHONPATH=src python benchmarks/host_plan.py [--batch 64] [--context 100000] [--steps 64] [--dtype int2 bf16]

Per decode step: ``schedule`` = Scheduler.schedule (pages, migrations); ``plan`` = the runner's index plan
(KernelAttention.plan, its DecodeStep block tables included) and the step's token ids (what ModelRunner.run
builds before the forward); ``finish`` = Scheduler.finish_step for every sequence (frees migrated pages, offers
newly sealed pages to the prefix cache); ``gather``: the part of ``plan`` spent in BlockTables.gather (the copy of
the step's rows out of the device table: on the CPU a host memcpy of batch x pages x 4 bytes, on a GPU one kernel).

Sequences are set up by the real scheduler and pool: one prefill step of ``--context`` + i tokens for sequence i
(lengths staggered so page boundaries fall on different steps), then ``--steps`` timed decode steps.  The geometry
is 1 layer, 1 KV head, head dim 64, page 16: the pool tensors are never written (torch.empty), so 6.4M tokens cost
little memory.  The script runs on the tree before issue 19 too (no block tables there: gather reads 0).
"""

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from oscar_kv.engine import runner
from oscar_kv.engine.block_pool import PagePool, PoolPlan
from oscar_kv.engine.kernel_attention import PoolView
from oscar_kv.engine.scheduler import Scheduler
from oscar_kv.engine.sequence import SamplingParams, Sequence
from oscar_kv.kernels.layout import PoolGeometry


def plan_step(pool, codecs, view, steps) -> str:
    """The runner's plan of a step in kernel mode; returns the attention step's kind."""
    try:
        from oscar_kv.engine.attention import KernelAttention
    except ImportError:  # the tree before the attention backends
        return type(runner.PagedForward(pool, codecs, steps, view).kernel_step).__name__
    return type(KernelAttention(pool, codecs, view).plan(steps).step).__name__


def step_ids(steps) -> list[int]:
    """The step's token ids, as ModelRunner.run builds them."""
    if hasattr(runner, "step_token_ids"):
        return runner.step_token_ids(steps)
    ids = []  # the code before issue 19
    for st in steps:
        ids += st.seq.tokens[st.start:st.end]
    return ids


def sealed_pages(pool, seq) -> int:
    """How many leading pages PagePool.register_sealed would have offered by now."""
    g = pool.geometry
    full = seq.num_computed // g.page_size
    if not g.quantizes:
        return full
    return min(full, min(full, g.sink_pages) if seq.int2_pages == 0 else g.sink_pages + seq.int2_pages)


def measure(dtype: str, batch: int, context: int, steps: int, device: str) -> dict:
    bits = (16,) if dtype == "bf16" else None
    g = PoolGeometry(num_layers=1, num_kv_heads=1, head_dim=64, group_size=64, page_size=16, k_bits=bits)
    longest = context + batch + steps + 2 * g.page_size
    if g.quantizes:
        plan = PoolPlan(batch * (g.window_pages_per_seq() + 1), batch * g.int2_pages_for(longest) + batch, g)
    else:
        plan = PoolPlan(batch * g.pages_for(longest) + batch, 0, g)
    pool = PagePool(plan, device)
    view = PoolView(pool)
    codecs = [SimpleNamespace(k_rope_mean=None)]  # what the plan reads of the codecs
    sched = Scheduler(pool, batch, batch * longest, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=steps + 2, temperature=0)
    seqs = [Sequence(f"r{i}", torch.randint(0, 32000, (context + i,), generator=gen).tolist(), params)
            for i in range(batch)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()  # the whole prefill in one step (no forward runs)
    assert len(out.scheduled) == batch and not out.preempted
    for st in out.scheduled:
        sched.finish_step(st)
    # From here on sealed pages go to the prefix cache as when serving; the prompts' pages are marked offered
    # without hashing 400K pages (their chained hashes are computed once, as their registration would have).
    sched.enable_prefix_caching = True
    for seq in seqs:
        seq.page_hash(seq.num_computed // g.page_size - 1, g.page_size)
        seq.registered_pages = sealed_pages(pool, seq)
    times = {"schedule": [], "plan": [], "finish": []}
    gathered = []
    if hasattr(pool, "tables"):  # time the device table's gather (absent before issue 19)
        gather = pool.tables.gather

        def timed_gather(*args):
            t = time.perf_counter()
            out = gather(*args)
            gathered.append(1e3 * (time.perf_counter() - t))
            return out

        pool.tables.gather = timed_gather
    for step in range(steps + 1):  # step 0 is not timed (it uploads the new sequences' block tables)
        for seq in seqs:
            seq.output_ids.append(1)  # the token sampled by the previous step
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        kind = plan_step(pool, codecs, view, out.scheduled)
        step_ids(out.scheduled)
        t2 = time.perf_counter()
        for st in out.scheduled:
            sched.finish_step(st)
        t3 = time.perf_counter()
        assert len(out.scheduled) == batch and kind == "DecodeStep"
        for k, a, b in (("schedule", t0, t1), ("plan", t1, t2), ("finish", t2, t3)):
            if step:
                times[k].append(1e3 * (b - a))
    total = [sum(x) for x in zip(*times.values())]
    gathers = gathered[1:] if gathered else [0.0] * len(times["plan"])
    return {"dtype": dtype, **{k: statistics.median(v) for k, v in times.items()},
            "gather": statistics.median(gathers),
            "plan_on_gpu": statistics.median(p - g for p, g in zip(times["plan"], gathers)),
            "total": statistics.median(total), "mean": statistics.mean(total), "max": max(total)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--dtype", nargs="+", default=["int2", "bf16"], choices=["int2", "bf16"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"batch {args.batch} x {args.context} tokens, {args.steps} decode steps, ms per step "
          f"(median; total's mean and max)")
    print("plan - gather: the plan less the CPU pool's gather, which on a GPU is one asynchronous launch")
    print(f"{'cache':>5} {'schedule':>9} {'plan':>9} {'(gather)':>9} {'plan-gath':>9} {'finish':>9} {'total':>9} "
          f"{'mean':>9} {'max':>9}")
    for dtype in args.dtype:
        r = measure(dtype, args.batch, args.context, args.steps, args.device)
        print(f"{r['dtype']:>5} {r['schedule']:9.3f} {r['plan']:9.3f} {r['gather']:9.3f} {r['plan_on_gpu']:9.3f} "
              f"{r['finish']:9.3f} {r['total']:9.3f} {r['mean']:9.3f} {r['max']:9.3f}")


if __name__ == "__main__":
    main()
