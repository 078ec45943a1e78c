"""Block tables kept on the device across steps: one row per running sequence, updated by what changed.

A running sequence's page list (``Sequence.pages``, the host truth) changes in three ways: pages appended at its
end, a recent page replaced by its quantized copy (a migration), and the whole list when it is admitted (a prefix
hit plus its first pages).  Rebuilding [batch, pages] tables from the lists each step costs host time in
proportion to batch x context (400K entries at 64 sequences of 100K tokens); instead the scheduler records each
change as (row, column, page) and ``flush`` applies a step's changes with one host-to-device copy and one scatter.
A step takes its sequences' rows with one gather on the device (``gather``).

Columns past a sequence's page count hold stale page ids: the kernels read only pages below each sequence's
length.  The host mirror ``host`` serves the ranks that follow rank 0 under tensor parallelism (they receive the
changes, not the page lists) and tests.
"""

from __future__ import annotations

import numpy as np
import torch

from .uploads import upload


class BlockTables:
    """int32 [rows, width] on the pool's device (``table``) and its host mirror; grows when a row or column is
    missing (``reserve`` sizes it up front)."""

    def __init__(self, device: torch.device | str, rows: int = 8, width: int = 64):
        self.device = torch.device(device)
        self.host = np.zeros((0, 0), dtype=np.int32)
        self.table = torch.zeros(0, 0, dtype=torch.int32, device=self.device)
        self._free: list[int] = []  # rows nobody holds, the lowest last
        self._pending: dict[tuple[int, int], int] = {}  # (row, column) -> page; a later change replaces an earlier
        self.reserve(rows, width)

    def reserve(self, rows: int, width: int) -> None:
        """Make room for ``rows`` sequences of ``width`` pages (a larger table is kept)."""
        rows, width = max(rows, self.host.shape[0]), max(width, self.host.shape[1])
        if (rows, width) == self.host.shape:
            return
        old_rows, old_width = self.host.shape
        host = np.zeros((rows, width), dtype=np.int32)
        host[:old_rows, :old_width] = self.host
        table = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        table[:old_rows, :old_width] = self.table
        self.host, self.table = host, table
        self._free = list(range(rows - 1, old_rows - 1, -1)) + self._free

    # ---- rows (the scheduler, on rank 0) --------------------------------------------------------
    def assign(self, seq) -> None:
        """Give a sequence that starts running a row, holding its current pages."""
        if not self._free:
            self.reserve(2 * self.host.shape[0], self.host.shape[1])
        seq.block_row = self._free.pop()
        self.write(seq, 0, seq.pages)

    def release(self, seq) -> None:
        """Take back a sequence's row (finished, aborted or preempted); no-op for one that holds none."""
        if seq.block_row >= 0:
            self._free.append(seq.block_row)
            seq.block_row = -1

    def write(self, seq, column: int, pages) -> None:
        """Record that ``seq.pages[column:column + len(pages)]`` is now ``pages`` (nothing for a sequence without a
        row: ``assign`` writes its whole list)."""
        row = seq.block_row
        if row < 0:
            return
        for i, page in enumerate(pages, column):
            self._pending[row, i] = page

    # ---- the device table -----------------------------------------------------------------------
    def flush(self) -> np.ndarray | None:
        """Apply the changes recorded since the last flush; returns them as int32 [3, n] (rows, columns, pages)
        for ``apply`` on other ranks, or None when nothing changed."""
        if not self._pending:
            return None
        cells = list(self._pending)
        changes = np.array([[r for r, _ in cells], [c for _, c in cells], list(self._pending.values())],
                           dtype=np.int32)
        self._pending.clear()
        self.apply(changes)
        return changes

    def apply(self, changes: np.ndarray | None) -> None:
        """Write changes from ``flush`` (each cell at most once) into the host mirror and the device table."""
        if changes is None:
            return
        rows, cols, pages = changes
        have_rows, have_cols = self.host.shape
        self.reserve(_grown(int(rows.max()) + 1, have_rows), _grown(int(cols.max()) + 1, have_cols))
        self.host[rows, cols] = pages
        moved = upload(changes, self.device)  # the step's one host-to-device copy
        self.table.index_put_((moved[0], moved[1]), moved[2])

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """int32 [len(rows), width]: the block tables of the sequences in ``rows`` (device indices), in that order."""
        self.flush()
        return self.table[:, :width].index_select(0, rows)

    def rows_of(self, seqs) -> list[int]:
        """The rows of ``seqs`` (host ints); raises for a sequence the scheduler did not admit."""
        rows = [seq.block_row for seq in seqs]
        if min(rows) < 0:
            raise RuntimeError("a scheduled sequence holds no block-table row (it did not start running through "
                               "the scheduler, or BlockTables.assign was not called)")
        return rows


def _grown(need: int, have: int) -> int:
    """A size of at least ``need``, doubling ``have`` when it grows (few regrowths as sequences lengthen)."""
    return have if need <= have else max(need, 2 * have)
