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

Before that, a request's logit bias and penalties change its row (``apply_penalties``; only rows that ask pay), and
``gather_logprobs`` gives the log-probabilities a request asks for: of the raw logits (vLLM's default
``raw_logprobs``), never of the penalized or tempered ones, and computed only where some row asks.
"""

from __future__ import annotations

import numpy as np
import torch

from .sequence import PENDING, Sequence
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


def sample(logits: torch.Tensor, seqs: list[Sequence], last_inputs: torch.Tensor | None = None) -> torch.Tensor:
    """Args: logits [B, vocab] float32 (row i: seqs[i]'s last position); ``last_inputs`` int64 [B] on the device: each
    row's last input id (what an output id still PENDING is, for the penalties).  Returns int64 [B] token ids on the
    logits' device, without waiting for it."""
    if any(seq.params.penalized for seq in seqs):
        logits = apply_penalties(logits, seqs, last_inputs)
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
        from ..kernels import triton_available

        if triton_available():  # else the reference runs on the GPU (the start-up log says Triton is missing)
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


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], last_inputs: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` [B, vocab] with each penalized row changed (a new tensor; ``logits`` stays raw for the logprobs):

    1. logit_bias: the bias added to its token's logit (OpenAI);
    2. repetition_penalty r (CTRL / transformers / vLLM): the logit of every token seen in the prompt or the output
       so far divided by r where positive, multiplied by r where not;
    3. frequency_penalty f and presence_penalty p (OpenAI): minus f * (times the token was generated) minus
       p * (1 if it was generated at all); the prompt does not count.

    The output counts are rebuilt on the device each step from the sequence's output ids (an upload of O(output
    length) per penalized row and step); the prompt's tokens are uploaded once per sequence and kept as a mask.
    ``last_inputs`` (see ``sample``) stands in for an output id still PENDING."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.penalized]
    dev, vocab = logits.device, logits.shape[1]
    index = upload(np.array(rows, dtype=np.int64), dev)
    x = logits.index_select(0, index)  # a copy of the penalized rows
    params = [seqs[i].params for i in rows]
    bias = [(r, token, b) for r, q in enumerate(params) for token, b in q.logit_bias]
    if bias:
        where = upload(np.array([[r for r, _, _ in bias], [t for _, t, _ in bias]], dtype=np.int64), dev)
        x.index_put_((where[0], where[1]), upload(np.array([b for _, _, b in bias], dtype=np.float32), dev),
                     accumulate=True)
    if any(q.presence_penalty or q.frequency_penalty or q.repetition_penalty != 1.0 for q in params):
        outputs = [seqs[i].output_ids for i in rows]
        width = max(1, max(len(o) for o in outputs))
        ids = np.full((len(rows), width), vocab, dtype=np.int64)  # column `vocab`: padding, cut off below
        for r, out in enumerate(outputs):
            ids[r, :len(out)] = out
        ids_dev = upload(ids, dev)
        if any(out and out[-1] == PENDING for out in outputs):
            fill = last_inputs.index_select(0, index)[:, None] if last_inputs is not None else vocab
            ids_dev = torch.where(ids_dev == PENDING, fill, ids_dev)
        counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32, device=dev)
        counts.scatter_add_(1, ids_dev, torch.ones_like(ids_dev, dtype=torch.float32))
        counts = counts[:, :vocab]
        floats = upload(np.array([[q.repetition_penalty for q in params], [q.frequency_penalty for q in params],
                                  [q.presence_penalty for q in params]], dtype=np.float32), dev)
        if any(q.repetition_penalty != 1.0 for q in params):
            seen = torch.stack([_prompt_mask(seqs[i], vocab, dev) for i in rows]) | (counts > 0)
            rep = floats[0][:, None]
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - floats[1][:, None] * counts - floats[2][:, None] * (counts > 0).float()
    return logits.index_copy(0, index, x)


def _prompt_mask(seq: Sequence, vocab: int, device: torch.device) -> torch.Tensor:
    """bool [vocab] on ``device``: the tokens of ``seq``'s prompt (built once per sequence, kept on it)."""
    mask = seq.prompt_mask
    if mask is None or mask.device != device:
        ids = upload(np.asarray(seq.prompt_ids, dtype=np.int64), device)
        mask = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, True)
        seq.prompt_mask = mask
    return mask


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of rows of raw logits: ``logits`` [R, vocab] (any float dtype), ``targets`` int64 [R].
    Returns (float32 [R, 1 + k]: column 0 the target's log-probability, then the k largest, descending;
    int64 [R, k]: their token ids), on the logits' device, without waiting for it.  The target's value and the top
    values come from the same log_softmax, so a target that is the argmax equals column 1 exactly."""
    rows, vocab = logits.shape
    values = torch.empty(rows, 1 + k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    step = max(1, CHUNK_ELEMENTS // vocab)
    for a in range(0, rows, step):
        lp = torch.log_softmax(logits[a:a + step].float(), dim=-1)
        values[a:a + step, 0] = lp.gather(1, targets[a:a + step, None])[:, 0]
        if k:
            top = torch.topk(lp, min(k, vocab), dim=-1)
            values[a:a + step, 1:] = top.values
            ids[a:a + step] = top.indices
    return values, ids
