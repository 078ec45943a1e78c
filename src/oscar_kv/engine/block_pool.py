"""The paged KV pool: BF16 window pages + INT2 history pages, with a prefix cache and LRU eviction.

Layout (the same tensor layout as ``kernels/layout.py``, kept per layer so that layers stored at
another precision by the artifact's layer policy simply get wider codes):

  window pool   k_win[l], v_win[l]    window dtype (BF16) [NW, H, P, D]     sink and recent pages
  INT2 pool     k_codes[l], v_codes[l] uint8   [NQ, H, P, D*bits/8]          stride-packed (quant.py)
                k_meta[l],  v_meta[l]  float16 [NQ, H, P, 2*D/G]             [..., :NG] scale, [..., NG:] min

A sequence's logical page i (positions [iP, (i+1)P)) lives in the INT2 pool when
sink_pages <= i < sink_pages + int2_pages, in the window pool otherwise.  Everything the cache
stores counts toward the budget: INT2 codes, their 16-bit metadata and the BF16 windows.

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

log = logging.getLogger(__name__)

WINDOW, QUANT = "window", "quant"


@dataclass(frozen=True)
class PoolSpec:
    """Geometry of the stored cache.  ``layer_bits[l] == 16`` everywhere means a plain BF16 cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    group_size: int
    page_size: int
    sink_size: int
    recent_size: int
    layer_bits: tuple[int, ...]
    window_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if self.quantizes:
            if 16 in self.layer_bits:
                raise ValueError("the paged engine cannot mix BF16 layers into a quantized cache; "
                                 "recalibrate without a layer policy that stores layers at 16 bits")
            if self.sink_size % self.page_size:
                raise ConfigError(f"sink_size {self.sink_size} must be a multiple of page_size {self.page_size}",
                                  "sink_size", "page_size")
            if self.head_dim % self.group_size:
                raise ConfigError(f"group_size {self.group_size} must divide the head dim {self.head_dim}", "group_size")

    @property
    def quantizes(self) -> bool:
        return any(b < 16 for b in self.layer_bits)

    @property
    def sink_pages(self) -> int:
        return self.sink_size // self.page_size if self.quantizes else 0

    @property
    def num_groups(self) -> int:
        return self.head_dim // self.group_size

    def int2_pages_for(self, seq_len: int) -> int:
        """Steady-state quantized pages of a sequence of ``seq_len`` tokens (cache.py's migration rule)."""
        if not self.quantizes:
            return 0
        return max(0, (seq_len - self.sink_size - self.recent_size) // self.page_size)

    @property
    def window_page_bytes(self) -> int:
        elem = torch.empty(0, dtype=self.window_dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.page_size * self.head_dim * elem

    @property
    def quant_page_bytes(self) -> int:
        if not self.quantizes:
            return 0
        per_row = sum(self.head_dim * b // 8 + 2 * 2 * self.num_groups for b in self.layer_bits)  # codes + fp16 scale/min
        return 2 * self.num_kv_heads * self.page_size * per_row

    def window_pages_per_seq(self) -> int:
        """Window pages one sequence holds at most (sink + recent, plus one page in flight)."""
        if not self.quantizes:
            raise ValueError("a BF16 cache has no bound on window pages per sequence")
        return self.sink_pages + -(-(self.recent_size + self.page_size - 1) // self.page_size) + 1

    def bytes_for(self, seq_len: int) -> int:
        """Pool bytes one sequence of ``seq_len`` tokens occupies (whole pages)."""
        pages = -(-seq_len // self.page_size)
        q = self.int2_pages_for(seq_len)
        return (pages - q) * self.window_page_bytes + q * self.quant_page_bytes


@dataclass(frozen=True)
class PoolPlan:
    window_pages: int
    quant_pages: int
    spec: PoolSpec

    @property
    def window_bytes(self) -> int:
        return self.window_pages * self.spec.window_page_bytes

    @property
    def quant_bytes(self) -> int:
        return self.quant_pages * self.spec.quant_page_bytes

    @property
    def total_bytes(self) -> int:
        return self.window_bytes + self.quant_bytes

    @property
    def capacity_tokens(self) -> int:
        return (self.window_pages + self.quant_pages) * self.spec.page_size


def plan_pool(spec: PoolSpec, budget_bytes: int, max_model_len: int, max_num_seqs: int) -> PoolPlan:
    """Split a byte budget into window and INT2 pages.

    A BF16 cache is all window pages.  A quantized cache gives the window pool the share that
    max-model-len sequences need (sink + recent vs. history bytes), clamped to hold at least one
    sequence's window and at most ``max_num_seqs`` of them; the rest is INT2 pages.
    """
    if budget_bytes <= 0:
        raise ConfigError("kv_cache_memory must be positive", "kv_cache_memory")
    if not spec.quantizes:
        return PoolPlan(budget_bytes // spec.window_page_bytes, 0, spec)
    per_seq = spec.window_pages_per_seq()
    q_long = spec.int2_pages_for(max_model_len)
    w_long = -(-max_model_len // spec.page_size) - q_long
    share = w_long * spec.window_page_bytes / max(spec.bytes_for(max_model_len), 1)
    window = int(budget_bytes * share) // spec.window_page_bytes
    window = min(max(window, min(per_seq, budget_bytes // spec.window_page_bytes)), per_seq * max_num_seqs)
    quant = (budget_bytes - window * spec.window_page_bytes) // spec.quant_page_bytes
    return PoolPlan(window, quant, spec)


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
    """The KV tensors of both pools and their allocators."""

    def __init__(self, plan: PoolPlan, device: torch.device | str = "cpu"):
        s = plan.spec
        self.spec, self.plan, self.device = s, plan, torch.device(device)
        h, p, d, ng = s.num_kv_heads, s.page_size, s.head_dim, s.num_groups
        nw, nq = max(plan.window_pages, 1), max(plan.quant_pages, 1)
        # torch.empty: pages are only ever read where they were written.
        self.k_win = [torch.empty(nw, h, p, d, dtype=s.window_dtype, device=device) for _ in range(s.num_layers)]
        self.v_win = [torch.empty(nw, h, p, d, dtype=s.window_dtype, device=device) for _ in range(s.num_layers)]
        self.k_codes, self.v_codes, self.k_meta, self.v_meta = [], [], [], []
        if s.quantizes:
            for bits in s.layer_bits:
                for codes, meta in ((self.k_codes, self.k_meta), (self.v_codes, self.v_meta)):
                    codes.append(torch.empty(nq, h, p, d * bits // 8, dtype=torch.uint8, device=device))
                    meta.append(torch.empty(nq, h, p, 2 * ng, dtype=torch.float16, device=device))
        self.window = PageAllocator(plan.window_pages, WINDOW)
        self.quant = PageAllocator(plan.quant_pages, QUANT)
        self.hit_tokens = 0
        self.queried_tokens = 0

    def allocator(self, kind: str) -> PageAllocator:
        return self.window if kind == WINDOW else self.quant

    def kind_of(self, logical_page: int, int2_pages: int) -> str:
        sp = self.spec.sink_pages
        return QUANT if sp <= logical_page < sp + int2_pages else WINDOW

    def tensor_bytes(self) -> int:
        tensors = self.k_win + self.v_win + self.k_codes + self.v_codes + self.k_meta + self.v_meta
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def used_tokens(self) -> int:
        return (self.window.used + self.quant.used) * self.spec.page_size

    @property
    def used_bytes(self) -> int:
        return self.window.used * self.spec.window_page_bytes + self.quant.used * self.spec.quant_page_bytes

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
        s = self.spec
        max_q = s.int2_pages_for(tokens)
        pages, q = [], 0
        for i in range((tokens - 1) // s.page_size):
            kind = self.kind_of(i, max_q)
            if s.quantizes and i >= s.sink_pages and kind == WINDOW:
                break  # recent-window pages are never shared
            page = self.allocator(kind).lookup(seq.page_hash(i, s.page_size) + kind.encode())
            if page is None:
                break
            pages.append((kind, page))
            q += kind == QUANT
        for kind, page in pages:
            self.allocator(kind).ref(page)
        seq.pages = [p for _, p in pages]
        seq.int2_pages = q
        seq.num_computed = len(pages) * s.page_size
        seq.registered_pages = len(pages)
        seq.prefix_hit_tokens = seq.num_computed

    def register_sealed(self, seq) -> None:
        """Offer ``seq``'s newly sealed pages (full, final form) to the prefix cache."""
        s = self.spec
        full = seq.num_computed // s.page_size
        if s.quantizes:
            sealed = min(full, s.sink_pages) if seq.int2_pages == 0 else s.sink_pages + seq.int2_pages
            sealed = min(sealed, full)
        else:
            sealed = full
        for i in range(seq.registered_pages, sealed):
            kind = self.kind_of(i, seq.int2_pages)
            self.allocator(kind).register(seq.pages[i], seq.page_hash(i, s.page_size) + kind.encode())
        seq.registered_pages = max(seq.registered_pages, sealed)

    def release_seq(self, seq) -> None:
        for i, page in enumerate(seq.pages):
            self.allocator(self.kind_of(i, seq.int2_pages)).release(page)
        seq.pages, seq.int2_pages, seq.num_computed, seq.registered_pages = [], 0, 0, 0

    def reset_prefix_cache(self) -> None:
        self.window.clear_cache()
        self.quant.clear_cache()
