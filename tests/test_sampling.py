"""engine/sampling.py: one argmax for the greedy rows of a batch, seeded Gumbel-max sampling for the others."""

import math

import torch

from oscar_kv.engine.sampling import sample, uniforms
from oscar_kv.engine.sequence import SamplingParams, Sequence


def _seq(outputs: int = 0, **params) -> Sequence:
    seq = Sequence("r", [1, 2, 3], SamplingParams(**params))
    seq.output_ids = [5] * outputs
    return seq


def test_greedy_and_sampled_rows_in_one_batch():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[3, 7] = 100.0  # top_k 1 must pick it
    seqs = [_seq(temperature=0.0), _seq(temperature=0.8, seed=1), _seq(temperature=0.0),
            _seq(temperature=1.0, top_k=1, seed=2), _seq(temperature=0.7, top_p=0.9, seed=3)]
    tokens = sample(logits, seqs).tolist()
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert tokens[3] == 7
    again = sample(logits[[1, 4]], [_seq(temperature=0.8, seed=1), _seq(temperature=0.7, top_p=0.9, seed=3)])
    assert again.tolist() == [tokens[1], tokens[4]], "a seed gives the same tokens whatever else is in the batch"
    assert all(0 <= t < 50 for t in tokens)


def test_all_greedy_batch_is_one_argmax():
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(4))
    assert sample(logits, [_seq(temperature=0.0) for _ in range(8)]).tolist() == logits.argmax(-1).tolist()


def test_sampled_tokens_follow_the_softmax_of_the_kept_tokens():
    """Token i of a seeded request is drawn with its own noise: over 20000 output positions the frequencies match
    softmax(logits / T), restricted and renormalized to what top-k / top-p keep."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    cases = [(dict(temperature=0.7), None),
             (dict(temperature=1.3, top_k=3), [0, 1, 2]),
             (dict(temperature=1.0, top_p=0.8), None)]
    for params, keep in cases:
        t = params["temperature"]
        p = torch.softmax(logits / t, -1)
        if keep is not None:
            mask = torch.zeros_like(p, dtype=torch.bool)
            mask[keep] = True
            p = torch.where(mask, p, torch.zeros_like(p))
        if params.get("top_p", 1.0) < 1.0:  # the smallest prefix of the sorted tokens whose mass reaches top_p
            cum = p.cumsum(0) - p
            p = torch.where(cum <= params["top_p"], p, torch.zeros_like(p))
        p = p / p.sum()
        draws = sample(logits.expand(n, -1).contiguous(), [_seq(i, seed=11, **params) for i in range(n)])
        freq = torch.bincount(draws, minlength=6).double() / n
        sigma = (p.double() * (1 - p.double()) / n).sqrt()
        assert ((freq - p.double()).abs() <= 4 * sigma + 1e-9).all(), (params, freq.tolist(), p.tolist())


def test_noise_is_uniform_and_differs_by_seed_and_position():
    seeds = torch.tensor([0, 1, (1 << 62) - 1, 12345], dtype=torch.int64)
    u = uniforms(seeds, torch.tensor([0, 0, 7, 7]), 4096)
    assert u.dtype == torch.float32 and (u > 0).all() and (u < 1).all()
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float(u.var()) - 1 / 12) < 0.005
    for a in range(4):  # rows of other seeds or positions are not the same noise
        for b in range(a + 1, 4):
            assert abs(float(torch.corrcoef(torch.stack([u[a], u[b]]))[0, 1])) < 0.1
    again = uniforms(torch.tensor([1]), torch.tensor([1]), 4096)
    assert not torch.equal(again[0], u[1]), "the next token of a request draws new noise"
    lag = torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1]
    assert abs(float(lag)) < 0.1 and math.isfinite(float(lag))


def test_a_seed_gives_the_same_tokens_on_the_gpu():
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(2)) * 3
    seqs = [_seq(i, temperature=0.9, top_k=50 * i, top_p=1.0 - 0.05 * i, seed=100 + i) for i in range(6)]
    assert sample(logits.cuda(), seqs).tolist() == sample(logits, seqs).tolist()


def test_a_large_batch_samples_in_row_chunks_with_the_same_tokens(monkeypatch):
    """Rows are sampled a few at a time (the [rows, vocab] temporaries stay small at any batch); chunking changes
    no token."""
    from oscar_kv.engine import sampling

    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(5)) * 2
    seqs = [_seq(i, temperature=0.0 if i == 3 else 0.8, top_k=10 * (i % 3), top_p=0.9, seed=i) for i in range(7)]
    whole = sample(logits, seqs).tolist()
    monkeypatch.setattr(sampling, "CHUNK_ELEMENTS", 2 * 300)
    assert sample(logits, seqs).tolist() == whole
    assert whole[3] == int(logits[3].argmax())


def test_the_gumbel_kernel_picks_what_its_reference_picks():
    """kernels/gumbel.py against sampling.gumbel_argmax_reference: the same noise and the same token per row
    (greedy rows included, masked tokens never), under the interpreter on the CPU and on the GPU."""
    import os

    import pytest

    from oscar_kv.engine.sampling import gumbel_argmax_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel runs on CUDA or under TRITON_INTERPRET=1")
    from oscar_kv.kernels.gumbel import gumbel_argmax

    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 9000, generator=gen) * 4
    x = logits / 0.8
    x[1, 4000:] = float("-inf")  # a row whose top-k / top-p kept only the first tokens
    seeds = torch.tensor([0, 3, (1 << 62) - 1, 77, 5])
    counters = torch.tensor([0, 1, 2, 300, 4])
    greedy = torch.tensor([0, 0, 1, 0, 0])
    args = [t.to(device) for t in (x, logits, seeds, counters, greedy)]
    got = gumbel_argmax(*args).cpu()
    assert got.tolist() == gumbel_argmax_reference(x, logits, seeds, counters, greedy).tolist()
    assert got[2] == logits[2].argmax() and got[1] < 4000


def test_blockwise_cumsum_is_the_cumsum():
    from oscar_kv.engine.sampling import _cumsum

    p = torch.softmax(torch.randn(3, 2500, generator=torch.Generator().manual_seed(1)), -1)
    torch.testing.assert_close(_cumsum(p, width=256), p.cumsum(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(_cumsum(p[:, :256], width=256), p[:, :256].cumsum(-1), atol=1e-6, rtol=0)


def test_the_gumbel_kernel_splits_rows_over_programs_without_changing_tokens(monkeypatch):
    """One row over many programs, many rows over one program each: the same tokens (ties to the lowest id)."""
    import os

    import pytest

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel runs on CUDA or under TRITON_INTERPRET=1")
    from oscar_kv.kernels import gumbel

    logits = torch.zeros(3, 5000, device=device)
    logits[:, 4500] = 1.0
    logits[:, 4999] = 1.0  # a tie for the greedy row: the lower id wins
    x = (torch.randn(3, 5000, generator=torch.Generator().manual_seed(3)) * 2).to(device)
    seeds, counters = torch.tensor([1, 2, 3], device=device), torch.tensor([0, 5, 9], device=device)
    greedy = torch.tensor([1, 0, 0], device=device)
    picks = []
    for programs in (1, 3, 64):
        monkeypatch.setattr(gumbel, "PROGRAMS", programs)
        picks.append(gumbel.gumbel_argmax(x, logits, seeds, counters, greedy).tolist())
    assert picks[0] == picks[1] == picks[2] and picks[0][0] == 4500
