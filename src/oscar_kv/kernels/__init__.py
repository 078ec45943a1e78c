"""Triton kernels over the paged KV pool (layout.py) and their torch specification (reference.py).

Importing this package does not import Triton (a CPU install has none: README, Install); the kernel modules do,
and only the GPU paths import them, after ``triton_available()`` or ``require_triton()``:
  split_keys.py  the stored row of keys at two widths (quant.SplitWidth), in torch
  write.py    fused write path (rotate K, clip, quantize, pack, scatter) and page migration
  common.py   the attention kernels' shared jit helpers, split plan and merge
  decode.py   paged decode attention: INT2 mixed [sink | INT2 | recent]
  bf16_decode.py  the BF16 paged decode baseline, written the same way
  extend.py   chunked-prefill / prefix-hit attention over the paged history + the chunk itself
  materialized_extend.py  the same for long chunks: history copied to float16 once, then flash attention
  elementwise.py, gemv.py, gumbel.py  the executor's fused steps, its small-batch GEMV, sampling (the fused
              steps' torch references, which the CPU runs: elementwise_reference.py)
  pdl.py      programmatic dependent launch of the decode step's kernels (sm_90+; no Triton import)
"""

import functools

from .layout import PagedBatch, PagedKVPool, PoolGeometry, clip_indices, plan_batch, token_slots

__all__ = ["PagedBatch", "PagedKVPool", "PoolGeometry", "clip_indices", "plan_batch", "token_slots",
           "TRITON_MISSING", "require_triton", "triton_available"]

# why a GPU path cannot run, and what to do about it
TRITON_MISSING = "Triton is not installed (pip install triton, or pip install -e '.[kernels]')"


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports (asked once per process)."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def require_triton(what: str) -> None:
    """Raise ModuleNotFoundError saying how to install Triton unless it imports; ``what`` needs it."""
    if not triton_available():
        raise ModuleNotFoundError(f"{what} need Triton: {TRITON_MISSING}", name="triton")
