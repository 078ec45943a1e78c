"""The paged KV pool: BF16 window pages + INT2 history pages, with a prefix cache and LRU eviction.

Layout (the same tensor layout as ``kernels/layout.py``, kept per layer so that layers stored at
another precision by the artifact's layer policy simply get wider codes; the shape, page rules and
byte counts are ``kernels.layout.PoolGeometry``):

  window pool   k_win[l], v_win[l]    window dtype (BF16) [NW, H, P, D]     sink and recent pages
  INT2 pool     k_codes[l], v_codes[l] uint8   [NQ, H, P, D*bits/8]          stride-packed (quant.py), each side
                                                                               at its layer's width
                k_scale[l], v_scale[l] float16 [NQ, H, P, D/G]               each group's scale
                k_zero[l],  v_zero[l]  uint8   [NQ, H, P, D/G]               and zero point (quant.py)

A sequence's logical page i (positions [iP, (i+1)P)) lives in the INT2 pool when
sink_pages <= i < sink_pages + int2_pages, in the window pool otherwise.  Everything the cache
stores counts toward the budget: INT2 codes, their scales and zero points and the BF16 windows.

Prefix cache: a page is *sealed* once it is full and will never change form (sink pages, INT2
pages; with a BF16 cache every full page).  Sealed pages are registered under the chained hash of
the token prefix they end; a new request takes the longest registered chain of its prompt (see
``docs/serving.md`` for why recent-window pages are not shared).  Pages are reference counted;
a released sealed page stays cached and is evicted least-recently-used when a free page is needed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..kernels.layout import PoolGeometry
from .block_table import BlockTables

log = logging.getLogger(__name__)

WINDOW, QUANT = "window", "quant"


@dataclass(frozen=True)
class PoolPlan:
    window_pages: int
    quant_pages: int
    geometry: PoolGeometry

    @property
    def window_bytes(self) -> int:
        return self.window_pages * self.geometry.window_page_bytes

    @property
    def quant_bytes(self) -> int:
        return self.quant_pages * self.geometry.quant_page_bytes

    @property
    def total_bytes(self) -> int:
        return self.window_bytes + self.quant_bytes

    @property
    def capacity_tokens(self) -> int:
        return (self.window_pages + self.quant_pages) * self.geometry.page_size

    def holds(self, seq_len: int) -> bool:
        """Whether one sequence of ``seq_len`` tokens fits, with its window page in flight during migration."""
        g = self.geometry
        quant = g.int2_pages_for(seq_len)
        window = g.pages_for(seq_len) - quant + (1 if g.quantizes else 0)
        return self.window_pages >= window and self.quant_pages >= quant


def plan_pool(geometry: PoolGeometry, budget_bytes: int, max_model_len: int, max_num_seqs: int) -> PoolPlan:
    """Split a byte budget into window and INT2 pages.

    A BF16 cache is all window pages.  A quantized cache gives the window pool the share that
    max-model-len sequences need (sink + recent vs. history bytes), clamped to hold at least one
    sequence's window and at most ``max_num_seqs`` of them; the rest is INT2 pages.
    """
    if budget_bytes <= 0:
        raise ConfigError("kv_cache_memory must be positive", "kv_cache_memory")
    if not geometry.quantizes:
        return PoolPlan(budget_bytes // geometry.window_page_bytes, 0, geometry)
    per_seq = geometry.window_pages_per_seq()
    q_long = geometry.int2_pages_for(max_model_len)
    w_long = geometry.pages_for(max_model_len) - q_long
    share = w_long * geometry.window_page_bytes / max(geometry.sequence_bytes(max_model_len), 1)
    window = int(budget_bytes * share) // geometry.window_page_bytes
    window = min(max(window, min(per_seq, budget_bytes // geometry.window_page_bytes)), per_seq * max_num_seqs)
    quant = (budget_bytes - window * geometry.window_page_bytes) // geometry.quant_page_bytes
    return PoolPlan(window, quant, geometry)


class PageAllocator:
    """Reference counts, a free list, and the prefix cache (hash -> page, LRU of unreferenced pages)."""

    def __init__(self, num_pages: int, kind: str):
        self.kind, self.num_pages = kind, num_pages
        self.refcount = [0] * num_pages
        self.free: deque[int] = deque(range(num_pages))
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached pages nobody references, oldest first
        self.hash_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self.evictions = 0

    @property
    def available(self) -> int:
        return len(self.free) + len(self.lru)

    @property
    def used(self) -> int:
        return self.num_pages - self.available

    @property
    def cached(self) -> int:
        return len(self.lru)

    def allocate(self, n: int) -> list[int]:
        if n > self.available:
            raise MemoryError(f"{self.kind} pool: {n} pages asked, {self.available} available")
        out = []
        for _ in range(n):
            if self.free:
                page = self.free.popleft()
            else:
                page, _ = self.lru.popitem(last=False)
                del self.page_of[self.hash_of.pop(page)]
                self.evictions += 1
            self.refcount[page] = 1
            out.append(page)
        return out

    def ref(self, page: int) -> None:
        if self.refcount[page] == 0:
            self.lru.pop(page)
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        if self.refcount[page] <= 0:
            raise RuntimeError(f"{self.kind} page {page} released more often than referenced")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self.hash_of:
                self.lru[page] = None
            else:
                self.free.append(page)

    def register(self, page: int, key: bytes) -> None:
        if key not in self.page_of and page not in self.hash_of:
            self.page_of[key] = page
            self.hash_of[page] = key

    def lookup(self, key: bytes) -> int | None:
        return self.page_of.get(key)

    def clear_cache(self) -> None:
        """Forget every cached hash; unreferenced cached pages become free."""
        while self.lru:
            page, _ = self.lru.popitem(last=False)
            self.free.append(page)
        self.hash_of.clear()
        self.page_of.clear()


class PagePool:
    """The KV tensors of both pools, their allocators, and the running sequences' block tables (``tables``)."""

    def __init__(self, plan: PoolPlan, device: torch.device | str = "cpu"):
        g = plan.geometry
        self.geometry, self.plan, self.device = g, plan, torch.device(device)
        h, p, d, ng = g.num_kv_heads, g.page_size, g.head_dim, g.num_groups
        nw, nq = max(plan.window_pages, 1), max(plan.quant_pages, 1)
        # torch.empty: pages are only ever read where they were written.
        self.k_win = [torch.empty(nw, h, p, d, dtype=g.window_dtype, device=device) for _ in range(g.num_layers)]
        self.v_win = [torch.empty(nw, h, p, d, dtype=g.window_dtype, device=device) for _ in range(g.num_layers)]
        self.k_codes, self.v_codes, self.k_scale, self.v_scale, self.k_zero, self.v_zero = [], [], [], [], [], []
        if g.quantizes:
            for layer in range(g.num_layers):
                for nbytes, codes, scale, zero in zip(g.code_bytes(layer), (self.k_codes, self.v_codes),
                                                      (self.k_scale, self.v_scale), (self.k_zero, self.v_zero)):
                    codes.append(torch.empty(nq, h, p, nbytes, dtype=torch.uint8, device=device))
                    scale.append(torch.empty(nq, h, p, ng, dtype=torch.float16, device=device))
                    zero.append(torch.empty(nq, h, p, ng, dtype=torch.uint8, device=device))
        self.window = PageAllocator(plan.window_pages, WINDOW)
        self.quant = PageAllocator(plan.quant_pages, QUANT)
        self.tables = BlockTables(device)
        # read per sequence and step: the geometry's properties recompute them on every access
        self.sink_pages, self.quantizes = g.sink_pages, g.quantizes
        self.hit_tokens = 0
        self.queried_tokens = 0

    def allocator(self, kind: str) -> PageAllocator:
        return self.window if kind == WINDOW else self.quant

    def kind_of(self, logical_page: int, int2_pages: int) -> str:
        sp = self.sink_pages
        return QUANT if sp <= logical_page < sp + int2_pages else WINDOW

    def tensor_bytes(self) -> int:
        tensors = (self.k_win + self.v_win + self.k_codes + self.v_codes + self.k_scale + self.v_scale + self.k_zero
                   + self.v_zero)
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def used_tokens(self) -> int:
        return (self.window.used + self.quant.used) * self.geometry.page_size

    @property
    def used_bytes(self) -> int:
        return self.window.used * self.geometry.window_page_bytes + self.quant.used * self.geometry.quant_page_bytes

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def all_free(self) -> bool:
        """True when no page is referenced (cached unreferenced pages count as free)."""
        return self.window.used == 0 and self.quant.used == 0

    # ---- prefix cache --------------------------------------------------------------------------
    def match_prefix(self, seq, enabled: bool = True) -> None:
        """Attach the longest cached prefix of ``seq``'s tokens (full pages, at least one token left
        to compute, no more INT2 pages than the finished prompt would hold)."""
        tokens = seq.num_tokens
        if not enabled:
            return
        g = self.geometry
        max_q = g.int2_pages_for(tokens)
        pages, q = [], 0
        for i in range((tokens - 1) // g.page_size):
            kind = self.kind_of(i, max_q)
            if g.quantizes and i >= g.sink_pages and kind == WINDOW:
                break  # recent-window pages are never shared
            page = self.allocator(kind).lookup(seq.page_hash(i, g.page_size) + kind.encode())
            if page is None:
                break
            pages.append((kind, page))
            q += kind == QUANT
        for kind, page in pages:
            self.allocator(kind).ref(page)
        seq.pages = [p for _, p in pages]
        seq.int2_pages = q
        seq.num_computed = len(pages) * g.page_size
        seq.registered_pages = len(pages)
        seq.prefix_hit_tokens = seq.num_computed

    def register_sealed(self, seq) -> None:
        """Offer ``seq``'s newly sealed pages (full, final form) to the prefix cache."""
        g = self.geometry
        full = seq.num_computed // g.page_size
        if self.quantizes:
            sealed = min(full, self.sink_pages) if seq.int2_pages == 0 else self.sink_pages + seq.int2_pages
            sealed = min(sealed, full)
        else:
            sealed = full
        for i in range(seq.registered_pages, sealed):
            kind = self.kind_of(i, seq.int2_pages)
            self.allocator(kind).register(seq.pages[i], seq.page_hash(i, g.page_size) + kind.encode())
        seq.registered_pages = max(seq.registered_pages, sealed)

    def release_seq(self, seq) -> None:
        for i, page in enumerate(seq.pages):
            self.allocator(self.kind_of(i, seq.int2_pages)).release(page)
        self.tables.release(seq)
        seq.pages, seq.int2_pages, seq.num_computed, seq.registered_pages = [], 0, 0, 0

    def reset_prefix_cache(self) -> None:
        self.window.clear_cache()
        self.quant.clear_cache()
