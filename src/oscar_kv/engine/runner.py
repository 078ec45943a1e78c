"""The model runner: one packed (varlen) forward per step over the paged pool, then sampling.

All scheduled tokens of a step are packed into one row ``[1, N]`` with their own position ids.  The attention
backend (attention.py: the kernels, or the torch reference) plans the step once; the model's forward (our executor,
or transformers' modules whose attention calls reach the registered function ``oscar_kv_paged`` through the
forward kwargs) calls :class:`StepAttention.attend` once per layer, which runs the backend on that plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import AttentionInterface

from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..codec import LayerCodec
from ..parallel import SINGLE, TensorParallel
from .attention import KernelAttention, StepPlan, TorchAttention
from .block_pool import WINDOW, PagePool
from .kernel_attention import PoolView
from .sampling import CHUNK_ELEMENTS, gather_logprobs, sample
from .scheduler import Migration, ScheduledSeq
from .sequence import Logprob, Sequence
from .timing import NO_REGIONS
from .uploads import upload

ATTENTION_KEY = "oscar_kv_paged"


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, oscar_paged=None,
                    **kwargs):
    """The registered attention: the engine's paged path, or exact SDPA for a forward outside the engine's steps."""
    if oscar_paged is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    return oscar_paged.attend(module.layer_idx, query, key, value, scaling)


def register_paged_attention() -> None:
    AttentionInterface.register(ATTENTION_KEY, paged_attention)


class StepAttention:
    """A step's plan bound to its attention backend: what the model's attention calls reach, once per layer."""

    def __init__(self, backend, plan: StepPlan, regions=NO_REGIONS):
        self.backend, self.plan, self.regions = backend, plan, regions

    @property
    def positions(self) -> torch.Tensor:
        return self.plan.positions

    def attend(self, layer_idx: int, query, key, value, scaling):
        """query [1, Hq, N, D], key / value [1, Hkv, N, D] (post-RoPE) -> ([1, N, Hq, D], None)."""
        with self.regions.region("attend_total"):
            return self.backend.run(self.plan, layer_idx, query, key, value, scaling, self.regions), None


class ModelForward:
    """The model's forward over a step: our executor (models/decoder.py) or transformers' modules, whose attention
    calls reach ``paged_attention`` through the model's forward kwargs."""

    def __init__(self, model, executor=None):
        self.model, self.executor = model, executor

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, fwd: StepAttention) -> torch.Tensor:
        """input_ids, positions [1, N] on the device -> the last hidden states [1, N, hidden]."""
        if self.executor is not None:
            return self.executor.forward(input_ids[0], positions[0], fwd)[None]
        if self.model.config._attn_implementation != ATTENTION_KEY:  # someone ran generate() on the model
            self.model.set_attn_implementation(ATTENTION_KEY)
        return self.model.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                                oscar_paged=fwd).last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, C] -> logits [B, vocab] (the executor's GEMV at few sequences)."""
        return self.executor.logits(hidden) if self.executor is not None else self.model.lm_head(hidden)


class ModelRunner:
    """Runs a step's forward and samples the next token of each sequence that completed its tokens.

    Under tensor parallelism rank 0 runs the scheduler and calls ``run``; before its forward it sends the
    step (token ids, block-table changes, migrations) to the other ranks, which wait in ``follow`` and run the same
    forward on their heads: the row-parallel all-reduces inside the model meet.  Only rank 0 samples."""

    def __init__(self, model, pool: PagePool, codecs: list[LayerCodec], kernels: PoolView | None = None,
                 graphs=None, tp: TensorParallel = SINGLE, forward: ModelForward | None = None):
        self.model, self.pool, self.codecs, self.kernels = model, pool, codecs, kernels
        # the attention backend: the kernels over the pool's view, or the torch reference
        self.attention = KernelAttention(pool, codecs, kernels) if kernels is not None else TorchAttention(pool, codecs)
        self.device = next(model.parameters()).device
        self.graphs = graphs  # graphs.DecodeGraphs, or None: every step eager
        self.tp = tp
        self.forward = forward or ModelForward(model)
        self.regions = NO_REGIONS  # engine/timing.py: a benchmark installs its own to time the step's parts

    @torch.inference_mode()
    def launch(self, steps: list[ScheduledSeq], after: "LaunchedStep | None" = None) -> "LaunchedStep":
        """Queue the step's forward, logits and sampling on the device without waiting for them.  ``after``: the
        step still in flight whose sampled tokens are this step's input where a sequence's last id is PENDING."""
        with self.regions.region("runner"):
            with self.regions.region("step_plan"):
                changes = self.pool.tables.flush()  # the scheduler's block-table changes, for this rank and others
                fwd = StepAttention(self.attention, self.attention.plan(steps), self.regions)
            ids = step_token_ids(steps)
            if self.tp.size > 1:
                if after is not None:
                    raise RuntimeError("tensor-parallel ranks take a step's token ids from the host")
                self.tp.broadcast(("step", _wire(steps, ids, changes)))
            input_ids = upload(np.array([ids], dtype=np.int64), self.device)
            if after is not None:
                _take_pending(input_ids, steps, after)
            hidden = self._forward(fwd, input_ids)
            sampling, last, offset = [], [], 0
            for st in steps:  # each sampling sequence's last token in the packed row
                offset += st.num_tokens
                if st.samples:
                    sampling.append(st.seq)
                    last.append(offset - 1)
            prompt = self._prompt_logprobs(steps, hidden)
            if not sampling and prompt is None:
                return LaunchedStep(steps, [], None, None)
            tokens = logprobs = None
            if sampling:
                rows = upload(np.array(last, dtype=np.int64), self.device)
                logits = self.forward.logits(hidden[0, rows]).float()
                if any(seq.params.penalized for seq in sampling):  # an output id may be PENDING: its value is here
                    tokens = sample(logits, sampling, last_inputs=input_ids[0].index_select(0, rows))
                else:
                    tokens = sample(logits, sampling)
                logprobs = _sampled_logprobs(logits, tokens, sampling)
            launched = LaunchedStep(steps, sampling, tokens)
            launched.logprobs, launched.prompt = logprobs, prompt
            launched.download()
            return launched

    def _prompt_logprobs(self, steps: list[ScheduledSeq], hidden: torch.Tensor) -> "PromptLogprobs | None":
        """Queue the logprobs of the prompt tokens that this step's logits give, for the sequences that ask for them
        (none: nothing runs).  The logits at position p score prompt token p + 1; the last prompt position's are the
        sampler's.  A position is computed once, even when a preempted sequence computes it again."""
        spans, rows, targets, offset, k = [], [], [], 0, 0
        for st in steps:
            seq = st.seq
            if seq.prompt_logprobs is not None:
                lo, hi = max(st.start, seq.prompt_logprobs_next), min(st.end, len(seq.prompt_ids) - 1)
                if lo < hi:
                    spans.append((seq, lo + 1, hi - lo))  # scores of prompt tokens lo + 1 .. hi
                    rows.extend(range(offset + lo - st.start, offset + hi - st.start))
                    targets.extend(seq.prompt_ids[lo + 1:hi + 1])
                    k = max(k, seq.params.prompt_logprobs)
                    seq.prompt_logprobs_next = hi
            offset += st.num_tokens
        if not spans:
            return None
        index = upload(np.array([rows, targets], dtype=np.int64), self.device)
        values = torch.empty(len(rows), 1 + k, dtype=torch.float32, device=self.device)
        ids = torch.empty(len(rows), k, dtype=torch.int64, device=self.device)
        step = max(1, CHUNK_ELEMENTS // self.vocab_size)  # rows x vocab logits at a time
        for a in range(0, len(rows), step):
            logits = self.forward.logits(hidden[0].index_select(0, index[0, a:a + step]))
            values[a:a + step], ids[a:a + step] = gather_logprobs(logits, index[1, a:a + step], k)
        return PromptLogprobs(spans, values, ids)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def sampled(self, launched: "LaunchedStep") -> dict[Sequence, int]:
        """Wait for a launched step; the next token of each of its sampling sequences (their logprobs and the
        step's prompt logprobs are then in ``launched.results()``)."""
        if launched.ready is None and not launched.sampling:
            return {}
        with self.regions.region("sampling"):
            if launched.ready is not None:
                launched.ready.synchronize()  # this step's work only, not the steps queued after it
            if not launched.sampling:
                return {}
            return dict(zip(launched.sampling, launched.host["tokens"].tolist()))

    def _forward(self, fwd: StepAttention, input_ids: torch.Tensor) -> torch.Tensor:
        """The last hidden states [1, N, hidden] of the step (graph replay, or eager)."""
        hidden = self.graphs.run(fwd, input_ids) if self.graphs is not None else None
        if hidden is None:  # the step's positions, built once by the plan
            hidden = self.forward(input_ids, fwd.positions.to(self.device)[None], fwd)
        return hidden

    @torch.inference_mode()
    def copy_pages(self, kind: str, src: list[int], dst: list[int]) -> None:
        """Copy whole pages (every layer, K and V) of the window or quantized pool, on every rank."""
        if self.tp.size > 1 and self.tp.is_driver:
            self.tp.broadcast(("copy", (kind, src, dst)))
        pool = self.pool
        s_idx = torch.tensor(src, dtype=torch.long, device=pool.device)
        d_idx = torch.tensor(dst, dtype=torch.long, device=pool.device)
        groups = (pool.k_win, pool.v_win) if kind == WINDOW else (pool.k_codes, pool.v_codes, pool.k_scale,
                                                                    pool.v_scale, pool.k_zero, pool.v_zero)
        for tensors in groups:
            for t in tensors:
                t.index_copy_(0, d_idx, t.index_select(0, s_idx))

    def release_followers(self) -> None:
        """Rank 0: let the other ranks' ``follow`` return (the engine is done)."""
        if self.tp.size > 1 and self.tp.is_driver:
            self.tp.broadcast(("stop", None))

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks > 0: run rank 0's steps until it releases them."""
        while True:
            op, payload = self.tp.broadcast()
            if op == "stop":
                return
            if op == "copy":
                self.copy_pages(*payload)
                continue
            steps, ids = _unwire(payload, self.pool.tables)
            fwd = StepAttention(self.attention, self.attention.plan(steps))
            self._forward(fwd, upload(np.array([ids], dtype=np.int64), self.device))


@dataclass(eq=False)
class PromptLogprobs:
    """A step's prompt logprobs on the device: row r of ``values`` / ``ids`` (gather_logprobs' layout) scores one
    prompt token; ``spans`` (sequence, its first prompt token scored, how many) tell whose, in row order."""

    spans: list[tuple[Sequence, int, int]]
    values: torch.Tensor
    ids: torch.Tensor


@dataclass(eq=False)
class LaunchedStep:
    """A step queued on the device: its forward, the next token of each of its sampling sequences, and the
    logprobs that some of them asked for."""

    steps: list[ScheduledSeq]
    sampling: list[Sequence]  # the sequences it gives a token, in the tokens' order
    tokens: torch.Tensor | None  # int64 [len(sampling)], on the device (sampling.sample)
    # (sampling rows that asked, values, ids) of the sampled tokens (sampling.gather_logprobs), or None
    logprobs: tuple[list[int], torch.Tensor, torch.Tensor] | None = None
    prompt: PromptLogprobs | None = None
    host: dict = None  # name -> the tensor's copy in host memory, valid once ``ready`` has passed
    ready: torch.cuda.Event | None = None  # None: ``host`` is valid now (on the CPU)

    def download(self) -> None:
        """Queue the copies of the step's results to host memory, then one event after them."""
        tensors = {"tokens": self.tokens}
        if self.logprobs is not None:
            tensors["lp_values"], tensors["lp_ids"] = self.logprobs[1:]
        if self.prompt is not None:
            tensors["plp_values"], tensors["plp_ids"] = self.prompt.values, self.prompt.ids
        self.host, self.ready = _download_all({k: v for k, v in tensors.items() if v is not None})

    def results(self) -> tuple[dict[Sequence, "Logprob"], list[tuple[Sequence, int, list["Logprob"]]]]:
        """After ``ModelRunner.sampled``: the logprob of each sampled token that asked for one, and the prompt
        logprobs (sequence, first prompt token scored, one per token) of the step."""
        sampled, prompt = {}, []
        if self.logprobs is not None:
            entries = _logprob_entries(self.host["lp_values"], self.host["lp_ids"])
            for (lp, ids, tops), r in zip(entries, self.logprobs[0]):
                seq = self.sampling[r]
                k = seq.params.logprobs
                sampled[seq] = Logprob(lp, ids[:k], tops[:k])
        if self.prompt is not None:
            entries = _logprob_entries(self.host["plp_values"], self.host["plp_ids"])
            row = 0
            for seq, first, n in self.prompt.spans:
                k = seq.params.prompt_logprobs
                prompt.append((seq, first, [Logprob(lp, ids[:k], tops[:k]) for lp, ids, tops in entries[row:row + n]]))
                row += n
        return sampled, prompt


def _logprob_entries(values: torch.Tensor, ids: torch.Tensor) -> list[tuple[float, tuple, tuple]]:
    """Host rows of gather_logprobs' layout as (logprob, top ids, top logprobs)."""
    values, ids = values.tolist(), ids.tolist()
    return [(v[0], tuple(i), tuple(v[1:])) for v, i in zip(values, ids)]


def _sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, sampling: list[Sequence]):
    """(rows, values, ids) of the sampled tokens' logprobs for the rows that ask (raw logits), or None: a step where
    no request asks computes nothing."""
    rows = [i for i, seq in enumerate(sampling) if seq.params.logprobs is not None]
    if not rows:
        return None
    k = max(sampling[i].params.logprobs for i in rows)
    if len(rows) < len(sampling):
        index = upload(np.array(rows, dtype=np.int64), logits.device)
        logits, tokens = logits.index_select(0, index), tokens.index_select(0, index)
    return (rows, *gather_logprobs(logits, tokens, k))


def _download(tokens: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """A copy of ``tokens`` in host memory and the event after it (``_download_all`` of one tensor)."""
    host, ready = _download_all({"tokens": tokens})
    return host["tokens"], ready


def _download_all(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], "torch.cuda.Event | None"]:
    """Copies of a step's result tensors in host memory, and one event after them.  ``.tolist()`` on a device tensor
    would wait for the whole stream, i.e. also for the step queued after this one, and the GPU would idle while the
    host then schedules and plans the next step; waiting on this event waits for this step alone."""
    if not tensors or next(iter(tensors.values())).device.type != "cuda":
        return tensors, None
    host = {}
    for name, t in tensors.items():
        host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host[name].copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def _take_pending(input_ids: torch.Tensor, steps: list[ScheduledSeq], after: LaunchedStep) -> None:
    """Fill the PENDING ids of ``input_ids`` [1, N] (a sequence's last id, sampled by ``after``) from ``after``'s
    tokens on the device."""
    dst, src, offset = [], [], 0
    rows = {seq: i for i, seq in enumerate(after.sampling)}
    for st in steps:
        offset += st.num_tokens
        if st.seq.pending and st.end == st.seq.num_tokens:
            dst.append(offset - 1)
            src.append(rows[st.seq])
    if dst:
        index = upload(np.array([dst, src], dtype=np.int64), input_ids.device)
        input_ids[0].index_copy_(0, index[0], after.tokens.index_select(0, index[1]))


def step_token_ids(steps: list[ScheduledSeq]) -> list[int]:
    """The token ids a step computes, in batch order."""
    ids = []
    for st in steps:
        ids += st.seq.token_range(st.start, st.end)
    return ids


@dataclass(eq=False)
class _PageTable:
    """What a following rank knows of a sequence: its page table as rank 0 scheduled the step (a view of the
    rank's block-table mirror) and its block-table row."""

    pages: np.ndarray
    int2_pages: int
    num_tokens: int
    block_row: int


def _wire(steps: list[ScheduledSeq], ids: list[int], changes: np.ndarray | None) -> dict:
    """A step as plain arrays: the block-table changes since the last step, not the page lists (a 100K-token
    sequence has 6K pages)."""
    return dict(ids=ids, starts=[st.start for st in steps], counts=[st.num_tokens for st in steps],
                int2=[st.seq.int2_pages for st in steps], rows=[st.seq.block_row for st in steps],
                num_pages=[len(st.seq.pages) for st in steps], changes=changes,
                migrations=[[(m.index, m.src, m.dst) for m in st.migrations] for st in steps])


def _unwire(wire: dict, tables) -> tuple[list[ScheduledSeq], list[int]]:
    """The step on a following rank, after applying rank 0's block-table changes to this rank's ``tables``."""
    tables.apply(wire["changes"])
    steps = []
    for start, n, int2, row, num_pages, migs in zip(wire["starts"], wire["counts"], wire["int2"], wire["rows"],
                                                    wire["num_pages"], wire["migrations"]):
        pages = tables.host[row, :num_pages]
        steps.append(ScheduledSeq(_PageTable(pages, int2, start + n, row), start, n, [Migration(*m) for m in migs]))
    return steps, wire["ids"]
