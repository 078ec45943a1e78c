"""Decode-attention benchmark: the INT2 paged kernel, and the artifact's other key / value widths, vs BF16 baselines,
Qwen3-8B attention geometry.

    python -m oscar_kv.bench.attention --contexts 8192,32768,65536,131072 --batch-sizes 1,8,32 --output DIR
    python -m oscar_kv.bench.attention --contexts 8k,32k,128k --kv-bits 3 --output DIR   # a K3 / K4 allocation

Baselines measured in the same run: torch SDPA on a contiguous BF16 cache (flash, cuDNN and efficient
backends, GQA without expanding K/V) and our BF16 paged kernel (kernels/decode.py).  Reported per
(context, batch): time per call (median, L2 flushed between calls), speedup vs the best BF16, bytes the
INT2 call must read (codes + metadata + BF16 windows) over time as a fraction of the device-to-device copy
bandwidth measured in the same run, plus write-path and migration throughput.

Widths (bench/synthetic.py): the INT2 columns time K2V2, the INT2 default.  When the artifact stores layers at other
widths (``--rotations DIR``'s k_bits / v_bits, or ``--key-bits`` / ``--value-bits`` / ``--kv-bits`` on the synthetic
artifact), one layer of each distinct (key bits, value bits) pair is timed too, with the kernel the engine runs for
that layer (kernels/decode.int2_kernel_choice: the one-launch CUDA kernel reads only some widths, Triton the rest),
against the K2V2 kernel and the best BF16 at the same shape, with its bytes over the copy bandwidth; and the
whole-model estimate (every layer at its pair's time).  Writes ``DIR/attention.json`` and ``DIR/attention.png``
(when matplotlib is importable).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
import warnings

import torch

from ..rope import DEFAULT_PAIRS, KernelRope
from . import timing
from .attention_report import _fmt_row, _fmt_width, _plot, print_table
from .floors import against_copy, bf16_bytes, copy_bandwidth, int2_bytes, matmul_throughput, read_bytes  # noqa: F401
from .synthetic import (GEOMETRY, _fill_pool, _ints, _mixed_batch, _orthogonal, _rope_mean,  # noqa: F401
                        add_width_arguments, apply_widths, calibrated_like, check_width_arguments, int2_case,
                        layer_geometry, load_rotations, pair_label, use_head_dim, width_pairs)
from .timing import _bench, _bench_call, _kernel_ms  # noqa: F401


def _free_bytes(device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    return free


VARIANTS = [dict(block_n=256, num_warps=4, num_stages=2, maxnreg=128, split_target=8),
            dict(block_n=256, num_warps=4, num_stages=2, maxnreg=128, split_target=4),
            dict(block_n=256, num_warps=4, num_stages=2, maxnreg=112, split_target=8),
            dict(block_n=128, num_warps=4, num_stages=2, maxnreg=128, split_target=8),
            dict(block_n=256, num_warps=4, num_stages=2, maxnreg=128, split_target=8, use_asm=False)]
_KNOBS = ("block_n", "num_warps", "num_stages", "kt", "use_asm", "split_target", "maxnreg")


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


def prepare_artifact(rotations: str | None, rope_pairs: int, widths, context: int):
    """The artifact the run times (``--rotations``, Qwen3-8B's attention geometry, KV heads and head dim checked)
    at the widths the options ``widths`` ask for, and the widths record of the JSON (counted at ``context``)."""
    from ..models import AttentionGeometry

    geometry = AttentionGeometry("qwen3", GEOMETRY["num_layers"], GEOMETRY["num_q_heads"], GEOMETRY["num_kv_heads"],
                                 GEOMETRY["head_dim"])
    art = load_rotations(rotations, geometry, validate=False, rope_pairs=rope_pairs)
    return art, apply_widths(art, widths, context, GEOMETRY["sink_size"], GEOMETRY["recent_size"])


def _layer_rope(art, i: int, inv_freq, ctx: int, device):
    """Layer i's per-position centering as the kernels take it, or None where its keys are not so centered."""
    if art.key_centering != "rope" or not art.k_rope_mean[i].abs().max() > 0:
        return None
    return KernelRope.build(art.k_rope_mean[i].float().to(device), inv_freq, 1.0, ctx)


def width_entry(pair, layers, ms, kernel_ms, kernel, geom, bs, ctx, bw, ref_ms, best_bf16_ms, **extra) -> dict:
    """One row of the per-width table: time, bytes by kind, GB/s and share of the copy bandwidth, and the ratios to
    the K2V2 kernel and the best BF16 at the same shape."""
    rb = read_bytes(geom, bs, ctx)
    k_bits = pair[0] if isinstance(pair[0], int) else str(pair[0])  # a split width as written, e.g. "4x16+2"
    entry = dict(widths=pair_label(*pair), k_bits=k_bits, v_bits=pair[1], layers=len(layers), kernel=kernel[0],
                 kernel_note=kernel[1], ms=ms, kernel_ms=kernel_ms, read=rb, **extra)
    entry.update(against_copy(rb["total"], ms, bw))
    if ms:
        entry["over_k2v2"] = ms / ref_ms if ref_ms else None
        entry["speedup_vs_bf16"] = best_bf16_ms / ms if best_bf16_ms else None
    return entry


def model_estimate(entries: list[dict], num_layers: int, ref_ms: float | None, best_bf16_ms: float | None,
                   bw: float | None) -> dict | None:
    """Every layer at its pair's one-layer time and bytes (``entries``: one per pair, ``layers`` counted), against
    num_layers calls of the K2V2 kernel and of the best BF16; None unless every pair was timed."""
    if not entries or any(not e.get("ms") for e in entries if e["layers"]):
        return None
    ms = sum(e["layers"] * e["ms"] for e in entries)
    nbytes = sum(e["layers"] * e["bytes"] for e in entries)
    out = dict(widths="model", layers=num_layers, kernel="-", ms=ms, **against_copy(nbytes, ms, bw))
    out["over_k2v2"] = ms / (num_layers * ref_ms) if ref_ms else None
    out["speedup_vs_bf16"] = num_layers * best_bf16_ms / ms if best_bf16_ms else None
    return out


def time_widths(art, layer: int, row: dict, q, device, gen, inv_freq, bw: float) -> None:
    """One layer of each (key bits, value bits) pair of the artifact, as the engine decodes it (the kernel
    int2_kernel_choice picks for that layer, default tuning, the layer's rotation and centering), into
    ``row["by_width"]``; the K2V2 row is the INT2 columns' time (``int2_rope_ms`` where the keys are centered per
    position, else ``int2_ms``), so every pair is compared with the K2V2 kernel at the same shape."""
    from ..kernels.decode import int2_decode, int2_kernel_choice
    from ..kernels.layout import PagedKVPool

    ctx, bs = row["context"], row["batch"]
    gqa = GEOMETRY["num_q_heads"] // GEOMETRY["num_kv_heads"]
    best = row.get("best_bf16_ms")
    pairs = width_pairs(art.key_widths(), art.v_bits.tolist())
    entries = []
    for pair in [(2, 2)] + [p for p in pairs if p != (2, 2)]:
        layers = pairs.get(pair, [])
        i = layer if layer in layers or not layers else layers[0]
        rope = _layer_rope(art, i, inv_freq, ctx, device)
        ref_ms = row.get("int2_rope_ms") if rope is not None and row.get("int2_rope_ms") else row["int2_ms"]
        geom = layer_geometry(*pair)
        kernel = int2_kernel_choice(device, geom, gqa, rope, q.dtype, None, geom.layer_widths(0), geom.k_split[0])
        extra = dict(layer=i, centering="rope" if rope is not None else art.key_centering)
        if pair == (2, 2):  # the INT2 columns' call
            entries.append(width_entry(pair, layers, ref_ms, row.get("int2_rope_kernel_ms" if rope is not None
                                                                      else "int2_kernel_ms"),
                                       kernel, geom, bs, ctx, bw, ref_ms, best, reference=True, **extra))
            continue
        pool = None
        try:  # a width no kernel reads (8 bits) is reported, not fatal
            batch, nq, nw = _mixed_batch(geom, bs, ctx, device, gen)
            pool = PagedKVPool.allocate(geom, nq, nw, device=device)
            _fill_pool(pool)
            rot = art.k_rotation[i].float().to(device)
            fn = lambda: int2_decode(q, pool, 0, batch, rot, rope=rope,  # noqa: E731
                                     max_int2_pages=geom.int2_pages_for(ctx), max_seq_len=ctx)
            ms, kms = _bench_call(fn), _kernel_ms(fn)
        except Exception as e:
            ms = kms = None
            extra["error"] = repr(e)[:200]
        entries.append(width_entry(pair, layers, ms, kms, kernel, geom, bs, ctx, bw, ref_ms, best, **extra))
        del pool
        torch.cuda.empty_cache()
    row["by_width"] = entries
    row["model_estimate"] = model_estimate(entries, int(art.k_bits.numel()), entries[0]["ms"], best, bw)


def run(contexts: list[int], batch_sizes: list[int], output: str | None = None, sweep: bool = True,
        write_path: bool = True, extend_contexts: list[int] = (), extend_chunks: list[int] = (),
        rotations: str | None = None, layer: int = 0, rope_pairs: int = DEFAULT_PAIRS, widths=None) -> dict:
    """``widths``: the parsed ``--key-bits`` / ``--value-bits`` / ``--kv-bits`` (None: the artifact's widths)."""
    if not torch.cuda.is_available():
        raise SystemExit("the attention benchmark needs a CUDA GPU")
    import triton  # noqa: F401  (GPU only)

    from ..kernels import pdl
    from ..kernels.bf16_decode import bf16_decode
    from ..kernels.decode import int2_decode, int2_kernel_choice
    from ..kernels.layout import PagedKVPool

    device = torch.device("cuda")
    # every kernel timed alone, after the flush: launched with PDL the CUDA kernel's prologue would overlap the flush
    # kernel, which no contender's does (in a decode step PDL overlaps it with the cache write: bench decode)
    pdl.set_enabled(False)
    warnings.filterwarnings("ignore", message="For dense input, both fused kernels")
    torch.backends.cuda.matmul.allow_tf32 = False
    geom = layer_geometry()
    hq, hkv, d = GEOMETRY["num_q_heads"], geom.num_kv_heads, geom.head_dim
    # the artifact's layer ``layer``: its key rotation in every INT2 row, its per-position means in int2+rope; its
    # other width pairs: one layer each (time_widths)
    art, widths_record = prepare_artifact(rotations, rope_pairs, widths, max(contexts, default=131072))
    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(device)
    result = dict(timing="cuda-graph replay" if timing.USE_GRAPHS else "eager", device=props.name,
                  sms=props.multi_processor_count, torch=torch.__version__,
                  triton=__import__("triton").__version__, python=platform.python_version(),
                  geometry=GEOMETRY, date=time.strftime("%Y-%m-%d %H:%M:%S"), widths=widths_record, skipped=[],
                  rows=[])
    bw = copy_bandwidth(device)
    result["copy_bandwidth_GBps"] = bw / 1e9
    print(f"device {props.name}: device-to-device copy {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    result["launch_floor_ms"] = timing.launch_floor_ms()
    print(f"an empty kernel times {result['launch_floor_ms'] * 1e3:.1f} us per call this way (graph launch + events)",
          flush=True)

    kernel, why = int2_kernel_choice(device, geom, hq // hkv)
    cuda_ok = kernel == "cuda"
    result["int2_backend"] = "cuda (one launch)" if cuda_ok else f"triton ({why})"
    print(f"geometry: {hq} query / {hkv} KV heads, head dim {d}; INT2 kernel: {result['int2_backend']}", flush=True)
    print(f"widths: {widths_record['label']} ({widths_record['rule']})", flush=True)
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

    art_rot = art.k_rotation[layer].float().to(device)
    art_mu = art.k_rope_mean[layer].float().to(device)
    result["rotations"] = dict(source=rotations or "synthetic", layer=layer, key_centering=art.key_centering,
                               manifest=art.manifest.get("calibration", {}))
    inv_freq = 1e6 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # Qwen3's RoPE base
    pair_geoms = [layer_geometry(*p) for p in width_pairs(art.key_widths(), art.v_bits.tolist())]
    for ctx in contexts:
        for bs in batch_sizes:
            need = bf16_bytes(geom, bs, ctx) + max(int2_bytes(g, bs, ctx) for g in [geom] + pair_geoms)
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
            time_widths(art, layer, row, q, device, gen, inv_freq, bw)
            result["rows"].append(row)
            print(_fmt_row(row), flush=True)
            if len(row["by_width"]) > 1:
                for w in row["by_width"][1:] + [row["model_estimate"] or {}]:
                    print(_fmt_width(ctx, bs, w) if w else "model estimate: a pair was not timed", flush=True)
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
                              k_split=geom.k_split[:1] * layers,
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


def parser() -> argparse.ArgumentParser:
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
                    help="artifact directory (its KV heads and head dim must be Qwen3-8B's; its per-layer k_bits / "
                         "v_bits are timed, one layer per pair), 'synthetic' (a calibrated-like artifact: per-head "
                         "rotations, per-position key means in --rope-pairs RoPE pairs) or 'hadamard'")
    ap.add_argument("--layer", type=int, default=0,
                    help="the artifact's layer to time (a pair it is not stored at: that pair's first layer)")
    ap.add_argument("--rope-pairs", type=int, default=DEFAULT_PAIRS,
                    help="RoPE pairs per KV head of the synthetic artifact's per-position key means (calibrate "
                         "keeps 8, 16 or 32; the CUDA kernel's cost grows with them)")
    ap.add_argument("--head-dim", type=int, choices=(64, 128), default=128,
                    help="64 times Llama-3.2-1B's attention (32 query / 8 KV heads of 64 channels, group 64); 128 "
                         "(default) Qwen3-8B's")
    add_width_arguments(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    check_width_arguments(ap, a)
    timing.USE_GRAPHS = not a.eager
    use_head_dim(a.head_dim)
    run(_ints(a.contexts), _ints(a.batch_sizes), a.output, sweep=not a.no_sweep, write_path=not a.no_write_path,
        extend_contexts=_ints(a.extend_contexts), extend_chunks=_ints(a.extend_chunks), rotations=a.rotations,
        layer=a.layer, rope_pairs=a.rope_pairs, widths=a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
