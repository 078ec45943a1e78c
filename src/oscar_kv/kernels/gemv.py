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

from . import elementwise, pdl
from ._compat import install_interpreter_shim
from .elementwise import GLU_ACTIVATIONS, gate_activation
from .common import wait_for_inputs
from .tuning import TUNING, kernel_choice

install_interpreter_shim()

ENV = "OSCAR_KV_SMALL_GEMM"  # auto | triton | cublas


@triton.jit
def _gemv_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT: tl.constexpr, GLU: tl.constexpr, GELU: tl.constexpr, PDL: tl.constexpr = False):
    """Y[:, n] = X W[n]^T (+ B[n]) for the program's BLOCK_N rows n < N; with GLU, W holds gate rows [0, N) then
    up rows [N, 2N) and Y[:, n] = act(gate) * up (SiLU, or with GELU GELU's tanh approximation), each rounded to Y's
    dtype where transformers' MLP rounds."""
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
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        products = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        products_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    wait_for_inputs(PDL)  # X is the output of the kernel before (pdl.py)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr, mask=w_mask, other=0.0)
        if GLU:
            w_up = tl.load(w_ptr + N * stride_wn, mask=w_mask, other=0.0)
        if DOT:
            x = tl.load(x_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)
            if GLU:
                acc_up = tl.dot(w_up, tl.trans(x), acc_up)
        else:  # one token: no cross-lane sum inside the loop
            x = tl.load(x_ptr, mask=k_ok[None, :], other=0.0).to(tl.float32)
            products += w.to(tl.float32) * x
            if GLU:
                products_up += w_up.to(tl.float32) * x
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    if not DOT:
        acc = tl.sum(products, axis=1)[:, None]
        if GLU:
            acc_up = tl.sum(products_up, axis=1)[:, None]
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if GLU:
            acc_up += tl.load(B + N + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = acc.to(Y.dtype.element_ty)
    if GLU:
        gate = out.to(tl.float32)
        act = gate_activation(gate, GELU).to(Y.dtype.element_ty)
        out = (act.to(tl.float32) * acc_up.to(Y.dtype.element_ty).to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + rm[None, :] * stride_ym + rn[:, None], out, mask=n_ok[:, None] & m_ok[None, :])


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
                 block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                 glu: str | None = None) -> torch.Tensor:
    """x [M, K] (M <= TUNING.gemv_max_rows), weight [N, K] row-major, bias [N] or None -> [M, N] in x's dtype.
    ``glu``: a gate activation (GLU_ACTIVATIONS): weight is gate | up ([2F, K]) and the result act(gate) * up,
    [M, F].  Tiles default to ``TUNING``'s for one token or for several."""
    m, k = x.shape
    if glu is not None and glu not in GLU_ACTIVATIONS:
        raise ValueError(f"gate activation {glu!r} is not one of {GLU_ACTIVATIONS}")
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    if not 0 < m <= TUNING.gemv_max_rows or weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"small_linear takes 1..{TUNING.gemv_max_rows} unit-stride rows over a row-major weight")
    one = m == 1
    t = TUNING
    # gate and up tiles side by side: half the rows (one token: registers) or half the K per step (tl.dot's
    # pipeline stages in shared memory) keep them at the plain GEMV's
    block_n = block_n or (t.gemv_one_block_n // (2 if glu else 1) if one else t.gemv_block_n)
    block_k = block_k or (t.gemv_one_block_k if one else t.gemv_block_k // (2 if glu else 1))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=1 if one else 16, BLOCK_N=block_n, BLOCK_K=block_k, DOT=not one,
        GLU=glu is not None, GELU=glu == "gelu_pytorch_tanh",
        num_warps=num_warps or (t.gemv_one_num_warps if one else t.gemv_num_warps),
        num_stages=num_stages or (t.gemv_one_num_stages if one else t.gemv_num_stages),
        **pdl.launch_options(x.device))
    return y


def _small(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and 0 < x.shape[0] <= TUNING.gemv_max_rows and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.stride(1) == 1 and x.stride(1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through ``small_linear`` for up to TUNING.gemv_max_rows rows of a half-precision x (decode steps)."""
    return small_linear(x, weight, bias) if _small(x, weight) else F.linear(x, weight, bias)


def linear_glu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               activation: str = "silu") -> torch.Tensor:
    """act(gate) * up of the gate | up projection ([2F, K] weight): one GEMV for small x, else F.linear then
    elementwise.glu."""
    if _small(x, weight):
        return small_linear(x, weight, bias, glu=activation)
    return elementwise.glu(F.linear(x, weight, bias), activation)


def small_gemm_choice(device: torch.device, backend: str | None = None) -> tuple[str, str | None]:
    """("triton", None): decode-step projections of <= 16 tokens run ``small_linear``; or ("cublas", why not)."""
    return kernel_choice(ENV, backend, "triton", "cublas",
                         lambda: None if device.type == "cuda" else "not on a GPU", "the Triton GEMV")
