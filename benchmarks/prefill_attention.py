"""The materialized extend's attention alone: one prefill chunk of T queries over N keys (the history plus the
chunk, causal aligned to the lower right, GQA), SDPA flash against SDPA cuDNN with the lower-right mask, and the
engine's split (kernels/chunk_attention.py: cuDNN over the history and over the chunk, merged by log-sum-exp),
TFLOP/s against the H100's peak.

    python3 benchmarks/prefill_attention.py [--chunk 8192] [--contexts 16384,65536,100000]

Each backend is first asked whether it takes the call (``can_use_*_attention`` with its reasons printed); the
outputs are compared with flash's.
"""

from __future__ import annotations

import argparse

import torch
from torch.backends.cuda import SDPAParams, can_use_cudnn_attention, can_use_flash_attention
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention as sdpa

from oscar_kv.kernels.chunk_attention import chunk_attention

PEAK = 790e12  # dense bf16 / fp16 tensor-core FLOP/s of an H100 SXM as measured by cuBLAS (DESIGN.md)


def time_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--contexts", default="16384,65536,100000")
    ap.add_argument("--heads", default="32,8")
    args = ap.parse_args()
    hq, hkv = (int(x) for x in args.heads.split(","))
    d, t = 128, args.chunk
    for n in (int(x) for x in args.contexts.split(",")):
        g = torch.Generator(device="cuda").manual_seed(n)
        q = torch.randn(1, hq, t, d, device="cuda", dtype=torch.float16, generator=g)
        k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.float16, generator=g)
        v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.float16, generator=g)
        flops = 4 * hq * d * (t * (n - t) + t * t / 2)
        mask = causal_lower_right(t, n)
        results = {}
        for name, backend, check in (("flash", SDPBackend.FLASH_ATTENTION, can_use_flash_attention),
                                     ("cudnn", SDPBackend.CUDNN_ATTENTION, can_use_cudnn_attention)):
            params = SDPAParams(q, k, v, None, 0.0, False, True)
            ok = check(params, False)
            if not ok:
                check(params, True)  # prints why
            try:
                with sdpa_kernel(backend):
                    out = sdpa(q, k, v, attn_mask=mask, scale=d ** -0.5, enable_gqa=True)
                    ms = time_ms(lambda: sdpa(q, k, v, attn_mask=mask, scale=d ** -0.5, enable_gqa=True))
                results[name] = out
                err = (out.float() - results["flash"].float()).abs().max().item() if "flash" in results else 0.0
                print(f"N {n:>6} T {t} {name:>6}: {ms:8.2f} ms  {flops / ms / 1e9:6.1f} TFLOP/s "
                      f"({100 * flops / ms / 1e9 / PEAK * 1e12:4.1f}% of peak)  max |diff| vs flash {err:.2e} "
                      f"(can_use: {ok})", flush=True)
            except Exception as exc:
                print(f"N {n:>6} T {t} {name:>6}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        split_ms = time_ms(lambda: chunk_attention(q, k, v, d ** -0.5, "split"))
        err = (chunk_attention(q, k, v, d ** -0.5, "split").float() - results["flash"].float()).abs().max().item()
        print(f"N {n:>6} T {t}  split: {split_ms:8.2f} ms  {flops / split_ms / 1e9:6.1f} TFLOP/s "
              f"({100 * flops / split_ms / 1e9 / PEAK * 1e12:4.1f}% of peak)  max |diff| vs flash {err:.2e}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
