"""A decode step's chain of small kernels with and without programmatic dependent launch (kernels/pdl.py).

Qwen3-8B's layer shapes at a few tokens, ``--layers`` layers of: residual + RMSNorm, the q|k|v GEMV, q/k norm + RoPE,
o_proj GEMV, residual + RMSNorm, gate|up GEMV with SiLU, down GEMV (no attention: the chain the executor runs
around it).  Each variant is captured in one CUDA graph; rounds alternate the variants and the best replay time
of each is printed with the weight bytes' time at ``--bandwidth``.  The outputs of both variants must be equal
bit for bit (PDL changes when kernels start, not what they compute).

    python3 benchmarks/pdl_chain.py --tokens 1,8
"""

from __future__ import annotations

import argparse
import json

import torch

from oscar_kv.kernels import elementwise, pdl
from oscar_kv.kernels.gemv import linear, linear_glu


def build(layers: int, hidden: int, heads: tuple[int, int], head_dim: int, ffn: int, device):
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, device=device, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)

    hq, hkv = heads
    return [dict(norm1=torch.ones(hidden, device=device, dtype=torch.bfloat16),
                 qkv=w((hq + 2 * hkv) * head_dim, hidden), qk_norm=torch.ones(2, head_dim, device=device,
                                                                               dtype=torch.bfloat16),
                 o=w(hidden, hq * head_dim), norm2=torch.ones(hidden, device=device, dtype=torch.bfloat16),
                 gate_up=w(2 * ffn, hidden), down=w(hidden, ffn)) for _ in range(layers)]


def chain(weights, h, positions, cos, sin, heads, head_dim):
    residual = None
    n = h.shape[0]
    for lw in weights:
        x, residual = elementwise.rms_norm(h, lw["norm1"], 1e-6, residual)
        q, k, v = elementwise.rope_qkv(linear(x, lw["qkv"]), positions, cos, sin, heads, head_dim, lw["qk_norm"])
        h = linear(q.reshape(n, -1), lw["o"])  # attention's place: o_proj reads the rotated queries
        x, residual = elementwise.rms_norm(h, lw["norm2"], 1e-6, residual)
        h = linear(linear_glu(x, lw["gate_up"]), lw["down"])
    return elementwise.rms_norm(h, weights[0]["norm1"], 1e-6, residual)[0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="copy bandwidth, bytes/s (H200: ~4.3e12)")
    ap.add_argument("--output")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    hidden, heads, head_dim, ffn = 4096, (32, 8), 128, 12288
    weights = build(args.layers, hidden, heads, head_dim, ffn, device)
    weight_bytes = sum(t.numel() * t.element_size() for lw in weights for t in lw.values())
    cos = torch.randn(4096, head_dim, device=device).to(torch.bfloat16)
    sin = torch.randn(4096, head_dim, device=device).to(torch.bfloat16)
    rows = []
    for m in [int(x) for x in args.tokens.split(",")]:
        h = torch.randn(m, hidden, device=device).to(torch.bfloat16)
        positions = torch.arange(100, 100 + m, device=device)
        graphs, outs = {}, {}
        for name, on in (("off", False), ("on", True)):
            pdl.set_enabled(on)
            chain(weights, h, positions, cos, sin, heads, head_dim)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs[name] = chain(weights, h, positions, cos, sin, heads, head_dim)
            graphs[name] = graph
        pdl.set_enabled(None)
        best = {name: float("inf") for name in graphs}
        for _ in range(args.rounds):
            for name, graph in graphs.items():
                graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.replays):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
                best[name] = min(best[name], start.elapsed_time(end) / args.replays)
        equal = all(torch.equal(outs["off"], out) for out in outs.values())
        floor = weight_bytes / args.bandwidth * 1e3
        rows.append(dict(tokens=m, layers=args.layers, floor_ms=floor, equal=equal,
                         **{f"{name}_ms": t for name, t in best.items()}))
        print(f"tokens {m}: weights' floor {floor:.3f} ms; " + "; ".join(
            f"{name} {t:.3f} ms ({floor / t:.1%}, {t / best['off']:.3f}x off)" for name, t in best.items())
            + f"; outputs equal: {equal}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
