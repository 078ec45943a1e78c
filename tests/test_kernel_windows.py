"""The engine's kernel steps (engine/kernel_attention.py) on a pool with a sliding-window layer beside a full one:
each layer's attention follows its own window (PoolGeometry.layer_windows), through the decode kernel, the extend
kernel and the materialized flash path.  No model: the real scheduler and pool, random pool contents, the kernels
against their references (kernels/reference.py).
"""

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from oscar_kv.engine.block_pool import PagePool, PoolPlan  # noqa: E402
from oscar_kv.engine.kernel_attention import DecodeStep, ExtendStep, PoolView, kernel_step  # noqa: E402
from oscar_kv.engine.scheduler import Scheduler  # noqa: E402
from oscar_kv.engine.sequence import SamplingParams, Sequence  # noqa: E402
from oscar_kv.kernels import reference as ref  # noqa: E402
from oscar_kv.kernels.layout import PoolGeometry  # noqa: E402

from kernel_utils import DEV, rel_err  # noqa: E402


def _fill(pool: PagePool, gen: torch.Generator) -> None:
    """Random window rows, codes, scales (> 0) and zero points (any uint8) in every layer: the kernels read them as
    stored."""
    for i in range(pool.geometry.num_layers):
        for win in (pool.k_win[i], pool.v_win[i]):
            win.copy_(torch.randn(win.shape, generator=gen))
        for ints in (pool.k_codes[i], pool.v_codes[i], pool.k_zero[i], pool.v_zero[i]):
            ints.copy_(torch.randint(0, 256, ints.shape, generator=gen, dtype=torch.uint8))
        for scale in (pool.k_scale[i], pool.v_scale[i]):
            scale.copy_(torch.rand(scale.shape, generator=gen).half() * 0.5 + 0.1)


def test_each_layer_attends_with_its_own_window():
    """A 150-token prompt in chunks of 100 and 50 (the materialized path), a second one of 40 that joins while the
    first decodes (the extend kernel for the decode token beside it), then decode steps: layer 0 (window 20) and
    layer 1 (full) each match the reference with their own window, and layer 0's window changes the result."""
    g = PoolGeometry(num_layers=2, num_kv_heads=2, head_dim=64, group_size=64, page_size=16, sink_size=32,
                     recent_size=32, layer_windows=(20, None))
    pool = PagePool(PoolPlan(40, 40, g), device=DEV)
    gen = torch.Generator().manual_seed(0)
    _fill(pool, gen)
    view = PoolView(pool)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=100, enable_prefix_caching=False)
    sched.add(Sequence("a", list(range(150)), SamplingParams(max_tokens=3, temperature=0)))
    codec = SimpleNamespace(k_rotation=None, k_rope_mean=None, keys_as_is=True)
    kinds, paths = set(), set()
    for step in range(5):
        if step == 2:
            sched.add(Sequence("b", list(range(40)), SamplingParams(max_tokens=2, temperature=0)))
        out = sched.schedule()
        plan = kernel_step(view, out.scheduled)
        kinds.add(type(plan))
        if isinstance(plan, ExtendStep):
            part, flash = plan.paths(False, 20)
            paths |= {"flash"} if flash.groups else set()
            paths |= {"kernel"} if part is not None else set()
        n = sum(st.num_tokens for st in out.scheduled)
        q = torch.randn(1, 8, n, 64, generator=gen).to(DEV)
        k, v = (torch.randn(1, 2, n, 64, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
        for layer, window in enumerate(g.layer_windows):
            got = plan.attend(layer, codec, q, k, v, 0.125)[0]
            one = view.layer_pool(layer)
            qs = q[0].transpose(0, 1)
            if isinstance(plan, DecodeStep):
                want = ref.decode_reference(one, 0, qs, plan.batch, None, 0.125, window=window)
                full = ref.decode_reference(one, 0, qs, plan.batch, None, 0.125)
            else:
                kr, vr = k[0].transpose(0, 1), v[0].transpose(0, 1)
                want = ref.extend_reference(one, 0, qs, kr, vr, plan.cu_seqlens, plan.batch, None, 0.125,
                                            window=window)
                full = ref.extend_reference(one, 0, qs, kr, vr, plan.cu_seqlens, plan.batch, None, 0.125)
            assert rel_err(got, want) < 1e-2, (step, layer)
            if window is not None:
                assert rel_err(full, want) > 0.1, step
        for st in out.scheduled:
            sched.finish_step(st)
            if st.samples:
                st.seq.output_ids.append(7)
    assert kinds == {DecodeStep, ExtendStep} and paths == {"flash", "kernel"}


def test_the_start_up_line_says_which_decode_kernel_the_windowed_layers_take():
    """LLMEngine.describe's INT2 decode part: windowed layers take the CUDA kernel as the full ones do (its SLIDING
    variant); where the full layers take Triton anyway, one reason covers every layer."""
    from oscar_kv.engine.engine import LLMEngine

    def engine(windows, full_kernel):
        def choice(widths=(2, 2)):
            return (full_kernel, "not a CUDA device") if full_kernel != "cuda" else ("cuda", None)

        geom = PoolGeometry(num_layers=len(windows), num_kv_heads=2, layer_windows=windows)
        return SimpleNamespace(pool=SimpleNamespace(geometry=geom), int2_decode_kernel=choice)

    describe = LLMEngine.int2_decode_description
    assert describe(engine((None, None), "cuda")) == "the one-launch CUDA kernel"
    assert describe(engine((1024, 1024, None, 1024), "cuda")) == "the one-launch CUDA kernel"
    assert describe(engine((1024, None), "triton")) == "the Triton kernel (not a CUDA device)"
