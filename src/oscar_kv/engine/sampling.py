"""The next token of each sequence of a step, on the logits' device: greedy (argmax, as transformers' generate) or
temperature / top-k / top-p sampling.

Sampling is the Gumbel-max trick: argmax(logits / T + g) with g = -log(-log(u)) draws from softmax(logits / T)
restricted to the tokens top-k / top-p keep (the others are -inf).  The uniforms u come from an integer hash of
(the request's seed, the index of the token being sampled, the vocabulary id), not from a generator's state, so:

* a step of many requests samples in a few batched tensor ops on the GPU, and nothing waits for the host (the
  engine queues the next step before it reads these tokens, engine.py);
* a seed gives the same tokens whatever else is in the batch, and with or without that overlap (the index of the
  token is its place in the output, counted the same way in both);
* the hash is integer arithmetic, exact on any device.
"""

from __future__ import annotations

import numpy as np
import torch

from .sequence import Sequence
from .uploads import upload

_M31 = (1 << 31) - 1
_MUL = 0x45D9F3B  # an odd multiplier of a well-mixing 32-bit integer hash; products of 31-bit values fit in int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash (int64 tensors holding values in [0, 2^31))."""
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M31
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M31
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [B, vocab] in (0, 1): row b is the noise of token ``counters[b]`` of the request seeded ``seeds[b]``
    (int64 [B], non-negative, on the device wanted)."""
    lo, hi = seeds & _M31, (seeds >> 31) & _M31
    row = _mix(_mix(lo) ^ hi ^ _mix(counters & _M31))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix((row[:, None] + _mix(ids)[None, :]) & _M31)
    return ((bits >> 7).float() + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in float32, never 0 or 1


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Args: logits [B, vocab] float32 (row i: seqs[i]'s last position).  Returns int64 [B] token ids on the logits'
    device, without waiting for it."""
    if all(seq.params.greedy for seq in seqs):
        return torch.argmax(logits, dim=-1)
    params = [seq.params for seq in seqs]
    host = np.array([[max(q.top_k, 0) for q in params], [seq.sample_seed for seq in seqs],
                     [len(seq.output_ids) for seq in seqs], [q.greedy for q in params]], dtype=np.int64)
    ints = upload(host, logits.device)
    floats = upload(np.array([[q.temperature if not q.greedy else 1.0 for q in params], [q.top_p for q in params]],
                             dtype=np.float32), logits.device)
    k_max, nucleus = int(host[0].max()), any(q.top_p < 1.0 for q in params)
    out = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
    rows = max(1, CHUNK_ELEMENTS // logits.shape[1])
    for a in range(0, len(seqs), rows):
        out[a:a + rows] = _sample_rows(logits[a:a + rows], *ints[:, a:a + rows], *floats[:, a:a + rows], k_max, nucleus)
    return out


CHUNK_ELEMENTS = 1 << 22  # rows x vocab per pass: the [rows, vocab] temporaries stay at tens of MB at any batch


def _sample_rows(logits, top_k, seeds, counters, greedy, temperature, top_p, k_max: int, nucleus: bool):
    """``sample`` for a few rows: the per-row parameters as device tensors; ``k_max``: the largest top-k (0: none
    asks for top-k); ``nucleus``: some row asks for top-p."""
    vocab = logits.shape[1]
    x = logits / temperature[:, None]
    if k_max:
        kth = torch.topk(x, min(k_max, vocab), dim=-1).values  # [rows, k_max], descending
        bound = kth.gather(1, (top_k.clamp(min=1, max=kth.shape[1]) - 1)[:, None])
        x = x.masked_fill((top_k > 0)[:, None] & (x < bound), float("-inf"))
    if nucleus:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = _cumsum(probs) - probs > top_p[:, None]  # keep the smallest set whose mass reaches top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    if x.is_cuda:
        from ..kernels.gumbel import gumbel_argmax

        return gumbel_argmax(x, logits, seeds, counters, greedy)
    return gumbel_argmax_reference(x, logits, seeds, counters, greedy)


def _cumsum(p: torch.Tensor, width: int = 1024) -> torch.Tensor:
    """p.cumsum(-1) of [rows, vocab] as a scan inside blocks of ``width`` plus the blocks' running totals: torch's
    scan along one long row is slow on the GPU (~0.6 ms at 64 x 151936, NOTES.md run S4)."""
    rows, n = p.shape
    pad = -n % width
    blocks = torch.nn.functional.pad(p, (0, pad)).view(rows, -1, width).cumsum(-1)
    before = blocks[:, :, -1].cumsum(-1) - blocks[:, :, -1]  # the mass of the earlier blocks
    return (blocks + before[:, :, None]).view(rows, -1)[:, :n]


def gumbel_argmax_reference(x: torch.Tensor, logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                            greedy: torch.Tensor) -> torch.Tensor:
    """Row b: argmax(logits[b]) where greedy[b], else argmax(x[b] + g) with g = -log(-log(uniforms)) (Gumbel).
    x, logits [rows, vocab] float32; seeds, counters, greedy int64 [rows].  kernels/gumbel.py does it in one
    launch on the GPU."""
    noise = -torch.log(-torch.log(uniforms(seeds, counters, x.shape[1])))
    return torch.argmax(torch.where(greedy[:, None].bool(), logits, x + noise), dim=-1)
