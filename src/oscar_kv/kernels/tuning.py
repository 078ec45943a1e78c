"""The kernels' launch parameters, in one place: tile sizes, warps, pipeline stages, split targets, and where the
prefill path switches from the extend kernel to the materialized flash path.

Each kernel takes these as keyword defaults (``TUNING.<name>``); benchmarks and sweeps pass their own per call
(``bench attention``'s sweep, ``benchmarks/cuda_int2_sweep.py``).  The values were chosen on an H100
(benchmarks/NOTES.md: "Kernel notes", "Prefill with the float16-materialized path").  Compile-time constants of the
CUDA INT2 kernel (warps per CTA, tokens per round, the most splits and pages) live in int2_cuda.py beside its source.

``kernel_choice`` is how a caller or an environment variable picks between a fast kernel and its fallback (the INT2
decode kernel, the prefill attention).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


def kernel_choice(env: str, backend: str | None, preferred: str, fallback: str, why_not: Callable[[], str | None],
                  name: str) -> tuple[str, str | None]:
    """(preferred, None) or (fallback, why not preferred).  ``backend`` (default: $env, else "auto"): "auto" takes
    ``preferred`` where ``why_not()`` finds nothing against it, ``preferred`` raises where it cannot run (``name``
    says what in the message), ``fallback`` is taken as asked."""
    backend = backend or os.environ.get(env, "auto")
    if backend not in ("auto", preferred, fallback):
        raise ValueError(f"backend must be one of auto, {preferred}, {fallback} (the caller's or ${env}), "
                         f"got {backend!r}")
    if backend == fallback:
        return fallback, f"{env} or the caller asked for {fallback}"
    why = why_not()
    if why and backend == preferred:
        raise ValueError(f"{name} cannot run this call: {why}")
    return (fallback, why) if why else (preferred, None)


@dataclass(frozen=True)
class KernelTuning:
    # INT2 decode (Triton): history tokens per tile (at least a page), window tokens per tile, warps, stages, and
    # programs per SM the split plan aims for (fewer when batch x KV heads is small: each split is short then)
    decode_block_n: int = 256
    decode_block_w: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    decode_split_target: int = 8
    decode_split_target_small: int = 4  # when batch x KV heads <= 8
    # at head dim 256: 8 warps (4 spill ~470 bytes a thread under the 128-register cap, 8 about what D = 128 does at
    # 4; sm_90 builds, benchmarks/kernel_smem.py; not yet timed)
    decode_num_warps_d256: int = 8
    # BF16 paged decode (Triton)
    bf16_decode_block: int = 64
    bf16_decode_num_warps: int = 4
    bf16_decode_num_stages: int = 2
    # split plans of the Triton decode kernels: a split is at least this many tiles
    split_min_tiles: int = 4
    # extend (chunked prefill, short chunks): query rows per tile, warps, stages, programs per SM
    extend_block_m: int = 64
    extend_num_warps: int = 4
    extend_num_stages: int = 2
    extend_split_target: int = 2
    # at head dim 256: 32 keys per tile (64 x 256 bf16 K and V tiles, two stages, and the two query halves came
    # to 192 KiB of shared memory; 32 keys: 128 KiB) and 8 warps (the [64, 256] float32 accumulator: as many
    # registers per thread as D = 128 at 4 warps).  benchmarks/kernel_smem.py prints what each compiles to
    extend_block_n_d256: int = 32
    extend_num_warps_d256: int = 8  # (not yet timed)
    # write path: tokens per program; warps with a rotation (its float32 D x D operand spills out of 4 warps'
    # registers) and without
    write_block_t: int = 16
    write_num_warps_rotating: int = 8
    # at head dim 256 (the rotation in four row slices): sm_90 builds spill 8 KB a thread at 4 warps, 376 B at 8, 16 B
    # at 16 (benchmarks/kernel_smem.py; not yet timed)
    write_num_warps_rotating_d256: int = 16
    write_num_warps: int = 4
    # decode steps of at most this many rows (tokens x KV heads) store them with kernels/window_write.py (one
    # program per token, KV head and 32 key columns); larger ones keep write_kv's 16-token programs.  H200, D = 128
    # (benchmarks/write_decode.py, NOTES run WW1): 4.1 / 4.6 us against 6.6 / 7.1 at 8 / 64 rows, even at 256
    window_write_max_rows: int = 128
    migrate_num_warps: int = 4
    # prefill chunks of at least this many tokens take the materialized flash path (one pass over the history,
    # then flash attention), shorter ones the extend kernel; per-position centering makes the extend kernel ~13x
    # dearer per query x key (its term runs on CUDA cores), hence its lower bound
    flash_min_tokens: int = 64
    flash_min_tokens_rope: int = 8
    # decode-step GEMVs (kernels/gemv.py) take at most this many tokens; tiles from a sweep of Qwen3-8B and
    # Llama-3.1-8B projections (benchmarks/gemm_small_batch.py --triton-sweep): output rows per program, K per
    # step, warps, stages; one token, then 2..gemv_max_rows tokens
    gemv_max_rows: int = 16
    gemv_one_block_n: int = 4
    gemv_one_block_k: int = 2048
    gemv_one_num_warps: int = 4
    gemv_one_num_stages: int = 3
    gemv_block_n: int = 64
    gemv_block_k: int = 256
    gemv_num_warps: int = 4
    gemv_num_stages: int = 4


TUNING = KernelTuning()
