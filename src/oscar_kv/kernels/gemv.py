"""Decode-step linear layers at small batch: y = x W^T (+ b) for a few rows of x, bandwidth-bound on W.

At one to a few tokens a projection reads its whole weight for almost no arithmetic.  cuBLAS runs these shapes at
70-92% of copy bandwidth (benchmarks/gemm_small_batch.py): split-K with a separate reduction launch for the narrow
ones, and a fixed ~5 us each.  Here every program owns a few output rows over the whole K (no reduction pass):
at one token a handful of rows, products accumulated elementwise and summed once; at 2..16 tokens 64 rows through
tl.dot (the token axis padded to 16).  Tiles: ``TUNING.gemv_*``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._compat import install_interpreter_shim
from .tuning import TUNING, kernel_choice

install_interpreter_shim()

ENV = "OSCAR_KV_SMALL_GEMM"  # auto | triton | cublas


@triton.jit
def _gemv_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_ptr = W + rn[:, None] * stride_wn + rk[None, :]
    x_ptr = X + rm[:, None] * stride_xm + rk[None, :]
    if DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        products = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        w = tl.load(w_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            x = tl.load(x_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)
        else:  # one token: no cross-lane sum inside the loop
            x = tl.load(x_ptr, mask=k_ok[None, :], other=0.0)
            products += w.to(tl.float32) * x.to(tl.float32)
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    if DOT:
        out = acc
    else:
        out = tl.sum(products, axis=1)[:, None]
    if HAS_BIAS:
        out += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(Y + rm[None, :] * stride_ym + rn[:, None], out.to(Y.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
                 block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None
                 ) -> torch.Tensor:
    """x [M, K] (M <= TUNING.gemv_max_rows), weight [N, K] row-major, bias [N] or None -> [M, N] in x's dtype.
    Tiles default to ``TUNING``'s for one token or for several."""
    m, k = x.shape
    n = weight.shape[0]
    if not 0 < m <= TUNING.gemv_max_rows or weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"small_linear takes 1..{TUNING.gemv_max_rows} unit-stride rows over a row-major weight")
    one = m == 1
    t = TUNING
    block_n = block_n or (t.gemv_one_block_n if one else t.gemv_block_n)
    block_k = min(block_k or (t.gemv_one_block_k if one else t.gemv_block_k), max(16, triton.next_power_of_2(k)))
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=1 if one else 16, BLOCK_N=block_n, BLOCK_K=block_k, DOT=not one,
        num_warps=num_warps or (t.gemv_one_num_warps if one else t.gemv_num_warps),
        num_stages=num_stages or (t.gemv_one_num_stages if one else t.gemv_num_stages))
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through ``small_linear`` for up to TUNING.gemv_max_rows rows of a half-precision x (decode steps)."""
    if (0 < x.shape[0] <= TUNING.gemv_max_rows and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.stride(1) == 1 and x.stride(1) == 1):
        return small_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def small_gemm_choice(device: torch.device, backend: str | None = None) -> tuple[str, str | None]:
    """("triton", None): decode-step projections of <= 16 tokens run ``small_linear``; or ("cublas", why not)."""
    return kernel_choice(ENV, backend, "triton", "cublas",
                         lambda: None if device.type == "cuda" else "not on a GPU", "the Triton GEMV")
