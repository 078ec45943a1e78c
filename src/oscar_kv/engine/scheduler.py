"""Continuous batching: which sequences run this step, how many tokens each, and their pages.

Each step has a token budget (``max_num_batched_tokens``).  Running sequences go first, oldest
first: a decoding sequence takes one token, a sequence still prefilling takes the next chunk of its
prompt (chunked prefill).  Then waiting sequences are admitted while the budget, ``max_num_seqs``
and the pool allow, each after attaching its longest cached prefix.  When a running sequence
cannot get its pages, the newest running sequence is preempted: its pages are released and it
goes back to the front of the queue to be recomputed (prompt + tokens generated so far).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_pool import QUANT, WINDOW, PagePool
from .sequence import Sequence, SeqStatus


@dataclass
class Migration:
    """Logical page ``index`` moves from window page ``src`` to quantized page ``dst`` this step."""

    index: int
    src: int
    dst: int


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens already in the cache
    num_tokens: int  # tokens computed this step
    migrations: list[Migration] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The step computes the sequence's last known token, so it yields the next one."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    rejected: list[Sequence] = field(default_factory=list)  # cannot fit even into an empty pool

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, pool: PagePool, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.pool = pool
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and release its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release_seq(seq)

    def pause(self, seq: Sequence) -> None:
        """Stop scheduling a running sequence; it keeps its pages until ``resume`` or ``remove``."""
        self.running.remove(seq)

    def resume(self, seq: Sequence) -> None:
        """Schedule a paused sequence again, first in line."""
        self.running.insert(0, seq)

    def admit_running(self, seq: Sequence) -> None:
        """Take in a sequence that already holds its pages (LLMEngine.fork), as running."""
        seq.status = SeqStatus.RUNNING
        self.pool.tables.assign(seq)
        self.running.append(seq)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        rejected: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n == 0:  # its next token comes from the step in flight, which ends it (max_tokens): nothing to run
                i += 1
                continue
            step = self._allocate(seq, n)
            while step is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                step = self._allocate(seq, n)
            if step is None:
                break
            scheduled.append(step)
            budget -= n
            i += 1
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # a request that asks for prompt logprobs needs the logits of every prompt position: no cached prefix
            self.pool.match_prefix(seq, self.enable_prefix_caching and not seq.wants_prompt_logits)
            n = min(seq.num_tokens - seq.num_computed, budget)
            # keep one page per running sequence for its growth, so admission does not cause thrashing
            step = self._allocate(seq, n, reserve=len(self.running))
            if step is None:
                self.pool.release_seq(seq)  # undo the prefix hit; try again next step
                if self.running:
                    break
                rejected.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            self.pool.queried_tokens += seq.num_tokens
            self.pool.hit_tokens += seq.num_computed
            self.pool.tables.assign(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append(step)
            budget -= n
        return SchedulerOutput(scheduled, preempted, rejected)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release_seq(seq)
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _allocate(self, seq: Sequence, n: int, reserve: int = 0) -> ScheduledSeq | None:
        """Give ``seq`` the pages its layout needs after ``n`` more tokens, or None if the pool is short."""
        pool, geometry = self.pool, self.pool.geometry
        start = seq.num_computed
        end = start + n
        h_old = seq.int2_pages
        h_new = max(h_old, geometry.int2_pages_for(end))
        num_pages = geometry.pages_for(end)
        if h_new == h_old and num_pages <= len(seq.pages):
            return ScheduledSeq(seq, start, n)  # most decode steps: the same pages
        # Only two kinds of pages change (cost independent of the sequence length): existing recent
        # pages that join the history (window -> quantized) and the new pages at the end.
        migrating = range(pool.sink_pages + h_old, min(pool.sink_pages + h_new, len(seq.pages)))
        added = range(len(seq.pages), num_pages)
        need = {WINDOW: 0, QUANT: len(migrating)}
        for i in added:
            need[pool.kind_of(i, h_new)] += 1
        if (need[WINDOW] and need[WINDOW] + reserve > pool.window.available) or \
                (need[QUANT] and need[QUANT] + reserve > pool.quant.available):
            return None
        fresh = {kind: iter(pool.allocator(kind).allocate(k)) for kind, k in need.items()}
        # in place and recorded for the device block tables: never a copy of the whole list (block_table.py)
        pages, migrations = seq.pages, []
        for i in migrating:
            page = next(fresh[QUANT])
            migrations.append(Migration(i, pages[i], page))
            pages[i] = page
            pool.tables.write(seq, i, (page,))
        new = [next(fresh[pool.kind_of(i, h_new)]) for i in added]
        pool.tables.write(seq, len(pages), new)
        pages += new
        seq.int2_pages = h_new
        return ScheduledSeq(seq, start, n, migrations)

    def finish_step(self, step: ScheduledSeq) -> None:
        """After the forward: account the computed tokens, free migrated window pages, seal pages."""
        seq = step.seq
        seq.num_computed = step.end
        for m in step.migrations:
            self.pool.window.release(m.src)
        if self.enable_prefix_caching:
            self.pool.register_sealed(seq)
