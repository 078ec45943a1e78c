"""Split key rows (kernels/split_keys.py) read by the attention kernels, against the torch reference.

On a machine without CUDA the kernels run under Triton's interpreter at small sizes; on a GPU at full size (a 128K
sequence beside short ones).  The pool is filled through the reference writer, so these tests check the readers;
tests/test_split_write.py checks the write kernels against the same reference.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from oscar_kv.kernels import reference as ref  # noqa: E402
from oscar_kv.kernels import split_keys  # noqa: E402
from oscar_kv.kernels.layout import PagedKVPool, PoolGeometry, clip_indices, plan_batch, token_slots  # noqa: E402
from oscar_kv.quant import SplitWidth  # noqa: E402

from kernel_utils import DEV, GPU, outlier_rows, random_orthogonal, rel_err, rope_case  # noqa: E402

# (head dim, split key width, value bits): the first part in one slice, in part of one, over two (D/2); narrow
# widths 2 and 3; upper bits 1 to 6
CASES = [(128, SplitWidth(2, 16, 4), 2), (128, SplitWidth(2, 32, 5), 2), (128, SplitWidth(2, 64, 8), 2),
         (128, SplitWidth(3, 16, 4), 2), (64, SplitWidth(2, 8, 5), 2), (64, SplitWidth(2, 32, 3), 3)]


def case_id(case):
    d, width, v = case
    return f"D{d}-K{width}V{v}"


def split_geometry(d, width, v_bits, layers=1, group=None):
    return PoolGeometry(num_layers=layers, num_kv_heads=2, head_dim=d, group_size=group or d, page_size=16,
                        sink_size=32, recent_size=64, k_bits=(width.bits,) * layers, v_bits=(v_bits,) * layers,
                        k_split=(width,) * layers)


def build_pool(geom, seq_lens, gen, clip=(0.96, 0.92), int2_pages=None):
    """A pool filled through the reference writer (last layer) with random outlier keys / values."""
    batch, nq, nw = plan_batch(geom, seq_lens, int2_pages, generator=gen)
    pool = PagedKVPool.allocate(geom, nq, nw, device=DEV, fill_nan=True)
    batch = batch.to(DEV)
    h, d, layer = geom.num_kv_heads, geom.head_dim, geom.num_layers - 1
    rot = random_orthogonal(h, d, gen).to(DEV)
    ck = split_keys.clip_indices(clip[0], geom.k_split[layer], d, (h,)).to(DEV)
    cv = clip_indices(clip[1], d, (h,)).to(DEV)
    for b, n in enumerate(seq_lens):
        if n:
            pos = torch.arange(n, device=DEV)
            win, q2 = token_slots(geom, batch, torch.full_like(pos, b), pos)
            ref.write_reference(pool, layer, outlier_rows(n, h, d, gen), outlier_rows(n, h, d, gen, scale=0.5),
                                win, q2, rot, None, ck, cv, (0.5, 0.0))
    return pool, batch, rot


# decode kernels: on a GPU both the one-launch CUDA kernel and Triton's; off it Triton's, interpreted
BACKENDS = ("cuda", "triton") if GPU else ("triton",)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_reads_split_keys(case):
    from oscar_kv.kernels.decode import int2_decode, int2_kernel_choice

    d, width, v_bits = case
    geom = split_geometry(d, width, v_bits)
    gen = torch.Generator().manual_seed(d + width.hi_dims)
    seq_lens = [0, 7, 300, 517] if not GPU else [0, 7, 1000, 131072 + 77]
    pool, batch, rot = build_pool(geom, seq_lens, gen)
    q = torch.randn(len(seq_lens), 8, d, generator=gen).to(DEV, torch.bfloat16)
    want = ref.decode_reference(pool, 0, q, batch, rot)
    for backend in BACKENDS:
        out = torch.full_like(q, float("nan"))
        int2_decode(q, pool, 0, batch, rot, out=out, backend=backend)
        assert not out.isnan().any(), backend
        assert rel_err(out, want) < 1e-2, backend
        assert out[0].abs().max() == 0
    # every split width calibration writes at D = 64 and 128 is the CUDA kernel's (off CUDA: "not a CUDA device")
    kernel, why = int2_kernel_choice(torch.device(DEV), geom, 4, widths=(width.bits, v_bits), split=width)
    assert (kernel, why) == ("cuda", None) if GPU else kernel == "triton"


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_reads_split_keys_with_the_position_aware_offset_and_a_window(backend):
    from oscar_kv.kernels.decode import int2_decode

    d, width = 128, SplitWidth(2, 16, 5)
    geom = split_geometry(d, width, 2)
    gen = torch.Generator().manual_seed(3)
    seq_lens = [300, 517] if not GPU else [5000, 70000]
    pool, batch, rot = build_pool(geom, seq_lens, gen)
    rope = rope_case(2, d, max(seq_lens) + 1, gen, live=8)
    q = torch.randn(len(seq_lens), 8, d, generator=gen).to(DEV, torch.bfloat16)
    for window in (None, 200):
        want = ref.decode_reference(pool, 0, q, batch, rot, rope=rope, window=window)
        out = int2_decode(q, pool, 0, batch, rot, rope=rope, window=window, backend=backend)
        assert rel_err(out, want) < 1e-2, window


def test_which_split_widths_the_cuda_kernel_reads(monkeypatch):
    """int2_cuda.split_error: head dim 64 or 128, the narrow part at 2-4 bits, 8 .. D/2 wide channels at <= 8 bits
    (every width allocation.split_widths offers there); others take Triton, and asking for CUDA names the reason."""
    from oscar_kv.allocation import split_widths
    from oscar_kv.kernels import decode, int2_cuda

    for d in (64, 128):
        for width in split_widths(d):
            assert int2_cuda.split_error(width, d) is None, width
    assert int2_cuda.split_error(None, 256) is None
    assert "head dim 256" in int2_cuda.split_error(SplitWidth(2, 32, 4), 256)
    assert int2_cuda.split_error(SplitWidth(2, 4, 4), 64) is not None  # fewer than 8 wide channels
    monkeypatch.setattr(int2_cuda, "unsupported", lambda *args: None)  # as on an H100
    monkeypatch.setattr(decode, "INTERPRET", False)
    cuda = torch.device("cuda")
    geom = split_geometry(128, SplitWidth(2, 32, 5), 2)
    assert decode.int2_kernel_choice(cuda, geom, 4, widths=(2, 2), split=SplitWidth(2, 32, 5)) == ("cuda", None)
    wide = split_geometry(256, SplitWidth(2, 32, 4), 2)
    kernel, why = decode.int2_kernel_choice(cuda, wide, 4, widths=(2, 2), split=SplitWidth(2, 32, 4))
    assert kernel == "triton" and "head dim 256" in why
    with pytest.raises(ValueError, match="split 4x32\\+2 at head dim 256"):
        decode.int2_kernel_choice(cuda, wide, 4, backend="cuda", widths=(2, 2), split=SplitWidth(2, 32, 4))


def chunk_case(geom, hist, chunk, gen):
    """A pool holding each sequence's history and a chunk of new tokens after it: (pool, batch, rot, q, k_new,
    v_new, cu_seqlens)."""
    pool, batch, rot = build_pool(geom, hist, gen)
    h, d, t = geom.num_kv_heads, geom.head_dim, sum(chunk)
    cu = torch.tensor([0] + chunk, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEV)
    q = torch.randn(t, h * 4, d, generator=gen).to(DEV, torch.bfloat16)
    k_new = ref.rotate_keys(outlier_rows(t, h, d, gen), rot, None).to(torch.bfloat16)
    v_new = outlier_rows(t, h, d, gen, scale=0.5).to(torch.bfloat16)
    return pool, batch, rot, q, k_new, v_new, cu


PREFILL_CASES = [("extend", c) for c in CASES[::2] + CASES[-1:]] + [("materialized", c) for c in CASES[1::2]]


@pytest.mark.parametrize("path, case", PREFILL_CASES, ids=[f"{p}-{case_id(c)}" for p, c in PREFILL_CASES])
def test_prefill_paths_read_split_keys(path, case):
    """The extend kernel (short chunks) and the materialized path (long ones) over split key history."""
    from oscar_kv.kernels.extend import int2_extend
    from oscar_kv.kernels.materialized_extend import materialized_extend

    d, width, v_bits = case
    geom = split_geometry(d, width, v_bits)
    gen = torch.Generator().manual_seed(5 if path == "extend" else 6)
    hist, chunk = ([0, 203, 333], [7, 33, 16]) if not GPU else ([0, 1000, 16384 + 77], [33, 512, 257])
    pool, batch, rot, q, k_new, v_new, cu = chunk_case(geom, hist, chunk, gen)
    want = ref.extend_reference(pool, 0, q, k_new, v_new, cu, batch, rot)
    attend = int2_extend if path == "extend" else materialized_extend
    out = attend(q, k_new, v_new, cu, pool, 0, batch, rot)
    assert rel_err(out, want) < 1e-2


def test_the_cuda_decode_refuses_split_rows_it_is_not_told_of():
    """int2_cuda.decode checks a split layer's rows before it compiles or launches anything (so this runs on the CPU):
    rows read as plain K2 rows, a split width whose narrow part is not the layer's key width, and a split width it
    does not read each raise ValueError naming the problem."""
    from oscar_kv.kernels import int2_cuda

    width = SplitWidth(2, 16, 4)
    geom = split_geometry(128, width, 2)
    batch, nq, nw = plan_batch(geom, [300])
    pool = PagedKVPool.allocate(geom, nq, nw)
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    layer = pool.layer(0)

    def decode(**kw):
        int2_cuda.decode(q, None, layer, geom, batch, out, 1, 128, 0.1, **kw)

    with pytest.raises(ValueError, match="are not K2V2 at head dim 128"):
        decode(widths=(2, 2))  # the tails make the rows longer than K2's
    with pytest.raises(ValueError, match="39 / 32 bytes are not K4x16\\+3V2"):
        decode(widths=(3, 2), split=SplitWidth(3, 16, 4))  # not the pool's rows (4x16+2: 39 bytes)
    with pytest.raises(ValueError, match="are not K4x16\\+2V2"):
        decode(widths=(3, 2), split=width)  # the split's narrow width is not the layer's key width
    with pytest.raises(ValueError, match="keys split 4x16\\+2 at head dim 256"):
        wide = split_geometry(256, SplitWidth(2, 32, 4), 2)
        int2_cuda.decode(torch.zeros(1, 8, 256, dtype=torch.bfloat16), None, layer, wide, batch,
                         torch.empty(1, 8, 256, dtype=torch.bfloat16), 1, 128, 0.1, widths=(2, 2), split=width)
