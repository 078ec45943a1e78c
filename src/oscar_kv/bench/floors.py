"""What a decode call or step must read, and the floors the benchmarks hold it against: the device-to-device copy
bandwidth and the bf16 tensor-core rate, both measured in the same run.

Bytes are counted at each layer's own widths (``PoolGeometry.k_bits`` / ``v_bits``: codes at their width, a float16
scale and zero point per group of each side, BF16 sink and recent rows), as memory.bits_per_element counts them.
"""

from __future__ import annotations

import torch

from ..kernels.split_keys import TAIL_METADATA_BYTES
from .timing import _bench


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


def _num_q_heads(num_q_heads: int | None) -> int:
    if num_q_heads is not None:
        return num_q_heads
    from .synthetic import GEOMETRY

    return GEOMETRY["num_q_heads"]


def query_output_bytes(geom, bs: int, num_q_heads: int | None = None) -> int:
    """The BF16 query read and output written by one decode call (default: the benchmark's query heads)."""
    return 2 * bs * _num_q_heads(num_q_heads) * geom.head_dim * 2


def read_bytes(geom, bs: int, ctx: int, layer: int = 0, num_q_heads: int | None = None) -> dict:
    """What one decode call over a full-attention layer reads for ``bs`` sequences of ``ctx`` tokens, by kind:
    ``codes`` (keys and values at the layer's widths), ``metadata`` (float16 scale and uint8 zero point per group, both
    sides), ``window`` (BF16 sink and recent rows), ``query_output`` (the BF16 query and output) and ``total``."""
    h = geom.num_kv_heads
    quant = geom.int2_pages_for(ctx) * geom.page_size
    per_token = geom.quant_bytes_per_token(layer)
    # a split key row's tail holds one group's scale and zero point: metadata, not codes
    tail_metadata = TAIL_METADATA_BYTES if geom.quantizes and geom.k_split[layer] is not None else 0
    code_bytes = sum(geom.code_bytes(layer)) - tail_metadata if geom.quantizes else 0
    out = dict(codes=bs * h * quant * code_bytes, metadata=bs * h * quant * (per_token - code_bytes),
               window=bs * h * (ctx - quant) * geom.window_bytes_per_token(),
               query_output=query_output_bytes(geom, bs, num_q_heads))
    out["total"] = sum(out.values())
    return out


def int2_bytes(geom, bs: int, ctx: int) -> int:
    """Bytes a quantized decode call must read at ``geom``'s widths (INT2 by default): codes + scales and zero points of the
    history, BF16 sink/recent, q, out."""
    return bs * geom.layer_read_bytes(ctx) + query_output_bytes(geom, bs)


def bf16_bytes(geom, bs: int, ctx: int) -> int:
    """Bytes a BF16 decode call over the same context must read (the cache unquantized, q, out)."""
    return bs * geom.as_bf16().layer_read_bytes(ctx) + query_output_bytes(geom, bs)


def against_copy(nbytes: int, ms: float | None, bandwidth: float | None) -> dict:
    """``nbytes`` read in ``ms``: GB/s, the fraction of the copy bandwidth (bytes/s) and the floor in ms (the time
    the bytes take at that bandwidth)."""
    out = dict(bytes=int(nbytes))
    if bandwidth:
        out["floor_ms"] = nbytes / bandwidth * 1e3
    if ms:
        out["GBps"] = nbytes / (ms * 1e-3) / 1e9
        if bandwidth:
            out["copy_fraction"] = nbytes / (ms * 1e-3) / bandwidth
    return out


def decode_floor(geometry, weight_bytes: int, context: int, batch: int, bandwidth: float | None) -> dict:
    """The memory-bandwidth floor of one decode step: the weights once plus every sequence's cache (all layers, each
    at its widths), at the copy bandwidth measured in the same run."""
    kv = batch * sum(geometry.layer_read_bytes(context, layer) for layer in range(geometry.num_layers))
    out = dict(floor_bytes=weight_bytes + kv, kv_read_bytes=kv)
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
