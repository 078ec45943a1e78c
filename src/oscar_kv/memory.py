"""Honest KV memory accounting: codes, metadata and BF16 windows all count.

Bits per element (one element = one K or V channel of one token of one KV head) for a sequence of
T tokens with sink S0, recent window W, head dim D, group G and b-bit codes:
    quantized tokens  n = max(T - S0 - W, 0)
    bits = (min(T, S0 + W) * window_bits + n * (b + group_bits / G)) / T
group_bits = 24 per group: a float16 scale and an 8-bit zero point (quant.py).  At T = 128K, D = G = 128:
(320 * 16 + 130752 * 2.1875) / 131072 = 2.2212 (the paper's 2.28 stores a float16 minimum: 32 bits a group).
Layers whose keys or values are stored at another width (the artifact's k_bits / v_bits) are averaged in, each
side at its own width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import SplitWidth

# Metadata bits per group of G channels: a float16 scale and a uint8 zero point (quant.py).
GROUP_METADATA_BITS = 24


@dataclass(frozen=True)
class KVFootprint:
    """Measured bytes of a live cache: window (sink + recent) and quantized history."""

    window_bytes: int
    quantized_bytes: int
    elements: int  # K and V channels of all tokens, heads and layers

    def __add__(self, other: "KVFootprint") -> "KVFootprint":
        return KVFootprint(self.window_bytes + other.window_bytes, self.quantized_bytes + other.quantized_bytes,
                           self.elements + other.elements)

    @property
    def total_bytes(self) -> int:
        return self.window_bytes + self.quantized_bytes

    @property
    def bits_per_element(self) -> float:
        return 8 * self.total_bytes / self.elements if self.elements else 0.0


def bits_per_element(seq_len: int, head_dim: int, group_size: int | None = None, bits: int = 2,
                     sink_size: int = 64, recent_size: int = 256, window_bits: int = 16,
                     group_bits: int = GROUP_METADATA_BITS,
                     k_bits: list[int] | None = None, v_bits: list[int] | None = None,
                     key_group_size: int | None = None) -> float:
    """Average stored bits per KV element at ``seq_len`` tokens (see the module docstring).

    ``k_bits`` / ``v_bits``: each layer's key / value width (the artifact's; ``bits`` is the least any side is
    stored at, 16: nothing is quantized; a key width may be a quant.SplitWidth: two groups a row); None: ``bits``
    everywhere (``v_bits`` None: as ``k_bits``, whose split widths then count as their narrow part).
    ``key_group_size`` is the number of key elements sharing one scale / zero point when it differs
    from the values' (KIVI's per-channel keys: one per channel per page of tokens).  ``group_bits``: metadata bits
    per group.
    """
    if seq_len <= 0:
        raise ValueError("sequence length must be positive")
    group_size = group_size or min(head_dim, 128)
    k_bits = k_bits or [bits]
    v_bits = v_bits or [k.bits if isinstance(k, SplitWidth) else k for k in k_bits]
    windowed = min(seq_len, sink_size + recent_size)
    quantized = seq_len - windowed
    total = 0.0
    for kb, vb in zip(k_bits, v_bits, strict=True):
        if isinstance(kb, SplitWidth) and bits <= kb.bits:  # two groups a row, each part at its width
            stored = kb.code_bits(head_dim) + 2 * group_bits / head_dim
            total += (windowed * window_bits + quantized * stored) / seq_len
            kb = None
        elif isinstance(kb, SplitWidth):  # a wider cache precision stores every channel at it
            kb = kb.bits
        for b, group in ((kb, key_group_size or group_size), (vb, group_size)):
            if b is None:
                continue
            b = max(b, bits) if bits < 16 and b < 16 else 16
            if b >= 16:
                total += window_bits
            else:
                total += (windowed * window_bits + quantized * (b + group_bits / group)) / seq_len
    return total / (2 * len(k_bits))


def width_summary(k_bits, v_bits) -> str:
    """Layers' key / value widths in words, e.g. "K3V2 x 20, K4V2 x 4"."""
    counts: dict[str, int] = {}
    for k, v in zip(k_bits, v_bits, strict=True):
        counts[f"K{k}V{v}"] = counts.get(f"K{k}V{v}", 0) + 1
    return ", ".join(f"{name} x {n}" for name, n in sorted(counts.items()))


def kv_bytes(seq_len: int, num_layers: int, num_kv_heads: int, head_dim: int, batch: int = 1, **kwargs) -> float:
    """Bytes of K and V for ``batch`` sequences of ``seq_len`` tokens at the given scheme."""
    elements = 2 * num_layers * num_kv_heads * head_dim * seq_len * batch
    return elements * bits_per_element(seq_len, head_dim, **kwargs) / 8


def free_bytes(device: torch.device) -> int:
    """Bytes free where ``device`` keeps tensors: the GPU's free memory, or on the CPU the RAM Linux reports
    available (MemAvailable; all of it where /proc/meminfo cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError):
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
