"""The engine's attention through the Triton kernels (kernels/decode.py) instead of the torch reference.

The engine pool keeps one tensor per layer in exactly the layout of ``kernels/layout.py``; ``PoolView``
lets the kernels address it (``layer(i)`` for the per-layer kernels, ``layer_pool(i)`` a one-layer
``PagedKVPool`` of views for ``write.migrate_pages``, which takes a pool with a leading layer dimension).
The step's tokens are written by ``write.write_kv`` (attention.KernelAttention) before either kernel runs:

* ``DecodeStep`` (every sequence computes one token): the decode kernel reads the new token from its
  BF16 window page together with the rest of the cache (so write_kv may rotate the keys itself).
* ``ExtendStep`` (prefill chunks, possibly mixed with decodes): each sequence attends to positions
  [0, start) as stored after the step and causally to the chunk's own keys and values from the step's
  tensors (``reads_chunk``: the caller passes the rotated keys, as the chunk's tokens bound for INT2 pages
  are not in the pool at full precision).  ``extend_path`` picks, per sequence, one of two computations of
  that: a long chunk materializes its history as float16 K/V and runs flash attention
  (kernels/materialized_extend.py: the cost of BF16 flash attention); a short one (decode tokens mixed into
  the step, a short suffix after a prefix hit) runs the extend kernel, which reads the compressed pool
  directly (kernels/extend.py) instead of writing the whole history once for a few queries.

A sliding-window layer (``PoolGeometry.layer_windows``) passes its window to every kernel: each attends only to
keys in (position - window, position], and its splits and materialized history cover only that.  The window is a
per-layer constant, so decode graphs capture it like the layer index.

These are the reference path's semantics (``attention.TorchAttention``), computed with float16 / bf16 tensor-core
arithmetic instead of float32, so outputs agree to ~1e-2 relative, not bit for bit.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

from ..config import ATTENTION_BACKENDS
from ..errors import ConfigError
from ..kernels import TRITON_MISSING, triton_available
from ..kernels import split_keys
from ..kernels.layout import POOL_TENSORS, PagedBatch, PagedKVPool, clip_indices
from ..kernels.tuning import TUNING
from .block_pool import PagePool
from .uploads import upload

# Chunks of at least this many tokens take the materialized flash path (extend_path; kernels/tuning.py says why).
# Module names so that bench decode --prefill-attention can move them; tune with bench decode --prefill-only.
FLASH_MIN_TOKENS = TUNING.flash_min_tokens
FLASH_MIN_TOKENS_ROPE = TUNING.flash_min_tokens_rope


def extend_path(num_tokens: int, rope_centered: bool) -> str:
    """How one sequence of an extend step attends: "flash" (materialize the history, then flash attention) or
    "kernel" (the extend kernel over the paged pool).  The one place this is decided."""
    return "flash" if num_tokens >= (FLASH_MIN_TOKENS_ROPE if rope_centered else FLASH_MIN_TOKENS) else "kernel"


def kernel_support(pool: PagePool, backend: str = "auto", rope_centered: bool = False) -> str | None:
    """None when the Triton kernels can serve this pool, else why not (for the start-up log).
    ``backend``: "auto" (kernels on CUDA), "triton" (kernels wherever they run) or "torch" (never).
    ``rope_centered``: the artifact centers keys per position (rope.py)."""
    if backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}",
                          "attention_backend")
    if backend == "torch":
        return "attention_backend is 'torch'"
    if backend == "auto" and pool.device.type != "cuda":
        return "no CUDA device (the torch reference runs on the CPU)"
    if not triton_available():
        return TRITON_MISSING
    if pool.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the kernels need CUDA or TRITON_INTERPRET=1"
    g = pool.geometry
    if rope_centered and not g.quantizes:
        return "the BF16 decode kernel does not add the position-aware key offset (the INT2 kernels do)"
    if g.head_dim < 64:
        return f"head dim {g.head_dim} < 64 (the extend kernel needs at least 64)"
    if g.head_dim > 256:  # the kernels' tiles are sized up to 256 (benchmarks/kernel_smem.py: shared memory per CTA)
        return f"head dim {g.head_dim} > 256 (the Triton kernels are sized for at most 256)"
    return g.kernel_error()


class PoolView:
    """The engine pool through the interface the kernels take (``geometry`` and ``layer(i)``)."""

    def __init__(self, pool: PagePool):
        self.pool, self.geometry = pool, pool.geometry  # the kernels address the engine pool as it is
        g = self.geometry
        # A BF16 cache has no INT2 pool; the kernels still take (never read) INT2 tensors.
        self._no_codes = torch.zeros(1, g.num_kv_heads, g.page_size, g.head_dim // 4, dtype=torch.uint8,
                                     device=pool.device)
        self._no_scale = torch.zeros(1, g.num_kv_heads, g.page_size, g.num_groups, dtype=torch.float16,
                                     device=pool.device)
        self._no_zero = torch.zeros(1, g.num_kv_heads, g.page_size, g.num_groups, dtype=torch.uint8,
                                    device=pool.device)
        self._clips: dict[int, tuple] = {}
        self._layer_pools: dict[int, PagedKVPool] = {}
        self._rope_weights: dict[int, tuple] = {}
        from ..kernels.materialized_extend import Scratch  # (imports Triton: a PoolView exists only when usable)

        self.scratch = Scratch()  # the materialized history of extend steps, shared by every layer and step

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        p = self.pool
        if not p.geometry.quantizes:
            return {"k_codes": self._no_codes, "v_codes": self._no_codes, "k_scale": self._no_scale,
                    "v_scale": self._no_scale, "k_zero": self._no_zero, "v_zero": self._no_zero,
                    "k_win": p.k_win[i], "v_win": p.v_win[i]}
        return {name: getattr(p, name)[i] for name in POOL_TENSORS}

    def layer_pool(self, i: int) -> PagedKVPool:
        """Layer i as a one-layer PagedKVPool (views of the engine's tensors, nothing copied)."""
        if i not in self._layer_pools:
            t, g = self.layer(i), self.geometry
            one = dataclasses.replace(g, num_layers=1, k_bits=g.k_bits[i:i + 1], v_bits=g.v_bits[i:i + 1],
                                      k_split=g.k_split[i:i + 1],
                                      layer_windows=g.layer_windows[i:i + 1])
            self._layer_pools[i] = PagedKVPool(one, *(t[n].unsqueeze(0) for n in POOL_TENSORS))
        return self._layer_pools[i]

    def clips(self, i: int, codec) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 [H] clip indices floor(c*D) of layer i's keys and values (quant.clip_rows' threshold rank; split
        keys: [H, 2], each part's, kernels/split_keys.clip_indices), computed once per layer (``codec``: its
        codec.LayerCodec)."""
        hit = self._clips.get(i)
        if hit is None or hit[0] is not codec:
            h, d = self.geometry.num_kv_heads, self.geometry.head_dim
            dev = self.pool.device
            split = self.geometry.k_split[i]
            keys = (split_keys.clip_indices(codec.k_clip.to(dev), split, d, (h,)) if split is not None
                    else clip_indices(codec.k_clip.to(dev), d, (h,)))
            hit = (codec, keys.to(dev), clip_indices(codec.v_clip.to(dev), d, (h,)))
            self._clips[i] = hit
        return hit[1], hit[2]


    def rope_weights(self, i: int, codec, rope) -> torch.Tensor | None:
        """Layer i's materialized_extend.rope_key_weights (RoPE_p(mu_pre) @ R_K as cos | sin @ W), built once."""
        if rope is None:
            return None
        hit = self._rope_weights.get(i)
        if hit is None or hit[0] is not codec:
            from ..kernels.materialized_extend import rope_key_weights

            hit = (codec, rope_key_weights(rope, codec.k_rotation, self.geometry.num_kv_heads))
            self._rope_weights[i] = hit
        return hit[1]


def _step_batch(view: PoolView, steps, lengths: list[int], int2_pages: list[int]) -> PagedBatch:
    """The step's block tables (its rows of the pool's device tables, gathered on the device: no host work per
    page) with ``lengths`` / ``int2_pages`` as seq_lens / int2_pages; one host-to-device copy for the three."""
    tables = view.pool.tables
    meta = np.array([tables.rows_of(st.seq for st in steps), lengths, int2_pages], dtype=np.int32)
    meta = upload(meta, view.pool.device)  # numpy builds it faster than torch.tensor
    width = max(1, max(len(st.seq.pages) for st in steps))
    return PagedBatch(tables.gather(meta[0], width), meta[1], meta[2])


def write_slots(pages: list[int], t: int, page_size: int, sink_end: int, hist_end: int) -> tuple[int, int]:
    """(window slot, INT2 slot) where position ``t`` of a sequence with these ``pages`` is written, -1 for the
    pool it does not go to: positions in [sink_end, hist_end) (its INT2 history) go to the INT2 pool."""
    slot = pages[t // page_size] * page_size + t % page_size
    return (-1, slot) if sink_end <= t < hist_end else (slot, -1)


@dataclasses.dataclass
class DecodeWrites:
    """Where a decode step's tokens go, on the device: write slots (-1: not that pool), position ids, and the
    recent pages migrating to INT2 before the first layer writes."""

    win_slot: torch.Tensor  # int32 [B]
    int2_slot: torch.Tensor  # int32 [B]
    positions: torch.Tensor  # int64 [B]
    migrations: torch.Tensor | None  # int32 [2, M] (window page, INT2 page)
    to_int2: bool  # some token goes straight to an INT2 page


class DecodeStep:
    """Block tables of a decode-only step, built once and used by every layer."""

    reads_chunk = False  # the new tokens are read from the pool, ``keys`` / ``values`` are ignored

    def __init__(self, view: PoolView, batch: PagedBatch, max_int2_pages: int, max_seq_len: int):
        """``max_int2_pages`` / ``max_seq_len``: host bounds that fix the kernels' split plans (graphs.py
        captures with bucketed bounds)."""
        self.view, self.batch = view, batch
        self.max_int2_pages, self.max_seq_len = max_int2_pages, max_seq_len

    @classmethod
    def of(cls, view: PoolView, steps) -> "DecodeStep":
        """``steps``: the step's ScheduledSeqs, one token each, already counted in their page tables."""
        return cls.with_writes(view, steps)[0]

    @classmethod
    def with_writes(cls, view: PoolView, steps) -> tuple["DecodeStep", "DecodeWrites"]:
        """The step and where its tokens are written, in one pass over the sequences and one host-to-device copy
        (a decode plan runs every step: at 64 sequences each Python pass or upload is a sizable part of it)."""
        pool = view.pool
        p, sink_end = pool.geometry.page_size, pool.sink_pages * pool.geometry.page_size
        win, q, rows, lens, int2, positions, src, dst = [], [], [], [], [], [], [], []
        width = 1
        for st in steps:
            seq, t = st.seq, st.start
            pages, h = seq.pages, seq.int2_pages
            w, i = write_slots(pages, t, p, sink_end, sink_end + h * p if pool.quantizes else sink_end)
            win.append(w)
            q.append(i)
            rows.append(seq.block_row)
            lens.append(t + 1)
            int2.append(h)
            positions.append(t)
            width = max(width, len(pages))
            for m in st.migrations:
                src.append(m.src)
                dst.append(m.dst)
        if min(rows) < 0:
            pool.tables.rows_of([st.seq for st in steps])  # raises, naming what went wrong
        table = upload(np.array([win, q, rows, lens, int2, positions], dtype=np.int64), pool.device)
        small = table[:5].to(torch.int32)
        step = cls(view, PagedBatch(pool.tables.gather(small[2], width), small[3], small[4]), max(int2), max(lens))
        migrations = upload(np.array([src, dst], dtype=np.int32), pool.device) if src else None
        return step, DecodeWrites(small[0], small[1], table[5], migrations, max(q) >= 0)

    def attend(self, layer_idx: int, codec, query: torch.Tensor, keys=None, values=None,
               scaling: float | None = None) -> torch.Tensor:
        """query [1, Hq, B, D] (one token per sequence, already in the pool) -> [1, B, Hq, D]."""
        from ..kernels.bf16_decode import bf16_decode
        from ..kernels.decode import int2_decode

        q = query[0].transpose(0, 1)  # [B, Hq, D]
        window = self.view.geometry.layer_windows[layer_idx]
        if self.view.pool.geometry.quantizes:
            out = int2_decode(q, self.view, layer_idx, self.batch, codec.k_rotation, scaling,
                              rope=_rope(codec, self.max_seq_len), max_int2_pages=self.max_int2_pages,
                              max_seq_len=self.max_seq_len, window=window)
        else:
            p = self.view.pool
            out = bf16_decode(q, p.k_win[layer_idx], p.v_win[layer_idx], self.batch.block_table, self.batch.seq_lens,
                              None if codec.keys_as_is else codec.k_rotation, scaling,
                              page_size=p.geometry.page_size, max_seq_len=self.max_seq_len, window=window)
        return out.unsqueeze(0)


class ExtendStep:
    """Chunk offsets and history block tables of a step with prefill chunks, used by every layer."""

    reads_chunk = True  # attend needs the chunk's rotated keys and values

    def __init__(self, view: PoolView, steps):
        g = view.pool.geometry
        p, sink_end = g.page_size, g.sink_pages * g.page_size
        history_int2 = []
        for st in steps:
            # INT2 pages (after this step) that hold positions before the chunk; the last may be partial.
            hist_end = min(sink_end + st.seq.int2_pages * p, st.start)
            history_int2.append(max(0, -(-(hist_end - sink_end) // p)))
        cu = [0]
        for st in steps:
            cu.append(cu[-1] + st.num_tokens)
        dev = view.pool.device
        self.view = view
        self.cu = cu
        self.starts = [st.start for st in steps]
        self.history_int2 = history_int2
        self.cu_seqlens = upload(np.array(cu, dtype=np.int32), dev)
        self.batch = _step_batch(view, steps, self.starts, history_int2)
        self.max_seqlen = max(st.num_tokens for st in steps)
        self.max_int2_pages = max(history_int2)
        self.max_position = max(st.end for st in steps)
        self._part = None  # (rope_centered, _KernelPart | None), by the first layer
        self._plans = {}  # (rope_centered, window) -> MaterializePlan: a layer of each window kind builds one
        self._finite = None  # device bool: every materialized output of the step so far is finite

    def paths(self, rope_centered: bool, window: int | None = None):
        """The step's sequences split by extend_path: (the extend kernel's _KernelPart or None, the materialized
        flash path's MaterializePlan for a layer of this sliding ``window``, None: full attention)."""
        counts = [b - a for a, b in zip(self.cu, self.cu[1:])]
        if self._part is None or self._part[0] != rope_centered:
            kernel = [i for i, n in enumerate(counts) if n and extend_path(n, rope_centered) == "kernel"]
            part = None
            if kernel:
                part = _KernelPart(self, None if len(kernel) == len(counts) else kernel)
            self._part = (rope_centered, part)
        plan = self._plans.get((rope_centered, window))
        if plan is None:
            from ..kernels.materialized_extend import MaterializePlan

            flash = [i for i, n in enumerate(counts) if n and extend_path(n, rope_centered) == "flash"]
            plan = MaterializePlan.build(self.cu, self.starts, flash, self.view.pool.device, window=window)
            self._plans[(rope_centered, window)] = plan
        return self._part[1], plan

    def attend(self, layer_idx: int, codec, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """query [1, Hq, N, D]; keys / values [1, H, N, D] as stored (rotated, centered; any float dtype, read
        as BF16 by the extend kernel, float16 by the materialized path) -> [1, N, Hq, D]."""
        from ..kernels.extend import int2_extend
        from ..kernels.materialized_extend import materialized_extend

        q = query[0].transpose(0, 1)
        k_rows, v_rows = _token_rows(keys), _token_rows(values)
        rope = _rope(codec, self.max_position)
        window = self.view.geometry.layer_windows[layer_idx]
        part, plan = self.paths(rope is not None, window)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if part is not None:
            sub = part.rows is not None
            pick = (lambda x: x.index_select(0, part.rows)) if sub else (lambda x: x)  # noqa: E731
            got = int2_extend(pick(q), pick(k_rows), pick(v_rows), part.cu_seqlens, self.view, layer_idx, part.batch,
                              codec.k_rotation, scaling, rope=rope, max_seqlen=part.max_seqlen,
                              max_int2_pages=part.max_int2_pages, window=window, out=None if sub else out)
            if sub:
                out.index_copy_(0, part.rows, got)
        if plan.groups:
            materialized_extend(q, k_rows, v_rows, self.cu_seqlens, self.view, layer_idx, self.batch, codec.k_rotation,
                                scaling, rope=rope, plan=plan, scratch=self.view.scratch,
                                rope_weights=self.view.rope_weights(layer_idx, codec, rope), window=window, out=out)
            self._check_finite(layer_idx, out)
        return out.unsqueeze(0)

    def _check_finite(self, layer_idx: int, out: torch.Tensor) -> None:
        """The materialized history is float16 (max 65504): an overflow shows as a non-finite output.  Checked on
        the device per layer, raised once per step after the last layer (one sync), never silently wrong."""
        ok = torch.isfinite(out).all()
        self._finite = ok if self._finite is None else self._finite & ok
        if layer_idx == self.view.geometry.num_layers - 1 and not bool(self._finite):
            raise FloatingPointError("non-finite attention output in a prefill step: a key, value or query of the "
                                     "materialized float16 history exceeds 65504, or the model produced NaN / inf")


class _KernelPart:
    """The sequences of an extend step that run the extend kernel (all of them when ``seqs`` is None): their
    packed rows, chunk offsets and history block tables."""

    def __init__(self, step: ExtendStep, seqs: list[int] | None):
        dev = step.view.pool.device
        if seqs is None:
            self.rows, self.cu_seqlens, self.batch = None, step.cu_seqlens, step.batch
            self.max_seqlen, self.max_int2_pages = step.max_seqlen, step.max_int2_pages
            return
        cu, rows, sub_cu = step.cu, [], [0]
        for i in seqs:
            rows += range(cu[i], cu[i + 1])
            sub_cu.append(sub_cu[-1] + cu[i + 1] - cu[i])
        self.rows = upload(np.array(rows, dtype=np.int64), dev)
        self.cu_seqlens = upload(np.array(sub_cu, dtype=np.int32), dev)
        pick = upload(np.array(seqs, dtype=np.int64), dev)
        self.batch = PagedBatch(*(x.index_select(0, pick) for x in (step.batch.block_table, step.batch.seq_lens,
                                                                     step.batch.int2_pages)))
        self.max_seqlen = max(cu[i + 1] - cu[i] for i in seqs)
        self.max_int2_pages = max(step.history_int2[i] for i in seqs)


def _rope(codec, positions: int):
    """The kernels' ``rope`` argument for a layer whose keys are centered per position, else None."""
    if codec.k_rope_mean is None:
        return None
    return codec.rope.kernel_rope(codec.k_rope_mean, positions, codec.rope_pairs)


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """[1, H, N, D] -> [N, H, D] (a view; the kernels take any strides but a unit one in D)."""
    rows = x[0].transpose(0, 1)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def kernel_step(view: PoolView, steps):
    """The kernel plan of a step: the decode kernel when every sequence computes one token."""
    return DecodeStep.of(view, steps) if all(st.num_tokens == 1 for st in steps) else ExtendStep(view, steps)
