"""The decode step's KV write: every token goes to a BF16 window page (``write.write_kv`` with no INT2-bound token).

A decode step writes one token per sequence and KV head, so ``write_kv``'s program (a 16-token block, the whole
float32 D x D rotation as one MMA operand, 8 warps) does 16 times the work it keeps and reads R (64 KB at D = 128)
in one program per head.  Here a program takes one token, one KV head and BLOCK_C of the rotated key's columns:
its slice of R (D x BLOCK_C float32, 16 KB at D = 128) is loaded before the PDL wait, the key row is centered as
``write_kv`` centers it (``_centered_keys``, recomputed by each column block: D values), and its columns are
sum_d k_d R[d, c] in float32.  The same program stores those columns of the value.  The stored BF16 keys are the
float32 rotation rounded, as ``write_kv``'s; only the order of the float32 sum differs.  On an H200 a launch
takes 4.1 us at one token and 8 KV heads where write_kv's takes 6.6, and a Qwen3-8B-sized decode step 0.16 ms less
at 32K batch 1 (benchmarks/NOTES.md, run WW1); past TUNING.window_write_max_rows rows write_kv is as fast or faster.

Specification: reference.write_reference (tests/test_window_write.py checks this writer against it and write_kv).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..rope import RotaryLayout
from . import pdl
from .common import wait_for_inputs
from .layout import PagedKVPool
from .write import _centered_keys, key_operands

BLOCK_C = 32  # rotated key columns per program: 4 programs a head at D = 128


@triton.jit
def _window_write_kernel(K, V, R, MU, MUP, COS, SIN, WS, Kw, Vw,
                         stride_kt, stride_kh, stride_vt, stride_vh, stride_rh, stride_wp, stride_wh,
                         D: tl.constexpr, P: tl.constexpr, BLOCK_C: tl.constexpr, ROTATE: tl.constexpr,
                         CENTER: tl.constexpr, ROPE_CENTER: tl.constexpr, ROT_HALF: tl.constexpr,
                         INTERLEAVED: tl.constexpr, PDL: tl.constexpr = False):
    t = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_t = t + tl.arange(0, 1)  # the program's token as a block of one row (_centered_keys' shapes)
    tmask = offs_t >= 0
    offs_d = tl.arange(0, D)
    if ROTATE:  # R's columns before the wait (pdl.py: no kernel of the step writes it)
        r = tl.load(R + h * stride_rh + offs_d[:, None] * D + cols[None, :]).to(tl.float32)
    wait_for_inputs(PDL)
    ws = tl.load(WS + offs_t).to(tl.int64)  # -1: a padded row of a captured batch, nothing to store
    wmask = (ws >= 0)[:, None]
    wrow = (ws // P) * stride_wp + h * stride_wh + (ws % P) * D
    if ROTATE:
        k = _centered_keys(K, MU, MUP, COS, SIN, offs_t, tmask, h, stride_kt, stride_kh, offs_d, D, CENTER,
                           ROPE_CENTER, ROT_HALF, INTERLEAVED)
        y = tl.sum(k[:, :, None] * r[None, :, :], axis=1)  # [1, BLOCK_C]
    else:
        y = _centered_keys(K, MU, MUP, COS, SIN, offs_t, tmask, h, stride_kt, stride_kh, cols, D, CENTER,
                           ROPE_CENTER, ROT_HALF, INTERLEAVED)
    tl.store(Kw + wrow[:, None] + cols[None, :], y.to(tl.bfloat16), mask=wmask)
    v = tl.load(V + offs_t[:, None] * stride_vt + h * stride_vh + cols[None, :])
    tl.store(Vw + wrow[:, None] + cols[None, :], v.to(tl.bfloat16), mask=wmask)


def write_window(pool: PagedKVPool, layer: int, k: torch.Tensor, v: torch.Tensor, win_slot: torch.Tensor,
                 k_rotation: torch.Tensor | None, k_mean: torch.Tensor | None,
                 k_rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 rope_layout: RotaryLayout | None = None) -> None:
    """``write.write_kv`` for tokens that all go to window pages (a decode step): the same arguments, less the
    INT2 slots, the clip indices and the rescale strengths, which only quantizing reads.

    Shapes: k, v [T, Hkv, D] (last dim contiguous); win_slot int32 [T] (-1: no store); k_rotation [Hkv | 1, D, D];
    k_mean [Hkv, D]; k_rope ([Hkv, D], [T, D], [T, D]).
    """
    t, h, d = k.shape
    if t == 0:
        return
    L = pool.layer(layer)
    kw, vw = L["k_win"], L["v_win"]
    r, stride_rh, mu, mu_pre, cos, sin = key_operands(k, k_rotation, k_mean, k_rope)
    _window_write_kernel[(t, h, d // BLOCK_C)](
        k, v, r, mu, mu_pre, cos, sin, win_slot, kw, vw,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), stride_rh, kw.stride(0), kw.stride(1),
        D=d, P=pool.geometry.page_size, BLOCK_C=BLOCK_C, ROTATE=k_rotation is not None,
        CENTER=k_mean is not None, ROPE_CENTER=k_rope is not None,
        ROT_HALF=(rope_layout.rotary_dim if rope_layout is not None else d) // 2,
        INTERLEAVED=rope_layout is not None and rope_layout.interleaved,
        num_warps=4 if d <= 128 else 8, **pdl.launch_options(k.device))
