"""The paged KV pool: BF16 window pages + INT2 history pages, addressed through one block table.

Why this layout
---------------
The serving engine batches requests continuously and shares prompt prefixes between them.  What a
prefix hit can share is the *settled* part of a sequence: the BF16 sink (first S0 tokens) and the
INT2 history.  The recent window (last W .. W+P-1 tokens, BF16) keeps changing and belongs to one
request.  Everything is therefore stored in fixed-size **pages of P tokens** (P = 16, 32 or 64; S0 must
be a multiple of P), in two pools:

* **window pool** (BF16, rotated/centered keys, rotated values) for sink pages and recent pages::

      k_win, v_win   bfloat16 [L, NW, H, P, D]        (L layers, NW pages, H KV heads, D head dim)

* **INT2 pool** for history pages, codes and 16-bit metadata in separate tensors::

      k_codes, v_codes  uint8   [L, NQ, H, P, D*b/8]  b-bit codes (b = 2, 3, 4, 5 or 8 for keys, 2, 3, 4 or 8
                                                      for values, each side at its own width), stride-packed as
                                                      in quant.py (INT2: byte j holds channels j, j+D/4, j+D/2,
                                                      j+3D/4; INT3 / INT5: an INT2 / INT4 plane, then the high bits)
      k_scale, v_scale  float16 [L, NQ, H, P, NG]     NG = D/G groups: each group's scale s
      k_zero,  v_zero   uint8   [L, NQ, H, P, NG]     its zero point z; x_hat = s * (code - z 2^-F), F =
                                                      quant.fraction_bits(b) (quant.py: 24 bits a group)

  A layer whose keys are split (two widths a row, quant.SplitWidth: ``PoolGeometry.k_split``) stores longer key rows:
  the row at its narrow width, then a tail with the wider part's scale, zero point and upper bits (split_keys.py);
  its other part's scale and zero point are group 0 of k_scale / k_zero.

  One (page, head) tile is contiguous: P*D*b/8 code bytes (512 B at P=16, D=128, INT2), P*2*NG bytes of scales
  and P*NG zero points, so a decode program streams whole pages with 16-byte loads.  The scale and zero-point
  tensors have the same shape, so one stride (in elements) addresses both.  Within each 16 tokens of a page the
  metadata of tokens j and j + 8 sit side by side (``metadata_slot``): a thread of the CUDA decode kernel reads
  tokens g and g + 8 of a sub-tile, so one 4-byte load brings both scales and one 2-byte load both zero points
  (token order cost 25% more time at 128K: twice the load instructions; benchmarks/NOTES.md, run Z3).  The layer dimension leads
  so that one launch can address every layer (migration) while a per-layer view is a plain slice.

A sequence is described by three small tensors (the engine's scheduler owns them):

* ``block_table`` int32 [B, max_pages]: logical page i of sequence b -> physical page id.  The pool
  the id points into follows from i:
    - i <  S0/P                                  sink page    -> window pool
    - S0/P <= i < S0/P + int2_pages[b]           INT2 page    -> INT2 pool
    - otherwise                                  recent page  -> window pool
* ``seq_lens`` int32 [B]: tokens in the cache (the last page may be partly filled).
* ``int2_pages`` int32 [B]: INT2 pages of the sequence (explicit, not derived from the length, so a
  prefix-cache hit may bring in more INT2 pages than the steady-state rule and a short recent window).

Token position t lives in logical page t // P at offset t % P.  The recent window starts on a page
boundary at S0 + P*int2_pages[b].  Steady state (``int2_pages_for``): int2_pages = (T - S0 - W) // P
when T >= S0 + W, so the recent window holds W .. W+P-1 tokens; when it reaches W+P the oldest recent
page (full) is quantized into a fresh INT2 page (``write.migrate_pages``, one launch for all layers and
requests), the block-table entry is swapped and the window page is freed.

Prefix sharing: sink pages and INT2 pages are immutable once full and can be shared by refcount
(a cached prefix ends on an INT2 page boundary); recent pages are never shared.  Padding rows of a
batch simply have seq_len 0.  Page ids are int32 (2^31 pages is far beyond any pool).

Rotations: ``k_rotation`` float32/bfloat16 [Hr, D, D] with Hr = H (per KV head) or 1 (shared per
layer).  Keys are stored as (k - mu_K) @ R_K, queries are rotated q @ R_K[kv_head(q)]; values arrive
rotated.  Sink/recent rows are stored rotated too, so the whole cache lives in one space.

One ``PoolGeometry`` describes a pool for both of its users: the engine (engine/block_pool.py: allocation,
byte budget, prefix cache) and the kernels.  It lives here, in the lower layer, so that the page rules and
byte counts are written once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import ConfigError
from ..memory import width_summary
from ..quant import SplitWidth
from .split_keys import row_bytes


# A float16 scale and a uint8 zero point (quant.py).
METADATA_BYTES_PER_GROUP = 3
# The pool's tensors, in PagedKVPool's field order.
POOL_TENSORS = ("k_codes", "v_codes", "k_scale", "v_scale", "k_zero", "v_zero", "k_win", "v_win")
# A geometry that names no bits per layer is an INT2 cache.
KERNEL_BITS = 2
# The code widths the Triton kernels read and write: keys at 2, 3, 4, 5 or 8 bits, values at 2, 3, 4 or 8 (5 bits is a
# key width only: allocation.KEY_WIDTHS).  The CUDA decode kernel reads fewer (int2_cuda.WIDTHS; a layer it does not
# read runs the Triton kernel: decode.int2_kernel_choice).  kernel_error names layers at any other width.
KERNEL_KEY_WIDTHS = (2, 3, 4, 5, 8)
KERNEL_VALUE_WIDTHS = (2, 3, 4, 8)


def kernel_widths_text() -> str:
    """The Triton kernels' widths in words, for errors: "keys at 2, 3, 4, 5 or 8 bits, values at 2, 3, 4 or 8"."""
    def words(widths):
        return f"{', '.join(map(str, widths[:-1]))} or {widths[-1]}"
    return f"keys at {words(KERNEL_KEY_WIDTHS)} bits, values at {words(KERNEL_VALUE_WIDTHS)}"


@dataclass(frozen=True)
class PoolGeometry:
    """The shape of a paged KV pool: what the engine allocates and accounts, and what the kernels address.

    ``k_bits[l]`` / ``v_bits[l]``: bits per code of layer l's quantized key / value pages (default: 2 on every
    layer; ``v_bits`` None: as ``k_bits``).  16 on every layer is a plain cache in ``window_dtype``: window pages
    only, no sink, no quantized pages.
    ``k_split[l]``: layer l's keys at two widths (quant.SplitWidth, whose narrow width is ``k_bits[l]``; their rows'
    layout: split_keys.py), or None (default: every layer) where every channel is at ``k_bits[l]``.
    ``layer_windows[l]``: layer l's sliding window (a query at position p attends to keys in (p - window, p]), or
    None where it attends to the whole sequence (default: every layer; models.layer_windows).  Every layer
    stores every token: the windows change what attention reads, not the layout.  Settings that
    no pool can use raise ``ConfigError``; :meth:`kernel_error` says what the kernels need beyond that.

    Byte counts cover K and V.  ``*_bytes_per_token`` are per token, KV head and layer; ``*_page_bytes``
    per page across every layer (a page id addresses the same slot in each layer's tensor).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int = 128
    group_size: int = 128
    page_size: int = 16
    sink_size: int = 64
    recent_size: int = 256
    k_bits: tuple[int, ...] | None = None
    window_dtype: torch.dtype = torch.bfloat16
    layer_windows: tuple[int | None, ...] | None = None
    v_bits: tuple[int, ...] | None = None
    k_split: tuple[SplitWidth | None, ...] | None = None

    def __post_init__(self):
        k_bits = (KERNEL_BITS,) * self.num_layers if self.k_bits is None else tuple(self.k_bits)
        v_bits = k_bits if self.v_bits is None else tuple(self.v_bits)
        object.__setattr__(self, "k_bits", k_bits)  # frozen: normalize once, here
        object.__setattr__(self, "v_bits", v_bits)
        for name, bits in (("k_bits", k_bits), ("v_bits", v_bits)):
            if len(bits) != self.num_layers:
                raise ValueError(f"{name} has {len(bits)} entries for {self.num_layers} layers")
        bits = k_bits + v_bits
        splits = (None,) * self.num_layers if self.k_split is None else tuple(self.k_split)
        object.__setattr__(self, "k_split", splits)
        if len(splits) != self.num_layers:
            raise ValueError(f"k_split has {len(splits)} entries for {self.num_layers} layers")
        for layer, (split, kb) in enumerate(zip(splits, k_bits)):
            if split is not None:
                split.check(self.head_dim)
                if split.bits != kb or split.hi_dims % 8:
                    raise ValueError(f"layer {layer}'s split keys {split} need k_bits {split.bits} (not {kb}) and a "
                                     "multiple of 8 channels at the wider width")
        windows = (None,) * self.num_layers if self.layer_windows is None else tuple(self.layer_windows)
        object.__setattr__(self, "layer_windows", windows)
        if len(windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(windows)} entries for {self.num_layers} layers")
        if any(w is not None and w < 1 for w in windows):
            raise ValueError(f"sliding windows must be at least 1 token: {windows}")
        if self.quantizes:
            if 16 in bits:
                raise ConfigError("the paged engine cannot mix BF16 layers into a quantized cache; "
                                 "recalibrate without a layer policy that stores layers at 16 bits")
            if self.sink_size % self.page_size:
                raise ConfigError(f"sink_size {self.sink_size} must be a multiple of page_size {self.page_size}",
                                  "sink_size", "page_size")
            if self.head_dim % self.group_size:
                raise ConfigError(f"group_size {self.group_size} must divide the head dim {self.head_dim}",
                                  "group_size")

    def kernel_error(self) -> str | None:
        """None when the Triton/CUDA kernels can address this pool, else why not."""
        d, g, p = self.head_dim, self.group_size, self.page_size
        if self.quantizes:
            widths = "/".join(f"K{k}V{v}" for k, v in sorted(set(zip(self.k_bits, self.v_bits)))
                              if k not in KERNEL_KEY_WIDTHS or v not in KERNEL_VALUE_WIDTHS)
            if widths:
                return f"the artifact stores layers at {widths} (the kernels read {kernel_widths_text()})"
        if any(s is not None and (s.hi_dims > d // 2 or s.hi_dims & (s.hi_dims - 1)) for s in self.k_split):
            return (f"split keys need a power of two channels, at most D/2 = {d // 2}, at the wider width "
                    f"({self.width_summary()})")
        if d % 4 or d % g or g < d // 4:
            return f"group size {g} must divide head dim {d} and be >= D/4 = {d // 4}"
        if d & (d - 1) or d < 32:
            return f"head dim must be a power of two >= 32, got {d}"
        if p not in (16, 32, 64):
            return f"page size must be 16, 32 or 64, got {p}"
        if self.window_dtype != torch.bfloat16:
            return "the kernels read BF16 windows"
        return None

    def as_bf16(self) -> "PoolGeometry":
        """The same pool stored without quantization (what a BF16 cache of these layers would hold)."""
        return replace(self, k_bits=(16,) * self.num_layers, v_bits=(16,) * self.num_layers, k_split=None)

    # ---- pages -----------------------------------------------------------------------------------
    @property
    def quantizes(self) -> bool:
        return any(b < 16 for b in self.k_bits)

    @property
    def num_groups(self) -> int:
        return self.head_dim // self.group_size

    @property
    def sink_pages(self) -> int:
        """Logical pages before the first quantized page (none in a BF16 cache: nothing follows them)."""
        return self.sink_size // self.page_size if self.quantizes else 0

    def pages_for(self, seq_len: int) -> int:
        """Pages of a sequence of ``seq_len`` tokens (the last one possibly partly filled)."""
        return -(-seq_len // self.page_size)

    def int2_pages_for(self, seq_len: int) -> int:
        """Steady-state quantized pages of a sequence of ``seq_len`` tokens (see the module docstring)."""
        if not self.quantizes:
            return 0
        return max(0, (seq_len - self.sink_size - self.recent_size) // self.page_size)

    def window_pages_per_seq(self) -> int:
        """Window pages one sequence holds at most (sink + recent, plus one page in flight)."""
        if not self.quantizes:
            raise ValueError("a BF16 cache has no bound on window pages per sequence")
        return self.sink_pages + -(-(self.recent_size + self.page_size - 1) // self.page_size) + 1

    def decode_pages(self, seq_len: int) -> tuple[int, int]:
        """(window pages, quantized pages) one sequence holds at most while it grows to ``seq_len`` tokens."""
        pages, q = self.pages_for(seq_len), self.int2_pages_for(seq_len)
        if self.quantizes:  # sink + recent + the page in flight during migration
            return min(pages, self.window_pages_per_seq()), q
        return pages - q, q

    # ---- bytes -----------------------------------------------------------------------------------
    def window_bytes_per_token(self) -> int:
        return 2 * self.head_dim * self.window_dtype.itemsize

    def quant_bytes_per_token(self, layer: int = 0) -> int:
        """Layer ``layer``'s quantized bytes, keys and values: codes + a float16 scale and a uint8 zero point per
        group (0 in a BF16 cache)."""
        if not self.quantizes:
            return 0
        return sum(self.code_bytes(layer)) + 2 * METADATA_BYTES_PER_GROUP * self.num_groups

    def code_bytes(self, layer: int) -> tuple[int, int]:
        """(key, value) bytes of one stored row of layer ``layer``'s codes (a split key row's tail included)."""
        split = self.k_split[layer]
        keys = row_bytes(split, self.head_dim) if split is not None else self.head_dim * self.k_bits[layer] // 8
        return keys, self.head_dim * self.v_bits[layer] // 8

    def layer_widths(self, layer: int) -> tuple[int, int]:
        """(key bits, value bits) of layer ``layer``'s quantized pages (split keys: the narrow width, which the
        whole row is read at; ``k_split[layer]`` has the rest)."""
        return self.k_bits[layer], self.v_bits[layer]

    def key_widths(self) -> list:
        """Each layer's key width: its k_bits, or its quant.SplitWidth."""
        return [s if s is not None else b for s, b in zip(self.k_split, self.k_bits)]

    @property
    def has_split_keys(self) -> bool:
        return any(s is not None for s in self.k_split)

    def width_summary(self) -> str:
        """The layers' widths in words, e.g. "K3V2 x 20, K4V2 x 4" (split keys: "K4x16+2V2")."""
        return width_summary(self.key_widths(), self.v_bits)

    @property
    def window_page_bytes(self) -> int:
        return self.num_layers * self.num_kv_heads * self.page_size * self.window_bytes_per_token()

    @property
    def quant_page_bytes(self) -> int:
        per_token = sum(self.quant_bytes_per_token(layer) for layer in range(self.num_layers))
        return self.num_kv_heads * self.page_size * per_token

    def sequence_bytes(self, seq_len: int) -> int:
        """Pool bytes one sequence of ``seq_len`` tokens occupies (whole pages)."""
        q = self.int2_pages_for(seq_len)
        return (self.pages_for(seq_len) - q) * self.window_page_bytes + q * self.quant_page_bytes

    def layer_read_bytes(self, seq_len: int, layer: int = 0) -> int:
        """Bytes of one layer's cache a decode step reads for a sequence of ``seq_len`` tokens: the quantized
        history's codes, scales and zero points plus the window rows (tokens, not whole pages); a windowed layer reads only
        the positions its window reaches."""
        quant_tokens = self.int2_pages_for(seq_len) * self.page_size
        window = self.layer_windows[layer]
        first = 0 if window is None else max(0, seq_len - window)
        sink_end = self.sink_size if quant_tokens else 0
        quant_read = max(0, sink_end + quant_tokens - max(first, sink_end))
        return self.num_kv_heads * (quant_read * self.quant_bytes_per_token(layer)
                                    + (seq_len - first - quant_read) * self.window_bytes_per_token())


@dataclass
class PagedKVPool:
    """The pool's tensors for every layer (layout: the module docstring).

    The layers are stacked, so every layer stores its keys at one width and its values at one width (the geometry's
    ``k_bits`` / ``v_bits``, each uniform over the layers; they may differ from each other).  The engine keeps
    one tensor per layer instead and hands the kernels one-layer pools or per-layer views, whose widths may differ
    from layer to layer (engine/kernel_attention.PoolView).

    Shapes:
        k_codes: uint8 [L, N_int2, Hkv, P, D * k_bits / 8], v_codes likewise at v_bits; k_scale, v_scale: float16
        and k_zero, v_zero: uint8 [L, N_int2, Hkv, P, NG]; k_win, v_win: bfloat16 [L, N_win, Hkv, P, D].
    """

    geometry: PoolGeometry
    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_zero: torch.Tensor
    v_zero: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor

    @classmethod
    def allocate(cls, geom: PoolGeometry, num_int2_pages: int, num_window_pages: int,
                 device: torch.device | str = "cpu", fill_nan: bool = False) -> "PagedKVPool":
        """A pool of ``num_int2_pages`` INT2 and ``num_window_pages`` window pages (at least one each) for the
        kernels; ValueError when they cannot address ``geom``.  ``fill_nan``: scales and windows start as NaN and
        zero points as 255 (tests: a read of an unwritten slot shows), else zeros."""
        why = geom.kernel_error()
        if why is None and (len(set(geom.key_widths())) > 1 or len(set(geom.v_bits)) > 1):
            why = (f"a stacked pool holds every layer at one key width and one value width, not "
                   f"{geom.width_summary()} (allocate one pool per layer)")
        if why is not None:  # this pool exists for the kernels
            raise ValueError(why)
        l, h, p, d, ng = geom.num_layers, geom.num_kv_heads, geom.page_size, geom.head_dim, geom.num_groups
        nq, nw = max(num_int2_pages, 1), max(num_window_pages, 1)
        # a BF16 cache (16 bits) gets INT2-sized placeholders the kernels never read
        k_bytes, v_bytes = geom.code_bytes(0) if geom.quantizes else (d // 4, d // 4)
        codes = lambda n: torch.zeros(l, nq, h, p, n, dtype=torch.uint8, device=device)  # noqa: E731
        fill = float("nan") if fill_nan else 0.0
        scale = lambda: torch.full((l, nq, h, p, ng), fill, dtype=torch.float16, device=device)  # noqa: E731
        zero = lambda: torch.full((l, nq, h, p, ng), 255 if fill_nan else 0, dtype=torch.uint8,  # noqa: E731
                                  device=device)
        win = lambda: torch.full((l, nw, h, p, d), fill, dtype=torch.bfloat16, device=device)  # noqa: E731
        return cls(geom, codes(k_bytes), codes(v_bytes), scale(), scale(), zero(), zero(), win(), win())

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name)[i] for name in POOL_TENSORS}


@dataclass
class PagedBatch:
    """Block tables and lengths of a batch of sequences (see the module docstring)."""

    block_table: torch.Tensor  # int32 [B, max_pages]
    seq_lens: torch.Tensor  # int32 [B]
    int2_pages: torch.Tensor  # int32 [B]

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    def to(self, device) -> "PagedBatch":
        return PagedBatch(self.block_table.to(device), self.seq_lens.to(device), self.int2_pages.to(device))


def plan_batch(geom: PoolGeometry, seq_lens: list[int], int2_pages: list[int] | None = None,
               generator: torch.Generator | None = None, spare_int2: int = 0,
               spare_window: int = 0) -> tuple[PagedBatch, int, int]:
    """Assign physical pages for a batch (shuffled when ``generator`` is given, to exercise indirection).

    Returns the batch and the numbers of INT2 and window pages a pool needs (plus the spares asked for).
    """
    p, sp = geom.page_size, geom.sink_pages
    if int2_pages is None:
        int2_pages = [geom.int2_pages_for(n) for n in seq_lens]
    pages = [-(-n // p) for n in seq_lens]
    for n, q in zip(seq_lens, int2_pages):
        if q and n < geom.sink_size + q * p:
            raise ValueError(f"sequence of {n} tokens cannot hold {q} INT2 pages after the sink")
    kinds = []  # per sequence: list of (is_int2) per logical page
    n_int2 = n_win = 0
    for np_, q in zip(pages, int2_pages):
        k = [sp <= i < sp + q for i in range(np_)]
        kinds.append(k)
        n_int2 += sum(k)
        n_win += len(k) - sum(k)
    tot_q, tot_w = n_int2 + spare_int2, n_win + spare_window
    perm_q = torch.randperm(max(tot_q, 1), generator=generator) if generator is not None else torch.arange(max(tot_q, 1))
    perm_w = torch.randperm(max(tot_w, 1), generator=generator) if generator is not None else torch.arange(max(tot_w, 1))
    table = torch.zeros(len(seq_lens), max(max(pages, default=1), 1), dtype=torch.int32)
    iq = iw = 0
    for b, k in enumerate(kinds):
        for i, is_q in enumerate(k):
            if is_q:
                table[b, i] = perm_q[iq]
                iq += 1
            else:
                table[b, i] = perm_w[iw]
                iw += 1
    batch = PagedBatch(table, torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(int2_pages, dtype=torch.int32))
    return batch, tot_q, tot_w


def token_slots(geom: PoolGeometry, batch: PagedBatch, seq_ids: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat destination slots (page * P + offset) of tokens, in the window pool or the INT2 pool.

    Args:
        geom, batch: the pool's geometry and the sequences' block tables and INT2 page counts.
        seq_ids: each token's row in ``batch``.
        positions: each token's position in its sequence.
    Shapes:
        seq_ids, positions: [T].
    Returns:
        (win_slot, int2_slot), int32 [T] each, -1 where the token does not go to that pool.
    """
    p, sp = geom.page_size, geom.sink_pages
    seq_ids, positions = seq_ids.long(), positions.long()
    lpage = positions // p
    phys = batch.block_table.long()[seq_ids, lpage]
    q = batch.int2_pages.long()[seq_ids]
    is_q = (lpage >= sp) & (lpage < sp + q)
    slot = phys * p + positions % p
    minus = torch.full_like(slot, -1)
    return torch.where(is_q, minus, slot).int(), torch.where(is_q, slot, minus).int()


def metadata_slot(offset, page_size: int):
    """Where the token at ``offset`` in its page keeps its scales and zero points, in groups of NG (module
    docstring): slot 2 (j mod 8) + j // 8 for token j of each 16 tokens; pages of other sizes (the torch path's)
    keep token order.  Works on ints and integer tensors (kernels.common.meta_slot is the kernels' copy)."""
    if page_size % 16:
        return offset
    return offset - offset % 16 + 2 * (offset % 8) + (offset % 16) // 8


def clip_indices(ratios: torch.Tensor | float, head_dim: int, shape: tuple[int, ...]) -> torch.Tensor:
    """int32 clip indices floor(c*D) clamped to [0, D-1] (quant.clip_index semantics), broadcast to shape."""
    r = torch.as_tensor(ratios, dtype=torch.float64)
    idx = (r * head_dim).floor().clamp(0, head_dim - 1).to(torch.int32)
    return idx.expand(shape).contiguous()
