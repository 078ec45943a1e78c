"""The fused write path at decode sizes (one token per sequence per layer): time per launch and accuracy.

    python benchmarks/write_decode.py [--out FILE.json]

Variants of the key rotation: inside write_kv (its float32 FMA dot) with 4 or 8 warps ("kernel"), done by
torch (float32 einsum, centering included) before a write_kv that only stores ("torch"), or the decode step's
window writer (kernels/window_write.py: one program per token, KV head and 32 key columns; "window").  Accuracy: the stored BF16 keys against the float64 rotation rounded to BF16: the
fraction of elements equal and the largest difference in BF16 ulps.  Timing: 10 replays of a CUDA graph of 20
launches (as decode steps run), H = 8 and 4 KV heads (one GPU / two-way tensor parallel), D = 128.
"""

import argparse
import json

import torch

from oscar_kv.kernels.layout import PagedKVPool, PoolGeometry, clip_indices
from oscar_kv.kernels.window_write import write_window
from oscar_kv.kernels.write import write_kv

D = 128


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the BF16 spacing at b."""
    spacing = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp_min(1e-30)
    return ((a.float() - b.float()).abs() / spacing).floor()


def measure(h: int, t: int, variant: str, warps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    geom = PoolGeometry(num_layers=1, num_kv_heads=h, head_dim=D, group_size=D, page_size=16, sink_size=64,
                        recent_size=256)
    pool = PagedKVPool.allocate(geom, 8, 64, device="cuda")
    k = (torch.randn(t, h, D, generator=gen) * 3).cuda().to(torch.bfloat16)
    v = torch.randn(t, h, D, generator=gen).cuda().to(torch.bfloat16)
    rot = torch.linalg.qr(torch.randn(h, D, D, generator=gen, dtype=torch.float64))[0]
    mean = torch.randn(h, D, generator=gen, dtype=torch.float64)
    win = torch.arange(t, dtype=torch.int32, device="cuda") * 16  # one token per page, as in a decode batch
    q2 = torch.full((t,), -1, dtype=torch.int32, device="cuda")
    ck = cv = clip_indices(0.96, D, (h,)).cuda()
    r32, mu32 = rot.float().cuda(), mean.float().cuda()

    def launch():
        if variant == "torch":
            keys = torch.einsum("thd,hde->the", k.float() - mu32, r32)
            write_kv(pool, 0, keys, v, win, q2, None, None, ck, cv, num_warps=warps)
        elif variant == "window":
            write_window(pool, 0, k, v, win, r32, mu32)
        else:
            write_kv(pool, 0, k, v, win, q2, r32, mu32, ck, cv, num_warps=warps)

    launch()
    exact = torch.einsum("thd,hde->the", k.double().cpu() - mean, rot).to(torch.bfloat16)
    stored = pool.k_win[0][win.long() // 16, :, 0].cpu()  # [T, H, D]
    ulps = bf16_ulps(stored, exact)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()  # as the engine runs decode steps: no host launch cost in the timing
    with torch.cuda.graph(graph):
        for _ in range(20):
            launch()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return dict(heads=h, tokens=t, variant=variant, warps=warps, us=round(start.elapsed_time(end) * 1e3 / 200, 2),
                equal=round(float((ulps == 0).float().mean()), 4), max_ulps=int(ulps.max()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for h in (8, 4):
        for t in (1, 8, 32, 64):
            for variant, warps in (("kernel", 8), ("window", 4), ("torch", 4)):
                row = measure(h, t, variant, warps)
                rows.append(row)
                print(f"H={h:2d} T={t:3d} {variant:7s} warps={warps}: {row['us']:8.2f} us  "
                      f"bf16-equal {row['equal']:.4f}  max {row['max_ulps']} ulp", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
