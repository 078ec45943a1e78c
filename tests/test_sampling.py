"""engine/sampling.py: one argmax for the greedy rows of a batch, seeded sampling for the others."""

import torch

from oscar_kv.engine.sampling import sample
from oscar_kv.engine.sequence import SamplingParams, Sequence


def _seq(**params) -> Sequence:
    return Sequence("r", [1, 2, 3], SamplingParams(**params))


def test_greedy_and_sampled_rows_in_one_batch():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[3, 7] = 100.0  # top_k 1 must pick it
    seqs = [_seq(temperature=0.0), _seq(temperature=0.8, seed=1), _seq(temperature=0.0),
            _seq(temperature=1.0, top_k=1, seed=2), _seq(temperature=0.7, top_p=0.9, seed=3)]
    tokens = sample(logits, seqs)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert tokens[3] == 7
    again = sample(logits[[1, 4]], [_seq(temperature=0.8, seed=1), _seq(temperature=0.7, top_p=0.9, seed=3)])
    assert again == [tokens[1], tokens[4]], "a seed gives the same tokens"
    assert all(0 <= t < 50 for t in tokens)


def test_all_greedy_batch_is_one_argmax():
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(4))
    assert sample(logits, [_seq(temperature=0.0) for _ in range(8)]) == logits.argmax(-1).tolist()
