"""The decode benchmark's clocks: engine steps timed as a server runs them (back to back, overlapped) and with a
sync at each edge (where the host time goes), the runner's timing regions (engine/timing.py) for a step's breakdown,
and the GPU kernels of a step (torch.profiler)."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch

from .decode_engine import _check_outputs

SYNCED_STEPS = 8  # steps per row timed with a sync at each edge, for the host-time split (time_decode)


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
    """GPU kernel time per step by kernel (torch.profiler), grouped; busy = kernel time / step time.  ``pdl``: whether
    the step's kernels were launched with PDL, under which a kernel's time includes its wait for the one before
    (the sums then overlap: read per-kernel times with OSCAR_KV_PDL=off)."""
    from torch.profiler import ProfilerActivity, profile

    from ..kernels import pdl

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
                pdl=torch.cuda.is_available() and pdl.enabled(torch.device("cuda")),
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
