"""CUDA graphs for decode steps, as vLLM and SGLang use them.

A decode-only step launches the same kernels every time; only its inputs change.  Run eagerly, the
transformers modules cost tens of milliseconds of Python and launches per step, more than the GPU work at
batch 1.  So each (batch bucket, length bucket, fused write) is captured
once: the model forward over static buffers (token ids, positions, write slots, block tables, lengths)
padded to the bucket.  A step copies its inputs in and replays.  Padding rows have length 0 and write slot -1: the
kernels neither write nor read anything for them.

The length bucket fixes what the kernels' split plans take as a host number (the longest INT2 history, or
the longest sequence for a BF16 cache): a bound at most 25% above the step's.  The step's page migrations
run eagerly before the replay.  Keys centered per position are rotated inside the graph (RoPE tables
reserved up to max-model-len first).  Not graphed (eager): prefill and mixed steps, and the
torch backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codec import shared_ropes
from ..kernels.layout import PagedBatch
from .kernel_attention import DecodeStep

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def length_bucket(n: int) -> int:
    """The smallest bound >= n of the form m * 2^e with 4 <= m < 8 (at most 25% above n)."""
    if n <= 8:
        return max(n, 1)
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    fwd: object  # runner.StepAttention over the static tensors below
    input_ids: torch.Tensor  # [1, B]
    positions: torch.Tensor  # [1, B]
    hidden: torch.Tensor  # [1, B, hidden] (written by the replay)


class DecodeGraphs:
    """Captured decode forwards of one engine, keyed by (batch bucket, length bucket), captured on first use."""

    def __init__(self, forward, attention, max_model_len: int):
        """``forward``: runner.ModelForward (input ids, positions, step attention -> hidden states);
        ``attention``: the runner's attention.KernelAttention."""
        self.forward, self.attention = forward, attention
        self.pool, self.codecs, self.view = attention.pool, attention.codecs, attention.view
        self.width = self.pool.geometry.pages_for(max_model_len)  # block table columns: the longest sequence's pages
        self.max_model_len = max_model_len
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.mempool = torch.cuda.graph_pool_handle()

    def accepts(self, fwd, batch: int) -> bool:
        return isinstance(getattr(fwd.plan, "step", None), DecodeStep) and batch <= BATCH_BUCKETS[-1]

    def run(self, fwd, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's last hidden states [1, B, hidden] by graph replay, or None when it must run eagerly.
        ``fwd``: the step's runner.StepAttention; ``input_ids``: [1, B] on the device."""
        b = input_ids.shape[1]
        if not self.accepts(fwd, b):
            return None
        plan = fwd.plan
        step = plan.step
        bucket = next(x for x in BATCH_BUCKETS if x >= b)
        quantizes = self.pool.geometry.quantizes
        length = length_bucket(step.max_int2_pages if quantizes else step.max_seq_len)
        key = (bucket, length, plan.fused_rotation)  # fused: write_kv centers and rotates the keys
        g = self.graphs.get(key) or self._capture(*key)
        self.attention.run_migrations(plan)
        static, static_plan = g.fwd.plan.step.batch, g.fwd.plan
        src = step.batch
        g.input_ids[:, :b] = input_ids
        g.positions[0, :b] = plan.positions
        static_plan.win_slot[:b] = plan.win_slot
        static_plan.int2_slot[:b] = plan.int2_slot
        static.block_table[:b, :src.block_table.shape[1]] = src.block_table
        static.seq_lens[:b] = src.seq_lens
        static.int2_pages[:b] = src.int2_pages
        if b < bucket:  # rows of an earlier, larger batch: make them padding again
            static_plan.win_slot[b:] = -1
            static_plan.int2_slot[b:] = -1
            static.seq_lens[b:] = 0
            static.int2_pages[b:] = 0
        g.graph.replay()
        return g.hidden[:, :b]

    def _capture(self, bucket: int, length: int, fused: bool) -> _Captured:
        from .runner import StepAttention

        dev = self.pool.device
        quantizes = self.pool.geometry.quantizes
        batch = PagedBatch(torch.zeros(bucket, self.width, dtype=torch.int32, device=dev),
                           torch.zeros(bucket, dtype=torch.int32, device=dev),
                           torch.zeros(bucket, dtype=torch.int32, device=dev))
        step = DecodeStep(self.view, batch, length if quantizes else 0,
                          self.max_model_len if quantizes else length)
        ids = torch.zeros(1, bucket, dtype=torch.long, device=dev)
        positions = torch.zeros(1, bucket, dtype=torch.long, device=dev)
        slots = torch.full((2, bucket), -1, dtype=torch.int32, device=dev)
        fwd = StepAttention(self.attention, self.attention.graph_plan(step, positions[0], slots[0], slots[1], fused))
        # the RoPE tables were reserved for max_model_len by the engine: a lookup inside the graph never grows them
        ropes = shared_ropes(self.codecs)

        def forward():
            return self.forward(ids, positions, fwd)

        # one eager pass first (all rows are padding: nothing is written or read): compiles what is new
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(dev).wait_stream(side)
        for rope in ropes:
            rope.forget()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            hidden = forward()
        captured = _Captured(graph, fwd, ids, positions, hidden)
        self.graphs[(bucket, length, fused)] = captured
        return captured
