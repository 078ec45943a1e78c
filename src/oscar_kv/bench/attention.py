"""Decode-attention benchmark: INT2 paged kernel vs BF16 baselines, Qwen3-8B attention geometry.

    python -m oscar_kv.bench.attention --contexts 8192,32768,65536,131072 --batch-sizes 1,8,32 --output DIR

Baselines measured in the same run: torch SDPA on a contiguous BF16 cache (flash, cuDNN and efficient
backends, GQA without expanding K/V) and our BF16 paged kernel (kernels/decode.py).  Reported per
(context, batch): time per call (median, L2 flushed between calls), speedup vs the best BF16, bytes the
INT2 call must read (codes + metadata + BF16 windows) over time as a fraction of the device-to-device copy
bandwidth measured in the same run, plus write-path and migration throughput.  Writes
``DIR/attention.json`` and ``DIR/attention.png`` (when matplotlib is importable).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import sys
import time
import warnings

import torch

from ..rope import DEFAULT_PAIRS, KernelRope, keep_pairs, random_pairs

GEOMETRY = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, group_size=128, page_size=16, sink_size=64,
                recent_size=256, num_layers=36)


def use_head_dim(head_dim: int) -> None:
    """Time head dim 64 as Llama-3.2-1B's attention (32 query / 8 KV heads of 64 channels, group 64), 128 as
    Qwen3-8B's (GEOMETRY)."""
    GEOMETRY.update(head_dim=head_dim, group_size=min(head_dim, 128))


def layer_geometry():
    """The pool geometry of one Qwen3-8B layer (GEOMETRY), as every attention benchmark times it."""
    from ..kernels.layout import PoolGeometry

    return PoolGeometry(num_layers=1, **{k: GEOMETRY[k] for k in ("num_kv_heads", "head_dim", "group_size", "page_size",
                                                                  "sink_size", "recent_size")})


def _ints(s: str) -> list[int]:
    out = []
    for part in s.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        out.append(int(part.rstrip("k")) * mult)
    return out


def _bench(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds per call; triton's do_bench flushes L2 between calls."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


USE_GRAPHS = True


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


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def matmul_throughput(device: torch.device, n: int = 8192) -> float:
    """Dense bfloat16 tensor-core FLOP/s of one large square GEMM (cuBLAS): the compute floor's peak."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = _bench(lambda: a @ b, warmup_ms=300, rep_ms=300)  # long warm-up: clocks settle under tensor-core load
    del a, b
    return 2 * n ** 3 / (ms * 1e-3)


def _orthogonal(h: int, d: int, device) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(h, d, d, dtype=torch.float64))
    return q.float().to(device)


def _rope_mean(h: int, d: int, gen: torch.Generator, pairs: int = DEFAULT_PAIRS, layout=None) -> torch.Tensor:
    """A pre-RoPE key mean as calibration ships it: large (a k_proj bias), live in ``pairs`` of the RoPE pairs
    per head (the rotated ones of ``layout``)."""
    rotated = d // 2 if layout is None else layout.rotated_pairs
    keep = torch.zeros(h, d // 2, dtype=torch.bool)
    keep[:, :rotated] = random_pairs(h, rotated, min(pairs, rotated), gen)
    return keep_pairs(torch.randn(h, d, generator=gen) * 20, keep, layout)


def calibrated_like(geometry, seed: int = 0, pairs: int = DEFAULT_PAIRS, layout=None):
    """A synthetic artifact shaped like the one ``calibrate`` ships, for random-weight models: per-head
    orthogonal key and value rotations, a constant key mean plus per-position means live in ``pairs`` RoPE pairs
    per head (magnitude as _rope_mean), default clips; ``layout``: the model's rope.RotaryLayout where its RoPE
    is partial or interleaved.  Speed depends on this shape, not on the numbers."""
    from ..artifacts import DEFAULT_K_CLIP, DEFAULT_V_CLIP, Rotations

    g = geometry
    gen = torch.Generator().manual_seed(seed)
    rot = Rotations.data_free(g, "hadamard", k_clip=DEFAULT_K_CLIP, v_clip=DEFAULT_V_CLIP)
    for name in ("k_rotation", "v_rotation"):
        q, _ = torch.linalg.qr(torch.randn(g.num_layers * g.num_kv_heads, g.head_dim, g.head_dim, generator=gen,
                                           dtype=torch.float64))
        setattr(rot, name, q.float().view(g.num_layers, g.num_kv_heads, g.head_dim, g.head_dim))
    rot.k_mean = torch.randn(g.num_layers, g.num_kv_heads, g.head_dim, generator=gen)
    rot.k_rope_mean = torch.stack([_rope_mean(g.num_kv_heads, g.head_dim, gen, pairs, layout)
                                   for _ in range(g.num_layers)])
    if layout is not None and not layout.standard:
        rot.rope_layout = layout
    rot.manifest = {"calibration": {"composition": "synthetic calibrated-like (bench.attention.calibrated_like)",
                                    "key_centering": "rope", "rope_pairs": pairs}}
    rot.validate()
    return rot


def load_rotations(spec: str | None, geometry, validate: bool = True, rope_pairs: int = DEFAULT_PAIRS, layout=None):
    """``--rotations`` of the benchmarks: an artifact directory, ``synthetic`` (default: calibrated_like with
    ``rope_pairs`` pairs in ``layout``'s rotated pairs) or ``hadamard`` (data-free, no centering: the cheapest decode
    attention).  ``validate``: a directory's artifact must be for ``geometry`` exactly (else only its KV heads and
    head dim)."""
    from ..artifacts import DEFAULT_K_CLIP, DEFAULT_V_CLIP, Rotations

    if spec in (None, "", "synthetic"):
        return calibrated_like(geometry, pairs=rope_pairs, layout=layout)
    if spec == "hadamard":
        return Rotations.data_free(geometry, "hadamard", k_clip=DEFAULT_K_CLIP, v_clip=DEFAULT_V_CLIP)
    rot = Rotations.load(spec)
    g = rot.geometry
    if (g.num_kv_heads, g.head_dim) != (geometry.num_kv_heads, geometry.head_dim) or \
            (validate and g.as_dict() != geometry.as_dict()):
        raise SystemExit(f"--rotations {spec}: the artifact is for {g.as_dict()}, the benchmark runs {geometry.as_dict()}")
    return rot


def _mixed_batch(geom, bs: int, ctx: int, device, gen: torch.Generator):
    """Uniform-length batch with shuffled physical pages; returns (PagedBatch, int2 pages, window pages)."""
    from ..kernels.layout import PagedBatch

    sp = geom.sink_pages
    nq = geom.int2_pages_for(ctx)
    nw = geom.pages_for(ctx) - nq
    q_ids = torch.randperm(bs * nq, generator=gen).view(bs, nq).int() if nq else torch.zeros(bs, 0, dtype=torch.int32)
    w_ids = torch.randperm(bs * nw, generator=gen).view(bs, nw).int()
    table = torch.cat([w_ids[:, :sp], q_ids, w_ids[:, sp:]], 1)
    batch = PagedBatch(table, torch.full((bs,), ctx, dtype=torch.int32), torch.full((bs,), nq, dtype=torch.int32))
    return batch.to(device), bs * nq, bs * nw


def _fill_pool(pool, gen_device_seed: int = 0):
    torch.manual_seed(gen_device_seed)
    for c in (pool.k_codes, pool.v_codes):
        c.random_(0, 256)
    for m in (pool.k_meta, pool.v_meta):
        ng = m.shape[-1] // 2
        m[..., :ng].uniform_(0.01, 0.1)
        m[..., ng:].uniform_(-0.2, 0.0)
    for w in (pool.k_win, pool.v_win):
        w.normal_()


def _query_output_bytes(geom, bs: int) -> int:
    """The BF16 query read and output written by one decode call."""
    return 2 * bs * GEOMETRY["num_q_heads"] * geom.head_dim * 2


def int2_bytes(geom, bs: int, ctx: int) -> int:
    """Bytes an INT2 decode call must read: codes + scale/min of history, BF16 sink/recent, q, out."""
    return bs * geom.layer_read_bytes(ctx) + _query_output_bytes(geom, bs)


def bf16_bytes(geom, bs: int, ctx: int) -> int:
    """Bytes a BF16 decode call over the same context must read (the cache unquantized, q, out)."""
    return bs * geom.as_bf16().layer_read_bytes(ctx) + _query_output_bytes(geom, bs)


def _free_bytes(device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    return free


VARIANTS = [dict(block_n=256, num_warps=4, num_stages=2, maxnreg=128, split_target=8),
            dict(block_n=256, num_warps=4, num_stages=2, maxnreg=128, split_target=4),
            dict(block_n=256, num_warps=4, num_stages=2, maxnreg=112, split_target=8),
            dict(block_n=128, num_warps=4, num_stages=2, maxnreg=128, split_target=8),
            dict(block_n=256, num_warps=4, num_stages=2, maxnreg=128, split_target=8, use_asm=False)]
_KNOBS = ("block_n", "num_warps", "num_stages", "kt", "use_asm", "split_target", "maxnreg")


def int2_case(geom, ctx: int, bs: int, device, gen):
    """One timing point: a filled mixed pool of bs sequences of ctx tokens, a bf16 query, per-head rotations.
    Returns (pool, batch, q, rotations, max INT2 pages)."""
    from ..kernels.layout import PagedKVPool

    batch, nq, nw = _mixed_batch(geom, bs, ctx, device, gen)
    pool = PagedKVPool.allocate(geom, nq, nw, device=device)
    _fill_pool(pool)
    q = torch.randn(bs, GEOMETRY["num_q_heads"], geom.head_dim, device=device, dtype=torch.bfloat16)
    rot = _orthogonal(geom.num_kv_heads, geom.head_dim, device)
    return pool, batch, q, rot, geom.int2_pages_for(ctx)


def sweep_int2(geom, ctx: int, bs: int, device, gen) -> list[dict]:
    """Time INT2 kernel variants (code conversion path, tile, warps, stages) at one point."""
    from ..kernels.decode import int2_decode

    pool, batch, q, rot, mp = int2_case(geom, ctx, bs, device, gen)
    rows = []
    for v in VARIANTS:
        try:
            ms = _bench_call(lambda: int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp, **v))
        except Exception as e:  # a variant that does not compile is reported, not fatal
            rows.append(dict(v, ms=None, error=repr(e)[:200]))
            continue
        rows.append(dict(v, ms=ms))
    del pool
    torch.cuda.empty_cache()
    return rows


def run(contexts: list[int], batch_sizes: list[int], output: str | None = None, sweep: bool = True,
        write_path: bool = True, extend_contexts: list[int] = (), extend_chunks: list[int] = (),
        rotations: str | None = None, layer: int = 0, rope_pairs: int = DEFAULT_PAIRS) -> dict:
    import triton  # noqa: F401  (GPU only)

    from ..kernels.decode import bf16_decode, int2_decode
    from ..kernels.layout import PagedKVPool

    if not torch.cuda.is_available():
        raise SystemExit("the attention benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    warnings.filterwarnings("ignore", message="For dense input, both fused kernels")
    torch.backends.cuda.matmul.allow_tf32 = False
    geom = layer_geometry()
    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(device)
    result = dict(timing="cuda-graph replay" if USE_GRAPHS else "eager", device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                  triton=__import__("triton").__version__, python=platform.python_version(),
                  geometry=GEOMETRY, date=time.strftime("%Y-%m-%d %H:%M:%S"), skipped=[], rows=[])
    bw = copy_bandwidth(device)
    result["copy_bandwidth_GBps"] = bw / 1e9
    print(f"device {props.name}: device-to-device copy {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    empty = torch.cuda._compile_kernel('extern "C" __global__ void oscar_empty() {}', "oscar_empty")
    result["launch_floor_ms"] = _bench_call(lambda: empty(grid=(1, 1, 1), block=(32, 1, 1), args=[]))
    print(f"an empty kernel times {result['launch_floor_ms'] * 1e3:.1f} us per call this way (graph launch + events)",
          flush=True)

    from ..kernels import int2_cuda

    why = int2_cuda.unsupported(device, geom, GEOMETRY["num_q_heads"] // geom.num_kv_heads, None)
    cuda_ok = why is None
    result["int2_backend"] = "cuda (one launch)" if cuda_ok else f"triton ({why})"
    print(f"geometry: {GEOMETRY['num_q_heads']} query / {GEOMETRY['num_kv_heads']} KV heads, head dim "
          f"{GEOMETRY['head_dim']}; INT2 kernel: {result['int2_backend']}", flush=True)
    best = {}
    if sweep:
        for sctx, sbs in ((max(contexts), 1), (max(contexts), 8)):
            rows = sweep_int2(geom, sctx, sbs, device, gen)
            result.setdefault("sweep", []).append(dict(context=sctx, batch=sbs, variants=rows))
            ok = [r for r in rows if r.get("ms")]
            if ok:
                b = min(ok, key=lambda r: r["ms"])
                best[sbs] = {k: b[k] for k in _KNOBS if k in b}
                print(f"sweep ctx={sctx} bs={sbs}: best {best[sbs]} {b['ms'] * 1e3:.1f} us "
                      f"(worst {max(r['ms'] for r in ok) * 1e3:.1f} us)", flush=True)

    sdpa_backends = {}
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa_backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                         "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
    except Exception as e:  # pragma: no cover
        result["skipped"].append(f"sdpa backends unavailable: {e!r}")

    hq, hkv, d = GEOMETRY["num_q_heads"], geom.num_kv_heads, geom.head_dim
    from ..models import AttentionGeometry

    # the artifact's layer ``layer``: its key rotation in every INT2 row, its per-position means in int2+rope
    art = load_rotations(rotations, AttentionGeometry("qwen3", GEOMETRY["num_layers"], hq, hkv, d), validate=False,
                         rope_pairs=rope_pairs)
    art_rot = art.k_rotation[layer].float().to(device)
    art_mu = art.k_rope_mean[layer].float().to(device)
    result["rotations"] = dict(source=rotations or "synthetic", layer=layer, key_centering=art.key_centering,
                               manifest=art.manifest.get("calibration", {}))
    inv_freq = 1e6 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # Qwen3's RoPE base
    for ctx in contexts:
        for bs in batch_sizes:
            need = bf16_bytes(geom, bs, ctx) + int2_bytes(geom, bs, ctx)
            if need > 0.85 * (_free_bytes(device)):
                msg = f"ctx={ctx} bs={bs}: needs {need / 2**30:.1f} GiB (BF16 cache + INT2 pool), does not fit"
                result["skipped"].append(msg)
                print("skip", msg, flush=True)
                continue
            row = dict(context=ctx, batch=bs)
            q = torch.randn(bs, hq, d, device=device, dtype=torch.bfloat16)
            rot = art_rot
            # ---- INT2 mixed pool
            batch, nq, nw = _mixed_batch(geom, bs, ctx, device, gen)
            pool = PagedKVPool.allocate(geom, nq, nw, device=device)
            _fill_pool(pool)
            mp = geom.int2_pages_for(ctx)
            var = best.get(1 if bs == 1 else 8, {})
            backend = "cuda" if cuda_ok else "triton"
            row["int2_variant"] = dict(var, backend=backend)
            row["int2_ms"] = _bench_call(lambda: int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp,
                                                             backend=backend, **var))
            row["int2_kernel_ms"] = _kernel_ms(lambda: int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp,
                                                                   backend=backend, **var))
            if backend == "cuda":  # the all-Triton kernel as well, for the record
                row["int2_triton_ms"] = _bench_call(lambda: int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp,
                                                                        backend="triton", **var))
            row["int2_prerotated_ms"] = _bench_call(lambda: int2_decode(q, pool, 0, batch, None, max_int2_pages=mp,
                                                                        backend=backend, **var))
            row["int2_eager_ms"] = _bench(lambda: int2_decode(q, pool, 0, batch, rot, max_int2_pages=mp,
                                                              backend=backend, **var))
            # keys centered per position (what calibrate ships, rope.py): the kernel adds q . RoPE_p(mu_pre) per key
            if art.key_centering == "rope":
                rope = KernelRope.build(art_mu, inv_freq, 1.0, ctx)
                row["rope_pairs"] = rope.pairs.shape[1]
                rope_fn = lambda: int2_decode(q, pool, 0, batch, rot, rope=rope, max_int2_pages=mp,  # noqa: E731
                                              max_seq_len=ctx, **var)
                row["int2_rope_ms"] = _bench_call(rope_fn)
                row["int2_rope_kernel_ms"] = _kernel_ms(rope_fn)
                if backend == "cuda":
                    row["int2_rope_triton_ms"] = _bench_call(
                        lambda: int2_decode(q, pool, 0, batch, rot, rope=rope, max_int2_pages=mp, max_seq_len=ctx,
                                            backend="triton", **var))
            del pool, batch
            torch.cuda.empty_cache()
            # ---- BF16 paged (all pages BF16)
            npages = geom.pages_for(ctx)
            table = torch.randperm(bs * npages, generator=gen).view(bs, npages).int().to(device)
            lens = torch.full((bs,), ctx, dtype=torch.int32, device=device)
            kw = torch.randn(bs * npages, hkv, geom.page_size, d, device=device, dtype=torch.bfloat16)
            vw = torch.randn_like(kw)
            bf16_fn = lambda: bf16_decode(q, kw, vw, table, lens, None, page_size=geom.page_size,  # noqa: E731
                                          max_seq_len=ctx)
            row["bf16_paged_ms"] = _bench_call(bf16_fn)
            row["bf16_paged_kernel_ms"] = _kernel_ms(bf16_fn)
            del kw, vw, table
            torch.cuda.empty_cache()
            # ---- SDPA on a contiguous BF16 cache
            kc = torch.randn(bs, hkv, ctx, d, device=device, dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            q4 = q.view(bs, hq, 1, d)
            for name, backend in sdpa_backends.items():
                try:
                    with sdpa_kernel([backend]):
                        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True)  # noqa: E731
                        fn()
                        row[name + "_ms"] = _bench_call(fn)
                        row[name + "_kernel_ms"] = _kernel_ms(fn)
                except Exception as e:
                    row[name + "_ms"] = None
                    row[name + "_error"] = repr(e)[:160]
            del kc, vc
            torch.cuda.empty_cache()
            bf16_times = [row[k] for k in ("sdpa_flash_ms", "sdpa_cudnn_ms", "sdpa_efficient_ms", "bf16_paged_ms")
                          if row.get(k)]
            row["best_bf16_ms"] = min(bf16_times)
            row["speedup"] = row["best_bf16_ms"] / row["int2_ms"]
            if row.get("int2_rope_ms"):  # per-position centering: vs BF16 and vs constant centering
                row["rope_speedup"] = row["best_bf16_ms"] / row["int2_rope_ms"]
                row["rope_over_constant"] = row["int2_rope_ms"] / row["int2_ms"]
            bf16_kernel = [row.get(k + "_kernel_ms") for k in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "bf16_paged")]
            bf16_kernel = [v for v in bf16_kernel if v]
            if bf16_kernel and row.get("int2_kernel_ms"):  # the same ratio on GPU kernel time alone
                row["best_bf16_kernel_ms"] = min(bf16_kernel)
                row["kernel_speedup"] = row["best_bf16_kernel_ms"] / row["int2_kernel_ms"]
            row["int2_bytes"] = int2_bytes(geom, bs, ctx)
            row["int2_bw_fraction"] = row["int2_bytes"] / (row["int2_ms"] * 1e-3) / bw
            row["bf16_bytes"] = bf16_bytes(geom, bs, ctx)
            row["bf16_best_bw_fraction"] = row["bf16_bytes"] / (row["best_bf16_ms"] * 1e-3) / bw
            row["int2_floor_ms"] = row["int2_bytes"] / bw * 1e3
            result["rows"].append(row)
            print(_fmt_row(row), flush=True)
    if extend_contexts:
        result["extend"] = bench_extend(geom, device, extend_contexts, extend_chunks, gen)
    if write_path:
        try:
            result["write_path"] = bench_write_path(geom, device, batch_sizes)
        except ImportError as e:
            result["skipped"].append(f"write path not benchmarked: {e!r}")
    if output:
        os.makedirs(output, exist_ok=True)
        with open(os.path.join(output, "attention.json"), "w") as f:
            json.dump(result, f, indent=1)
        _plot(result, os.path.join(output, "attention.png"))
    print_table(result)
    return result


def bench_write_path(geom, device, batch_sizes: list[int]) -> dict:
    """Write-path throughput: decode-step writes (one token per sequence), a prefill chunk, migration."""
    from ..kernels.layout import PagedKVPool, clip_indices
    from ..kernels.write import migrate_pages, write_kv

    out = {}
    h, d, p = geom.num_kv_heads, geom.head_dim, geom.page_size
    layers = GEOMETRY["num_layers"]
    g36 = dataclasses.replace(geom, num_layers=layers, k_bits=geom.k_bits[:1] * layers, v_bits=geom.v_bits[:1] * layers,
                              layer_windows=geom.layer_windows[:1] * layers)
    pool = PagedKVPool.allocate(g36, 4096, 4096, device=device)
    _fill_pool(pool)
    rot = _orthogonal(h, d, device)
    mean = torch.randn(h, d, device=device)
    ck = clip_indices(0.96, d, (layers, h)).to(device)
    cv = clip_indices(0.92, d, (layers, h)).to(device)
    for t in sorted(set(batch_sizes) | {8192}):
        k = torch.randn(t, h, d, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        slots = torch.randperm(4096 * p, device=device)[:t].int()
        half = torch.rand(t, device=device) < 0.5
        win = torch.where(half, slots, -1).int()
        q2 = torch.where(half, -1, slots).int()
        ms = _bench(lambda: write_kv(pool, 0, k, v, win, q2, rot, mean, ck[0], cv[0]))
        out[f"write_{t}_tokens_ms"] = ms
        out[f"write_{t}_tokens_per_s"] = t / (ms * 1e-3)
    for m in sorted(set(batch_sizes)):
        src = torch.randperm(4096, device=device)[:m].int()
        dst = torch.randperm(4096, device=device)[:m].int()
        ms = _bench(lambda: migrate_pages(pool, src, dst, ck, cv))
        out[f"migrate_{m}_pages_{layers}_layers_ms"] = ms
    del pool
    torch.cuda.empty_cache()
    return out


def bench_extend(geom, device, contexts: list[int], chunks: list[int], gen) -> list[dict]:
    """Extend attention (chunked prefill / prefix hit) of one sequence: ``chunk`` new tokens after ``ctx``
    cached ones, INT2 kernel over the mixed pool vs SDPA over a contiguous BF16 cache (bottom-right causal)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from ..kernels.extend import int2_extend
    from ..kernels.layout import PagedKVPool

    hq, hkv, d = GEOMETRY["num_q_heads"], geom.num_kv_heads, geom.head_dim
    rows = []
    for ctx in contexts:
        batch, nq, nw = _mixed_batch(geom, 1, ctx, device, gen)
        pool = PagedKVPool.allocate(geom, nq, nw, device=device)
        _fill_pool(pool)
        rot = _orthogonal(hkv, d, device)
        mp = geom.int2_pages_for(ctx)
        for t in chunks:
            q = torch.randn(t, hq, d, device=device, dtype=torch.bfloat16)
            kn, vn = (torch.randn(t, hkv, d, device=device, dtype=torch.bfloat16) for _ in range(2))
            cu = torch.tensor([0, t], dtype=torch.int32, device=device)
            row = dict(context=ctx, chunk=t)
            row["int2_extend_ms"] = _bench_call(lambda: int2_extend(q, kn, vn, cu, pool, 0, batch, rot, max_seqlen=t,
                                                                    max_int2_pages=mp))
            kc, vc = (torch.randn(1, hkv, ctx + t, d, device=device, dtype=torch.bfloat16) for _ in range(2))
            q4 = q.transpose(0, 1)[None]
            mask = causal_lower_right(t, ctx + t)
            for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
                try:
                    with sdpa_kernel([backend]):
                        fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                            q4, kc, vc, attn_mask=mask, enable_gqa=True)
                        fn()
                        row[name + "_ms"] = _bench_call(fn)
                except Exception as e:
                    row[name + "_ms"] = None
                    row[name + "_error"] = repr(e)[:160]
            best = [row[k] for k in ("sdpa_flash_ms", "sdpa_efficient_ms") if row.get(k)]
            row["speedup"] = min(best) / row["int2_extend_ms"] if best else None
            del kc, vc
            rows.append(row)
            print(f"extend ctx={ctx} chunk={t}: int2 {row['int2_extend_ms'] * 1e3:.1f} us, SDPA "
                  + ", ".join(f"{k[:-3]} {row[k] * 1e3:.1f} us" for k in ("sdpa_flash_ms", "sdpa_efficient_ms")
                              if row.get(k)) + (f" -> {row['speedup']:.2f}x" if row["speedup"] else ""), flush=True)
        del pool
        torch.cuda.empty_cache()
    return rows


def _fmt_row(r: dict) -> str:
    def f(k):
        v = r.get(k)
        return f"{v * 1e3:9.1f}" if v else "        -"
    return (f"{r['context']:>7} {r['batch']:>4} {f('sdpa_flash_ms')} {f('sdpa_cudnn_ms')} {f('sdpa_efficient_ms')} "
            f"{f('bf16_paged_ms')} {f('int2_triton_ms')} {f('int2_ms')} {f('int2_rope_ms')} {r['speedup']:7.2f}x {100 * r['int2_bw_fraction']:6.1f}% "
            f"{100 * r['bf16_best_bw_fraction']:6.1f}%" +
            (f" | rope {r['rope_speedup']:5.2f}x bf16, {r['rope_over_constant']:5.2f}x const"
             if r.get("rope_speedup") else "") +
            (f" | kernels {r['best_bf16_kernel_ms'] * 1e3:8.1f} {r['int2_kernel_ms'] * 1e3:7.1f} {r['kernel_speedup']:6.2f}x"
             if r.get("kernel_speedup") else ""))


def print_table(result: dict) -> None:
    print(f"\n{result['device']}  copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s; times in us per call "
          f"(median, L2 flushed; an empty kernel: {result.get('launch_floor_ms', 0) * 1e3:.1f} us); speedup = best BF16 / INT2")
    print(f"{'ctx':>7} {'bs':>4} {'sdpa-fa':>9} {'sdpa-cudnn':>9} {'sdpa-eff':>9} {'bf16-pg':>9} {'int2-tri':>9} {'int2':>9} {'int2+rope':>9} "
          f"{'speedup':>8} {'int2-bw':>7} {'bf16-bw':>7} | {'GPU kernel time only: best BF16, INT2, speedup'}")
    for r in result["rows"]:
        print(_fmt_row(r))
    for s in result["skipped"]:
        print("skipped:", s)
    for k, v in result.get("write_path", {}).items():
        print(f"{k}: {v:.4g}")


def _plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("matplotlib is not importable: no PNG written")
        return
    rows = result["rows"]
    if not rows:
        return
    bss = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(bss), figsize=(5 * len(bss), 4), squeeze=False)
    for ax, bs in zip(axes[0], bss):
        rr = sorted((r for r in rows if r["batch"] == bs), key=lambda r: r["context"])
        x = [r["context"] // 1024 for r in rr]
        for key, label in (("best_bf16_ms", "best BF16"), ("bf16_paged_ms", "BF16 paged (ours)"),
                           ("int2_ms", "INT2 paged (ours)"), ("int2_floor_ms", "INT2 bandwidth floor")):
            ax.plot(x, [r.get(key) or math.nan for r in rr], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel("ms per decode call (one layer)")
        ax.set_title(f"batch {bs}")
        ax.legend(fontsize=8)
    fig.suptitle(f"Decode attention, {result['geometry']['num_q_heads']}/{result['geometry']['num_kv_heads']} heads of "
                 f"{result['geometry']['head_dim']}, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="oscar-kv bench attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="8192,32768,65536,131072", help="comma list; 8k style allowed")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--output", default=None, help="directory for attention.json / attention.png")
    ap.add_argument("--no-sweep", action="store_true", help="skip the INT2 kernel variant sweep")
    ap.add_argument("--no-write-path", action="store_true")
    ap.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    ap.add_argument("--extend-contexts", default="", help="also time the extend kernel after these cached lengths")
    ap.add_argument("--extend-chunks", default="16,512,2048", help="new tokens per extend call")
    ap.add_argument("--rotations", default="synthetic",
                    help="artifact directory (Qwen3-8B attention geometry), 'synthetic' (a calibrated-like artifact: "
                         "per-head rotations, per-position key means in --rope-pairs RoPE pairs) or 'hadamard'")
    ap.add_argument("--layer", type=int, default=0, help="the artifact's layer to time")
    ap.add_argument("--rope-pairs", type=int, default=DEFAULT_PAIRS,
                    help="RoPE pairs per KV head of the synthetic artifact's per-position key means (calibrate "
                         "keeps 8, 16 or 32; the CUDA kernel's cost grows with them)")
    ap.add_argument("--head-dim", type=int, choices=(64, 128), default=128,
                    help="64 times Llama-3.2-1B's attention (32 query / 8 KV heads of 64 channels, group 64); 128 "
                         "(default) Qwen3-8B's")
    a = ap.parse_args(argv)
    global USE_GRAPHS
    USE_GRAPHS = not a.eager
    use_head_dim(a.head_dim)
    run(_ints(a.contexts), _ints(a.batch_sizes), a.output, sweep=not a.no_sweep, write_path=not a.no_write_path,
        extend_contexts=_ints(a.extend_contexts), extend_chunks=_ints(a.extend_chunks), rotations=a.rotations,
        layer=a.layer, rope_pairs=a.rope_pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
