"""How many bits each layer's keys are stored at: calibration's width allocation.

Why keys, and why this measure.  A far key whose logit carries an error of variance s^2 (in nats^2, over the queries
that read it) inflates the softmax mass of N such keys by e^{s^2/2} on average, while the margin by which the key a
query retrieves beats the others shrinks like log N.  So a key error that is harmless at 4K tokens loses needles at
32K (issue "Long-context retrieval that holds on every model"); value errors only average over the attended tokens.
The quantity to bound is therefore each KV head's key *logit noise*

    s^2 = scale^2 * mean_j e_j^T C_Q e_j,     e_j = k_j - k_hat_j  (the stored key's error)

with C_Q the second moment of the (post-RoPE) queries of the head's GQA group, which calibration already has.  It is
a property of the model's queries and keys at a width, measured on held-back text, not a constant chosen on one
model.  Every width {2, 3, 4} is measured with clips fitted at that width (an INT2 clip shrinks what a 4-bit code
would keep).

The rule: every layer starts at the narrowest width; of the layers above ``tolerance`` (nats^2) that can still be
widened, the one whose worst KV head is noisiest is widened first, until none is left or the next widening would take
the mean stored bits per element past ``budget`` (at the model's context, windows and metadata counted:
memory.bits_per_element).  Widening the worst first keeps the largest noise as small as the budget allows (a single retrieval head
that drowns its needle fails the answer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .memory import bits_per_element

KEY_WIDTHS = (2, 3, 4)


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


@dataclass
class WidthChoice:
    """What ``allocate_key_widths`` chose and why (recorded in the manifest)."""

    k_bits: list[int]
    noise: list[float]  # the chosen width's logit noise per layer (worst KV head), nats^2
    bits_per_element: float  # mean stored bits per element at the budget's context
    reason: str


def allocate_key_widths(noise: dict[int, list[float]], v_bits: list[int], tolerance: float | None,
                        budget: float | None, seq_len: int, head_dim: int, group_size: int, sink_size: int = 64,
                        recent_size: int = 256, steps: int | None = None) -> WidthChoice:
    """The key width of every layer (module docstring: the noisiest layer is widened first).

    Args:
        noise: per candidate width, every layer's logit noise at it (worst KV head), nats^2.
        v_bits: the values' widths per layer (they count against the budget).
        tolerance: stop once every layer's noise is at most this; None: only the budget stops.
        budget: the most mean stored bits per element at ``seq_len`` tokens; None: no bound.
        seq_len, head_dim, group_size, sink_size, recent_size: what the budget's bits are counted at.
        steps: stop after this many widenings (a point on the path the other bounds walk: ``--max-kl`` searches
            it); None: no bound.
    Returns:
        The WidthChoice.
    """
    if tolerance is None and budget is None and steps is None:
        raise ValueError("a key width allocation needs a noise tolerance, a bit budget or a step count")
    widths = sorted(noise)
    layers = len(v_bits)
    chosen = [widths[0]] * layers

    def cost(k_bits):
        return bits_per_element(seq_len, head_dim, group_size, 2, sink_size, recent_size, k_bits=k_bits, v_bits=v_bits)

    def current(i):
        return noise[chosen[i]][i]

    if budget is not None and cost(chosen) > budget + 1e-9:
        raise ValueError(f"a budget of {budget:.3f} bits per element is below the narrowest allocation "
                         f"({cost(chosen):.3f} at {seq_len} tokens)")
    reason = "every layer at the widest width"
    taken = 0
    while True:
        if steps is not None and taken == steps:
            reason = f"{steps} widening(s) of the noisiest layers"
            break
        above = [i for i in range(layers) if tolerance is None or current(i) > tolerance]
        if not above:
            reason = f"every layer's key logit noise is within {tolerance:g} nats^2"
            break
        widenable = [i for i in above if chosen[i] != widths[-1]]
        if not widenable:
            worst = max(above, key=current)
            reason = (f"{len(above)} layer(s) at the widest width ({widths[-1]} bits) above the tolerance, the worst "
                      f"layer {worst} with noise {current(worst):.3g} nats^2" if tolerance is not None
                      else "every layer at the widest width")
            break
        worst = max(widenable, key=current)
        wider = chosen.copy()
        wider[worst] = widths[widths.index(chosen[worst]) + 1]
        if budget is not None and cost(wider) > budget + 1e-9:
            reason = (f"the budget of {budget:g} bits per element is spent (widening layer {worst}, noise "
                      f"{current(worst):.3g} nats^2, would cost {cost(wider):.3f})")
            break
        chosen = wider
        taken += 1
    return WidthChoice(chosen, [round(current(i), 5) for i in range(layers)], round(cost(chosen), 4), reason)
