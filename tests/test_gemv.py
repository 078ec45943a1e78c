"""kernels/gemv.py: the decode-step GEMV against F.linear (the Triton interpreter on the CPU, the kernel on a GPU)."""

import os

import pytest
import torch

from oscar_kv.kernels.gemv import linear, small_gemm_choice, small_linear
from oscar_kv.kernels.tuning import TUNING

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs a GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_matches_f_linear(m, bias):
    # N and K not multiples of any tile, so the masked edges run too
    g = torch.Generator().manual_seed(m + 10 * bias)
    n, k = 203, 328
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    got = small_linear(x, w, b).float()
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (m, n)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert (got - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("m", [1, 2])
def test_small_linear_small_tiles_cover_k_in_several_steps(m):
    g = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # (float32 tl.dot would run in TF32 on a GPU)
    x = torch.randn(m, 100, generator=g).to(DEVICE, dtype)
    w = torch.randn(50, 100, generator=g).to(DEVICE, dtype)
    got = small_linear(x, w, block_n=16, block_k=32).float()
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert (got - ref).abs().max() <= (2e-2 if DEVICE == "cuda" else 1e-4) * ref.abs().max()


def test_linear_takes_the_gemv_only_where_it_runs():
    x = torch.randn(TUNING.gemv_max_rows + 1, 64, device=DEVICE)
    w = torch.randn(32, 64, device=DEVICE)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))  # too many rows, and float32: F.linear
    with pytest.raises(ValueError, match="unit-stride rows"):
        small_linear(torch.randn(TUNING.gemv_max_rows + 1, 64, device=DEVICE), w)


def test_small_gemm_choice():
    assert small_gemm_choice(torch.device("cpu")) == ("cublas", "not on a GPU")
    assert small_gemm_choice(torch.device("cpu"), "cublas")[0] == "cublas"
    with pytest.raises(ValueError, match="Triton GEMV cannot run"):
        small_gemm_choice(torch.device("cpu"), "triton")
    if torch.cuda.is_available():
        assert small_gemm_choice(torch.device("cuda")) == ("triton", None)


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_gate_up_gemv_applies_the_gate_activation(m, bias, activation):
    from oscar_kv.kernels.elementwise import glu_reference

    g = torch.Generator().manual_seed(7 * m + bias)
    f, k = 83, 200
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(2 * f, k, generator=g) * 0.1).to(DEVICE, dtype)
    b = torch.randn(2 * f, generator=g).to(DEVICE, dtype) if bias else None
    got = small_linear(x, w, b, glu=activation).float()
    ref = glu_reference(torch.nn.functional.linear(x, w, b), activation).float()
    assert got.shape == (m, f)
    assert (got - ref).abs().max() <= (3e-2 if dtype == torch.bfloat16 else 1e-4) * ref.abs().max()
