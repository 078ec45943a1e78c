"""Decode-step GEMMs of one model at small batch: time and share of copy bandwidth per shape, cuBLAS against
cuBLASLt (torch.backends.cuda.preferred_blas_library), with and without a bias.

    python3 benchmarks/gemm_small_batch.py [--arch qwen3-8b] [--batches 1,8,16]

Shapes are the executor's (models/decoder.py): q|k|v, o_proj, gate|up, down, lm_head.  Times are medians of CUDA
graph replays of 20 back-to-back calls on distinct weight copies (so the L2 cache holds none of them).
"""

from __future__ import annotations

import argparse

import torch

from oscar_kv.bench.floors import copy_bandwidth
from oscar_kv.bench.models import ARCHS


def shapes(arch: str) -> dict[str, tuple[int, int]]:
    a = ARCHS[arch]
    d, hq, hkv, c, f = a["head_dim"], a["num_attention_heads"], a["num_key_value_heads"], a["hidden_size"], \
        a["intermediate_size"]
    return {"qkv": ((hq + 2 * hkv) * d, c), "o_proj": (c, hq * d), "gate_up": (2 * f, c), "down": (c, f),
            "lm_head": (a["vocab_size"], c)}


def time_linear(n: int, k: int, m: int, bias: bool, linear=torch.nn.functional.linear) -> float:
    """ms per call."""
    copies = max(2, min(20, int(4e9 // (2 * n * k))))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for w in ws:  # warm up (and pick the algorithm) outside the graph
        linear(x, w, b)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws:
            linear(x, w, b)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / copies)
    del ws, g
    torch.cuda.empty_cache()
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3-8b", choices=sorted(ARCHS))
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--triton-sweep", action="store_true",
                    help="time kernels/gemv.py's small_linear over its tile settings against cuBLAS instead")
    args = ap.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    if args.triton_sweep:
        triton_sweep(args, bw)
        return
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; ms per call (% of copy bandwidth for the weight bytes)")
    print(f"{'shape':>8} {'n x k':>14} {'m':>3} {'cublas':>15} {'cublaslt':>15} {'cublas+b':>15} {'cublaslt+b':>15}")
    for name, (n, k) in shapes(args.arch).items():
        floor = 2 * n * k / bw * 1e3
        for m in (int(x) for x in args.batches.split(",")):
            cells = []
            for bias in (False, True):
                for lib in ("cublas", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(lib)
                    ms = time_linear(n, k, m, bias)
                    cells.append(f"{ms:7.4f} ({100 * floor / ms:3.0f}%)")
            print(f"{name:>8} {f'{n}x{k}':>14} {m:>3} " + " ".join(f"{c:>15}" for c in cells), flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")


def triton_sweep(args, bw: float) -> None:
    """Each shape and batch: cuBLAS, then small_linear's best tile setting (and the worst, to show the spread),
    outputs checked against F.linear first."""
    import functools
    import itertools

    from oscar_kv.kernels.gemv import small_linear

    def settings_for(m: int) -> list[dict]:
        grid = (((2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8), (2, 3, 4)) if m == 1 else
                ((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 5)))
        return [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns) for bn, bk, nw, ns in itertools.product(*grid)
                if bn * bk <= (8192 if m == 1 else 16384)]

    from oscar_kv.kernels.elementwise import glu

    def cublas_silu(x, w, b):
        return glu(torch.nn.functional.linear(x, w, b))

    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; ms per call (% of copy bandwidth); gate_up+silu: cuBLAS then the "
          "glu kernel, against the GEMV with SiLU * up in its epilogue")
    rows = [(name, n, k, False) for name, (n, k) in shapes(args.arch).items() if name != "lm_head"]  # lm_head: 94%
    rows.append(("gate_up+silu", *shapes(args.arch)["gate_up"], True))
    for name, n, k, gated in rows:
        floor = 2 * n * k / bw * 1e3
        for m in (int(x) for x in args.batches.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            ref = cublas_silu(x, w, None).float() if gated else torch.nn.functional.linear(x, w).float()
            cublas = time_linear(n, k, m, False, cublas_silu if gated else torch.nn.functional.linear)
            results = []
            for s in settings_for(m):
                if gated:
                    s = dict(s, glu="silu")
                try:
                    err = (small_linear(x, w, **s).float() - ref).abs().max().item()
                    if err > 1e-2 * ref.abs().max().item():
                        print(f"  {name} m={m} {s}: wrong, max error {err:.3g}")
                        continue
                    results.append((time_linear(n, k, m, False, functools.partial(small_linear, **s)), s))
                except Exception as exc:  # a setting over the shared-memory or register budget
                    print(f"  {name} m={m} {s}: {type(exc).__name__}")
            results.sort(key=lambda r: r[0])
            best, worst = results[0], results[-1]
            default = time_linear(n, k, m, False, functools.partial(small_linear, glu="silu" if gated else None))
            print(f"{name:>12} {f'{n}x{k}':>14} m={m:<3} cublas {cublas:.4f} ({100 * floor / cublas:3.0f}%)  "
                  f"triton default {default:.4f} ({100 * floor / default:3.0f}%)  best {best[0]:.4f} "
                  f"({100 * floor / best[0]:3.0f}%) {best[1]}  worst {worst[0]:.4f}  "
                  f"top3 {[(round(t, 4), tuple(s.values())[:4]) for t, s in results[:3]]}", flush=True)
            del w
            torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
