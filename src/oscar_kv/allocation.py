"""How many bits each layer's keys and values are stored at: calibration's width allocation.

Why keys, and why this measure.  A far key whose logit carries an error of variance s^2 (in nats^2, over the queries
that read it) inflates the softmax mass of N such keys by e^{s^2/2} on average, while the margin by which the key a
query retrieves beats the others shrinks like log N.  So a key error that is harmless at 4K tokens loses needles at
32K (issue "Long-context retrieval that holds on every model"); value errors only average over the attended tokens.
The quantity to bound is therefore each KV head's key *logit noise*

    s^2 = scale^2 * mean_j e_j^T C_Q e_j,     e_j = k_j - k_hat_j  (the stored key's error)

with C_Q the second moment of the (post-RoPE) queries of the head's GQA group, which calibration already has.  It is
a property of the model's queries and keys at a width, measured on held-back text, not a constant chosen on one
model.  Every width {2, 3, 4, 5, 8} is measured with clips fitted at that width (an INT2 clip shrinks what a 4-bit code
would keep).

Values, in the same units.  A key whose logit is off by d moves the attention output by p d (v - o) (p its
attention weight, o the output, about the mean value); a value off by e moves it by p e.  So a value error whose
squared size is u^2 = |e|^2 / |v - mean v|^2 of the values' spread moves the output as much as a key logit error of
variance u^2 nats^2: the *value output noise* (``value_output_noise``), measured per width {2, 3, 4} with value clips
fitted at that width.  It has no long-context amplification (a value error does not raise a far token's weight), so
at a tolerance that bounds the keys the values usually stay at 2 bits; where KL says more is needed (``--max-kl``)
the widening goes on through keys and values in one order.  On Gemma 3 270M, after its keys were at 8 bits, values
at 2 bits were 85% of the KL left (K8V2 0.021, K8V4 0.0035 at 8K: benchmarks/NOTES.md, runs D1-D2).

The rule: every part (a layer's keys, or its values) starts at the narrowest width; of the parts above
``tolerance`` (nats^2) that can still be widened, the one whose worst KV head is noisiest is widened first, until
none is left or the next widening would take the mean stored bits per element past ``budget`` (at the model's
context, windows and metadata counted: memory.bits_per_element).  Widening the worst first keeps the largest noise as
small as the budget allows (a single retrieval head that drowns its needle fails the answer).

Split keys (``calibrate --key-formats split``).  The logit error weighs each rotated key direction by the queries'
energy along it (C_Q's eigenvalue), and a few directions hold most of it; one width a row spends the same bits on all.
A split width (quant.SplitWidth) stores the top 1/8, 1/4 or 1/2 of the eigen-directions (rotation.compose_split) at
3-8 bits and the rest at 2-4, each part one group.  Each layer's candidates are then every plain and split width
measured on it, ordered by stored bits, keeping only those quieter than every narrower one on that layer (its own
bits-vs-noise front); the widening walks each layer's front.  At a tolerance of 0.1 nats^2 the keys' mean stored bits
fall from 4.33 to 3.48 on Qwen2.5-Coder-1.5B and from 4.44 to 3.88 on SmolLM2-135M (benchmarks/NOTES.md, run S1).  The
noise ranks widths within a family, not plain against split: at the same noise the split widths cost more KL on
SmolLM2 and Gemma 3 (runs D36-D38), so calibrate's ``--key-formats auto`` lets the KL check choose the family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .memory import GROUP_METADATA_BITS, bits_per_element
from .quant import SplitWidth

# 5 and 8 bits: the few layers whose keys are still noisy at 4.  One bit more mostly does, where 8 cost four
# (benchmarks/NOTES.md, run Z1: Qwen2.5's layer 0 keys 0.46 nats^2 at 4 bits, 0.128 at 5; Gemma 3 270M's global
# layers 5 and 11, 0.36-0.44 at 4 in run D1, 0.088 and 0.111 at 5; the default tolerance is 0.3), so the widening
# passes 5 before 8; 8 (~0.002 on those layers) stays for keys still noisy at 5 and for KL targets that ask for more
KEY_WIDTHS = (2, 3, 4, 5, 8)
# values: 2-4 bits (4 bits kept every value's accuracy that 8 did on Gemma 3 270M: run D1)
VALUE_WIDTHS = (2, 3, 4)


# split key widths, as fractions of the head dim and (wide part, narrow part) bits: run S1's menu
SPLIT_FRACTIONS = (8, 4, 2)  # hi_dims = D // f
SPLIT_BITS = ((3, 2), (4, 2), (5, 2), (4, 3), (5, 3), (8, 2), (8, 3), (5, 4), (8, 4))


def split_widths(head_dim: int) -> list[SplitWidth]:
    """The split key widths calibration measures for a head dim (those whose parts pack)."""
    out = []
    for f in SPLIT_FRACTIONS:
        for hi, lo in SPLIT_BITS:
            w = SplitWidth(lo, head_dim // f, hi)
            try:
                w.check(head_dim)
            except ValueError:
                continue
            out.append(w)
    return out


def stored_bits(width: int | SplitWidth, head_dim: int, group_size: int) -> float:
    """Bits per element a quantized row costs at a width: codes and scale / zero point."""
    if isinstance(width, SplitWidth):
        return width.code_bits(head_dim) + 2 * GROUP_METADATA_BITS / head_dim
    return width + GROUP_METADATA_BITS / group_size


def widening_paths(table: dict, layers: int, head_dim: int, group_size: int) -> list[list]:
    """Per layer, the widths the widening walks, narrowest first (module docstring): plain widths in order; with
    split widths among them, each layer's own front (a width is kept only if quieter than the last one kept)."""
    order = sorted(table, key=lambda w: stored_bits(w, head_dim, group_size))
    if not any(isinstance(w, SplitWidth) for w in order):
        return [order] * layers
    paths = []
    for i in range(layers):
        path = []
        for w in order:
            if not path or table[w][i] < table[path[-1]][i]:
                path.append(w)
        paths.append(path)
    return paths


def key_logit_noise(keys: torch.Tensor, stored: torch.Tensor, c_q: torch.Tensor, scale: float) -> torch.Tensor:
    """Per KV head, the mean over keys of the squared logit error a query of the head's group sees.

    Args:
        keys: the exact keys, in any orthonormal basis shared with ``stored`` and ``c_q``.
        stored: the keys as the cache stores them (dequantized).
        c_q: the second moment of the group's queries, E[q q^T], in the same basis.
        scale: the layer's softmax scale.
    Shapes:
        keys, stored: [Hkv, T, D]; c_q: [Hkv, D, D].
    Returns:
        float64 [Hkv]: s^2 in nats^2.
    """
    e = (keys - stored).double()
    return scale ** 2 * torch.einsum("htd,hde,hte->h", e, c_q.double(), e) / e.shape[1]


def value_output_noise(values: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """Per KV head, the stored values' squared error relative to their spread (module docstring: a value error of
    this relative size moves the attention output as much as a key logit error of this variance, in nats^2).

    Args:
        values: the exact values, centered, in any orthonormal basis shared with ``stored``.
        stored: the values as the cache stores them (dequantized).
    Shapes:
        values, stored: [Hkv, T, D].
    Returns:
        float64 [Hkv].
    """
    e = (values - stored).double()
    return e.pow(2).sum((1, 2)) / values.double().pow(2).sum((1, 2)).clamp_min(1e-30)


@dataclass
class WidthChoice:
    """What ``allocate_widths`` chose and why (recorded in the manifest)."""

    k_bits: list[int | SplitWidth]
    noise: list[float]  # the chosen key width's logit noise per layer (worst KV head), nats^2
    bits_per_element: float  # mean stored bits per element at the budget's context
    reason: str
    steps: int = 0  # widenings taken (one side of one layer one width up its candidates each)
    v_bits: list[int] | None = None  # the values' widths (None: as given, not allocated)
    value_noise: list[float] | None = None  # the chosen value width's output noise per layer (worst KV head)


def allocate_key_widths(noise: dict[int, list[float]], v_bits: list[int], tolerance: float | None,
                        budget: float | None, seq_len: int, head_dim: int, group_size: int, sink_size: int = 64,
                        recent_size: int = 256, steps: int | None = None,
                        value_noise: dict[int, list[float]] | None = None) -> WidthChoice:
    """The key (and, with ``value_noise``, value) width of every layer (module docstring: the noisiest part is
    widened first).

    Args:
        noise: per candidate key width (bits, or a quant.SplitWidth), every layer's key logit noise at it (worst KV
            head), nats^2.
        v_bits: the values' widths per layer when they are not allocated (they count against the budget).
        tolerance: stop once every part's noise is at most this; None: only the budget stops.
        budget: the most mean stored bits per element at ``seq_len`` tokens; None: no bound.
        seq_len, head_dim, group_size, sink_size, recent_size: what the budget's bits are counted at.
        steps: stop after this many widenings (a point on the path the other bounds walk: ``--max-kl`` searches
            it); None: no bound.
        value_noise: per candidate value width, every layer's value output noise at it: values start at the
            narrowest and widen by the same rule as keys, in one order with them; None: values stay at ``v_bits``.
    Returns:
        The WidthChoice.
    """
    if tolerance is None and budget is None and steps is None:
        raise ValueError("a width allocation needs a noise tolerance, a bit budget or a step count")
    layers = len(v_bits)
    sides = {"k": noise} if value_noise is None else {"k": noise, "v": value_noise}
    paths = {side: widening_paths(table, layers, head_dim, group_size) for side, table in sides.items()}
    chosen = {side: [paths[side][i][0] for i in range(layers)] for side in sides}
    if value_noise is None:
        chosen["v"] = list(v_bits)

    def cost(k_bits, v):
        return bits_per_element(seq_len, head_dim, group_size, 2, sink_size, recent_size, k_bits=k_bits, v_bits=v)

    def current(part):
        side, i = part
        return sides[side][chosen[side][i]][i]

    def name(part):
        return f"layer {part[1]}'s {'keys' if part[0] == 'k' else 'values'}"

    if budget is not None and cost(chosen["k"], chosen["v"]) > budget + 1e-9:
        raise ValueError(f"a budget of {budget:.3f} bits per element is below the narrowest allocation "
                         f"({cost(chosen['k'], chosen['v']):.3f} at {seq_len} tokens)")
    parts = [(side, i) for side in sides for i in range(layers)]
    reason = "every layer at the widest width"
    taken = 0
    while True:
        if steps is not None and taken == steps:
            reason = f"{steps} widening(s) of the noisiest layers"
            break
        above = [p for p in parts if tolerance is None or current(p) > tolerance]
        if not above:
            reason = f"every layer's {'key logit' if value_noise is None else 'key and value'} noise is within " \
                     f"{tolerance:g} nats^2"
            break
        widenable = [p for p in above if chosen[p[0]][p[1]] != paths[p[0]][p[1]][-1]]
        if not widenable:
            worst = max(above, key=current)
            reason = (f"{len(above)} part(s) at the widest width above the tolerance, the worst {name(worst)} with "
                      f"noise {current(worst):.3g} nats^2" if tolerance is not None
                      else "every layer at the widest width")
            break
        worst = max(widenable, key=current)
        side, i = worst
        wider = {s: list(c) for s, c in chosen.items()}
        wider[side][i] = paths[side][i][paths[side][i].index(chosen[side][i]) + 1]
        if budget is not None and cost(wider["k"], wider["v"]) > budget + 1e-9:
            reason = (f"the budget of {budget:g} bits per element is spent (widening {name(worst)}, noise "
                      f"{current(worst):.3g} nats^2, would cost {cost(wider['k'], wider['v']):.3f})")
            break
        chosen = wider
        taken += 1
    return WidthChoice(chosen["k"], [round(current(("k", i)), 5) for i in range(layers)],
                       round(cost(chosen["k"], chosen["v"]), 4), reason, taken, chosen["v"],
                       None if value_noise is None else [round(current(("v", i)), 5) for i in range(layers)])
