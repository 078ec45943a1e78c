"""Triton kernels over the paged KV pool (layout.py) and their torch specification (reference.py).

Importing this package does not import Triton; the kernel modules do:
  write.py    fused write path (rotate K, clip, quantize, pack, scatter) and page migration
  common.py   the attention kernels' shared jit helpers, split plan and merge
  decode.py   paged decode attention: INT2 mixed [sink | INT2 | recent] and the BF16 baseline
  extend.py   chunked-prefill / prefix-hit attention over the paged history + the chunk itself
  materialized_extend.py  the same for long chunks: history copied to float16 once, then flash attention
"""

from .layout import PagedBatch, PagedKVPool, PoolGeometry, clip_indices, plan_batch, token_slots

__all__ = ["PagedBatch", "PagedKVPool", "PoolGeometry", "clip_indices", "plan_batch", "token_slots",
           "triton_available"]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True
