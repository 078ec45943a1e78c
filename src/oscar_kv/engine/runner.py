"""The model runner: one packed (varlen) forward per step over the paged pool, then sampling.

All scheduled tokens of a step are packed into one row ``[1, N]`` with their own position ids.
The transformers model runs unchanged; its attention calls go to the registered function
``oscar_kv_paged``, which receives the step's :class:`PagedForward` through the model's forward
kwargs (transformers hands extra kwargs on to the attention function).  Per layer it

1. rotates and centers the step's keys with the layer's codec (codec.py), as the generate() cache does,
2. writes the step's tokens into their final places: BF16 window pages (sink / recent) or, for
   positions that belong to the history once the step is done, quantized pages; recent-window
   pages that leave the window are quantized from their BF16 rows (cache.py's migration),
3. attends, per sequence, to the history *as stored* (INT2 pages dequantized inside the call)
   plus the step's own tokens exactly - the same semantics as ``cache.oscar_attention``, so a
   request alone in the batch reproduces ``oscar_kv.generation.generate`` token for token.

With the Triton kernels (``kernels`` given) steps 1-2 are the fused write path of ``kernels/write.py``
and step 3 the decode kernel, or for prefill chunks flash attention over the history materialized as float16
(long chunks) or the extend kernel (short ones) (``kernel_attention.py``):

* per step, before layer 0: ``migrate_pages`` quantizes the step's migrating recent pages from their BF16
  rows (one launch per layer: the engine keeps per-layer tensors, the kernel wants a leading layer
  dimension).  The torch path quantizes the same rows during the forward: nothing writes to a migrating
  window page during the step (it has left the block table) and it is freed only after the forward.
  A migrating page may be partly filled (a prefill chunk that ends inside it); its rows from ``start`` on
  are this step's tokens, bound for the same INT2 page through their INT2 slots, so the whole-page
  migration quantizes stale rows there that each layer's ``write_kv`` overwrites before anything reads them.
* per layer: one ``write_kv`` launch for the step's tokens (flat slots page*P + offset, built once per
  step).  Decode steps (the hot path) let it center + rotate the keys in float32 and store BF16 (window
  rows within one BF16 ulp of the float64 rotation, bit-equal for most rows).  Steps that need the
  rotated keys for attention (extend) or that send tokens straight to INT2 pages rotate in float64 as
  the torch path does and hand write_kv the BF16 rows: bit-identical windows, codes and metadata.
* values are rounded to the window dtype before write_kv: tokens are quantized from their BF16 form in
  both paths (a no-op cast for a BF16 model).

The fused path does not check for non-finite activations (``quant.quantize_rows`` raises on them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import AttentionInterface

from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..codec import LayerCodec, stored_attention
from ..parallel import SINGLE, TensorParallel
from .block_pool import QUANT, WINDOW, PagePool
from .kernel_attention import PoolView, kernel_step
from .scheduler import Migration, ScheduledSeq
from .sampling import sample
from .timing import NO_REGIONS
from .sequence import Sequence

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


@dataclass
class _Rows:
    """Pool slots (page, offset) as two index tensors."""

    page: torch.Tensor
    off: torch.Tensor

    @classmethod
    def of(cls, table: torch.Tensor, positions: torch.Tensor, page_size: int) -> "_Rows":
        return cls(table[positions // page_size], positions % page_size)

    @classmethod
    def cat(cls, rows: list["_Rows"]) -> "_Rows":
        if not rows:
            empty = torch.zeros(0, dtype=torch.long)
            return cls(empty, empty)
        return cls(torch.cat([r.page for r in rows]), torch.cat([r.off for r in rows]))

    def to(self, device) -> "_Rows":
        return _Rows(self.page.to(device), self.off.to(device))

    def __len__(self) -> int:
        return len(self.page)


@dataclass
class _SeqView:
    """Where one sequence's data sits in the packed step and in the gathered history rows."""

    chunk: tuple[int, int]  # token range in the packed row
    start: int  # its first position
    sink: tuple[int, int]  # range in the gathered window rows
    quant: tuple[int, int]  # range in the gathered quantized rows
    recent: tuple[int, int]  # range in the gathered window rows

    def parts(self) -> list[tuple[str, int, int]]:
        """(pool kind, start, end) of the sink, history and recent rows, in position order."""
        return [(WINDOW, *self.sink), (QUANT, *self.quant), (WINDOW, *self.recent)]


class PagedForward:
    """Index plan of one step, shared by all layers; ``attend`` is called once per layer."""

    def __init__(self, pool: PagePool, codecs: list[LayerCodec], steps: list[ScheduledSeq],
                 kernels: PoolView | None = None, regions=NO_REGIONS):
        self.pool, self.codecs, self.steps, self.regions = pool, codecs, steps, regions
        # With kernels enabled, decode-only steps use the decode kernel and others the extend kernel.
        self.kernel_step = kernel_step(kernels, steps) if kernels is not None else None
        if self.kernel_step is not None:
            self._plan_kernels(kernels)
            return
        # position of every token of the step, in batch order: the position ids, and position-aware key centering
        self.positions = torch.cat([torch.arange(st.start, st.end) for st in steps]).to(pool.device)
        g = pool.geometry
        p, sink_end = g.page_size, g.sink_pages * g.page_size
        win_writes, win_src, q_writes, q_src, mig_src, mig_dst = [], [], [], [], [], []
        win_reads, q_reads, views = [], [], []
        offset = n_win = n_q = 0
        for step in steps:
            seq = step.seq
            table = torch.tensor(seq.pages, dtype=torch.long)
            hist_end = sink_end + seq.int2_pages * p
            pos = torch.arange(step.start, step.end)
            in_q = (pos >= sink_end) & (pos < hist_end) if g.quantizes else torch.zeros_like(pos, dtype=torch.bool)
            idx = torch.arange(offset, offset + step.num_tokens)
            win_writes.append(_Rows.of(table, pos[~in_q], p))
            win_src.append(idx[~in_q])
            q_writes.append(_Rows.of(table, pos[in_q], p))
            q_src.append(idx[in_q])
            for m in step.migrations:
                old = _span(m.index * p, min((m.index + 1) * p, step.start))
                mig_src.append(_Rows(torch.full_like(old, m.src), old % p))
                mig_dst.append(_Rows(torch.full_like(old, m.dst), old % p))
            # history read by the reference attention: positions [0, start) in their form after this
            # step (the kernels read the pool through block tables instead)
            reads = self.kernel_step is None
            sink = _span(0, min(step.start, sink_end) if reads else 0)
            quant = _span(sink_end, min(step.start, hist_end) if reads else 0)
            recent = _span(hist_end, step.start if reads else 0)
            win_reads += [_Rows.of(table, sink, p), _Rows.of(table, recent, p)]
            q_reads.append(_Rows.of(table, quant, p))
            views.append(_SeqView((offset, offset + step.num_tokens), step.start,
                                  (n_win, n_win + len(sink)), (n_q, n_q + len(quant)),
                                  (n_win + len(sink), n_win + len(sink) + len(recent))))
            n_win += len(sink) + len(recent)
            n_q += len(quant)
            offset += step.num_tokens
        dev = pool.device
        self.win_writes, self.q_writes = _Rows.cat(win_writes).to(dev), _Rows.cat(q_writes).to(dev)
        self.win_src = torch.cat(win_src).to(dev)
        self.q_src = torch.cat(q_src).to(dev)
        self.mig_src, self.mig_dst = _Rows.cat(mig_src).to(dev), _Rows.cat(mig_dst).to(dev)
        self.win_reads, self.q_reads = _Rows.cat(win_reads).to(dev), _Rows.cat(q_reads).to(dev)
        self.views = views
        self.num_tokens = offset

    def _plan_kernels(self, view: PoolView) -> None:
        """Kernel mode: flat window / INT2 slots and positions of the step's tokens, and the migrating pages
        (host work per token and migration, never per page of a sequence's history)."""
        g = self.pool.geometry
        p, sink_end = g.page_size, self.pool.sink_pages * g.page_size
        win, q, positions, src, dst = [], [], [], [], []
        for step in self.steps:
            pages = step.seq.pages
            hist_end = sink_end + step.seq.int2_pages * p if self.pool.quantizes else sink_end
            for t in range(step.start, step.end):
                slot = pages[t // p] * p + t % p
                if sink_end <= t < hist_end:
                    win.append(-1)
                    q.append(slot)
                else:
                    win.append(slot)
                    q.append(-1)
            positions += range(step.start, step.end)
            src += [m.src for m in step.migrations]
            dst += [m.dst for m in step.migrations]
        dev = self.pool.device
        self.view, self.views, self.num_tokens = view, [], len(positions)
        # one host-to-device copy for the slots and the position ids (numpy builds it faster than torch.tensor)
        plan = torch.from_numpy(np.array([win, q, positions], dtype=np.int64)).to(dev)
        self.positions = plan[2]
        slots = plan[:2].to(torch.int32)
        self.win_slot, self.int2_slot = slots[0], slots[1]
        # the stored keys come from write_kv's own float32 centering and rotation unless the attention needs them
        # too or some token is quantized right away (its codes then come from the float64 rotation, as in _write)
        self.fused_rotation = not self.kernel_step.reads_chunk and max(q, default=-1) < 0
        self.migrations = torch.tensor([src, dst], dtype=torch.int32).to(dev) if src else None

    @classmethod
    def for_graph(cls, pool: PagePool, codecs: list[LayerCodec], view: PoolView, step, positions: torch.Tensor,
                  win_slot: torch.Tensor, int2_slot: torch.Tensor, fused: bool) -> "PagedForward":
        """A decode plan over static tensors (graphs.py fills them before each replay); ``fused``: write_kv
        rotates the keys; migrations are done by the caller before the replay."""
        fwd = cls.__new__(cls)
        fwd.pool, fwd.codecs, fwd.steps, fwd.views = pool, codecs, [], []
        fwd.view, fwd.kernel_step, fwd.positions = view, step, positions
        fwd.win_slot, fwd.int2_slot, fwd.num_tokens = win_slot, int2_slot, len(win_slot)
        fwd.fused_rotation, fwd.migrations, fwd.regions = fused, None, NO_REGIONS
        return fwd

    def run_migrations(self) -> None:
        """Quantize the step's migrating recent pages, every layer (kernel mode; before the first layer writes)."""
        from ..kernels.write import migrate_pages

        if self.migrations is None:
            return
        for i, codec in enumerate(self.codecs):
            ck, cv = self.view.clips(i, codec)
            migrate_pages(self.view.layer_pool(i), self.migrations[0], self.migrations[1], ck[None], cv[None],
                          rescale=(codec.k_rescale, codec.v_rescale))
        self.migrations = None

    # ---- per layer -----------------------------------------------------------------------------
    def attend(self, layer_idx: int, query, key, value, scaling):
        with self.regions.region("attend_total"):
            codec = self.codecs[layer_idx]
            if self.kernel_step is not None:
                return self._attend_kernels(layer_idx, codec, query, key, value, scaling), None
            return self._attend_reference(layer_idx, codec, query, key, value, scaling), None

    def _attend_reference(self, layer_idx: int, codec: LayerCodec, query, key, value, scaling) -> torch.Tensor:
        """The torch path: write (quantizing in torch), then attend to the stored history per sequence."""
        with self.regions.region("key_rotation"):
            keys = codec.rotate_keys(key, self.positions)  # [1, H, N, D] float32, (k - offset) @ R_K
        values = value.float()
        with self.regions.region("kv_write_and_migration"):
            self._write(layer_idx, codec, keys, values)
        hist_k, hist_v = self._gather(layer_idx, self.win_reads, self.q_reads)
        with self.regions.region("query_rotation"):
            q_rot = codec.rotate_queries(query)  # [1, Hq, N, D]
        _, hq, n_tok, d = query.shape
        scaling = d ** -0.5 if scaling is None else scaling
        out = query.new_empty(1, n_tok, hq, d)
        for view in self.views:
            c0, c1 = view.chunk
            parts = [part for part in view.parts() if part[2] > part[1]]
            ks = [_heads_first(hist_k[part]) for part in parts]
            vs = [_heads_first(hist_v[part]) for part in parts]
            k_all = codec.restore_offsets(torch.cat(ks + [keys[:, :, c0:c1]], 2))  # [1, H, n, D], positions 0..n-1
            v_all = torch.cat(vs + [values[:, :, c0:c1]], 2)
            mask = _causal_mask(view.start, c1 - c0, k_all.shape[2], query.device) if c1 - c0 > 1 else None
            out[:, c0:c1] = stored_attention(q_rot[:, :, c0:c1], k_all, v_all, scaling, mask).transpose(1, 2)
        return out

    def _attend_kernels(self, li: int, codec: LayerCodec, query, key, value, scaling) -> torch.Tensor:
        """Fused write (kernels/write.py) then the decode / extend kernel; returns [1, N, Hq, D]."""
        keys, values = self._write_kernels(li, codec, key, value)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        return self.kernel_step.attend(li, codec, query, keys, values, scaling).to(query.dtype)

    def _write_kernels(self, li: int, codec: LayerCodec, key, value):
        """Store layer li's step tokens (after every layer's migrations, with layer 0).  Returns the keys and
        values the extend kernel reads, [1, H, N, D] in the window dtype (keys None when write_kv rotated)."""
        from ..kernels.write import write_kv

        wdt = self.pool.geometry.window_dtype
        values = value if value.dtype == wdt else value.to(wdt)  # stored form, quantized as such (as _write)
        v_rows = _unit_stride(values[0].transpose(0, 1))  # [N, H, D]
        ck, cv = self.view.clips(li, codec)
        rescale = (codec.k_rescale, codec.v_rescale)
        if self.fused_rotation:
            keys = None
            k_rows = _unit_stride(key[0].transpose(0, 1))
            rope = None
            if codec.k_rope_mean is not None:  # the same positions tensor for every layer: one gather per step
                rope = (codec.k_rope_mean, *codec.rope(self.positions))
            as_is = codec.keys_as_is
            rotation, mean = (None, None) if as_is else (codec.k_rotation, codec.k_mean)
        else:
            with self.regions.region("key_rotation"):
                keys = codec.rotate_keys(key, self.positions).to(wdt)  # [1, H, N, D] in float64 as _write
            k_rows, rope, rotation, mean = keys[0].transpose(0, 1), None, None, None
        with self.regions.region("kv_write_and_migration"):
            self.run_migrations()  # first layer of the step: every layer's migrations
            write_kv(self.view, li, k_rows, v_rows, self.win_slot, self.int2_slot, rotation, mean, ck, cv,
                     rescale=rescale, k_rope=rope)
        return keys, values

    def _write(self, li: int, codec: LayerCodec, keys: torch.Tensor, values: torch.Tensor) -> None:
        pool = self.pool
        wdt = pool.geometry.window_dtype
        k_rows = keys[0].transpose(0, 1).to(wdt)  # [N, H, D], stored form of the window
        v_rows = values[0].transpose(0, 1).to(wdt)
        if len(self.win_writes):
            w = self.win_writes
            pool.k_win[li][w.page, :, w.off] = k_rows[self.win_src]
            pool.v_win[li][w.page, :, w.off] = v_rows[self.win_src]
        if not (len(self.q_writes) or len(self.mig_src)):
            return
        # quantize BF16-rounded rows, as the generate() cache migrates its BF16 recent window
        m = self.mig_src
        qk = torch.cat([pool.k_win[li][m.page, :, m.off], k_rows[self.q_src]]).float()  # [N, H, D]
        qv = torch.cat([pool.v_win[li][m.page, :, m.off], v_rows[self.q_src]]).float()
        dst = _Rows.cat([self.mig_dst, self.q_writes])
        for q, codes, meta in ((codec.quantize_keys(qk), pool.k_codes, pool.k_meta),
                               (codec.quantize_values(qv), pool.v_codes, pool.v_meta)):
            codes[li][dst.page, :, dst.off] = q.codes
            meta[li][dst.page, :, dst.off] = torch.cat([q.scale, q.minimum], -1)

    def _gather(self, li: int, win: _Rows, quant: _Rows):
        """History rows as float32: window rows followed by dequantized rows (two tensors each)."""
        pool = self.pool
        k_w = pool.k_win[li][win.page, :, win.off].float()
        v_w = pool.v_win[li][win.page, :, win.off].float()
        if not len(quant):
            return _Joined(k_w, None), _Joined(v_w, None)
        codec = self.codecs[li]
        k_q, v_q = (codec.stored_rows(codes[li][quant.page, :, quant.off], meta[li][quant.page, :, quant.off])
                    for codes, meta in ((pool.k_codes, pool.k_meta), (pool.v_codes, pool.v_meta)))
        return _Joined(k_w, codec.dequantize_keys(k_q)), _Joined(v_w, codec.dequantize_values(v_q))


class _Joined:
    """Window rows and dequantized rows addressed by (kind, start, end) ranges from _SeqView.parts."""

    def __init__(self, window: torch.Tensor, quant: torch.Tensor | None):
        self.window, self.quant = window, quant

    def __getitem__(self, key):
        kind, a, b = key
        return (self.quant if kind == QUANT else self.window)[a:b]


def _causal_mask(start: int, t: int, n: int, device):
    """Logits of queries at positions start.. over keys 0..n-1: those of later keys pushed to the float32 minimum."""
    pos_q = torch.arange(start, start + t, device=device)
    allowed = torch.arange(n, device=device)[None, :] <= pos_q[:, None]
    return lambda logits: logits.masked_fill(~allowed, torch.finfo(torch.float32).min)


def _span(a: int, b: int) -> torch.Tensor:
    return torch.arange(a, max(a, b))


def _unit_stride(rows: torch.Tensor) -> torch.Tensor:
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _heads_first(rows: torch.Tensor) -> torch.Tensor:
    return rows.transpose(0, 1).unsqueeze(0)  # [n, H, D] -> [1, H, n, D]


class ModelForward:
    """The model's forward over a step: our executor (models/llama.py) or transformers' modules, whose attention
    calls reach ``paged_attention`` through the model's forward kwargs."""

    def __init__(self, model, executor=None):
        self.model, self.executor = model, executor

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, fwd: "PagedForward") -> torch.Tensor:
        """input_ids, positions [1, N] on the device -> the last hidden states [1, N, hidden]."""
        if self.executor is not None:
            return self.executor.forward(input_ids[0], positions[0], fwd)[None]
        if self.model.config._attn_implementation != ATTENTION_KEY:  # someone ran generate() on the model
            self.model.set_attn_implementation(ATTENTION_KEY)
        return self.model.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                                oscar_paged=fwd).last_hidden_state


class ModelRunner:
    """Runs a step's forward and samples the next token of each sequence that completed its tokens.

    Under tensor parallelism rank 0 runs the scheduler and calls ``run``; before its forward it sends the
    step (token ids, block-table changes, migrations) to the other ranks, which wait in ``follow`` and run the same
    forward on their heads: the row-parallel all-reduces inside the model meet.  Only rank 0 samples."""

    def __init__(self, model, pool: PagePool, codecs: list[LayerCodec], kernels: PoolView | None = None,
                 graphs=None, tp: TensorParallel = SINGLE, forward: ModelForward | None = None):
        self.model, self.pool, self.codecs, self.kernels = model, pool, codecs, kernels
        self.device = next(model.parameters()).device
        self.graphs = graphs  # graphs.DecodeGraphs, or None: every step eager
        self.tp = tp
        self.forward = forward or ModelForward(model)
        self.regions = NO_REGIONS  # engine/timing.py: a benchmark installs its own to time the step's parts

    @torch.inference_mode()
    def run(self, steps: list[ScheduledSeq]) -> dict[Sequence, int]:
        with self.regions.region("runner"):
            return self._run(steps)

    def _run(self, steps: list[ScheduledSeq]) -> dict[Sequence, int]:
        with self.regions.region("step_plan"):
            changes = self.pool.tables.flush()  # the scheduler's block-table changes, for this rank and the others
            fwd = PagedForward(self.pool, self.codecs, steps, self.kernels, self.regions)
        ids = step_token_ids(steps)
        if self.tp.size > 1:
            self.tp.broadcast(("step", _wire(steps, ids, changes)))
        hidden = self._forward(fwd, torch.tensor([ids], dtype=torch.long, device=self.device))
        sampling, last, offset = [], [], 0
        for st in steps:  # each sampling sequence's last token in the packed row
            offset += st.num_tokens
            if st.samples:
                sampling.append(st)
                last.append(offset - 1)
        if not sampling:
            return {}
        last = torch.tensor(last, device=self.device)
        logits = self.model.lm_head(hidden[0, last]).float()
        seqs = [st.seq for st in sampling]
        with self.regions.region("sampling"):
            return dict(zip(seqs, sample(logits, seqs)))

    def _forward(self, fwd: PagedForward, input_ids: torch.Tensor) -> torch.Tensor:
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
        groups = (pool.k_win, pool.v_win) if kind == WINDOW else (pool.k_codes, pool.v_codes, pool.k_meta,
                                                                    pool.v_meta)
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
            fwd = PagedForward(self.pool, self.codecs, steps, self.kernels)
            self._forward(fwd, torch.tensor([ids], dtype=torch.long, device=self.device))


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
