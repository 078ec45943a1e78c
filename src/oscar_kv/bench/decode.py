"""End-to-end decode benchmark through the serving engine: BF16 vs INT2 KV cache on one model.

    python -m oscar_kv.bench.decode --arch qwen3-8b --contexts 30000,60000,100000 --batch-sizes 1,8 \
        --kv-cache-dtype bf16,int2 --decode-steps 32 --kv-cache-memory 40 --output DIR

The model is built from the public architecture numbers of the chosen model with random bf16 weights
on the device (no download; decode speed does not depend on weight values).  Rotations for INT2 are
``--rotations``: by default a synthetic artifact shaped like the one ``calibrate`` ships (per-head rotations,
per-position key means in rope.DEFAULT_PAIRS RoPE pairs: bench.attention.calibrated_like); BF16 runs the engine exactly as
``oscar-kv serve --kv-cache-dtype bf16`` does (no artifact).  Same model, same contexts, same KV
memory: only the KV scheme differs.  Three measurements:

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
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from ..config import ATTENTION_BACKENDS, MODEL_IMPLS, SERVED_KV_CACHE_DTYPES, EngineConfig
from ..rope import DEFAULT_PAIRS
from .attention import _ints
from .models import ARCHS, TokenIdsOnly, build_model
from .report import finish_throughput, fmt_breakdown, fmt_row, plot, print_tables, speedups

GB = 1e9
SCHEMES = SERVED_KV_CACHE_DTYPES
SYNCED_STEPS = 8  # steps per row timed with a sync at each edge, for the host-time split (time_decode)

def decode_floor(geometry, weight_bytes: int, context: int, batch: int, bandwidth: float | None) -> dict:
    """The memory-bandwidth floor of one decode step: the weights once plus every sequence's cache (all layers),
    at the copy bandwidth measured in the same run."""
    kv = batch * sum(geometry.layer_read_bytes(context, layer) for layer in range(geometry.num_layers))
    out = dict(floor_bytes=weight_bytes + kv)
    if bandwidth:
        out["floor_ms"] = round((weight_bytes + kv) / bandwidth * 1e3, 3)
    return out


def prefill_floor(model_info: dict, context: int, peak: float | None) -> dict:
    """The compute floor of prefilling one ``context``-token prompt: every token through the weight GEMMs
    (2 FLOPs per parameter) plus causal attention (QK^T and PV, 4 x Hq x D FLOPs per query-key pair, half the
    square), at the dense tensor-core FLOP/s measured in the same run."""
    m = model_info
    gemm = 2 * m["token_matmul_parameters"] * context
    attention = 4 * m["num_attention_heads"] * m["head_dim"] * context * (context + 1) / 2 * m["num_layers"]
    out = dict(floor_flops=gemm + attention)
    if peak:
        out["floor_seconds"] = round((gemm + attention) / peak, 3)
    return out


def pool_geometry(scheme: str, geometry, page_size: int, sink: int, recent: int):
    """The pool geometry the engine builds for ``scheme`` (data-free rotations: every layer at 2 bits)."""
    from ..kernels.layout import PoolGeometry

    bits = 16 if scheme == "bf16" else 2
    return PoolGeometry(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, min(geometry.head_dim, 128),
                        page_size, sink, recent, (bits,) * geometry.num_layers, torch.bfloat16)


def max_batch(plan, length: int) -> tuple[int, str]:
    """Largest number of ``length``-token sequences the pool holds, and which pool limits it."""
    w, q = plan.geometry.decode_pages(length)
    by_w = plan.window_pages // w if w else 1 << 30
    by_q = plan.quant_pages // q if q else 1 << 30
    return min(by_w, by_q), ("BF16 window pages" if by_w <= by_q else "INT2 pages")


def plan_summary(plan) -> dict:
    s = plan.geometry
    return dict(window_pages=plan.window_pages, quant_pages=plan.quant_pages, window_page_bytes=s.window_page_bytes,
                quant_page_bytes=s.quant_page_bytes, total_bytes=plan.total_bytes,
                capacity_tokens=plan.capacity_tokens)


def no_fit_reason(plan, scheme: str, batch: int, length: int) -> str:
    s = plan.geometry
    w, q = s.decode_pages(length)
    fit, limit = max_batch(plan, length)
    need = f"{w} BF16 window pages" + (f" + {q} INT2 pages" if s.quantizes else "")
    have = f"{plan.window_pages} window pages" + (f" + {plan.quant_pages} INT2 pages" if s.quantizes else "")
    return (f"{scheme}: a {length}-token sequence needs {need} ({s.sequence_bytes(length) / GB:.3g} GB); the "
            f"{plan.total_bytes / GB:.3g} GB pool has {have} (capacity {plan.capacity_tokens} tokens) and holds "
            f"{fit} such sequences (limited by {limit}), batch {batch} does not fit")


# ---------------------------------------------------------------------------------------------- timing helpers
@contextlib.contextmanager
def patched(obj, name: str, value):
    old = getattr(obj, name)
    had_own = name in getattr(obj, "__dict__", {})
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had_own or isinstance(obj, type) or type(obj).__name__ == "module":
            setattr(obj, name, old)
        else:
            delattr(obj, name)  # an instance attribute shadowing a method: remove it again


class Clock:
    """Wall-clock timing with device syncs on CUDA, plus region recording (CUDA events or perf_counter)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        self.sync()
        return time.perf_counter()


class Regions:
    """Accumulates time spent in wrapped callables.  On CUDA, events on the current stream: the regions
    then partition the stream's timeline of a step (a CPU-only region shows up as the time the GPU waited
    for it), so they add up to the step time measured with synchronize."""

    def __init__(self, clock: Clock, names: tuple[str, ...] | None = None):
        self.clock, self.names = clock, names  # names: the regions recorded (None: all)
        self.marks: dict[str, list] = {}

    @contextlib.contextmanager
    def region(self, name: str):
        """The engine's timing seam (engine/timing.py): ``engine.runner.regions = this``."""
        if self.names is not None and name not in self.names:
            yield
            return
        if self.clock.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self.marks.setdefault(name, []).append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.marks.setdefault(name, []).append(time.perf_counter() - t0)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            with self.region(name):
                return fn(*args, **kwargs)

        return timed

    def totals_ms(self) -> dict[str, float]:
        self.clock.sync()
        out = {}
        for name, marks in self.marks.items():
            if self.clock.cuda:
                out[name] = sum(s.elapsed_time(e) for s, e in marks)
            else:
                out[name] = 1e3 * sum(marks)
        self.marks.clear()
        return out


# ---------------------------------------------------------------------------------------------- engine driving
@dataclass
class Unit:
    """One engine (scheme, context) and the sequences it holds."""

    engine: object
    scheme: str
    context: int
    template: object | None = None  # prefilled, parked outside the scheduler
    counter: int = 0
    temperature: float = 0.0  # of every request (0: greedy)


def make_engine(model, scheme: str, rotations, args, max_model_len: int, budget_gb: float):
    from ..engine import EngineConfig, LLMEngine

    cfg = EngineConfig(kv_cache_dtype=scheme, sink_size=args.sink_size, recent_size=args.recent_size,
                       page_size=args.page_size, max_model_len=max_model_len, kv_cache_memory=budget_gb,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       enable_prefix_caching=False,  # every sequence keeps private pages: honest memory traffic
                       attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                       model_impl=args.model_impl, async_scheduling=not args.no_async_scheduling)
    return LLMEngine(model, TokenIdsOnly(), rotations if scheme != "bf16" else None, cfg, args.ranks)


def _params(max_tokens: int, temperature: float = 0.0):
    """Greedy, or sampling at ``temperature`` with top-p 0.95 (what chat clients commonly send)."""
    from ..engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=0.95 if temperature else 1.0,
                          ignore_eos=True)


def _check_outputs(outputs) -> None:
    for out in outputs:
        if out.error:
            raise RuntimeError(f"engine step failed for {out.request_id}: {out.error}")


def prefill(unit: Unit, lengths: list[int], gen: torch.Generator, vocab: int, max_tokens: int, clock: Clock):
    """Add one random-token request per length and step the engine until each has its first token."""
    engine = unit.engine
    seqs = []
    for n in lengths:
        unit.counter += 1
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        seqs.append(engine.add_request(f"{unit.scheme}-{unit.context}-{unit.counter}", ids,
                                       _params(max_tokens, unit.temperature)))
    t0 = clock.now()
    steps = 0
    while any(not s.output_ids for s in seqs):
        _check_outputs(engine.step())
        steps += 1
        if any(s.finished for s in seqs):
            raise RuntimeError("a prefilling request finished early (rejected by the pool?)")
    return seqs, clock.now() - t0, steps


def _room(pool, length: int, n: int) -> bool:
    w, q = pool.geometry.decode_pages(length)
    return n * w <= pool.window.available and n * q <= pool.quant.available


@torch.no_grad()
def clone_sequence(unit: Unit, src):
    """A new running sequence whose pages are fresh copies of ``src``'s pages (same tokens, same state)."""
    unit.counter += 1
    return unit.engine.fork(src.request_id, f"{unit.scheme}-{unit.context}-{unit.counter}")


def release(unit: Unit, seqs) -> None:
    for s in seqs:
        if not s.finished:
            unit.engine.abort_request(s.request_id)


class StepTimer:
    """Per engine step: wall time, time in ModelRunner.run, and in its step plan (engine/timing.py's regions
    "runner" and "step_plan", host clock with a device sync at each edge)."""

    def __init__(self, engine, clock: Clock):
        self.engine, self.clock = engine, clock
        self.runner_s = self.plan_s = 0.0

    @contextlib.contextmanager
    def region(self, name: str):
        if name not in ("runner", "step_plan"):
            yield
            return
        t0 = self.clock.now()
        try:
            yield
        finally:
            spent = self.clock.now() - t0
            if name == "runner":
                self.runner_s += spent
            else:
                self.plan_s += spent

    @contextlib.contextmanager
    def installed(self):
        with patched(self.engine.runner, "regions", self):
            yield self

    def step(self, seqs, synced: bool = True) -> dict:
        """One engine step, checked (one token per sequence, no preemption); timed with a device sync at each
        edge unless ``synced`` is False."""
        before = [len(s.output_ids) for s in seqs]
        preempted = self.engine.scheduler.num_preemptions
        self.runner_s = self.plan_s = 0.0
        t0 = self.clock.now() if synced else 0.0
        outs = self.engine.step()
        wall = self.clock.now() - t0 if synced else 0.0
        _check_outputs(outs)
        if self.engine.scheduler.num_preemptions != preempted:
            raise RuntimeError("the scheduler preempted a sequence: the batch does not fit the pool")
        if any(len(s.output_ids) != b + 1 for s, b in zip(seqs, before)):
            raise RuntimeError("a sequence did not get exactly one token in a decode step")
        return dict(step=wall, runner=self.runner_s, plan=self.plan_s)


@contextlib.contextmanager
def attend_timer(engine, clock: Clock):
    """While active, the time spent in the attention layers (every layer's key rotation, KV write and attention),
    as Regions' "attend_total" (CUDA events on a GPU)."""
    regions = Regions(clock, ("attend_total",))
    with patched(engine.runner, "regions", regions):
        yield regions


@contextlib.contextmanager
def prefill_attention(path: str):
    """``kernel``: every prefill chunk runs the extend kernel; ``auto``:
    kernel_attention.extend_path decides."""
    if path == "auto":
        yield
        return
    from ..engine import kernel_attention

    never = 1 << 62
    with patched(kernel_attention, "FLASH_MIN_TOKENS", never), \
            patched(kernel_attention, "FLASH_MIN_TOKENS_ROPE", never):
        yield


def time_decode(engine, seqs, steps: int, warmup: int, clock: Clock) -> dict:
    """ms per decode step as a client gets them: ``steps`` engine steps back to back, one device sync before and
    after (a step may overlap the next one's scheduling, engine.py), then a few steps with a sync at each edge
    for where the host time goes (runner, plan, scheduler: the ``synced_*`` and ``*_ms`` fields)."""
    timer = StepTimer(engine, clock)
    first = seqs[0].num_tokens - 1 + warmup  # position of the first timed token
    with timer.installed():
        for _ in range(warmup):
            timer.step(seqs)
    pauses = []  # the garbage collector's pauses during the timed steps (host hiccups the mean carries)

    def on_gc(phase, info, start=[0.0]):  # noqa: B006 - the start time between the two calls
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            pauses.append(1e3 * (time.perf_counter() - start[0]))

    gc.callbacks.append(on_gc)
    t0 = clock.now()
    ends = []
    try:
        for _ in range(steps):
            timer.step(seqs, synced=False)
            ends.append(time.perf_counter())  # a step returns once the step before it is done (async scheduling)
        step_ms_mean = 1e3 * (clock.now() - t0) / steps
    finally:
        gc.callbacks.remove(on_gc)
    gaps = [1e3 * (b - a) for a, b in zip(ends, ends[1:])] or [step_ms_mean]
    with timer.installed():
        recs = [timer.step(seqs) for _ in range(SYNCED_STEPS)]
    ms = lambda key: [1e3 * r[key] for r in recs]  # noqa: E731
    step, runner, plan = ms("step"), ms("runner"), ms("plan")
    forward = [r - p for r, p in zip(runner, plan)]
    med = statistics.median
    b = len(seqs)
    # the median of the gaps between steps' returns (a host hiccup, e.g. a garbage collection, moves the mean, not
    # the median; both are reported)
    out = dict(steps=steps, step_ms=med(gaps), step_ms_mean=step_ms_mean, step_ms_max=max(gaps),
               synced_step_ms=med(step), synced_step_ms_min=min(step),
               synced_step_ms_max=max(step), runner_ms=med(runner), plan_ms=med(plan), forward_ms=med(forward),
               scheduler_ms=med([s - r for s, r in zip(step, runner)]))
    out.update(tokens_per_s_per_seq=1e3 / out["step_ms"], tokens_per_s=b * 1e3 / out["step_ms"],
               forward_tokens_per_s_per_seq=1e3 / out["forward_ms"], forward_tokens_per_s=b * 1e3 / out["forward_ms"])
    out["gc_pause_ms"] = sum(pauses)
    out = {k: round(v, 4) for k, v in out.items()}
    out["decode_positions"] = [first, first + steps - 1]
    return out


def breakdown(engine, seqs, steps: int, clock: Clock, profile_steps: int) -> dict:
    """Where one decode step's time goes (average over ``steps`` steps, eager: the runner's timing regions,
    engine/timing.py), and a GPU kernel summary.  Under tensor parallelism only the kernel summary (rank 0's GPU,
    graph-mode steps): rank 0 alone would run eagerly."""
    if engine.tp.size > 1:
        out = dict(steps=0, regions_ms={}, note="tensor parallel: GPU kernels of rank 0 only")
        if clock.cuda and profile_steps:
            out["gpu_kernels"] = kernel_summary(engine, seqs, profile_steps, clock, None)
        out["step_ms"] = out.get("gpu_kernels", {}).get("step_ms", 0.0)
        return out

    regions = Regions(clock)
    with patched(engine.runner, "regions", regions), patched(engine.runner, "graphs", None):  # regions: eager steps
        timer = StepTimer(engine, clock)
        step = regions.wrap("step", lambda: timer.step(seqs))
        for _ in range(steps):
            step()
        t = {k: v / steps for k, v in regions.totals_ms().items()}
    get = lambda k: t.get(k, 0.0)  # noqa: E731
    attention = get("attend_total") - get("key_rotation") - get("kv_write_and_migration") - get("query_rotation")
    parts = dict(scheduler_and_bookkeeping=get("step") - get("runner"), step_plan=get("step_plan"),
                 key_rotation=get("key_rotation"), kv_write_and_migration=get("kv_write_and_migration"),
                 query_rotation=get("query_rotation"), attention=attention, sampling=get("sampling"),
                 rest_of_model=get("runner") - get("step_plan") - get("attend_total") - get("sampling"))
    layers = len(engine.codecs)
    out = dict(steps=steps, step_ms=round(get("step"), 4), regions_ms={k: round(v, 4) for k, v in parts.items()},
               note="regions partition the step's stream timeline (CUDA events; perf_counter on the CPU); recording "
                    "them adds a few us per layer, so step_ms is slightly above the untimed median",
               attention_per_layer_us=round(1e3 * attention / layers, 2),
               attention_path="triton decode kernel" if engine.kernel_status is None
               else f"torch reference ({engine.kernel_status})")
    if clock.cuda and profile_steps:
        try:
            out["gpu_kernels"] = kernel_summary(engine, seqs, profile_steps, clock, get("step"))
        except Exception as exc:  # the profiler is optional
            out["gpu_kernels"] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
    return out


def kernel_summary(engine, seqs, steps: int, clock: Clock, step_ms: float) -> dict:
    """GPU kernel time per step by kernel (torch.profiler), grouped; busy = kernel time / step time."""
    from torch.profiler import ProfilerActivity, profile

    timer = StepTimer(engine, clock)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = clock.now()
        for _ in range(steps):
            timer.step(seqs, synced=False)  # as time_decode runs them: idle gaps are the GPU's in served steps
        clock.sync()
        if step_ms is None:  # steps under the profiler: a little slower than unprofiled ones
            step_ms = 1e3 * (clock.now() - started) / steps
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us and us > 0:
            kernels.append((e.key, us / steps / 1e3, e.count // steps))
    groups = {"decode_attention": 0.0, "query_rotation": 0.0, "kv_write": 0.0, "gemm": 0.0, "all_reduce": 0.0,
              "other": 0.0}
    for name, ms, _ in kernels:
        low = name.lower()
        if "nccl" in low or "allreduce" in low:
            groups["all_reduce"] += ms
        elif "_decode_kernel" in low or "_merge_kernel" in low or "oscar_int2" in low:
            groups["decode_attention"] += ms
        elif "_write_kernel" in low or "_migrate_kernel" in low:
            groups["kv_write"] += ms
        elif "rotate_query" in low:
            groups["query_rotation"] += ms
        elif any(k in low for k in ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas")):
            groups["gemm"] += ms
        else:
            groups["other"] += ms
    total = sum(ms for _, ms, _ in kernels)
    top = sorted(kernels, key=lambda k: -k[1])[:12]
    return dict(kernel_ms_per_step=round(total, 4), step_ms=round(step_ms, 4),
                busy_fraction=round(total / step_ms, 3) if step_ms else None,
                groups_ms={k: round(v, 4) for k, v in groups.items()},
                top=[dict(name=n[:120], ms_per_step=round(ms, 4), launches_per_step=c) for n, ms, c in top],
                idle=_idle_between_kernels(prof, steps))


IDLE_STEP_EDGE_US = 200.0  # a longer idle stretch is the host between two synced steps, not inside a step
# launches made by the host between graph replays (input copies, page migrations, sampling): their gaps are host
# time, which an overlapped step hides; the rest are kernels of the captured forward
_HOST_PACED = ("memcpy", "memset", "_migrate_kernel", "at::native")


def _idle_between_kernels(prof, steps: int) -> dict:
    """Where the GPU idles inside the captured forward: the time between one kernel's end and the next one's start
    (the profiler's kernel records), per step, summed by the pair of kernels around it; gaps next to host-paced
    launches are left out (``host_paced_ms_per_step``)."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    pairs: dict[str, float] = {}
    host = 0.0
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        idle = start - end
        if not 0 < idle < IDLE_STEP_EDGE_US:
            continue
        if any(h in a.lower() or h in b.lower() for h in _HOST_PACED):
            host += idle / steps
            continue
        key = f"{a[:24]} -> {b[:24]}"
        pairs[key] = pairs.get(key, 0.0) + idle / steps
    top = sorted(pairs.items(), key=lambda kv: -kv[1])[:12]
    return dict(ms_per_step=round(sum(pairs.values()) / 1e3, 4), host_paced_ms_per_step=round(host / 1e3, 4),
                top=[dict(between=k, us_per_step=round(v, 1)) for k, v in top])


# ---------------------------------------------------------------------------------------------- the run
def _device_info(device: torch.device) -> dict:
    info = dict(device_type=device.type, torch=torch.__version__, python=platform.python_version(),
                date=time.strftime("%Y-%m-%d %H:%M:%S %z"))
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:  # pragma: no cover
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, sms=props.multi_processor_count, memory_gb=round(props.total_memory / GB, 1))
    else:
        info["device"] = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return info


def default_budget(device: torch.device, model) -> float:
    """GB: 40 on a GPU (less if the GPU does not have it after the model), 0.02 on the CPU (tiny model)."""
    if device.type != "cuda":
        return 0.02
    free, _ = torch.cuda.mem_get_info(device)
    # the engine keeps a copy of v_proj / o_proj for un-folding, and prefill chunks need activations
    folded = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                 if ".v_proj." in n or ".o_proj." in n)
    return round(min(40.0, 0.9 * (free - folded - 4 * GB) / GB), 1)


class Deadline:
    def __init__(self, seconds: float):
        self.start = time.perf_counter()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, predicted: float = 0.0) -> bool:
        return not self.seconds or self.elapsed() + predicted <= self.seconds


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
    schemes = [s.strip() for s in args.kv_cache_dtype.split(",") if s.strip()]
    bad = [s for s in schemes if s not in SCHEMES]
    if bad or not schemes or not contexts or not batch_sizes:
        raise SystemExit(f"--kv-cache-dtype takes {','.join(SCHEMES)}; contexts and batch sizes must not be empty")
    from ..artifacts import DEFAULT_K_CLIP, DEFAULT_V_CLIP
    from ..engine.block_pool import plan_pool
    from ..models import AttentionGeometry

    result = dict(_device_info(device))
    result["timing_meaningful"] = device.type == "cuda"
    if device.type == "cuda":
        from .attention import copy_bandwidth, matmul_throughput

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
    from .attention import load_rotations

    rotations = load_rotations(args.rotations, geometry, rope_pairs=args.rope_pairs, layout=rope_layout)
    # Every batch starts from a prefilled sequence and decodes at most this many tokens past it.
    grow = 1 + args.warmup_steps + max(args.decode_steps, args.throughput_steps) + SYNCED_STEPS + args.breakdown_steps \
        + args.profile_steps + args.page_size
    result.update(model=minfo, settings=dict(
        contexts=contexts, batch_sizes=batch_sizes, schemes=schemes, decode_steps=args.decode_steps,
        warmup_steps=args.warmup_steps, kv_cache_memory_gb=budget, page_size=args.page_size,
        sink_size=args.sink_size, recent_size=args.recent_size, group_size=min(geometry.head_dim, 128),
        int2_rotations=args.rotations, key_centering=rotations.key_centering, k_clip=DEFAULT_K_CLIP,
        v_clip=DEFAULT_V_CLIP,
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

    # Per scheme, the engine's max-model-len is the largest context one sequence of which fits the budget
    # (so that the pool split is the one a server for that length would use).
    budget_bytes = int(budget * GB)
    max_len: dict[str, int | None] = {}
    for scheme in schemes:
        pool_geom = pool_geometry(scheme, geometry, args.page_size, args.sink_size, args.recent_size)
        max_len[scheme] = None
        for ctx in reversed(contexts):
            n = ctx + grow
            if n <= minfo["max_position_embeddings"] and plan_pool(pool_geom, budget_bytes, n,
                                                                   args.max_num_seqs).holds(n):
                max_len[scheme] = n
                break
        plan = plan_pool(pool_geom, budget_bytes, max_len[scheme], args.max_num_seqs) if max_len[scheme] else None
        result["schemes"][scheme] = dict(max_model_len=max_len[scheme], attention=None,
                                         plan=plan_summary(plan) if plan else None)

    top = contexts[-1]
    throughput = dict(context=top, kv_cache_memory_gb=budget, schemes={})
    result["throughput_at_budget"] = throughput if args.throughput_steps else None
    gen = torch.Generator().manual_seed(args.seed)
    warmed: set[str] = set()
    prefill_history: dict[str, tuple[int, float]] = {}

    def save():
        if args.output:
            os.makedirs(args.output, exist_ok=True)
            with open(os.path.join(args.output, "decode.json"), "w") as f:
                json.dump(result, f, indent=1)

    # Largest context first: the headline numbers (speedup at long context, throughput, breakdown) live there.
    for ctx in reversed(contexts):
        for scheme in schemes:
            pool_geom = pool_geometry(scheme, geometry, args.page_size, args.sink_size, args.recent_size)
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
                measure_context(args, model, rotations, scheme, ctx, mml, budget, batch_sizes, result, throughput,
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
    ap.add_argument("--kv-cache-dtype", default="bf16,int2", help="schemes to compare: bf16,int2")
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
                    help="INT2 artifact: a directory from `oscar-kv calibrate`, 'synthetic' (default: calibrated-like "
                         "for the random-weight model, per-position key means in --rope-pairs RoPE pairs) or 'hadamard' "
                         "(data-free, no centering)")
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
    a = ap.parse_args(argv)
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
