"""The device block tables (engine/block_table.py) against the host truth, ``Sequence.pages``.

No model: the real scheduler and pool run a random workload (arrivals with shared prefixes, chunked prefill,
decode, migrations into INT2 pages, preemption, aborts) and every step the device table, its host mirror, a
follower's table fed only the changes (tensor parallelism), and the kernel steps' block tables must equal the
tables built from the page lists.
"""

import random

import numpy as np
import pytest
import torch

from oscar_kv.engine.block_pool import PagePool, PoolPlan
from oscar_kv.engine.block_table import BlockTables
from oscar_kv.engine.kernel_attention import DecodeStep, ExtendStep, PoolView, kernel_step
from oscar_kv.engine.runner import _unwire, _wire, step_token_ids
from oscar_kv.engine.scheduler import Scheduler
from oscar_kv.engine.sequence import SamplingParams, Sequence, SeqStatus
from oscar_kv.kernels.layout import PoolGeometry


class _Seq:
    def __init__(self, pages):
        self.pages, self.block_row = pages, -1


def test_rows_are_reused_and_changes_replace_earlier_ones():
    t = BlockTables("cpu", rows=2, width=4)
    a, b, c = _Seq([5, 6]), _Seq([7]), _Seq([1, 2, 3, 4, 5, 6])
    t.assign(a)
    t.assign(b)
    t.assign(c)  # a third row: the table grows
    assert (a.block_row, b.block_row, c.block_row) == (0, 1, 2)
    t.write(a, 1, [9])
    t.write(a, 1, [8])  # the later change wins
    changes = t.flush()
    assert changes.shape == (3, 9) and t.flush() is None
    assert t.table.shape[1] >= 6 and t.table[0, :2].tolist() == [5, 8] and t.table[2, :6].tolist() == [1, 2, 3, 4, 5, 6]
    assert np.array_equal(t.host, t.table.numpy())
    t.release(b)
    t.release(b)  # idempotent
    d = _Seq([3])
    t.assign(d)
    assert d.block_row == 1 and b.block_row == -1
    t.write(_Seq([0]), 0, [4])  # a sequence without a row: nothing recorded
    rows = torch.tensor([2, 0, 1], dtype=torch.int32)
    assert t.gather(rows, 2).tolist() == [[1, 2], [5, 8], [3, 0]]  # flushes d's row first
    follower = BlockTables("cpu", rows=1, width=1)
    follower.apply(changes)
    follower.apply(np.array([[1], [0], [3]], dtype=np.int32))
    assert np.array_equal(follower.host[:3, :6], t.host[:3, :6])


def test_a_sequence_without_a_row_is_refused():
    t = BlockTables("cpu")
    with pytest.raises(RuntimeError, match="no block-table row"):
        t.rows_of([_Seq([1])])


def _check_step(view, steps, follower):
    """The step's kernel block tables, the pool's table and a follower's, against the page lists."""
    pool = view.pool
    running = [st.seq for st in steps]
    plan = kernel_step(view, steps)
    for i, seq in enumerate(running):
        n = len(seq.pages)
        assert plan.batch.block_table[i, :n].tolist() == seq.pages
        assert pool.tables.host[seq.block_row, :n].tolist() == seq.pages
        assert pool.tables.table[seq.block_row, :n].tolist() == seq.pages
        assert follower.host[seq.block_row, :n].tolist() == seq.pages
        assert follower.table[seq.block_row, :n].tolist() == seq.pages
    if isinstance(plan, DecodeStep):
        assert plan.batch.seq_lens.tolist() == [st.end for st in steps]
        assert plan.batch.int2_pages.tolist() == [st.seq.int2_pages for st in steps]
    else:
        assert plan.batch.seq_lens.tolist() == [st.start for st in steps]
        part, _ = plan.paths(False)
        if part is not None and part.rows is not None:  # the extend kernel's subset of the batch
            picked = [i for i, st in enumerate(steps) if st.num_tokens and st.num_tokens < 64]
            for j, i in enumerate(picked):
                assert part.batch.block_table[j, :len(running[i].pages)].tolist() == running[i].pages
    return type(plan)


@pytest.mark.parametrize("dtype", ["int2", "bf16"])
def test_device_tables_follow_the_page_lists_through_a_long_run(dtype):
    g = PoolGeometry(num_layers=1, num_kv_heads=1, head_dim=64, group_size=64, page_size=16, sink_size=32,
                     recent_size=64, k_bits=(16,) if dtype == "bf16" else None)
    plan = PoolPlan(30, 50, g) if g.quantizes else PoolPlan(60, 0, g)  # small: long sequences preempt others
    pool = PagePool(plan)
    view = PoolView(pool)
    sched = Scheduler(pool, max_num_seqs=6, max_num_batched_tokens=100, enable_prefix_caching=True)
    follower = BlockTables("cpu", rows=1, width=1)  # a following rank: only the changes reach it
    rng = random.Random(0)
    base = [rng.randrange(1000) for _ in range(700)]
    live, kinds, migrations, n = [], set(), 0, 0
    for step in range(700):
        if step < 560 and rng.random() < 0.25 and len(live) < 12:
            prompt = base[:rng.randint(1, 300)] + [rng.randrange(1000) for _ in range(rng.randint(0, 40))]
            seq = Sequence(f"r{n}", prompt, SamplingParams(max_tokens=rng.randint(1, 300), temperature=0))
            n += 1
            live.append(seq)
            sched.add(seq)
        if live and rng.random() < 0.02:  # an abort, running or waiting
            seq = live.pop(rng.randrange(len(live)))
            sched.remove(seq)
            assert seq.block_row == -1
        out = sched.schedule()
        for seq in out.rejected:
            live.remove(seq)
        for seq in out.preempted:
            assert seq.block_row == -1 and seq.status is SeqStatus.WAITING
        rows = [s.block_row for s in sched.running]
        assert min(rows, default=0) >= 0 and len(set(rows)) == len(rows)
        assert all(s.block_row == -1 for s in sched.waiting)
        if not out.scheduled:
            continue
        # what ModelRunner.run does: flush, and hand the changes to the other ranks with the step
        wire = _wire(out.scheduled, step_token_ids(out.scheduled), pool.tables.flush())
        for st, follower_st in zip(out.scheduled, _unwire(wire, follower)[0]):
            assert follower_st.seq.pages.tolist() == st.seq.pages and follower_st.seq.block_row == st.seq.block_row
        kinds.add(_check_step(view, out.scheduled, follower))
        for st in out.scheduled:
            migrations += len(st.migrations)
            sched.finish_step(st)
            if st.samples:
                st.seq.output_ids.append(rng.randrange(1000))
                if len(st.seq.output_ids) >= st.seq.params.max_tokens:
                    live.remove(st.seq)
                    sched.remove(st.seq)
    while live:
        sched.remove(live.pop())
    assert pool.all_free() and sorted(pool.tables._free) == list(range(pool.tables.host.shape[0]))
    assert kinds == {DecodeStep, ExtendStep}
    assert sched.num_preemptions > 0 and pool.hit_tokens > 0
    assert migrations > 0 or not g.quantizes
