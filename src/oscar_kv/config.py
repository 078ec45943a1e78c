"""Settings shared by the library, the CLI and the server, defined once.  Imports nothing heavy: the CLI's
``--help`` reads it."""

from __future__ import annotations

from typing import Literal, get_args

KVCacheDtype = Literal["bf16", "int2", "int4", "int8"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)  # what the generate() cache stores (cache.py)
KV_CACHE_BITS = {d: 16 if d == "bf16" else int(d[3:]) for d in KV_CACHE_DTYPES}  # bits per element of the history
ServedKVCacheDtype = Literal["bf16", "int2"]
SERVED_KV_CACHE_DTYPES: tuple[str, ...] = get_args(ServedKVCacheDtype)  # what the paged engine serves


def check_window_sizes(sink_size: int, recent_size: int, page_size: int) -> None:
    """The BF16 windows and the page of a KV cache (the generate() cache's and the engine's)."""
    if sink_size < 0 or recent_size < 0 or page_size < 1:
        raise ValueError("sink and recent sizes must be >= 0 and the page size >= 1")
