"""Shared memory per CTA of the engine's Triton kernels as compiled for sm_90 (H100), on any machine, no GPU.

Triton compiles for a named target without a driver (ptxas ships with it), and the compiled kernel's metadata
carries the shared memory it asks for at launch.  This script makes the wrappers (write_kv, migrate_pages,
int2_decode, bf16_decode, int2_extend, materialize) compile instead of launch: a stand-in driver reports an
sm_90 target, every launch becomes a warm-up (compile only), and the kernel names and bytes are recorded.  An
SM of an H100 grants a CTA at most 227 KiB (232448 bytes).

    python benchmarks/kernel_smem.py [--dims 64 128 256] [--gqa 2] [--group 256] [--only extend]

Run it without TRITON_INTERPRET (the interpreter compiles nothing).  Inputs are random CPU tensors; only their
dtypes, strides and shapes matter.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager

SM_LIMIT = 232448  # 227 KiB


class _Sm90Driver:
    """Enough of a Triton driver for compiling: an sm_90 target and device 0."""

    def __init__(self):
        import torch

        self.get_current_device = lambda: 0
        self.get_current_stream = lambda idx=None: 0
        self._torch = torch

    @staticmethod
    def is_active():
        return True

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return self._torch.device("cpu")

    def map_python_to_cpp_type(self, ty):
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)

    def get_benchmarker(self):
        raise NotImplementedError


def _resources(cubin: bytes) -> str:
    """Registers per thread and stack bytes (spills) of a cubin, from cuobjdump (shipped with Triton)."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return f"regs {m.group(1)} stack {m.group(2)}" if m else "regs ?"


@contextmanager
def compile_only(record: list):
    """Within: Triton launches compile for sm_90 and append (kernel name, shared bytes, constexprs) to record."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def warm(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        record.append((self.fn.__name__, kernel.metadata.shared, kernel.metadata.num_warps,
                       kernel.metadata.num_stages, _resources(kernel.asm["cubin"])))
        return kernel

    before = driver._active  # no GPU, no default driver: put back what was there, not the default
    driver.set_active(_Sm90Driver())
    JITFunction.run = warm
    try:
        yield
    finally:
        JITFunction.run = run
        driver._active = before


def _cases(d: int, gqa: int, group: int):
    """(label, thunk) per kernel call the engine makes, at head dim d and quantization group size ``group``."""
    import torch

    from oscar_kv.kernels import bf16_decode, decode, extend, materialized_extend, write
    from oscar_kv.kernels.layout import PagedBatch, PagedKVPool, PoolGeometry

    # the PTX code conversion, as on a GPU (the wrappers turn it off for a CPU device)
    decode.asm_enabled = extend.asm_enabled = lambda device, use_asm: True
    h, p, pages = 2, 16, 8
    geom = PoolGeometry(num_layers=1, num_kv_heads=h, head_dim=d, group_size=group, page_size=p, sink_size=p,
                        recent_size=2 * p)
    pool = PagedKVPool.allocate(geom, pages, pages, device="cpu")
    bt = torch.arange(pages, dtype=torch.int32).reshape(1, pages)
    batch = PagedBatch(bt, torch.tensor([pages * p], dtype=torch.int32), torch.tensor([4], dtype=torch.int32))
    rot = torch.eye(d).expand(h, d, d).contiguous()
    clip = torch.full((h,), d - 1, dtype=torch.int32)
    t = 16
    k = torch.randn(t, h, d, dtype=torch.bfloat16)
    slots = torch.arange(t, dtype=torch.int32)
    q1 = torch.randn(1, h * gqa, d, dtype=torch.bfloat16)
    qt = torch.randn(t, h * gqa, d, dtype=torch.bfloat16)
    cu = torch.tensor([0, t], dtype=torch.int32)
    # per-position key centering over 8 pairs per head (calibration's default)
    from oscar_kv.rope import KernelRope, keep_pairs, random_pairs

    gen = torch.Generator().manual_seed(0)
    mu = keep_pairs(torch.randn(h, d, generator=gen), random_pairs(h, d // 2, 8, gen))
    rope = KernelRope.build(mu, 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d), 1.0, pages * p + t)
    scratch = materialized_extend.Scratch()
    yield "write_kv (rotating)", lambda: write.write_kv(pool, 0, k, k, slots, slots, rot, None, clip, clip)
    yield "write_kv (keys rotated)", lambda: write.write_kv(pool, 0, k, k, slots, slots, None, None, clip, clip)
    yield "migrate_pages", lambda: write.migrate_pages(pool, slots[:2], slots[:2], clip[None], clip[None])
    yield "int2_decode (Triton)", lambda: decode.int2_decode(q1, pool, 0, batch, rot, max_int2_pages=4,
                                                             backend="triton")
    yield "bf16_decode (rotating)", lambda: bf16_decode.bf16_decode(q1, pool.k_win[0], pool.v_win[0], bt,
                                                                    batch.seq_lens, rot, page_size=p,
                                                                    max_seq_len=pages * p)
    yield "bf16_decode (keys as is)", lambda: bf16_decode.bf16_decode(q1, pool.k_win[0], pool.v_win[0], bt,
                                                                      batch.seq_lens, None, page_size=p,
                                                                      max_seq_len=pages * p)
    yield "int2_extend", lambda: extend.int2_extend(qt, k, k, cu, pool, 0, batch, rot, max_seqlen=t,
                                                    max_int2_pages=4, num_splits=2)
    yield "int2_decode (rope, 8 pairs)", lambda: decode.int2_decode(q1, pool, 0, batch, rot, rope=rope,
                                                                    max_int2_pages=4, max_seq_len=pages * p,
                                                                    backend="triton")
    yield "int2_extend (rope, 8 pairs)", lambda: extend.int2_extend(qt, k, k, cu, pool, 0, batch, rot, rope=rope,
                                                                    max_seqlen=t, max_int2_pages=4, num_splits=2)
    plan = materialized_extend.MaterializePlan.build([0, t], [pages * p], [0], "cpu")
    kb, vb = scratch.take(plan.rows, h, d, "cpu")
    yield "materialize", lambda: materialized_extend.materialize(pool, 0, batch, k, k, cu, plan.groups[0], kb, vb)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--gqa", type=int, default=2, help="query heads per KV head")
    ap.add_argument("--only", default="", help="cases whose label contains this")
    ap.add_argument("--group", type=int, default=0,
                    help="quantization group size (default: calibration's, min(head dim, 128); larger: one per head)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter compiles nothing", file=sys.stderr)
        return 2
    worst = 0
    for d in args.dims:
        group = min(d, args.group or 128)
        for label, call in _cases(d, args.gqa, group):
            if args.only not in label:
                continue
            record: list = []
            with compile_only(record):
                call()
            for name, shared, warps, stages, res in record:
                flag = "  OVER" if shared > SM_LIMIT else ""
                print(f"D={d:4d} G={group:3d}  {label:26s} {name:22s} warps {warps} stages {stages}  {res:20s} "
                      f"shared {shared / 1024:6.1f} KiB{flag}", flush=True)
                worst = max(worst, shared)
    print(f"largest: {worst / 1024:.1f} KiB (an H100 SM grants {SM_LIMIT / 1024:.0f} KiB per CTA)")
    return 0 if worst <= SM_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
