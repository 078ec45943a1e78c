"""The engine's attention backends, FlashInfer's split: ``plan(steps)`` once per step on the host, ``run(plan, layer,
...)`` once per layer.  ``TorchAttention`` is the reference; ``KernelAttention`` runs the Triton / CUDA kernels.

All scheduled tokens of a step are packed into one row ``[1, N]`` with their own position ids (runner.py).  Per
layer the torch reference

1. rotates and centers the step's keys with the layer's codec (codec.py), as the generate() cache does,
2. writes the step's tokens into their final places: BF16 window pages (sink / recent) or, for
   positions that belong to the history once the step is done, quantized pages; recent-window
   pages that leave the window are quantized from their BF16 rows (cache.py's migration),
3. attends, per sequence, to the history *as stored* (INT2 pages dequantized inside the call)
   plus the step's own tokens exactly - the same semantics as ``cache.oscar_attention``, so a
   request alone in the batch reproduces ``oscar_kv.generation.generate`` token for token.  A
   sliding-window layer (``PoolGeometry.layer_windows``) gathers and dequantizes only the positions
   its window reaches.

With the kernels (``KernelAttention``) steps 1-2 are the fused write path of ``kernels/write.py``
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

from ..codec import LayerCodec, stored_attention
from ..kernels.layout import metadata_slot
from .block_pool import QUANT, WINDOW, PagePool
from .kernel_attention import DecodeStep, ExtendStep, PoolView, kernel_step, write_slots
from .scheduler import ScheduledSeq
from .timing import NO_REGIONS
from .uploads import upload


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
    first: int  # the first position read (0, or the oldest one a sliding window reaches)
    sink: tuple[int, int]  # range in the gathered window rows
    quant: tuple[int, int]  # range in the gathered quantized rows
    recent: tuple[int, int]  # range in the gathered window rows

    def parts(self) -> list[tuple[str, int, int]]:
        """(pool kind, start, end) of the sink, history and recent rows, in position order."""
        return [(WINDOW, *self.sink), (QUANT, *self.quant), (WINDOW, *self.recent)]


class _Joined:
    """Window rows and dequantized rows addressed by (kind, start, end) ranges from _SeqView.parts."""

    def __init__(self, window: torch.Tensor, quant: torch.Tensor | None):
        self.window, self.quant = window, quant

    def __getitem__(self, key):
        kind, a, b = key
        return (self.quant if kind == QUANT else self.window)[a:b]


def _causal_mask(start: int, t: int, n: int, device, first: int = 0, window: int | None = None):
    """Logits of queries at positions start.. over keys at first..first+n-1: those of later keys, and with a
    ``window`` those of keys at or before p - window, pushed to the float32 minimum."""
    pos_q = torch.arange(start, start + t, device=device)[:, None]
    pos_k = torch.arange(first, first + n, device=device)[None, :]
    allowed = pos_k <= pos_q
    if window is not None:
        allowed = allowed & (pos_k > pos_q - window)
    return lambda logits: logits.masked_fill(~allowed, torch.finfo(torch.float32).min)


def _first_read(start: int, window: int | None) -> int:
    """The oldest position a query at ``start`` or later sees through ``window`` (None: every position)."""
    return 0 if window is None else max(start - window + 1, 0)


def _span(a: int, b: int) -> torch.Tensor:
    return torch.arange(a, max(a, b))


def _unit_stride(rows: torch.Tensor) -> torch.Tensor:
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _heads_first(rows: torch.Tensor) -> torch.Tensor:
    return rows.transpose(0, 1).unsqueeze(0)  # [n, H, D] -> [1, H, n, D]


@dataclass
class StepPlan:
    """What every layer of one step reads, built once on the host by a backend's ``plan``."""

    positions: torch.Tensor  # [N] int64 on the device: the position ids, and position-aware key centering
    num_tokens: int
    steps: list[ScheduledSeq]  # what was planned (empty for a captured graph's plan)


@dataclass
class _Reads:
    """The history the layers of one sliding window (or of none) read in a step: window rows, then quantized
    rows, and where each sequence's part of them sits."""

    win: _Rows
    quant: _Rows
    views: list[_SeqView]


@dataclass
class TorchPlan(StepPlan):
    """The reference backend's plan: pool rows to write and to read, per sequence."""

    win_writes: _Rows  # window rows of the step's tokens bound for window pages
    win_src: torch.Tensor  # their indices in the step
    q_writes: _Rows  # quantized rows of the tokens bound for INT2 pages
    q_src: torch.Tensor
    mig_src: _Rows  # window rows of migrating recent pages, and the quantized rows they go to
    mig_dst: _Rows
    reads: dict[int | None, _Reads]  # by the layers' sliding window (None: full attention)


@dataclass
class KernelPlan(StepPlan):
    """The kernel backend's plan: flat write slots, the migrations, and the attention step (block tables)."""

    step: DecodeStep | ExtendStep
    win_slot: torch.Tensor  # int32 [N]: page * P + offset in the window pool, or -1
    int2_slot: torch.Tensor  # int32 [N]: in the INT2 pool, or -1
    fused_rotation: bool  # write_kv centers and rotates the keys itself
    migrations: torch.Tensor | None  # int32 [2, M] (window page, INT2 page), run before the first layer writes


class TorchAttention:
    """The reference: keys rotated in float64, written with torch indexing, attention in float32 per sequence over
    the history as stored (INT2 rows dequantized)."""

    def __init__(self, pool: PagePool, codecs: list[LayerCodec]):
        self.pool, self.codecs = pool, codecs

    def plan(self, steps: list[ScheduledSeq]) -> TorchPlan:
        pool = self.pool
        positions = torch.cat([torch.arange(st.start, st.end) for st in steps]).to(pool.device)
        g = pool.geometry
        p, sink_end = g.page_size, g.sink_pages * g.page_size
        win_writes, win_src, q_writes, q_src, mig_src, mig_dst = [], [], [], [], [], []
        windows = list(dict.fromkeys(g.layer_windows))  # each window the layers read with, once
        reads = {w: ([], [], []) for w in windows}  # per window: window rows, quantized rows, views
        counts = {w: [0, 0] for w in windows}
        offset = 0
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
            # the history the attention reads: positions [first, start) in their form after this step, where
            # first is 0, or for a sliding-window layer the oldest position its window reaches
            for w in windows:
                first = _first_read(step.start, w)
                sink = _span(first, min(step.start, sink_end))
                quant = _span(max(sink_end, first), min(step.start, hist_end))
                recent = _span(max(hist_end, first), step.start)
                win_reads, q_reads, views = reads[w]
                n_win, n_q = counts[w]
                win_reads += [_Rows.of(table, sink, p), _Rows.of(table, recent, p)]
                q_reads.append(_Rows.of(table, quant, p))
                views.append(_SeqView((offset, offset + step.num_tokens), step.start, first,
                                      (n_win, n_win + len(sink)), (n_q, n_q + len(quant)),
                                      (n_win + len(sink), n_win + len(sink) + len(recent))))
                counts[w] = [n_win + len(sink) + len(recent), n_q + len(quant)]
            offset += step.num_tokens
        dev = pool.device
        return TorchPlan(positions, offset, steps, _Rows.cat(win_writes).to(dev), torch.cat(win_src).to(dev),
                         _Rows.cat(q_writes).to(dev), torch.cat(q_src).to(dev), _Rows.cat(mig_src).to(dev),
                         _Rows.cat(mig_dst).to(dev),
                         {w: _Reads(_Rows.cat(r[0]).to(dev), _Rows.cat(r[1]).to(dev), r[2]) for w, r in reads.items()})

    def run(self, plan: TorchPlan, layer_idx: int, query, key, value, scaling, regions=NO_REGIONS) -> torch.Tensor:
        """query [1, Hq, N, D], key / value [1, Hkv, N, D] -> [1, N, Hq, D]."""
        codec = self.codecs[layer_idx]
        with regions.region("key_rotation"):
            keys = codec.rotate_keys(key, plan.positions)  # [1, H, N, D] float32, (k - offset) @ R_K
        values = value.float()
        with regions.region("kv_write_and_migration"):
            self._write(plan, layer_idx, codec, keys, values)
        window = self.pool.geometry.layer_windows[layer_idx]
        reads = plan.reads[window]
        hist_k, hist_v = self._gather(layer_idx, reads.win, reads.quant)
        with regions.region("query_rotation"):
            q_rot = codec.rotate_queries(query)  # [1, Hq, N, D]
        _, hq, n_tok, d = query.shape
        scaling = d ** -0.5 if scaling is None else scaling
        out = query.new_empty(1, n_tok, hq, d)
        for view in reads.views:
            c0, c1 = view.chunk
            parts = [part for part in view.parts() if part[2] > part[1]]
            ks = [_heads_first(hist_k[part]) for part in parts]
            vs = [_heads_first(hist_v[part]) for part in parts]
            # [1, H, n, D] of positions first..first+n-1
            k_all = codec.restore_offsets(torch.cat(ks + [keys[:, :, c0:c1]], 2), first=view.first)
            v_all = torch.cat(vs + [values[:, :, c0:c1]], 2)
            # one query (decode) sees every key read: the reads start where its window does
            mask = (_causal_mask(view.start, c1 - c0, k_all.shape[2], query.device, view.first, window)
                    if c1 - c0 > 1 else None)
            out[:, c0:c1] = stored_attention(q_rot[:, :, c0:c1], k_all, v_all, scaling, mask).transpose(1, 2)
        return out

    def _write(self, plan: TorchPlan, li: int, codec: LayerCodec, keys: torch.Tensor, values: torch.Tensor) -> None:
        pool = self.pool
        wdt = pool.geometry.window_dtype
        k_rows = keys[0].transpose(0, 1).to(wdt)  # [N, H, D], stored form of the window
        v_rows = values[0].transpose(0, 1).to(wdt)
        if len(plan.win_writes):
            w = plan.win_writes
            pool.k_win[li][w.page, :, w.off] = k_rows[plan.win_src]
            pool.v_win[li][w.page, :, w.off] = v_rows[plan.win_src]
        if not (len(plan.q_writes) or len(plan.mig_src)):
            return
        # quantize BF16-rounded rows, as the generate() cache migrates its BF16 recent window
        m = plan.mig_src
        qk = torch.cat([pool.k_win[li][m.page, :, m.off], k_rows[plan.q_src]]).float()  # [N, H, D]
        qv = torch.cat([pool.v_win[li][m.page, :, m.off], v_rows[plan.q_src]]).float()
        dst = _Rows.cat([plan.mig_dst, plan.q_writes])
        slots = metadata_slot(dst.off, pool.geometry.page_size)
        for q, side in ((codec.quantize_keys(qk), "k"), (codec.quantize_values(qv), "v")):
            codes, scale, zero = codec.pool_rows(q)
            codec.store_codes(getattr(pool, f"{side}_codes")[li], (dst.page, slice(None), dst.off), codes, side)
            for name, t in (("scale", scale), ("zero", zero)):  # split keys: group 0 (kernels/split_keys.py)
                getattr(pool, f"{side}_{name}")[li][dst.page, :, slots, :t.shape[-1]] = t

    def _gather(self, li: int, win: _Rows, quant: _Rows):
        """History rows as float32: window rows followed by dequantized rows (two tensors each)."""
        pool = self.pool
        k_w = pool.k_win[li][win.page, :, win.off].float()
        v_w = pool.v_win[li][win.page, :, win.off].float()
        if not len(quant):
            return _Joined(k_w, None), _Joined(v_w, None)
        codec = self.codecs[li]
        slots = metadata_slot(quant.off, pool.geometry.page_size)
        k_q, v_q = (codec.stored_rows(codec.load_codes(getattr(pool, f"{side}_codes")[li],
                                                       (quant.page, slice(None), quant.off), side),
                                      *(getattr(pool, f"{side}_{name}")[li][quant.page, :, slots]
                                        for name in ("scale", "zero")), side) for side in ("k", "v"))
        return _Joined(k_w, codec.dequantize_keys(k_q)), _Joined(v_w, codec.dequantize_values(v_q))


class KernelAttention:
    """The kernels: one fused write per layer (kernels/write.py), then the decode kernel (decode steps) or, for
    prefill chunks, the materialized flash path or the extend kernel (kernel_attention.py)."""

    def __init__(self, pool: PagePool, codecs: list[LayerCodec], view: PoolView):
        self.pool, self.codecs, self.view = pool, codecs, view

    def plan(self, steps: list[ScheduledSeq]) -> KernelPlan:
        """Flat window / INT2 slots and positions of the step's tokens, and the migrating pages (host work per
        token and migration, never per page of a sequence's history); decode-only steps use the decode kernel."""
        if all(st.num_tokens == 1 for st in steps):
            return self._decode_plan(steps)
        step = kernel_step(self.view, steps)
        g = self.pool.geometry
        p, sink_end = g.page_size, self.pool.sink_pages * g.page_size
        win, q, positions, src, dst = [], [], [], [], []
        for st in steps:
            pages = st.seq.pages
            hist_end = sink_end + st.seq.int2_pages * p if self.pool.quantizes else sink_end
            for t in range(st.start, st.end):
                w, i = write_slots(pages, t, p, sink_end, hist_end)
                win.append(w)
                q.append(i)
            positions += range(st.start, st.end)
            src += [m.src for m in st.migrations]
            dst += [m.dst for m in st.migrations]
        dev = self.pool.device
        # one host-to-device copy for the slots and the position ids (numpy builds it faster than torch.tensor)
        table = upload(np.array([win, q, positions], dtype=np.int64), dev)
        slots = table[:2].to(torch.int32)
        # the stored keys come from write_kv's own float32 centering and rotation unless the attention needs them
        # too or some token is quantized right away (its codes then come from the float64 rotation, as in _write)
        fused = not step.reads_chunk and max(q, default=-1) < 0
        migrations = upload(np.array([src, dst], dtype=np.int32), dev) if src else None
        return KernelPlan(table[2], len(positions), steps, step, slots[0], slots[1], fused, migrations)

    def _decode_plan(self, steps: list[ScheduledSeq]) -> KernelPlan:
        """``plan`` of a decode-only step (DecodeStep.with_writes: one pass, one upload)."""
        step, w = DecodeStep.with_writes(self.view, steps)
        # write_kv rotates the keys itself unless a token goes to an INT2 page right away
        return KernelPlan(w.positions, len(steps), steps, step, w.win_slot, w.int2_slot, not w.to_int2, w.migrations)

    def graph_plan(self, step: DecodeStep, positions: torch.Tensor, win_slot: torch.Tensor, int2_slot: torch.Tensor,
                   fused: bool) -> KernelPlan:
        """A decode plan over static tensors (graphs.py fills them before each replay); ``fused``: write_kv
        rotates the keys; migrations are run by the caller before the replay."""
        return KernelPlan(positions, len(win_slot), [], step, win_slot, int2_slot, fused, None)

    def run_migrations(self, plan: KernelPlan) -> None:
        """Quantize the step's migrating recent pages, every layer (before the first layer writes); once."""
        from ..kernels.write import migrate_pages

        if plan.migrations is None:
            return
        for i, codec in enumerate(self.codecs):
            ck, cv = self.view.clips(i, codec)
            migrate_pages(self.view.layer_pool(i), plan.migrations[0], plan.migrations[1], ck[None], cv[None],
                          rescale=(codec.k_rescale, codec.v_rescale))
        plan.migrations = None

    def run(self, plan: KernelPlan, layer_idx: int, query, key, value, scaling, regions=NO_REGIONS) -> torch.Tensor:
        """Fused write then the decode / extend kernel: query [1, Hq, N, D], key / value [1, Hkv, N, D] ->
        [1, N, Hq, D]."""
        codec = self.codecs[layer_idx]
        keys, values = self._write(plan, layer_idx, codec, key, value, regions)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        return plan.step.attend(layer_idx, codec, query, keys, values, scaling).to(query.dtype)

    def _write(self, plan: KernelPlan, li: int, codec: LayerCodec, key, value, regions):
        """Store layer li's step tokens (after every layer's migrations, with layer 0).  Returns the keys and
        values the extend kernel reads, [1, H, N, D] in the window dtype (keys None when write_kv rotated)."""
        from ..kernels.tuning import TUNING
        from ..kernels.window_write import write_window
        from ..kernels.write import write_kv

        wdt = self.pool.geometry.window_dtype
        values = value if value.dtype == wdt else value.to(wdt)  # stored form, quantized as such (as the torch path)
        v_rows = _unit_stride(values[0].transpose(0, 1))  # [N, H, D]
        ck, cv = self.view.clips(li, codec)
        if plan.fused_rotation:
            keys = None
            k_rows = _unit_stride(key[0].transpose(0, 1))
            rope = None
            if codec.k_rope_mean is not None:  # the same positions tensor for every layer: one gather per step
                rope = (codec.k_rope_mean, *codec.rope(plan.positions))
            rotation, mean = (None, None) if codec.keys_as_is else (codec.k_rotation, codec.k_mean)
        else:
            with regions.region("key_rotation"):
                keys = codec.rotate_keys(key, plan.positions).to(wdt)  # [1, H, N, D] in float64 as the torch path
            k_rows, rope, rotation, mean = keys[0].transpose(0, 1), None, None, None
        with regions.region("kv_write_and_migration"):
            self.run_migrations(plan)  # first layer of the step: every layer's migrations
            layout = codec.rope.layout if rope is not None else None
            if (plan.fused_rotation and isinstance(plan.step, DecodeStep)
                    and k_rows.shape[0] * k_rows.shape[1] <= TUNING.window_write_max_rows):  # all to the window
                write_window(self.view, li, k_rows, v_rows, plan.win_slot, rotation, mean, k_rope=rope,
                             rope_layout=layout)
            else:
                write_kv(self.view, li, k_rows, v_rows, plan.win_slot, plan.int2_slot, rotation, mean, ck, cv,
                         rescale=(codec.k_rescale, codec.v_rescale), k_rope=rope, rope_layout=layout)
        return keys, values
