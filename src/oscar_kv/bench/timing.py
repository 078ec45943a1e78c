"""How the kernel benchmarks time one call: triton's do_bench (L2 flushed between calls), CUDA-graph replays, and the
GPU kernel time of a call alone (torch.profiler).  GPU only; nothing here runs on the CPU."""

from __future__ import annotations

import functools

import torch

# bench attention --eager sets this False: eager calls instead of CUDA-graph replays
USE_GRAPHS = True


def _bench(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds per call; triton's do_bench flushes L2 between calls."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _capture(fn):
    """fn captured in a CUDA graph (after a warm-up on a side stream), or None when capture fails."""
    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph
    except Exception as e:  # pragma: no cover - depends on the backend
        print(f"graph capture failed ({e!r:.80}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        return None


def _bench_call(fn) -> float:
    """Time one decode call as a serving engine runs it: captured once in a CUDA graph, then replayed
    (median, L2 flushed between replays).  Without the graph, a call of a few tens of microseconds
    measures Python launch overhead (several launches per call) rather than the GPU.  Falls back to
    eager timing when capture fails.  Events around a replay also count the graph's launch: an empty
    kernel measures ~4.4 us this way on the H100 (``launch_floor_ms``; benchmarks/NOTES.md, "what timing adds,
    per-step stamps, desync, a load-only loop")."""
    graph = _capture(fn) if USE_GRAPHS else None
    ms = _bench(graph.replay if graph is not None else fn)
    del graph
    return ms


_FLUSH_KERNEL = 'extern "C" __global__ void oscar_l2_flush(int4* p, int n) { ' \
    'for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = make_int4(0, 0, 0, 0); }'


@functools.lru_cache(maxsize=None)
def _flush_kernel(device_index: int):
    with torch.cuda.device(device_index):
        return torch.cuda._compile_kernel(_FLUSH_KERNEL, "oscar_l2_flush")


def _kernel_ms(fn, reps: int = 30) -> float | None:
    """GPU time of the kernels one call runs (CUPTI kernel records through torch.profiler), median over
    ``reps`` graph replays with an L2 flush before each: the call's cost inside a serving engine's step graph,
    without the graph launch and the events that ``_bench_call`` also counts.  A call of several kernels is
    the sum of its kernels (gaps between them not counted).  None where the profiler records no kernels."""
    from torch.profiler import ProfilerActivity, profile

    graph = _capture(fn)
    flush_buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    flush = _flush_kernel(torch.cuda.current_device())
    n16 = flush_buf.numel() // 16
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush(grid=(1024, 1, 1), block=(256, 1, 1), args=[flush_buf, n16])
            graph.replay() if graph is not None else fn()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.name, e.device_time) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0)
    calls, cur = [], None
    for _, name, us in kernels:  # split at the flushes: each call's kernels follow one flush
        if name == "oscar_l2_flush":
            cur = 0.0
            calls.append(cur)
        elif calls:
            calls[-1] += us
    del graph, flush_buf
    calls = sorted(c for c in calls if c > 0)
    return calls[len(calls) // 2] * 1e-3 if calls else None


def launch_floor_ms() -> float:
    """What ``_bench_call`` measures for an empty kernel: the graph launch and the events around a replay."""
    empty = torch.cuda._compile_kernel('extern "C" __global__ void oscar_empty() {}', "oscar_empty")
    return _bench_call(lambda: empty(grid=(1, 1, 1), block=(32, 1, 1), args=[]))
