"""The decode benchmark's engine driving: one engine per (scheme, context) with the scheme's artifact, its pool plan
and what fits it, prefilled requests and their page copies, the device and the KV budget.

Schemes: ``bf16`` (no artifact), ``int2`` (the artifact at K2V2 on every layer, the INT2 default) and ``mixed`` (the
artifact at its own per-layer widths: a ``--rotations`` directory's, or the synthetic allocation of ``--key-bits`` /
``--value-bits`` / ``--kv-bits``, bench/synthetic.py).  The engine serves ``int2`` and ``mixed`` alike as
``kv_cache_dtype int2``: each layer's widths come from its artifact.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from dataclasses import dataclass

import torch

from ..config import SERVED_KV_CACHE_DTYPES
from .models import TokenIdsOnly

GB = 1e9
MIXED = "mixed"
SCHEMES = SERVED_KV_CACHE_DTYPES + (MIXED,)


def engine_dtype(scheme: str) -> str:
    """The engine's kv_cache_dtype for a benchmark scheme (``mixed`` is an INT2 engine at the artifact's widths)."""
    return "int2" if scheme == MIXED else scheme


def scheme_rotations(rotations) -> dict:
    """The artifact each quantized scheme runs: ``int2`` a copy at K2V2 on every layer, ``mixed`` the artifact as it
    is (its widths).  The copy shares every tensor but the widths."""
    int2 = dataclasses.replace(rotations)
    int2.set_bits(2, 2)
    return {"bf16": None, "int2": int2, MIXED: rotations}


def is_k2v2(rotations) -> bool:
    return bool((rotations.k_bits == 2).all() and (rotations.v_bits == 2).all()) and not rotations.has_split_keys


def pool_geometry(scheme: str, geometry, page_size: int, sink: int, recent: int, rotations=None):
    """The pool geometry the engine builds for ``scheme``: BF16, or each layer at ``rotations``' widths (None: every
    layer at 2 bits)."""
    from ..kernels.layout import PoolGeometry

    n = geometry.num_layers
    split = None
    if scheme == "bf16":
        k_bits = v_bits = (16,) * n
    elif rotations is None:
        k_bits = v_bits = (2,) * n
    else:
        k_bits, v_bits = tuple(rotations.k_bits.tolist()), tuple(rotations.v_bits.tolist())
        split = tuple(rotations.key_split(i) for i in range(n))
    return PoolGeometry(n, geometry.num_kv_heads, geometry.head_dim, min(geometry.head_dim, 128), page_size, sink,
                        recent, k_bits, torch.bfloat16, v_bits=v_bits, k_split=split)


def max_batch(plan, length: int) -> tuple[int, str]:
    """Largest number of ``length``-token sequences the pool holds, and which pool limits it."""
    w, q = plan.geometry.decode_pages(length)
    by_w = plan.window_pages // w if w else 1 << 30
    by_q = plan.quant_pages // q if q else 1 << 30
    return min(by_w, by_q), ("BF16 window pages" if by_w <= by_q else "quantized pages")


def plan_summary(plan) -> dict:
    s = plan.geometry
    return dict(window_pages=plan.window_pages, quant_pages=plan.quant_pages, window_page_bytes=s.window_page_bytes,
                quant_page_bytes=s.quant_page_bytes, total_bytes=plan.total_bytes,
                capacity_tokens=plan.capacity_tokens)


def no_fit_reason(plan, scheme: str, batch: int, length: int) -> str:
    s = plan.geometry
    w, q = s.decode_pages(length)
    fit, limit = max_batch(plan, length)
    need = f"{w} BF16 window pages" + (f" + {q} quantized pages" if s.quantizes else "")
    have = f"{plan.window_pages} window pages" + (f" + {plan.quant_pages} quantized pages" if s.quantizes else "")
    return (f"{scheme}: a {length}-token sequence needs {need} ({s.sequence_bytes(length) / GB:.3g} GB); the "
            f"{plan.total_bytes / GB:.3g} GB pool has {have} (capacity {plan.capacity_tokens} tokens) and holds "
            f"{fit} such sequences (limited by {limit}), batch {batch} does not fit")



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

    cfg = EngineConfig(kv_cache_dtype=engine_dtype(scheme), sink_size=args.sink_size, recent_size=args.recent_size,
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


def prefill(unit: Unit, lengths: list[int], gen: torch.Generator, vocab: int, max_tokens: int, clock):
    """Add one random-token request per length and step the engine until each has its first token (``clock``:
    a decode_timing.Clock)."""
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



# ---------------------------------------------------------------------------------------------- the device
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
