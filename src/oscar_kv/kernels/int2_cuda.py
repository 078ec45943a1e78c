"""Decode attention over the mixed pool as one hand-written CUDA launch (``int2_decode.cu``).

Why not Triton for this: the Triton kernel (decode.py) needs ~3.1 SASS instructions per code and stays
instruction-bound at ~45% of the copy bandwidth (benchmarks/NOTES.md).  Its lowering replicates the 4 GQA
query rows to the MMA's 16, gathers the value operand byte by byte from shared memory and converts codes
through layout shuffles.  In CUDA each thread builds its mma.sync fragments straight from the bytes it loaded
(the MMA's k order is free, so the query fragment is permuted to match), the keys and the values are both
the A operand (tokens or channels as rows, the <= 8 query heads as the n8 columns), and movmatrix moves the
probabilities from the key MMA's output layout to the value MMA's input layout.

One launch does what the Triton path does in four (query rotation, window split, history splits, merge): each
CTA rotates its query group's rows, takes a share of the BF16 window and a chunk of the INT2 history, and the
last CTA of a (sequence, KV head) to finish merges the partials (an atomic counter per pair, left at zero).  At
128K tokens and batch 1 the separate launches cost ~15 of ~60 us (benchmarks/NOTES.md, "decode attention as one
CUDA launch").

Keys at 3, 4 or 8 bits and values at 3 or 4 (a layer's ``PoolGeometry.layer_widths``: K3V2, K8V3, K4V4, ...) run
variants compiled with KBITS = 3, 4 or 8 and VBITS = 3 or 4: the same MMAs, query fragments and offset removal, the
codes' bits gathered from the INT3 high-bit plane or the INT4 upper bytes into the same float16 1024 + c*4^s
(int2_decode.cu, key_a for keys, value_a for values), or an INT8 key byte put under the float16 exponent of 1024
(key_byte_pair); keys and values address their rows with their own strides.  The INT2 variant (K2V2) keeps the
registers and spills it had before the wider ones existed (benchmarks/cuda_int2_sass.py compares SASS; KBITS = 2 and
VBITS = 2 compile to the same PTX as before).  Values at 8 bits run the Triton kernels (decode.int2_kernel_choice).

More than 8 query heads per KV head (GLM-4: 16) run as query groups of at most 8: ``query_groups`` CTAs per (split,
KV head), each with its share of the heads, reading the same codes (the second read mostly from L2).  Sliding-window
layers (``window``) compile with SLIDING: the history splits cover the window only, the sink and recent sub-tiles
below it are skipped and the tokens below it masked.  Calls whose splits are short (``cta_plan``: batch 1, few KV heads
at small batches, a 4096-token window) run CTAs of 8 warps instead of 4 at head dim 128 (WIDE_WARPS's comment).

The kernel is compiled at first use by NVRTC, through torch (``torch.cuda._compile_kernel``), once per
device, geometry, key width and dtype (both CTA shapes at once, where the variant has two).  Math as ``decode._int2_decode_kernel`` (codes as float16 1024 + c*4^s, exact
offset removal; the window's query as bfloat16 hi + lo parts).  Supported: head dim 64, 128 or 256, one
quantization group per head (G = D) or, at D = 256, two (G = 128), up to MAX_GQA query heads per KV head, full or
sliding-window layers, float32 / bfloat16 / float16 queries, constant key
centering or per-position centering over at most MAX_ROPE_PAIRS pairs, full or partial rotary (the term
q . RoPE_p(mu_pre) as one more small MMA per 16 keys; int2_decode.cu, rope_terms; the layout places each pair's
two channels, pair_lo / pair_hi), and split key rows (split_keys.py) at D = 64 or 128 (``split_error``).  Anything else
runs the Triton kernels.

Split keys compile with SPLIT_M / SPLIT_HB / KTAIL (``split_defines``): the page's plain rows are streamed as a plain
page's, the wide part's low bits are scored by the same A operands against the query masked to it, its upper bits by
one more MMA per 16 of its channels, and each sub-tile's tails (scale, zero point, upper-bit planes) go to shared
memory by cp.async one step ahead (int2_decode.cu, the SPLIT_M paragraph).  H200, one layer of Qwen3-8B's attention:
``4x16+2`` in 1.14-1.41x K2V2's time for 1.10x its bytes (benchmarks/NOTES.md, run SK3).

A token's metadata is a float16 scale and a uint8 zero point per group (quant.py); a thread loads the scales of its
two tokens (g, g + 8: side by side in the pool, layout.metadata_slot) as one word and their zero points as another,
and never forms the minimum -s z 2^-F: a logit is s (c - z 2^-F sum(q)) with 2^-F sum(q) made once per query, and
the values' sum(p s z) is scaled by -2^-F once at the end (int2_decode.cu, load_meta / scale_zero).

Head dim 256 (Gemma 3) compiles with D = 256 and NG = D / G metadata groups per token: G = 256 (one scale and zero
point, as at D = 64 and 128) or G = 128 (two: NG = 2; code slices 0, 1 are group 0's channels, slices 2, 3 group
1's, so the key MMAs keep two logit accumulators and the value MMAs take each group's p * scale).  Its accumulators
and window tiles are twice D = 128's: 2 CTAs per SM (255 registers), the key MMAs' query fragments read from shared
memory, 16-token steps (``step16``), and the query rotated before the launch (decode.rotate_query; in the kernel each
CTA would read the whole 128 KB R^T: ROTATE_IN_KERNEL_MAX_DIM).  Other groups at D = 256 (G = 64) run the Triton
kernels.  H200, CUDA graphs, bfloat16, per call (with the rotation launch; Triton beside): 1 KV head x 128K tokens
35.7 us (37.3), 1 x 32K x 8 sequences 34.5 (54.0), 4 KV heads x 128K 45.0 (106.2), 8 x 32K x 8 137.8 (314.0); at one
(sequence, KV head) pair 1 CTA per SM instead of 2 gave 30.1 (the last CTA merges half as many partials), at 4 pairs
53.3 instead of 45.0: the split plan is not tuned for D = 256 yet.
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path

import torch

from .layout import PagedBatch, PoolGeometry
from .pdl import launch_cuda
from .split_keys import row_bytes, tail_bytes

SOURCE = Path(__file__).with_name("int2_decode.cu")
NUM_WARPS = 4
TOKENS_PER_ROUND = NUM_WARPS * 32  # one 32-token step per warp
MAX_PAGES = 2048  # page ids one CTA keeps in shared memory: its chunk is at most MAX_PAGES pages
# Calls whose plan fills at most one CTA per SM (few KV heads at batch 1: GLM-4's 2, a 4096-token window) leave each
# SM 4 warps, and a warp's history loop is a chain of dependent steps (~1 us a 32-token step): CTAs of 8 warps halve
# each warp's share of a split.  Their warps' outputs (s_acc) take twice the shared memory, so they keep 512 page ids
# (static shared memory stays under 48 KB); registers hold one such CTA per SM.  Head dim 128 only (at 64 the
# query rotation's m16 tiles need D / NWARPS >= 16 rows a warp; 256 holds 2 CTAs of 4 warps already), plain keys,
# constant centering or the term over 8 pairs (its tables for more pass the 48 KB).
WIDE_WARPS = 8
WIDE_MAX_PAGES = 512
# They pay less once per call (the merge over half the splits, the query rotation over twice the warps) and more per
# step (their loop ran 1.05-1.25x the 4-warp one's time where each warp had 43 or more steps).  H200, one layer, R8 and
# R0, Qwen3-8B / GLM-4 / Mistral-7B geometries: where the 4-warp plan gave a warp at most 32 steps (chunks of <= 4096
# tokens) 8 warps took 0.75-0.99x the time (GLM-4 at 32K batch 1: 21.8 against 25.7 us), from 43 steps 1.03-1.25x;
# chunks of one round (not two) kept short histories even (benchmarks/NOTES.md, run W1)
WIDE_MAX_CHUNK = 4096
WIDE_MIN_ROUNDS = 1
HEAD_DIMS = (64, 128, 256)
KEY_BITS = (2, 3, 4, 5, 8)  # key code widths with a compiled variant (KBITS)
VALUE_BITS = (2, 3, 4)  # value code widths with a compiled variant (VBITS)
MAX_GQA_PER_CTA = 8  # query heads one CTA takes: one n8 MMA column block
MAX_GQA = 64
WIDTHS = tuple((k, v) for k in KEY_BITS for v in VALUE_BITS)  # (key bits, value bits) of the layers the kernel reads
# CTAs per SM the register budget is set for: 3 (168 registers) beat 4 (128 registers, spilling) at batch 8 and 32
# (benchmarks/NOTES.md, "first GPU run of the kernel")
MIN_BLOCKS = 3
# With the position-aware term over 8 pairs, 2 CTAs per SM (203 registers, no spill) beat 3 (168, spilled):
# 1.04-1.16x constant centering's time instead of 1.14-1.32x; over 16 or 32 pairs 3 stay faster
# (benchmarks/NOTES.md, "2 CTAs per SM for R = 8")
ROPE_MIN_BLOCKS = {8: 2}
# Head dim 64 holds half the accumulators and query fragments: 4 CTAs fit in 128 registers without spilling
MIN_BLOCKS_D64 = 4
ROPE_MIN_BLOCKS_D64: dict[int, int] = {}
# ... except keys at 3-8 bits with the position-aware term over 8 pairs, which spill there since the merge became
# rolled loops (run M1-M6): at 3 CTAs (157-167 registers, no spill) K3 ran 0.84-0.99x, K5 0.85-0.94x and K4 0.97-1.02x
# the 4-CTA kernel before that change, where the 4-CTA one ran 1.19-1.28x (K4, K5), and K8 0.66-0.79x the 4-CTA one
# (one H200, 32K / 128K x batch 1 / 8 / 32; benchmarks/NOTES.md, run H1)
WIDE_KEYS_ROPE_MIN_BLOCKS_D64 = {8: 3}
# Values at 3 or 4 bits hold twice INT2's value bytes in flight (SubTile.vx).  Head dim 64: at 4 CTAs per SM (128
# registers) they spill 0-56 bytes a thread with keys at 2-4 bits, 120-208 with the RoPE term, 164-340 with 8-bit
# keys; at 3 (148-168 registers) none (sm_90, nvcc 13; not timed).  Head dim 128: at 3 CTAs they spill 28-104 bytes
# (76-212 with the RoPE term), at 2 none (203-237 registers), and 2 were faster at every point timed (H100, constant
# centering, 32K / 128K x batch 1 / 8: K4V3 23.5 / 58.4 / 104.9 / 371.3 us against 28.4 / 65.5 / 117.6 / 408.6 at 3;
# K3V3, K4V4 and K8V3 alike; benchmarks/NOTES.md, run E23)
WIDE_VALUES_MIN_BLOCKS_D64 = 3
WIDE_VALUES_MIN_BLOCKS_D128 = 2
# Head dim 256 holds twice D = 128's accumulators and code bytes: 2 CTAs per SM, 255 registers (sm_90, nvcc 13).
# With 32-token steps INT2 spilled 8 bytes a thread (G = 128; none at G = 256), 52 with a sliding window, 184 / 32 / 32
# with the RoPE term over 8 / 16 / 32 pairs, keys at 3 or 4 bits ~270 and at 8 bits ~900; with 16-token steps (step16)
# none of them spills.  Values at 3 or 4 bits (16 more registers of code bytes in flight) spill 4-12 bytes with keys at
# 3 or 4 bits and the RoPE term over 8 pairs, and at G = 128 16-28 with 8-bit keys, 104-128 with 8-bit keys and the term
# over 8 pairs; none of the others spills.
MIN_BLOCKS_D256 = 2


def min_blocks(rope_pairs: int = 0, head_dim: int = 128, kbits: int = 2, vbits: int = 2, split: bool = False) -> int:
    """CTAs per SM the kernel is compiled and planned for, given the head dim, the position-aware pairs it
    visits (0: none) and the key and value widths.  The 3- and 4-bit key variants use the INT2 variant's budgets: at
    128K on the H100, 2 CTAs per SM instead of 3 are within 4% of them at batch 1 and 8 (constant centering; their
    sm_90 builds spill 0-48 bytes a thread there, 80-224 with the RoPE term over 16 or 32 pairs; benchmarks/NOTES.md,
    "3- and 4-bit keys in the CUDA kernel").  The 8-bit variant at head dim 128 holds four times INT2's key bytes in
    flight: at 3 CTAs per SM it spills 188 bytes a thread, at 2 none (216 registers); the 5-bit one 2.5 times: 124
    bytes at 3 (NVRTC 13, sm_90), none at 2 (205 registers).  Values at 3 or 4 bits: 3 CTAs
    at head dim 64, 2 at head dim 128 (WIDE_VALUES_MIN_BLOCKS_D64's comment); at head dim 64 keys wider than 2 bits
    with the term over 8 pairs 3 (WIDE_KEYS_ROPE_MIN_BLOCKS_D64).  Split keys (``split``) hold the first
    part's query fragments and logits beside the INT2 ones: the wide values' budgets (SPLIT_MIN_BLOCKS)."""
    if head_dim == 256:
        return MIN_BLOCKS_D256
    if split:
        return SPLIT_MIN_BLOCKS[head_dim]
    if kbits in (5, 8) and head_dim == 128:
        return 2
    if head_dim == 64:
        if vbits != 2:
            return WIDE_VALUES_MIN_BLOCKS_D64
        if kbits != 2 and rope_pairs in WIDE_KEYS_ROPE_MIN_BLOCKS_D64:
            return WIDE_KEYS_ROPE_MIN_BLOCKS_D64[rope_pairs]
        return ROPE_MIN_BLOCKS_D64.get(rope_pairs, MIN_BLOCKS_D64)
    if vbits != 2:
        return WIDE_VALUES_MIN_BLOCKS_D128
    return ROPE_MIN_BLOCKS.get(rope_pairs, MIN_BLOCKS)


def step16(head_dim: int, kbits: int = 2, rope_pairs: int = 0, sliding: bool = False) -> bool:
    """Whether the variant's warps take 16-token INT2 steps (one sub-tile, loads one sub-tile ahead) instead of 32:
    every head dim 256 variant.  Their 32-token steps spill (MIN_BLOCKS_D256's comment) and were not faster where they
    do not (H200, G = 128, CUDA graphs: INT2 at 128K x 1 and 4 KV heads, 32K x 8 sequences x 1 and 8 KV heads 49.7 /
    57.5 / 48.1 / 144.1 us with 16-token steps, 50.7 / 60.4 / 49.3 / 154.1 with 32; K4V2 at 128K x 4 KV heads 60.0 /
    72.7).  The chunks stay multiples of TOKENS_PER_ROUND (then two rounds of 16-token steps).  ``kbits``,
    ``rope_pairs``, ``sliding``: the variant (every one takes them at D = 256, whatever the value width too)."""
    return head_dim == 256


# Split key rows (split_keys.py): narrow widths with a variant, and CTAs per SM.  They hold the first part's query
# fragments (qh, qu: 8-16 registers at D = 128), its logits and its offsets beside the INT2 variant's, so they take the
# budgets of the variants with wider values rather than the INT2 one's
SPLIT_KEY_BITS = (2, 3, 4)
SPLIT_MIN_BLOCKS = {64: WIDE_VALUES_MIN_BLOCKS_D64, 128: WIDE_VALUES_MIN_BLOCKS_D128}


def split_error(split, head_dim: int) -> str | None:
    """Why the kernel cannot read key rows split at ``split`` (a quant.SplitWidth; None: plain rows) at this head dim
    (None: it can): head dim 64 or 128, the narrow part at 2, 3 or 4 bits, the first part 8 .. D/2 channels (a power
    of two) at most 8 bits wide."""
    if split is None:
        return None
    m = split.hi_dims
    if head_dim not in SPLIT_MIN_BLOCKS or split.bits not in SPLIT_KEY_BITS or not 8 <= m <= head_dim // 2 or \
            m & (m - 1) or split.hi_bits > 8:
        return (f"keys split {split} at head dim {head_dim} (the CUDA kernel reads split keys at head dim 64 or 128, "
                f"the rest at {', '.join(map(str, SPLIT_KEY_BITS))} bits, 8 .. D/2 channels at up to 8 bits)")
    return None


def split_defines(split) -> tuple[int, int, int]:
    """(SPLIT_M, SPLIT_HB, KTAIL) of a split key width, (0, 0, 0) for plain rows: the compiled variant's macros."""
    if split is None:
        return 0, 0, 0
    return split.hi_dims, split.hi_bits, tail_bytes(split)


# Above this head dim the query arrives rotated (decode.rotate_query, one small launch before the kernel): in the
# kernel every CTA would read the whole float16 R^T, 128 KB at D = 256 (+18 us per call on the H200 at 1 to 64
# (sequence, KV head) pairs, whose one wave is ~264 CTAs; the launch costs ~3-5)
ROTATE_IN_KERNEL_MAX_DIM = 128
MAX_SPLITS = 512  # CTAs per (sequence, KV head), all merged by the last one (one wave here is <= 3 x SMs CTAs)
# The history's chunks are at least sqrt(MERGE_BALANCE_TOKENS x tokens) long.  The last CTA of a (sequence, KV head)
# merges every split's partial, so past some count more splits cost more merge than they save loop: with ~0.6 us per
# 128-token step and ~0.1 us per merged split (E19's stamps) the sum is least near sqrt(tokens / 21) splits, and the
# fastest plans measured at batch 1 had 33 splits at 32K and 66 at 128K (GLM-4, 2 KV heads), 33 at 32K and 16 at 8K
# (Qwen3-8B, 8 KV heads): chunks of about sqrt(32 x tokens) (benchmarks/NOTES.md, runs E19, E21, E23).  Where one wave
# already holds fewer splits (more sequences or KV heads) the bound does not bind.  0: one wave, whatever the merge.
# Head dim 256 keeps one wave: its 16-token steps make the loop dearer against the merge, and with the bound one KV head
# took 35.6 / 47.3 us at 32K / 128K against one wave's 31.3 / 43.6 (E23).
MERGE_BALANCE_TOKENS = 32
MIN_ROUNDS = 2  # a chunk is at least this many rounds of 32-token steps, one per warp (WIDE_MIN_ROUNDS: 8 warps)
STREAM_EVICT_FIRST_L2S = 2.0  # code loads are evict_first while a call's INT2 bytes are <= this many L2s
MAX_ROPE_PAIRS = 32  # the position-aware term's shared tables for more pairs pass the 48 KB static limit
_MAGIC = 0x64006400  # float16 1024 in both halves (see int2_decode.cu)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def width_error(k_bits: int, v_bits: int) -> str | None:
    """Why the kernel cannot read a layer stored at these (key, value) widths (None: it can)."""
    if (k_bits, v_bits) in WIDTHS:
        return None
    return (f"layer stored at K{k_bits}V{v_bits} (keys at {k_bits} bits, values at {v_bits}): the CUDA kernel reads "
            f"keys at {', '.join(map(str, KEY_BITS[:-1]))} or {KEY_BITS[-1]} bits and values at "
            f"{', '.join(map(str, VALUE_BITS[:-1]))} or {VALUE_BITS[-1]}")


@functools.lru_cache(maxsize=None)  # asked on every decode call
def query_groups(gqa: int) -> int:
    """CTAs that share a KV head's ``gqa`` query heads: the fewest that divide them into groups of at most
    MAX_GQA_PER_CTA (16 -> 2 of 8, 12 -> 2 of 6, 11 -> 11 of 1)."""
    groups = -(-gqa // MAX_GQA_PER_CTA)
    while gqa % groups:
        groups += 1
    return groups


def group_error(head_dim: int, group_size: int) -> str | None:
    """Why the kernel cannot read a pool of this head dim and metadata group (None: it can): one group per head at
    D = 64, 128 or 256, or two of 128 channels at D = 256 (Gemma 3's calibration default)."""
    if head_dim in HEAD_DIMS and (group_size == head_dim or (head_dim, group_size) == (256, 128)):
        return None
    return (f"head dim {head_dim} / group {group_size} (the kernel is written for D = G = 64, 128 or 256, and for "
            f"D = 256 with G = 128)")


def shape_error(geom: PoolGeometry, gqa: int, rope, dtype: torch.dtype = torch.bfloat16,
                widths: tuple[int, int] = (2, 2), split=None) -> str | None:
    """The checks of ``unsupported`` that need no GPU: widths, split keys, head dim and group, query heads, RoPE pairs,
    dtype."""
    why = width_error(*widths) or split_error(split, geom.head_dim)
    if why is not None:
        return why
    why = group_error(geom.head_dim, geom.group_size)
    if why is not None:
        return why
    if not 1 <= gqa <= MAX_GQA:
        return f"{gqa} query heads per KV head (at most {MAX_GQA})"
    if rope is not None and rope.pairs.shape[1] > MAX_ROPE_PAIRS:
        return f"position-aware key centering over {rope.pairs.shape[1]} pairs (at most {MAX_ROPE_PAIRS})"
    if dtype not in _DTYPES:
        return f"{dtype} queries (float32, bfloat16 or float16)"
    return None


def unsupported(device: torch.device, geom: PoolGeometry, gqa: int, rope,
                dtype: torch.dtype = torch.bfloat16, widths: tuple[int, int] = (2, 2), split=None) -> str | None:
    """Why the CUDA kernel cannot run this call (None: it can).  Called on every decode call: the shape checks
    are plain comparisons (``shape_error``), the device and compiler checks are cached per device, geometry and
    widths.  ``widths``: the layer's (key, value) code widths; ``split``: its quant.SplitWidth if its keys are split."""
    if device.type != "cuda":
        return "not a CUDA device"
    why = shape_error(geom, gqa, rope, dtype, widths, split)
    if why is not None:
        return why
    return _device_error(_index(device), geom.head_dim, geom.page_size, gqa // query_groups(gqa), geom.sink_pages,
                         widths[0], geom.num_groups, widths[1], split_defines(split))


@functools.lru_cache(maxsize=None)
def _device_error(device_index: int, head_dim: int, page_size: int, gqa: int, sink_pages: int,
                  kbits: int = 2, groups: int = 1, vbits: int = 2,
                  split: tuple[int, int, int] = (0, 0, 0)) -> str | None:
    """The torch build, the GPU and one compile, once per device and geometry (``gqa``: query heads per CTA): a
    machine whose NVRTC fails gets the reason (and the Triton kernel), not a crash."""
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no torch.cuda._compile_kernel"
    if torch.version.hip:
        return "ROCm"
    if torch.cuda.get_device_capability(device_index) < (8, 0):
        return "needs compute capability >= 8.0 (mma.sync m16n8k16, movmatrix)"
    try:
        _kernel(device_index, head_dim, page_size, gqa, sink_pages,
                min_blocks(0, head_dim, kbits, vbits=vbits, split=bool(split[0])), 1, 1, kbits=kbits, groups=groups,
                vbits=vbits, split=split)
    except Exception as e:  # NVRTC missing or refusing the source: reported, never fatal under "auto"
        warnings.warn(f"oscar-kv: the CUDA decode kernel for {kbits}-bit keys and {vbits}-bit values"
                      f"{' (split keys)' if split[0] else ''} did not compile ({e!r:.300}); using the Triton kernel")
        return f"NVRTC compilation failed: {e!r:.300}"
    return None


@functools.lru_cache(maxsize=None)
def _l2_bytes(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def stream_evict_first(int2_bytes: int, device_index: int) -> bool:
    """Whether a call that streams ``int2_bytes`` of INT2 history loads its codes as L2 evict_first: it saves
    the write-back of what L2 holds (at most one L2 of lines), so it pays only for streams of up to about two
    L2s; beyond, losing L2 reuse of the 256-byte blocks costs more (128K: -4.3 us at batch 1, +2-3% at batch 8
    and 32 on the H100; benchmarks/NOTES.md, "evict_first chosen per call")."""
    return int2_bytes <= STREAM_EVICT_FIRST_L2S * _l2_bytes(device_index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int, head_dim: int, page_size: int, gqa: int, sink_pages: int, min_blocks: int,
            q_kind: int, o_kind: int, stamps: bool = False, rope_pairs: int = 0, rope_rot: int = 0,
            rope_interleaved: bool = False, kbits: int = 2, qgroups: int = 1, sliding: bool = False,
            groups: int = 1, vbits: int = 2, split: tuple[int, int, int] = (0, 0, 0), warps: int = NUM_WARPS):
    """``gqa``: query heads per CTA; ``qgroups``: CTAs per KV head.  ``rope_rot`` / ``rope_interleaved``: the RoPE
    layout's rotary dim (0: the head dim) and pairing (rope.RotaryLayout), which place the channels of each visited
    pair.  ``kbits`` / ``vbits``: the key / value code widths.  ``sliding``: the variant for sliding-window layers.
    ``groups``: metadata groups per head (NG = D / G: 1, or 2 at D = 256).  ``split``: split_defines of the layer's
    split key width.  ``warps``: NUM_WARPS, or WIDE_WARPS (with WIDE_MAX_PAGES page ids)."""
    defines = dict(D=head_dim, P=page_size, GQA=gqa, SINK_PAGES=sink_pages, NWARPS=warps,
                   MAX_PAGES=max_pages(warps), MIN_BLOCKS=min_blocks, Q_KIND=q_kind, O_KIND=o_kind,
                   STAMPS=int(stamps), ROPE_R=rope_pairs, ROPE_ROT=rope_rot or head_dim,
                   ROPE_INTERLEAVED=int(rope_interleaved), KBITS=kbits, QGROUPS=qgroups, SLIDING=int(sliding))
    if head_dim == 256:  # (the D <= 128 sources stay byte for byte what they were)
        defines.update(NG=groups, STEP16=int(step16(head_dim, kbits, rope_pairs, sliding)))
    if vbits != 2:  # (as do the sources of the INT2-value variants)
        defines.update(VBITS=vbits)
    if split[0]:  # (and of the plain-key ones)
        defines.update(SPLIT_M=split[0], SPLIT_HB=split[1], KTAIL=split[2])
    source = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + SOURCE.read_text()
    with torch.cuda.device(device_index):
        return torch.cuda._compile_kernel(source, "oscar_int2_decode")


def split_plan(int2_tokens: int, programs_per_split: int, page_size: int, sms: int, per_sm: int,
               head_dim: int = 128, warps: int = NUM_WARPS, min_rounds: int = MIN_ROUNDS) -> tuple[int, int]:
    """(splits, chunk) for the history: chunks of whole 32-token steps per warp (multiples of 32 x ``warps`` tokens,
    TOKENS_PER_ROUND for NUM_WARPS) of at least ``min_rounds`` rounds (and, at head dims up to 128,
    sqrt(MERGE_BALANCE_TOKENS x tokens): the merge) and at most ``max_pages(warps)`` pages.  The CTAs
    (splits x programs_per_split) fill whole waves of per_sm x sms slots: at most one wave (rounded down) when the
    history allows it; when the page ids force more splits, the
    count in [forced, 2 x forced] whose last wave is fullest (64K x 32 sequences: 3 splits, 1.94 waves, not 2 and
    1.29).

    Args:
        int2_tokens: a bound on the INT2 history of the longest sequence.
        programs_per_split: sequences x KV heads.
        page_size: P.
        sms: the GPU's SM count.
        per_sm: CTAs per SM (min_blocks).
        head_dim: D (MERGE_BALANCE_TOKENS's comment).
        warps: warps per CTA (NUM_WARPS or WIDE_WARPS).
        min_rounds: the shortest chunk, in rounds of 32 x ``warps`` tokens.
    """
    rnd = 32 * warps
    if int2_tokens <= 0:
        return 1, rnd
    pairs = max(programs_per_split, 1)
    slots = per_sm * sms
    forced = -(-int2_tokens // (max_pages(warps) * page_size // rnd * rnd))
    balance = MERGE_BALANCE_TOKENS if head_dim <= 128 else 0
    longest = int2_tokens // max(min_rounds * rnd, math.isqrt(balance * int2_tokens))
    splits = min(max(1, slots // pairs), max(1, longest), MAX_SPLITS)
    if splits < forced:
        def fill(s: int) -> float:
            waves = pairs * s / slots
            return waves / math.ceil(waves)

        splits = max(range(forced, 2 * forced + 1), key=lambda s: (fill(s), -s))
    chunk = -(-int2_tokens // splits)
    chunk = -(-chunk // rnd) * rnd
    return -(-int2_tokens // chunk), chunk


def max_pages(warps: int) -> int:
    """Page ids a CTA of ``warps`` warps keeps in shared memory: the most pages of its chunk."""
    return WIDE_MAX_PAGES if warps == WIDE_WARPS else MAX_PAGES


def wide_error(head_dim: int, rope_pairs: int, split=None) -> str | None:
    """Why the variant cannot run CTAs of WIDE_WARPS warps (None: it can; WIDE_WARPS's comment)."""
    if head_dim != 128 or split is not None or rope_pairs not in (0, 8):
        return (f"CTAs of {WIDE_WARPS} warps are compiled for head dim 128, plain keys and constant centering or the "
                f"term over 8 pairs (asked: head dim {head_dim}, {'split' if split is not None else 'plain'} keys, "
                f"{rope_pairs} pairs)")
    return None


def cta_plan(int2_tokens: int, programs_per_split: int, page_size: int, sms: int, per_sm: int,
             head_dim: int = 128, wide: bool = False) -> tuple[int, int, int]:
    """(warps, splits, chunk): split_plan's with NUM_WARPS warps a CTA, or, when ``wide`` (the variant has a
    WIDE_WARPS build: ``wide_error``) and that plan's chunks are at most WIDE_MAX_CHUNK tokens, the plan of
    WIDE_WARPS-warp CTAs, one per SM, chunks of at least WIDE_MIN_ROUNDS rounds."""
    splits, chunk = split_plan(int2_tokens, programs_per_split, page_size, sms, per_sm, head_dim)
    if wide and 0 < int2_tokens and chunk <= WIDE_MAX_CHUNK:
        return (WIDE_WARPS, *split_plan(int2_tokens, programs_per_split, page_size, sms, 1, head_dim, WIDE_WARPS,
                                        WIDE_MIN_ROUNDS))
    return NUM_WARPS, splits, chunk


_ROTATIONS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rotation_operand(k_rotation: torch.Tensor) -> torch.Tensor:
    """R_K [Hr, D, D] as the kernel's A operand: float16 R^T (e-major), cached per tensor and version.  The entry
    keeps its source alive, so a new tensor cannot reuse the address and meet a stale copy.  float16 entries of
    an orthogonal matrix (|r| <= 1) err by <= 2^-11 relative, as the float16 query the INT2 MMAs use already."""
    key = (k_rotation.data_ptr(), k_rotation._version, tuple(k_rotation.shape), tuple(k_rotation.stride()),
           k_rotation.dtype, k_rotation.device)
    hit = _ROTATIONS.get(key)
    if hit is None:
        if len(_ROTATIONS) >= 1024:
            _ROTATIONS.clear()
        hit = (k_rotation, k_rotation.transpose(-1, -2).to(torch.float16).contiguous())
        _ROTATIONS[key] = hit
    return hit[1]


_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown counter buffers stay alive: captured graphs may still point at them


def _counters(device: torch.device, pairs: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, KV head, query group), per device and stream (two streams must not share
    them); the kernel leaves them at zero.  Grown by doubling, never freed."""
    key = (_index(device), torch.cuda.current_stream(device).cuda_stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < pairs:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(4096, 2 * pairs), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def decode(q: torch.Tensor, k_rotation: torch.Tensor | None, layer: dict[str, torch.Tensor], geom: PoolGeometry,
           batch: PagedBatch, out: torch.Tensor, splits: int, chunk: int, qk_scale: float,
           stamps: torch.Tensor | None = None, rope=None, widths: tuple[int, int] | None = None,
           window: int | None = None, split=None, warps: int = NUM_WARPS) -> torch.Tensor:
    """Decode attention over the mixed pool as one launch (``unsupported`` says which calls it takes).

    Args:
        q: the unrotated queries (float32, bfloat16 or float16).
        k_rotation: R_K, applied in the kernel (above ROTATE_IN_KERNEL_MAX_DIM by decode.rotate_query before it);
            None: q arrives rotated.
        layer: one layer of the pool (``PagedKVPool.layer``).
        geom, batch: the pool's geometry and the sequences' block tables and lengths.
        out: the output, written in place (any of the three dtypes).
        splits, chunk: CTAs per (sequence, KV head, query group) and INT2 tokens each (split_plan; with a window,
            planned over the window's part of the history, at most window + P tokens).
        qk_scale: sm_scale * log2(e).
        stamps: %globaltimer stamps per CTA (a separately compiled variant; benchmarks only).
        rope: a rope.KernelRope when keys are centered per position; its tables must cover the sequences
            (KernelRope.check, done by the caller).
        widths: the layer's (key, value) code widths (``geom.layer_widths``), one of WIDTHS; None: read off the
            code tensors' rows.
        window: the layer's sliding window (the query sees the last ``window`` tokens); None or 0: none.
        split: the layer's quant.SplitWidth when its keys are split (``widths[0]`` is then its narrow width): key pages
            of split_keys.row_bytes a row.
        warps: warps per CTA, NUM_WARPS or WIDE_WARPS (``cta_plan``; ``chunk`` a multiple of 32 x warps).
    Shapes:
        q, out: [B, Hq, D]; k_rotation: [Hkv | 1, D, D]; stamps: int64 [B, Hkv x query_groups, splits, 16].
    Returns:
        ``out``.
    """
    bsz, hq, d = q.shape
    h = geom.num_kv_heads
    if bsz == 0:
        return out
    qgroups = query_groups(hq // h)
    if window is not None and window < 0:
        raise ValueError(f"a sliding window must be >= 1 token, got {window}")
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"the CUDA decode kernel merges 1 .. {MAX_SPLITS} splits, got {splits}")
    if warps not in (NUM_WARPS, WIDE_WARPS) or chunk % (32 * warps) or chunk > max_pages(warps) * geom.page_size:
        raise ValueError(f"CTAs of {NUM_WARPS} or {WIDE_WARPS} warps take chunks of whole 32-token steps a warp, at "
                         f"most {max_pages(warps)} pages (got {warps} warps, {chunk} tokens)")
    kc, ks, kz, vc, vs, vz, kw, vw = (layer[k] for k in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero",
                                                          "k_win", "v_win"))
    if widths is None:
        widths = (kc.shape[-1] * 8 // d, vc.shape[-1] * 8 // d)
    kbits, vbits = widths
    why = width_error(kbits, vbits) or split_error(split, d)
    if why is not None:
        raise ValueError(why)
    key_row = d * kbits // 8 if split is None else row_bytes(split, d)
    if kc.shape[-1] != key_row or vc.shape[-1] != d * vbits // 8 or (split is not None and split.bits != kbits):
        raise ValueError(f"code rows of {kc.shape[-1]} / {vc.shape[-1]} bytes are not K{split or kbits}V{vbits} at "
                         f"head dim {d}")
    why = group_error(d, geom.group_size)
    ng = geom.num_groups
    if why is not None or any(t.shape[-1] != ng for t in (ks, kz, vs, vz)):
        raise ValueError(why or f"scale / zero-point rows of {ks.shape[-1]} / {kz.shape[-1]} (keys), {vs.shape[-1]} / "
                                f"{vz.shape[-1]} (values) entries are not {ng} groups")
    if ks.dtype != torch.float16 or vs.dtype != torch.float16 or kz.dtype != torch.uint8 or vz.dtype != torch.uint8:
        raise ValueError("the CUDA decode kernel reads float16 scales and uint8 zero points")
    if ks.stride(-2) != ng or any(t.stride() != ks.stride() for t in (kz, vs, vz)) or \
            (ks.data_ptr() | vs.data_ptr()) % (4 * ng) or (kz.data_ptr() | vz.data_ptr()) % (2 * ng):
        raise ValueError("the CUDA decode kernel reads two tokens' scales and zero points as one word each, from "
                         "tensors of one layout")
    if split is not None and (kc.data_ptr() % 16 or kc.stride(0) % 16 or kc.stride(1) % 16):
        raise ValueError("the CUDA decode kernel copies split key tails 16 bytes at a time: key pages must start at "
                         "multiples of 16 bytes")
    # K2V2 addresses both code pools with the same strides; other widths (and split keys) pass the keys' page and head
    # strides
    int2 = (kbits, vbits) == (2, 2) and split is None
    rows = kc.stride() == vc.stride() if int2 else (kc.stride(-2) == kc.shape[-1] and vc.stride(-2) == vc.shape[-1])
    if not rows or kw.stride() != vw.stride() or \
            kc.stride(-1) != 1 or vc.stride(-1) != 1 or ks.stride(-1) != 1 or kw.stride(-1) != 1 or kw.stride(-2) != d:
        raise ValueError("the CUDA decode kernel needs K and V pools of one contiguous layout")
    if q.stride(-1) != 1:
        q = q.contiguous()
    target = out if out.stride(-1) == 1 and out.dtype == q.dtype else torch.empty_like(q)
    rotate = k_rotation is not None
    if k_rotation is None:
        r, stride_rh = q, 0
    else:
        if k_rotation.dim() != 3 or k_rotation.shape[0] not in (1, h) or tuple(k_rotation.shape[1:]) != (d, d):
            raise ValueError(f"k_rotation must be [1 or {h}, {d}, {d}], got {tuple(k_rotation.shape)}")
        if d > ROTATE_IN_KERNEL_MAX_DIM:
            from .decode import rotate_query

            r, stride_rh = rotate_query(q, k_rotation, h), 0  # float32 [B, Hq, D]
            if rope is None:  # only the RoPE prologue reads the unrotated query
                q, rotate = r, False
        else:
            r = rotation_operand(k_rotation)
            stride_rh = 0 if r.shape[0] == 1 else r.stride(0)
    rope_rot, rope_interleaved = d, False
    if rope is None:
        mu = pairs = phases = tile = q  # not read
        rope_r = 0
    else:
        rope_rot, rope_interleaved = rope.rotary_layout.rotary_dim, rope.rotary_layout.interleaved
        rope_r = rope.pairs.shape[1]
        if rope_r % 8 or rope_r > MAX_ROPE_PAIRS or tuple(rope.mu_pre.shape) != (h, d) or rope.pairs.shape[0] != h:
            raise ValueError(f"rope: mu_pre must be [{h}, {d}] with 8 .. {MAX_ROPE_PAIRS} pairs (a multiple of 8) "
                             f"per head, got {tuple(rope.mu_pre.shape)} and {tuple(rope.pairs.shape)}")
        mu = rope.mu_pre if rope.mu_pre.dtype == torch.float32 else rope.mu_pre.float()
        mu, pairs = mu.contiguous(), rope.pairs.to(torch.int32).contiguous()
        phases, tile = rope.phases, rope.tile
    why = wide_error(d, rope_r, split) if warps == WIDE_WARPS else None
    if why is not None:
        raise ValueError(why)
    po = torch.empty(bsz, hq, splits, d, device=q.device, dtype=torch.float16)
    pl = torch.empty(bsz, hq, splits, device=q.device, dtype=torch.float32)
    bt = batch.block_table
    token_bytes = kc.shape[-1] + vc.shape[-1] + 2 * ng * (ks.element_size() + kz.element_size())  # codes, metadata
    history_bytes = bsz * h * splits * chunk * token_bytes  # an upper bound (the last chunk), read once from DRAM

    def variant(w: int):
        return _kernel(_index(q.device), d, geom.page_size, hq // h // qgroups, geom.sink_pages,
                       1 if w == WIDE_WARPS else min_blocks(rope_r, d, kbits, vbits=vbits, split=split is not None),
                       _DTYPES[q.dtype], _DTYPES[target.dtype], stamps is not None, rope_r, rope_rot, rope_interleaved,
                       kbits, qgroups, bool(window), geom.num_groups, vbits, split_defines(split), w)

    kernel = variant(warps)
    if wide_error(d, rope_r, split) is None:
        # the engine warms up on one plan (short histories: mostly 8 warps) and serves both later (long or batched
        # histories: 4): compile the other CTA shape now, so that no request waits for NVRTC (LLMEngine.warm_up)
        variant(NUM_WARPS + WIDE_WARPS - warps)
    launch_cuda(kernel, (splits, h * qgroups, bsz), (warps * 32, 1, 1), device=q.device,
                args=[q, r, rotate, kc, ks, kz, vc, vs, vz, kw, vw, bt, batch.seq_lens, batch.int2_pages, po, pl,
                      target, _counters(q.device, bsz * h * qgroups), float(qk_scale), q.stride(0), q.stride(1),
                      stride_rh,
                      vc.stride(0), vc.stride(1), ks.stride(0), ks.stride(1), kw.stride(0), kw.stride(1), bt.stride(0),
                      po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1), target.stride(0),
                      target.stride(1), chunk, _MAGIC, stamps if stamps is not None else po,
                      int(stream_evict_first(history_bytes, _index(q.device))), mu, pairs, phases, tile,
                      int(window or 0)]
                + ([] if int2 else [kc.stride(0), kc.stride(1)]))
    if target is not out:
        out.copy_(target)
    return out
