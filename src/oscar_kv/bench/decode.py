"""End-to-end decode benchmark through the serving engine: BF16 vs INT2 KV cache on one model, and a mixed-width
allocation beside them.

    python -m oscar_kv.bench.decode --arch qwen3-8b --contexts 30000,60000,100000 --batch-sizes 1,8 \
        --kv-cache-dtype bf16,int2 --decode-steps 32 --kv-cache-memory 40 --output DIR
    python -m oscar_kv.bench.decode --arch qwen3-8b --contexts 32000,100000 --batch-sizes 1,8 --kv-bits 3 --output DIR

The model is built from the public architecture numbers of the chosen model with random bf16 weights
on the device (no download; decode speed does not depend on weight values).  Rotations for INT2 are
``--rotations``: by default a synthetic artifact shaped like the one ``calibrate`` ships (per-head rotations,
per-position key means in rope.DEFAULT_PAIRS RoPE pairs: bench.synthetic.calibrated_like); BF16 runs the engine exactly as
``oscar-kv serve --kv-cache-dtype bf16`` does (no artifact).  Same model, same contexts, same KV
memory: only the KV scheme differs.

Widths (bench/synthetic.py, decode_engine.py): ``int2`` runs the artifact with every layer at K2V2 (the INT2 default);
when the artifact stores other widths (a ``--rotations`` directory's k_bits / v_bits, or ``--key-bits`` /
``--value-bits`` / ``--kv-bits`` on the synthetic artifact) the scheme ``mixed`` runs it at its own widths, in the
same run as ``bf16`` and ``int2`` (``--kv-cache-dtype auto``, the default).  Every row names its widths, and each
step's floor counts each layer's bytes at its widths.  Three measurements:

1. **Decode speed.**  Per (context, batch, scheme): a random-token prompt of ``context`` tokens is
   prefilled through ``LLMEngine.step`` (chunked prefill, excluded from timing), then
   ``--decode-steps`` engine steps run back to back as a server runs them (each overlaps the next one's
   scheduling): ``step_ms`` is the median time between consecutive steps' returns, ``step_ms_mean`` the wall
   time over the steps (``torch.cuda.synchronize`` at both ends).  A few more steps, each with a sync at both
   edges, are split into the model runner and, inside it, the per-step plan (the attention backend's ``plan``,
   engine/attention.py); ``forward`` = runner minus plan.  A (context,
   batch) that does not fit the KV pool (``engine.plan``) is recorded as not fitting, with why.
2. **Throughput at a fixed KV budget.**  At the largest context: the largest batch each scheme's pool
   holds, and generated tokens/s measured at that batch.
3. **Breakdown of a decode step** (at the largest context): CUDA events around scheduler, plan, key
   rotation, KV write / migration, query rotation, attention, sampling and the rest of the model, plus
   a torch.profiler kernel summary (GPU busy time).

**Prefill.**  The first prompt of each (scheme, context) is prefilled through the engine and timed
(``prefill`` in the JSON: seconds, tokens/s, chunks, and the time inside the attention layers, ``attend_seconds``:
key rotation, KV write and attention; the rest is the model's GEMMs, norms and sampling).  ``--prefill-only``
times only that (no decode), for BF16 vs INT2 prefill at long context::

    python -m oscar_kv.bench.decode --arch qwen3-8b --contexts 32768,100000 --kv-cache-dtype bf16,int2 \
        --prefill-only --output DIR

``--prefill-attention kernel`` routes every prefill chunk through the extend kernel instead of the materialized
flash path (kernel_attention.extend_path), to compare the two.

By default one sequence per (scheme, context) is prefilled through the engine and the other
sequences of a batch are copies of its pages into freshly allocated pages (``--prefill replicate``):
decoding reads exactly as many distinct bytes as B independently prefilled sequences, while the
prefill cost (quadratic in the context) is paid once.  ``--prefill engine`` prefills every
sequence through the engine instead.  Writes ``DIR/decode.json`` and ``DIR/decode.png``.
On the CPU the engine runs its torch reference path; timings there are not meaningful.
"""


from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

from ..config import ATTENTION_BACKENDS, MODEL_IMPLS, EngineConfig
from ..rope import DEFAULT_PAIRS
from .decode_engine import (GB, MIXED, SCHEMES, Deadline, Unit, _device_info, _room, clone_sequence,  # noqa: F401
                            default_budget, is_k2v2, make_engine, max_batch, no_fit_reason, plan_summary,
                            pool_geometry, prefill, release, scheme_rotations)
from .decode_timing import (SYNCED_STEPS, Clock, attend_timer, breakdown, prefill_attention,  # noqa: F401
                            time_decode)
from .floors import decode_floor, prefill_floor  # noqa: F401  (bench.decode's names before the split)
from .models import ARCHS, build_model
from .report import finish_throughput, fmt_breakdown, fmt_row, plot, print_tables, speedups
from .synthetic import _ints, add_width_arguments, apply_widths, check_width_arguments, widths_label


def run(args) -> dict:
    from .. import parallel

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # --tp N: every rank runs this function; rank 0 measures and reports, the others follow its engine steps
    args.ranks = ranks = parallel.init(args.tp, device)
    device = torch.device(parallel.local_device(device, args.tp))
    if not ranks.is_driver:
        args.output = None
        sys.stdout = open(os.devnull, "w")
    if ranks.size > 1 and not args.profile_steps:
        args.breakdown_steps = 0  # under --tp the breakdown is rank 0's kernel summary only
    deadline = Deadline(args.time_limit)
    clock = Clock(device)
    contexts = sorted(set(_ints(args.contexts)))
    batch_sizes = sorted(set(_ints(args.batch_sizes)))
    auto = args.kv_cache_dtype.strip() == "auto"
    schemes = ["bf16", "int2"] if auto else [s.strip() for s in args.kv_cache_dtype.split(",") if s.strip()]
    bad = [s for s in schemes if s not in SCHEMES]
    if bad or not schemes or not contexts or not batch_sizes:
        raise SystemExit(f"--kv-cache-dtype takes auto or {','.join(SCHEMES)}; contexts and batch sizes must not be "
                         "empty")
    from ..artifacts import DEFAULT_K_CLIP, DEFAULT_V_CLIP
    from ..engine.block_pool import plan_pool
    from ..models import AttentionGeometry

    result = dict(_device_info(device))
    result["timing_meaningful"] = device.type == "cuda"
    if device.type == "cuda":
        from .floors import copy_bandwidth, matmul_throughput

        result["copy_bandwidth_GBps"] = round(copy_bandwidth(device) / 1e9, 1)
        result["matmul_TFLOPs"] = round(matmul_throughput(device) / 1e12, 1)
    if device.type != "cuda":
        print("NOTE: running on the CPU (torch reference attention): timings are not meaningful", flush=True)
    torch.manual_seed(args.seed)  # the same random weights on every rank
    model, minfo = build_model(args.arch, args.layers, device)
    geometry = AttentionGeometry.of(model.config)
    from ..rope import RopeTable

    rope_layout = RopeTable(model, geometry.head_dim).layout  # partial / interleaved RoPE: GLM-4, Phi-3-mini
    parallel.check_geometry(geometry, ranks)
    budget = args.kv_cache_memory if args.kv_cache_memory is not None else default_budget(device, model)
    budget = ranks.smallest(budget)  # per GPU
    minfo["tensor_parallel"] = ranks.size
    if ranks.size > 1:  # an engine shards its model for good: each engine gets a fresh one (measure_context)
        model = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    from .synthetic import load_rotations

    rotations = load_rotations(args.rotations, geometry, rope_pairs=args.rope_pairs, layout=rope_layout)
    allocation = apply_widths(rotations, args, contexts[-1], args.sink_size, args.recent_size)
    if auto and not is_k2v2(rotations):
        schemes.append(MIXED)
    if not auto and MIXED not in schemes and not is_k2v2(rotations):
        print(f"note: the artifact's widths ({widths_label(rotations.key_widths(), rotations.v_bits.tolist())}) are "
              "not timed: --kv-cache-dtype has no mixed (int2 runs every layer at K2V2)", flush=True)
    if MIXED in schemes and is_k2v2(rotations):
        raise SystemExit("--kv-cache-dtype mixed: the artifact stores every layer at K2V2, as int2 does; pass "
                         "--key-bits / --value-bits / --kv-bits, or a --rotations directory with other widths")
    artifacts = scheme_rotations(rotations)  # each scheme's widths: int2 K2V2, mixed the artifact's
    widths = {s: "BF16" if s == "bf16" else widths_label(artifacts[s].key_widths(), artifacts[s].v_bits.tolist())
              for s in schemes}
    # Every batch starts from a prefilled sequence and decodes at most this many tokens past it.
    grow = 1 + args.warmup_steps + max(args.decode_steps, args.throughput_steps) + SYNCED_STEPS + args.breakdown_steps \
        + args.profile_steps + args.page_size
    result.update(model=minfo, settings=dict(
        contexts=contexts, batch_sizes=batch_sizes, schemes=schemes, decode_steps=args.decode_steps,
        warmup_steps=args.warmup_steps, kv_cache_memory_gb=budget, page_size=args.page_size,
        sink_size=args.sink_size, recent_size=args.recent_size, group_size=min(geometry.head_dim, 128),
        int2_rotations=args.rotations, key_centering=rotations.key_centering, k_clip=DEFAULT_K_CLIP,
        v_clip=DEFAULT_V_CLIP, widths=widths, allocation=allocation,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        attention_backend=args.attention_backend, model_impl=args.model_impl, prefill=args.prefill,
        temperature=args.temperature, async_scheduling=not args.no_async_scheduling,
        prefix_caching=False,
        prefill_only=args.prefill_only, prefill_attention=args.prefill_attention,
        timing="step_ms: median time between the returns of back-to-back LLMEngine.step calls (step_ms_mean: "
               "their wall time / steps, device synchronize at both ends); synced_*, runner, plan: steps with a "
               "sync at each edge; forward = ModelRunner.run minus the step plan (the attention backend's plan())"),
        schemes={}, prefill=[], decode=[], speedup=[], throughput_at_budget=None, breakdown=[], skipped=[], errors=[])
    print(f"{result['device']}: {args.arch} ({minfo['num_layers']} layers, {minfo['parameters'] / 1e9:.2f}B params, "
          f"built in {minfo['build_seconds']} s); KV budget {budget} GB", flush=True)
    print("widths: " + "; ".join(f"{s} {w}" for s, w in widths.items())
          + f" ({allocation['rule']}; {allocation['bits_per_element']:.3f} bits/element at {contexts[-1]} tokens)",
          flush=True)

    # Per scheme, the engine's max-model-len is the largest context one sequence of which fits the budget
    # (so that the pool split is the one a server for that length would use).
    budget_bytes = int(budget * GB)
    max_len: dict[str, int | None] = {}
    for scheme in schemes:
        pool_geom = pool_geometry(scheme, geometry, args.page_size, args.sink_size, args.recent_size,
                                  artifacts[scheme])
        max_len[scheme] = None
        for ctx in reversed(contexts):
            n = ctx + grow
            if n <= minfo["max_position_embeddings"] and plan_pool(pool_geom, budget_bytes, n,
                                                                   args.max_num_seqs).holds(n):
                max_len[scheme] = n
                break
        plan = plan_pool(pool_geom, budget_bytes, max_len[scheme], args.max_num_seqs) if max_len[scheme] else None
        result["schemes"][scheme] = dict(max_model_len=max_len[scheme], attention=None, widths=widths[scheme],
                                         plan=plan_summary(plan) if plan else None)

    top = contexts[-1]
    throughput = dict(context=top, kv_cache_memory_gb=budget, schemes={})
    result["throughput_at_budget"] = throughput if args.throughput_steps else None
    gen = torch.Generator().manual_seed(args.seed)
    warmed: set[str] = set()
    prefill_history: dict[str, tuple[int, float]] = {}

    def save():
        for r in result["decode"] + result["prefill"]:  # every row names the widths it timed
            r.setdefault("widths", widths[r["scheme"]])
        if args.output:
            os.makedirs(args.output, exist_ok=True)
            with open(os.path.join(args.output, "decode.json"), "w") as f:
                json.dump(result, f, indent=1)

    # Largest context first: the headline numbers (speedup at long context, throughput, breakdown) live there.
    for ctx in reversed(contexts):
        for scheme in schemes:
            pool_geom = pool_geometry(scheme, geometry, args.page_size, args.sink_size, args.recent_size,
                                      artifacts[scheme])
            length = ctx + grow
            mml = max_len[scheme]
            if mml is None or length > mml:
                plan = plan_pool(pool_geom, budget_bytes, min(length, 1 << 40), args.max_num_seqs)
                why = (f"{scheme}: context {ctx} exceeds the model's {minfo['max_position_embeddings']} positions"
                       if length > minfo["max_position_embeddings"] else no_fit_reason(plan, scheme, 1, length))
                for b in batch_sizes:
                    result["decode"].append(dict(scheme=scheme, context=ctx, batch=b, fits=False,
                                                 reason=why if b == 1 else no_fit_reason(plan, scheme, b, length)))
                if ctx == top:
                    throughput["schemes"][scheme] = dict(max_batch=0, limit=why, measured=False,
                                                         bytes_per_sequence=pool_geom.sequence_bytes(length))
                print(f"does not fit: {why}", flush=True)
                continue
            try:
                # the breakdown runs at the largest context one sequence of which fits this scheme's pool
                measure_context(args, model, artifacts[scheme], scheme, ctx, mml, budget, batch_sizes, result, throughput,
                                gen, clock, deadline, warmed, prefill_history, grow, ctx == top, length == mml, save)
            except Exception as exc:  # e.g. the pool does not fit the GPU: record it, go on with the rest
                msg = f"{scheme} context {ctx}: {type(exc).__name__}: {exc}"[:500]
                result["errors"].append(msg)
                print("ERROR", msg, flush=True)
                done = {r["batch"] for r in result["decode"] if r["scheme"] == scheme and r["context"] == ctx}
                result["decode"] += [dict(scheme=scheme, context=ctx, batch=b, fits=None, measured=False, error=msg)
                                     for b in batch_sizes if b not in done]
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            save()

    speedups(result)
    finish_throughput(throughput)
    result["elapsed_seconds"] = round(deadline.elapsed(), 1)
    save()
    if args.output:
        plot(result, os.path.join(args.output, "decode.png"))
    print_tables(result)
    return result


def _prefill_path(args) -> str:
    if args.prefill_attention == "kernel":
        return "the extend kernel for every chunk (--prefill-attention kernel)"
    from ..engine.kernel_attention import FLASH_MIN_TOKENS, FLASH_MIN_TOKENS_ROPE

    return (f"materialized float16 history + flash attention for chunks of >= {FLASH_MIN_TOKENS} tokens (>= "
            f"{FLASH_MIN_TOKENS_ROPE} with per-position key centering), the extend kernel for shorter ones")


def measure_context(args, model, rotations, scheme, ctx, mml, budget, batch_sizes, result, throughput, gen, clock,
                    deadline, warmed, prefill_history, grow, is_top, is_breakdown, save):
    """Everything at one (scheme, context): one engine, one prefilled template, the batches."""
    want_throughput = is_top and args.throughput_steps > 0
    if not args.ranks.broadcast(deadline.allows()):  # rank 0's clock decides for all
        _skip_all(result, scheme, ctx, batch_sizes, f"--time-limit {args.time_limit} s reached")
        if want_throughput:
            throughput["schemes"][scheme] = dict(measured=False, note="--time-limit reached")
        return
    if model is None:  # --tp: the same random weights again (run() seeds the first build alike)
        torch.manual_seed(args.seed)
        model, _ = build_model(args.arch, args.layers, clock.device)
    vocab = model.config.vocab_size
    engine = make_engine(model, scheme, rotations, args, mml, budget)
    if not args.ranks.is_driver:
        engine.follow()
        return
    unit = Unit(engine, scheme, ctx, temperature=args.temperature)
    geometry, plan = engine.pool.geometry, engine.plan
    info = result["schemes"][scheme]
    info["plan"] = plan_summary(plan)
    info["attention"] = (f"Triton kernels (decode kernel for decode steps; prefill: {_prefill_path(args)})"
                         if engine.kernel_status is None else f"torch reference ({engine.kernel_status})")
    info["describe"] = engine.describe()
    if engine.kernel_status is None and geometry.quantizes:  # which layers take the CUDA kernel, which Triton
        info["decode_kernel"] = engine.int2_decode_description()
    length = ctx + grow
    try:
        if scheme not in warmed and engine.kernel_status is None:
            # compile the Triton kernels outside any timed region
            t0 = clock.now()
            # two chunks, so that the second one attends to a stored (sink / INT2 / recent) history
            seqs, _, _ = prefill(unit, [min(ctx, args.max_num_batched_tokens + args.sink_size + args.recent_size
                                            + 2 * args.page_size + 7)], gen, vocab, grow, clock)
            if not args.prefill_only:
                time_decode(engine, seqs, 2, 1, clock)
            release(unit, seqs)
            info["compile_and_warmup_seconds"] = round(clock.now() - t0, 2)
        warmed.add(scheme)

        def get_template():
            prev = prefill_history.get(scheme)
            predicted = prev[1] * (ctx / prev[0]) ** 2 if prev else 0.0  # attention prefill is quadratic
            if not deadline.allows(predicted):
                raise TimeoutError(f"prefill of {ctx} tokens predicted at {predicted:.0f} s exceeds --time-limit")
            with attend_timer(engine, clock) as regions:
                (seq,), seconds, steps = prefill(unit, [ctx], gen, vocab, grow, clock)
            attend = regions.totals_ms().get("attend_total", 0.0) / 1e3
            prefill_history[scheme] = (ctx, seconds)
            row = dict(scheme=scheme, context=ctx, batch=1, seconds=round(seconds, 3),
                       tokens_per_s=round(ctx / seconds, 1), chunks=steps, chunk_tokens=args.max_num_batched_tokens,
                       attend_seconds=round(attend, 3), path=info["attention"],
                       **prefill_floor(result["model"], ctx, result.get("matmul_TFLOPs", 0) * 1e12))
            if "floor_seconds" in row:
                row["of_floor"] = round(row["floor_seconds"] / seconds, 3)
            result["prefill"].append(row)
            print(f"prefill {scheme} ctx={ctx}: {seconds:.2f} s ({ctx / seconds:.0f} tok/s, {steps} chunks; "
                  f"attention layers {attend:.2f} s)", flush=True)
            engine.pause(seq.request_id)  # parked: only its copies decode
            return seq

        def make_batch(b: int):
            if args.prefill == "engine":
                seqs, seconds, steps = prefill(unit, [ctx] * b, gen, vocab, grow, clock)
                result["prefill"].append(dict(scheme=scheme, context=ctx, batch=b, seconds=round(seconds, 3),
                                              tokens_per_s=round(b * ctx / seconds, 1), chunks=steps))
                return seqs
            if unit.template is None:
                unit.template = get_template()
            if _room(engine.pool, length, b):
                return [clone_sequence(unit, unit.template) for _ in range(b)]
            # the pool holds b sequences but not b copies next to the template: it decodes as one of them
            t, unit.template = unit.template, None
            engine.resume(t.request_id)
            return [t] + [clone_sequence(unit, t) for _ in range(b - 1)]

        def measure(b: int, steps: int, with_breakdown: bool) -> dict:
            row = dict(scheme=scheme, context=ctx, batch=b, fits=True)
            if not deadline.allows():
                row.update(measured=False, reason=f"--time-limit {args.time_limit} s reached")
                result["skipped"].append(f"{scheme} ctx={ctx} batch={b}: time limit")
                return row
            seqs = make_batch(b)
            try:
                row.update(time_decode(engine, seqs, steps, args.warmup_steps, clock), measured=True)
                row.update(decode_floor(geometry, result["model"]["streamed_weight_bytes"], ctx, b,
                                        result.get("copy_bandwidth_GBps", 0) * 1e9))
                if "floor_ms" in row:
                    row["of_floor"] = round(row["floor_ms"] / row["step_ms"], 3)
                print(fmt_row(row), flush=True)
                if with_breakdown:
                    bd = breakdown(engine, seqs, args.breakdown_steps, clock, args.profile_steps)
                    bd.update(scheme=scheme, context=ctx, batch=b)
                    result["breakdown"].append(bd)
                    print(fmt_breakdown(bd), flush=True)
            finally:
                release(unit, seqs)
            return row

        if args.prefill_only:
            try:
                get_template()
            except TimeoutError as exc:
                result["skipped"].append(f"{scheme} ctx={ctx} prefill: {exc}")
                print(f"skipped {scheme} ctx={ctx}: {exc}", flush=True)
            return

        for b in batch_sizes:
            fit, _ = max_batch(plan, length)
            if b > fit:
                result["decode"].append(dict(scheme=scheme, context=ctx, batch=b, fits=False,
                                             reason=no_fit_reason(plan, scheme, b, length)))
                print(f"does not fit: {no_fit_reason(plan, scheme, b, length)}", flush=True)
                continue
            try:
                row = measure(b, args.decode_steps, is_breakdown and args.breakdown_steps > 0)
            except TimeoutError as exc:
                row = dict(scheme=scheme, context=ctx, batch=b, fits=True, measured=False, reason=str(exc))
                result["skipped"].append(f"{scheme} ctx={ctx} batch={b}: {exc}")
            except Exception as exc:
                row = dict(scheme=scheme, context=ctx, batch=b, fits=True, measured=False,
                           error=f"{type(exc).__name__}: {exc}"[:400])
                result["errors"].append(f"{scheme} ctx={ctx} batch={b}: {row['error']}")
                print("ERROR", row["error"], flush=True)
            result["decode"].append(row)
            save()

        if want_throughput:
            fit, limit = max_batch(plan, length)
            by_bytes = plan.total_bytes // geometry.sequence_bytes(length)
            entry = dict(max_batch=fit, limit=limit, max_batch_by_bytes=by_bytes,
                         bytes_per_sequence=geometry.sequence_bytes(length), pool_bytes=plan.total_bytes,
                         capacity_tokens=plan.capacity_tokens)
            run_b = min(fit, args.max_batch, args.max_num_batched_tokens)
            if run_b < fit:
                entry["note"] = f"measured at batch {run_b} (--max-batch / --max-num-batched-tokens), not {fit}"
            if run_b >= 1:
                try:
                    row = next((r for r in result["decode"] if r["scheme"] == scheme and r["context"] == ctx
                                and r["batch"] == run_b and r.get("measured")), None)
                    if row is None:
                        row = measure(run_b, args.throughput_steps, False)
                        row["throughput_run"] = True
                        result["decode"].append(row)
                    entry.update(measured=bool(row.get("measured")), batch=run_b, step_ms=row.get("step_ms"),
                                 tokens_per_s=row.get("tokens_per_s"),
                                 forward_tokens_per_s=row.get("forward_tokens_per_s"),
                                 tokens_per_s_per_seq=row.get("tokens_per_s_per_seq"))
                    if not row.get("measured"):
                        entry["note"] = row.get("reason", "not measured")
                except Exception as exc:
                    entry.update(measured=False, error=f"{type(exc).__name__}: {exc}"[:400])
                    result["errors"].append(f"{scheme} throughput batch {run_b}: {entry['error']}")
            else:
                entry.update(measured=False, note="no sequence of this context fits")
            throughput["schemes"][scheme] = entry
    finally:
        release(unit, [s for s in list(engine.requests.values())])
        engine.shutdown()
        del unit, engine


def _skip_all(result, scheme, ctx, batch_sizes, why):
    for b in batch_sizes:
        result["decode"].append(dict(scheme=scheme, context=ctx, batch=b, fits=None, measured=False, reason=why))
    result["skipped"].append(f"{scheme} ctx={ctx}: {why}")
    print(f"skipped {scheme} ctx={ctx}: {why}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="oscar-kv bench decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None, help="truncate the model to N layers (quick runs)")
    ap.add_argument("--contexts", default="30000,60000,100000", help="prompt lengths; comma list (8k style allowed)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="schemes to compare, of bf16,int2,mixed (int2: every layer at K2V2; mixed: the artifact's "
                         "or --key-bits / --value-bits / --kv-bits widths); auto (default): bf16,int2 and mixed "
                         "where the widths are not all K2V2")
    ap.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per (context, batch)")
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--kv-cache-memory", type=float, default=None,
                    help="KV pool GB for every scheme (default: 40 on a GPU if free, 0.02 on the CPU)")
    ap.add_argument("--output", default=None, help="directory for decode.json / decode.png")
    ap.add_argument("--device", default=None, help="default: cuda if available")
    ap.add_argument("--prefill", choices=("replicate", "engine"), default="replicate",
                    help="replicate: prefill one sequence per context through the engine and copy its pages for the "
                         "rest of a batch; engine: prefill every sequence")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="prefill chunk (engine step budget)")
    ap.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs,
                    help="engine setting (bounds the window-pool share)")
    ap.add_argument("--page-size", type=int, default=EngineConfig.page_size)
    ap.add_argument("--sink-size", type=int, default=EngineConfig.sink_size)
    ap.add_argument("--recent-size", type=int, default=EngineConfig.recent_size)
    ap.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=EngineConfig.attention_backend)
    ap.add_argument("--rotations", default="synthetic",
                    help="the artifact: a directory from `oscar-kv calibrate` (its per-layer k_bits / v_bits: the mixed "
                         "scheme), 'synthetic' (default: calibrated-like for the random-weight model, per-position key "
                         "means in --rope-pairs RoPE pairs) or 'hadamard' (data-free, no centering)")
    ap.add_argument("--rope-pairs", type=int, default=DEFAULT_PAIRS,
                    help=f"RoPE pairs per KV head of the synthetic artifact's per-position key means (calibrate keeps "
                         f"{DEFAULT_PAIRS} by default, 8, 16 or 32 on request; the CUDA decode kernel's cost grows with them)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="requests sample at this temperature with top-p 0.95 (default 0: greedy)")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="each step waits for the previous one's tokens before it is scheduled (engine.py)")
    ap.add_argument("--model-impl", choices=MODEL_IMPLS, default=EngineConfig.model_impl,
                    help="model forward: oscar (our executor), transformers, or auto (the engine's default)")
    ap.add_argument("--prefill-only", action="store_true",
                    help="time only the prefill of one prompt per (scheme, context): no decode, throughput or "
                         "breakdown")
    ap.add_argument("--prefill-attention", choices=("auto", "kernel"), default="auto",
                    help="auto: long prefill chunks materialize their history and attend over it (kernels/chunk_attention.py), short ones "
                         "the extend kernel (kernel_attention.extend_path); kernel: the extend kernel for every chunk")
    ap.add_argument("--throughput-steps", type=int, default=8,
                    help="decode steps for the fixed-budget throughput run at the largest context (0: skip)")
    ap.add_argument("--max-batch", type=int, default=256, help="cap on the batch of the throughput run")
    ap.add_argument("--breakdown-steps", type=int, default=4, help="steps averaged in the breakdown (0: skip)")
    ap.add_argument("--profile-steps", type=int, default=2, help="steps under torch.profiler (CUDA; 0: skip)")
    ap.add_argument("--time-limit", type=float, default=300,
                    help="seconds; later work is skipped (and recorded) once exceeded (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallelism over N GPUs (N processes; --kv-cache-memory is per "
                         "GPU; no breakdown)")
    add_width_arguments(ap)
    a = ap.parse_args(argv)
    check_width_arguments(ap, a)
    if a.decode_steps < 1:
        ap.error("--decode-steps must be at least 1")
    if a.prefill_only:
        a.throughput_steps = a.breakdown_steps = a.profile_steps = 0
    from .. import parallel

    if a.tp > 1 and not parallel.launched():
        return parallel.relaunch(a.tp, ["bench", "decode", *(argv if argv is not None else sys.argv[1:])])
    try:
        with torch.no_grad(), prefill_attention(a.prefill_attention):
            run(a)
    finally:
        if hasattr(a, "ranks"):
            parallel.shutdown(a.ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
