"""The INT2 history splits of decode attention as a hand-written CUDA kernel (``int2_history.cu``).

Why not Triton for this part: the Triton kernel (decode.py) needs ~3.1 SASS instructions per code and stays
instruction-bound at ~45% of the copy bandwidth (benchmarks/NOTES.md).  Its lowering replicates the 4 GQA
query rows to the MMA's 16, gathers the value operand byte by byte from shared memory and converts codes
through layout shuffles.  In CUDA each thread builds its mma.sync fragments straight from the bytes it loaded
(the MMA's k order is free, so the query fragment is permuted to match), the keys and the values are both
the A operand (tokens or channels as rows, the <= 8 query heads as the n8 columns), and movmatrix moves the
probabilities from the key MMA's output layout to the value MMA's input layout.

The kernel is compiled at first use by NVRTC, through torch (``torch.cuda._compile_kernel``), once per
device and geometry.  It computes splits 1.. of ``decode._int2_decode_kernel`` (same partial-output layout,
same math: codes as float16 1024 + c*4^s, exact offset removal); split 0, the BF16 window, stays in Triton,
and decode._merge combines them.  Supported: head dim 128, one quantization group per head (G = D), at most
8 query heads per KV head, constant key centering.  Anything else runs the Triton kernel.
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path

import torch

from .layout import PagedBatch, PoolGeometry

SOURCE = Path(__file__).with_name("int2_history.cu")
NUM_WARPS = 4
TOKENS_PER_ROUND = NUM_WARPS * 32  # one 32-token step per warp
MAX_PAGES = 2048  # page ids one CTA keeps in shared memory: its chunk is at most MAX_PAGES pages
MIN_BLOCKS = 3  # CTAs per SM the register budget is set for (168 registers; 4 x 128 spilled: run C1)
_MAGIC = 0x64006400  # float16 1024 in both halves (see int2_history.cu)


def unsupported(device: torch.device, geom: PoolGeometry, gqa: int, rope) -> str | None:
    """Why the CUDA kernel cannot run this call (None: it can).  Called on every decode call: the shape checks
    are plain comparisons, the device and compiler checks are cached per device and geometry."""
    if device.type != "cuda":
        return "not a CUDA device"
    if geom.head_dim != 128 or geom.group_size != geom.head_dim:
        return f"head dim {geom.head_dim} / group {geom.group_size} (the kernel is written for D = G = 128)"
    if not 1 <= gqa <= 8:
        return f"{gqa} query heads per KV head (at most 8)"
    if rope is not None:
        return "position-aware key centering"
    return _device_error(_index(device), geom.head_dim, geom.page_size, gqa, geom.sink_pages)


@functools.lru_cache(maxsize=None)
def _device_error(device_index: int, head_dim: int, page_size: int, gqa: int, sink_pages: int) -> str | None:
    """The torch build, the GPU and one compile, once per device and geometry: a machine whose NVRTC fails gets
    the reason (and the Triton kernel), not a crash."""
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no torch.cuda._compile_kernel"
    if torch.version.hip:
        return "ROCm"
    if torch.cuda.get_device_capability(device_index) < (8, 0):
        return "needs compute capability >= 8.0 (mma.sync m16n8k16, movmatrix)"
    try:
        _kernel(device_index, head_dim, page_size, gqa, sink_pages, MIN_BLOCKS)
    except Exception as e:  # NVRTC missing or refusing the source: reported, never fatal under "auto"
        warnings.warn(f"oscar-kv: the CUDA INT2 decode kernel did not compile ({e!r:.300}); using the Triton kernel")
        return f"NVRTC compilation failed: {e!r:.300}"
    return None


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int, head_dim: int, page_size: int, gqa: int, sink_pages: int, min_blocks: int):
    defines = dict(D=head_dim, P=page_size, GQA=gqa, SINK_PAGES=sink_pages, NWARPS=NUM_WARPS,
                   MAX_PAGES=MAX_PAGES, MIN_BLOCKS=min_blocks)
    source = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + SOURCE.read_text()
    with torch.cuda.device(device_index):
        return torch.cuda._compile_kernel(source, "oscar_int2_history")


def split_plan(int2_tokens: int, programs_per_split: int, page_size: int, sms: int, per_sm: int) -> tuple[int, int]:
    """(splits, chunk) for the history: chunks of whole 32-token steps per warp (multiples of TOKENS_PER_ROUND) of
    at least two rounds and at most MAX_PAGES pages.  The CTAs (splits x programs_per_split) fill whole waves of
    per_sm x sms slots: one wave (rounded down) when the history allows it; when MAX_PAGES forces more splits, the
    count in [forced, 2 x forced] whose last wave is fullest (64K x 32 sequences: 3 splits, 1.94 waves, not 2 and
    1.29)."""
    if int2_tokens <= 0:
        return 1, TOKENS_PER_ROUND
    pairs = max(programs_per_split, 1)
    slots = per_sm * sms
    forced = -(-int2_tokens // (MAX_PAGES * page_size // TOKENS_PER_ROUND * TOKENS_PER_ROUND))
    splits = min(max(1, slots // pairs), max(1, int2_tokens // (2 * TOKENS_PER_ROUND)))
    if splits < forced:
        def fill(s: int) -> float:
            waves = pairs * s / slots
            return waves / math.ceil(waves)

        splits = max(range(forced, 2 * forced + 1), key=lambda s: (fill(s), -s))
    chunk = -(-int2_tokens // splits)
    chunk = -(-chunk // TOKENS_PER_ROUND) * TOKENS_PER_ROUND
    return -(-int2_tokens // chunk), chunk


def history(qr: torch.Tensor, layer: dict[str, torch.Tensor], geom: PoolGeometry, batch: PagedBatch,
            po: torch.Tensor, pl: torch.Tensor, splits: int, chunk: int, qk_scale: float) -> None:
    """Write splits 1..splits of po [B, Hq, splits + 1, D] / pl [B, Hq, splits + 1] (float32) from the rotated,
    unscaled float32 query qr [B, Hq, D]; qk_scale = sm_scale * log2(e)."""
    bsz, hq, d = qr.shape
    h = geom.num_kv_heads
    if bsz == 0 or splits == 0:
        return
    kc, km, vc, vm = layer["k_codes"], layer["k_meta"], layer["v_codes"], layer["v_meta"]
    if kc.stride() != vc.stride() or km.stride() != vm.stride() or kc.stride(-1) != 1 or km.stride(-1) != 1:
        raise ValueError("the CUDA INT2 kernel needs K and V pools of one contiguous layout")
    bt = batch.block_table
    kernel = _kernel(_index(qr.device), d, geom.page_size, hq // h, geom.sink_pages, MIN_BLOCKS)
    kernel(grid=(splits, h, bsz), block=(NUM_WARPS * 32, 1, 1),
           args=[qr, kc, km, vc, vm, bt, batch.int2_pages, po, pl, float(qk_scale),
                 qr.stride(0), qr.stride(1), kc.stride(0), kc.stride(1), km.stride(0), km.stride(1), bt.stride(0),
                 po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1), chunk, _MAGIC])
