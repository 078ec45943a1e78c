"""The last step of sampling (engine/sampling.py) in one launch: each row's Gumbel-max token, or its argmax for a
greedy row, with the same integer-hash noise as ``sampling.uniforms``.  The torch reference,
``sampling.gumbel_argmax_reference``, takes ~40 elementwise launches over [rows, vocab] int64 tensors: 1.2 ms of
GPU time per step at 64 rows of Qwen3's 151936 tokens (benchmarks/NOTES.md, run S4)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._compat import install_interpreter_shim

install_interpreter_shim()


@triton.jit
def _mix(x):
    """sampling._mix on uint32: its products of 31-bit values only matter modulo 2^31, which 32-bit wrapping keeps
    (int64 multiplies cost several instructions each on the GPU)."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & 0x7FFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & 0x7FFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(x_ptr, logits_ptr, seeds_ptr, counters_ptr, greedy_ptr, best_ptr, best_id_ptr, vocab,
                          x_stride, logits_stride, per_split, BLOCK: tl.constexpr):
    """Program (row, split): the best value and its id over tokens [split * per_split, (split + 1) * per_split)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    seed = tl.load(seeds_ptr + row)
    counter = tl.load(counters_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    lo = (seed & 0x7FFFFFFF).to(tl.uint32)
    hi = ((seed >> 31) & 0x7FFFFFFF).to(tl.uint32)
    base = _mix(_mix(lo) ^ hi ^ _mix((counter & 0x7FFFFFFF).to(tl.uint32)))
    best = -float("inf")
    best_id = 0
    first = split * per_split
    for start in range(first, tl.minimum(first + per_split, vocab), BLOCK):
        ids = start + tl.arange(0, BLOCK)
        ok = ids < vocab
        x = tl.load(x_ptr + row * x_stride + ids, mask=ok, other=-float("inf"))
        plain = tl.load(logits_ptr + row * logits_stride + ids, mask=ok, other=-float("inf"))
        bits = _mix((base + _mix(ids.to(tl.uint32))) & 0x7FFFFFFF)
        u = ((bits >> 7).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        v = tl.where(greedy, plain, x - tl.log(-tl.log(u)))
        v = tl.where(ok, v, -float("inf"))
        m = tl.max(v, axis=0)
        i = tl.argmax(v, axis=0)  # the first of equal maxima, as torch.argmax
        take = m > best
        best_id = tl.where(take, start + i, best_id)
        best = tl.where(take, m, best)
    tl.store(best_ptr + row * tl.num_programs(1) + split, best)
    tl.store(best_id_ptr + row * tl.num_programs(1) + split, best_id)


BLOCK = 2048
PROGRAMS = 256  # programs per call to aim for (rows x splits): a row alone is split over many SMs


def gumbel_argmax(x: torch.Tensor, logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                  greedy: torch.Tensor) -> torch.Tensor:
    """``sampling.gumbel_argmax_reference`` in one launch over (row, split) programs, then the best split per row
    (the first among equals, so ties go to the lowest id as in torch.argmax).  x, logits: unit column stride."""
    rows, vocab = x.shape
    if not rows:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    blocks = triton.cdiv(vocab, BLOCK)
    per_split = BLOCK * triton.cdiv(blocks, max(1, min(blocks, PROGRAMS // rows)))
    splits = triton.cdiv(vocab, per_split)
    best = torch.empty(rows, splits, dtype=torch.float32, device=x.device)
    best_id = torch.empty(rows, splits, dtype=torch.int32, device=x.device)
    _gumbel_argmax_kernel[(rows, splits)](x, logits, seeds, counters, greedy, best, best_id, vocab, x.stride(0),
                                          logits.stride(0), per_split, BLOCK=BLOCK, num_warps=4)
    return best_id.gather(1, best.argmax(1, keepdim=True))[:, 0].long()
