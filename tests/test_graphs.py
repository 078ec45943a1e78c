"""CUDA graphs for decode steps (engine/graphs.py): replayed steps compute what eager steps compute.

GPU only (CUDA graphs need a GPU).  A small random-weight Llama (4 KV heads, D = 64) with data-free
rotations: the graphs' correctness does not depend on weight values.  Sampling is replaced by a fixed token
stream so both engines see the same tokens and every step's logits can be compared.
"""

import pytest
import torch

from oscar_kv.engine.graphs import BATCH_BUCKETS, length_bucket

GPU = torch.cuda.is_available()


def test_length_buckets_are_tight_and_monotone():
    prev = 0
    for n in range(1, 5000):
        b = length_bucket(n)
        assert n <= b <= max(8, int(n * 1.25)), n
        assert b >= prev
        prev = b
    assert len({length_bucket(n) for n in range(1, 8193)}) < 60  # few graphs for 128K tokens of 16-token pages
    assert BATCH_BUCKETS == tuple(sorted(BATCH_BUCKETS))


def _engine(model, tok, rot, dtype, eager):
    from oscar_kv.engine import EngineConfig, LLMEngine

    cfg = EngineConfig(kv_cache_dtype=dtype, kv_cache_memory=1.0, max_model_len=4096, enable_prefix_caching=False,
                       enforce_eager=eager)
    return LLMEngine(model, tok, rot if dtype == "int2" else None, cfg)


def _run(engine, prompts, lengths):
    """Decode with a fixed token stream; returns {request: [logits per sampled token]}."""
    from oscar_kv.engine import SamplingParams
    from oscar_kv.engine import runner as runner_mod

    seen: dict[str, list[torch.Tensor]] = {}
    real = runner_mod.sample

    def fixed(logits, seqs):  # engine/sampling.sample's signature: a step's rows, their sequences -> token tensor
        for row, seq in zip(logits, seqs):
            seen.setdefault(seq.request_id, []).append(row.float().cpu())
        return torch.tensor([(len(seen[seq.request_id]) * 7 + 3) % 500 for seq in seqs], device=logits.device)

    runner_mod.sample = fixed
    try:
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
        while engine.has_work():
            engine.step()
    finally:
        runner_mod.sample = real
    return seen


class _Tok:
    eos_token_id = None

    def decode(self, ids, **kw):
        return " ".join(map(str, ids))


def _tiny_llama(head_dim: int, layers: int, limit: int):
    """(model, tokenizer, data-free rotations) of a small random-weight Llama (8 query, 4 KV heads) on the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscar_kv.artifacts import Rotations
    from oscar_kv.models import AttentionGeometry

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=head_dim, max_position_embeddings=limit)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    return model, _Tok(), Rotations.data_free(AttentionGeometry.of(cfg), "hadamard", head_dim)


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype,centering,head_dim", [("int2", "constant", 64), ("bf16", "constant", 64),
                                                      ("int2", "rope", 64), ("int2", "constant", 128)])
def test_graph_replay_matches_eager_steps(dtype, centering, head_dim):
    """INT2 decode attention runs as one CUDA launch (int2_cuda.py, head dim 64, 128 or 256) whose last CTA per (sequence,
    KV head) merges through counters that must be back at zero for the next replay."""
    model, tok, rot = _tiny_llama(head_dim, 3, 4096)
    if centering == "rope":  # keys centered per position: rotated inside the graph, the kernels add the term back
        from oscar_kv.rope import keep_pairs, random_pairs

        gen = torch.Generator().manual_seed(1)
        rot.k_rope_mean = torch.stack([keep_pairs(torch.randn(4, 64, generator=gen) * 3, random_pairs(4, 32, 12, gen))
                                       for _ in range(3)])
        assert rot.key_centering == "rope"
    # prompts around the windows (64 + 256) and far past them, INT2 pages migrating while decoding; the batch
    # shrinks 4 -> 3 -> 2 as requests finish (3 replays the bucket-4 graph with a stale row made padding)
    prompts = [[(5 * i + j) % 500 + 1 for j in range(n)] for i, n in enumerate((40, 330, 1500, 700))]
    lengths = [60, 45, 30, 15]
    eager = _run(_engine(model, tok, rot, dtype, True), prompts, lengths)
    graphed_engine = _engine(model, tok, rot, dtype, False)
    graphed = _run(graphed_engine, prompts, lengths)
    assert {b for b, _, _ in graphed_engine.runner.graphs.graphs} == {1, 2, 4}  # it replayed
    for rid in eager:
        assert len(graphed[rid]) == len(eager[rid]) == lengths[int(rid[1:])]
        for step, (a, b) in enumerate(zip(eager[rid], graphed[rid])):
            assert torch.isfinite(b).all()
            assert (a - b).norm() <= 2e-2 * a.norm(), (rid, step)


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU")
def test_graphs_decode_per_position_centering_up_to_max_model_len():
    """Issue 23's crash: under graphs the INT2 page bound is a bucket up to 25% above the history, so the
    kernels' old reach (bucket x page + windows + tiles) passed the RoPE table sized for max-model-len
    ("the RoPE table covers N positions, the kernel reads M").  A sequence whose history sits just past a bucket
    boundary (~266 pages -> bucket 320) decodes to the last position max-model-len allows, graphed as eager."""
    from oscar_kv.engine import EngineConfig, LLMEngine
    from oscar_kv.rope import keep_pairs, random_pairs

    limit = 4608
    model, tok, rot = _tiny_llama(128, 2, limit)
    gen = torch.Generator().manual_seed(2)
    rot.k_rope_mean = torch.stack([keep_pairs(torch.randn(4, 128, generator=gen) * 3, random_pairs(4, 64, 32, gen))
                                   for _ in range(2)])
    prompt = [(3 * j) % 500 + 1 for j in range(limit - 28)]
    outs = []
    for eager in (True, False):
        engine = LLMEngine(model, tok, rot, EngineConfig(kv_cache_dtype="int2", kv_cache_memory=1.0,
                                                           max_model_len=limit, enable_prefix_caching=False,
                                                           enforce_eager=eager))
        outs.append(_run(engine, [prompt], [limit - len(prompt)])["r0"])
    assert len(outs[1]) == len(outs[0]) == 28
    for a, b in zip(*outs):
        assert torch.isfinite(b).all() and (a - b).norm() <= 2e-2 * a.norm()
