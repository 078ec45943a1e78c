"""The next token of each sequence from its logits: greedy (argmax, as transformers' generate) or temperature /
top-k / top-p sampling with the request's own generator."""

from __future__ import annotations

import torch

from .sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], argmax: torch.Tensor | None = None) -> list[int]:
    """Args: logits [B, vocab] float32 (row i: seqs[i]'s last position); ``argmax`` [B]: the rows' argmax, when the
    step computed it on the device already.  Returns one token id per sequence.  The greedy rows share one argmax
    and one copy to the host: a device sync per row cost ~15 us each."""
    greedy = [i for i, seq in enumerate(seqs) if seq.params.greedy]
    tokens = [0] * len(seqs)
    if greedy:
        if argmax is None:
            argmax = torch.argmax(logits if len(greedy) == len(seqs) else logits[greedy], dim=-1)
        elif len(greedy) != len(seqs):
            argmax = argmax[greedy]
        for i, token in zip(greedy, argmax.tolist()):
            tokens[i] = token
    for i, seq in enumerate(seqs):
        if not seq.params.greedy:
            tokens[i] = sample_one(logits[i], seq)
    return tokens


def sample_one(logits: torch.Tensor, seq: Sequence) -> int:
    """Temperature / top-k / top-p sampling of one row [vocab] with ``seq``'s generator (on the host, so that a
    seed gives the same tokens on any device)."""
    p = seq.params
    x = logits / p.temperature
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, -1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest set whose mass reaches top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(x, -1)
    return int(torch.multinomial(probs.cpu(), 1, generator=seq.generator))
