"""Logprobs, prompt logprobs, penalties and logit bias in the engine (engine/sampling.py, runner.py), on the real
SmolLM2 against transformers' own forward."""

import copy
import math

import numpy as np
import pytest
import torch

from oscar_kv.engine import EngineConfig, LLMEngine, SamplingParams
from oscar_kv.engine.sampling import apply_penalties, gather_logprobs
from oscar_kv.engine.sequence import PENDING, Sequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: one torch thread for small steps

# BF16 K/V (8 mantissa bits) against transformers' float32 forward: measured 0.014 at most over the 149 prompt tokens
# below, 0.045 on "One, two, three" prefilled a token at a time (every key and value read back from the pool); the
# tokens of one chunk attend to each other exactly (0 difference).  A wrong position or token is off by whole nats.
TOL = 0.1


@pytest.fixture(scope="module")
def models(smol):
    """(a copy for the engines, the untouched reference): the engine folds nothing into a BF16 model, but keep the
    session's model out of it anyway."""
    lm, tok = smol
    return copy.deepcopy(lm), lm, tok


@pytest.fixture(scope="module")
def prompt(models):
    from oscar_kv.corpus import DEFAULT_CORPUS

    tok = models[2]
    return tok(DEFAULT_CORPUS.read_text()[20_000:21_000]).input_ids[:150]


def make_engine(models, **kwargs):
    settings = dict(kv_cache_dtype="bf16", kv_cache_memory=0.05, max_model_len=512)
    settings.update(kwargs)
    return LLMEngine(models[0], models[2], None, EngineConfig(**settings))


def run(engine, requests: dict) -> dict:
    """request id -> (prompt ids, params): run them together; request id -> its outputs."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    outputs = {}
    for _ in range(2000):
        if not engine.has_work():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert not engine.has_work()
    return outputs


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits [len(ids), vocab] (float32)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_prompt_logprobs_equal_the_models_own_over_chunked_prefill(models, prompt):
    """Prompt logprobs of a 150-token prompt prefilled in chunks of 32 (each chunk reads the earlier ones from the BF16
    pool), beside a plain request in the same steps: every token's logprob and top-5 match the model's forward."""
    engine = make_engine(models, max_num_batched_tokens=32)
    out = run(engine, {"lp": (prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=5, logprobs=3)),
                       "plain": (prompt[:40], SamplingParams(max_tokens=3, temperature=0))})
    first = out["lp"][0]
    assert first.prompt_logprobs is not None and all(o.prompt_logprobs is None for o in out["lp"][1:])
    entries = first.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None and all(e is not None for e in entries[1:])
    ref = reference_logprobs(models[1], prompt)
    expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = torch.tensor([e.logprob for e in entries[1:]])
    err = (got - expected).abs().max().item()
    print(f"\nprompt logprobs, chunked BF16 prefill vs transformers: max |diff| {err:.2e} over {len(got)} tokens")
    assert err < TOL
    top = ref[:-1].topk(5, dim=-1)
    agree = np.mean([e.top_ids[0] == t for e, t in zip(entries[1:], top.indices[:, 0].tolist())])
    assert agree > 0.95  # a near tie may swap under BF16 rounding
    assert all(len(e.top_ids) == 5 and list(e.top_logprobs) == sorted(e.top_logprobs, reverse=True)
               for e in entries[1:])
    assert torch.allclose(torch.tensor([e.top_logprobs for e in entries[1:]]), top.values, atol=TOL)
    assert all(o.prompt_logprobs is None and o.logprobs is None for o in out["plain"])


def test_sampled_logprobs_are_the_raw_distribution_of_each_step(models, prompt):
    """Greedy: each token is its own top-1, with the same value; the values are the model's log_softmax at that
    position (teacher-forced on the output) whatever the temperature, which changes only the sampling."""
    engine = make_engine(models)
    params = dict(max_tokens=6, ignore_eos=True, logprobs=2)
    out = run(engine, {"greedy": (prompt[:60], SamplingParams(temperature=0, **params)),
                       "hot": (prompt[:60], SamplingParams(temperature=1.5, seed=3, **params))})
    for rid, outs in out.items():
        ids = [t for o in outs for t in o.token_ids]
        lps = [e for o in outs for e in o.logprobs]
        assert len(ids) == len(lps) == 6 and all(len(e.top_ids) == 2 for e in lps)
        ref = reference_logprobs(models[1], prompt[:60] + ids)[59:-1]
        expected = ref[torch.arange(6), torch.tensor(ids)]
        assert (torch.tensor([e.logprob for e in lps]) - expected).abs().max() < TOL, rid
        if rid == "greedy":
            assert all(e.top_ids[0] == t and e.top_logprobs[0] == e.logprob for e, t in zip(lps, ids))


def test_a_request_without_logprobs_computes_none(models, prompt, monkeypatch):
    """No log_softmax, no top-k, nothing more downloaded, when no request of a step asks."""
    import oscar_kv.engine.runner as runner

    calls = []
    monkeypatch.setattr(runner, "gather_logprobs", lambda *a: calls.append(a) or gather_logprobs(*a))
    engine = make_engine(models, max_num_batched_tokens=32)
    launched = []
    launch = engine.runner.launch
    monkeypatch.setattr(engine.runner, "launch", lambda *a: launched.append(launch(*a)) or launched[-1])
    run(engine, {"a": (prompt[:70], SamplingParams(max_tokens=4, temperature=0)),
                 "b": (prompt[:20], SamplingParams(max_tokens=4, temperature=0.7, seed=1))})
    assert not calls and launched
    assert all(s.logprobs is None and s.prompt is None and set(s.host or {}) <= {"tokens"} for s in launched)
    run(engine, {"c": (prompt[:20], SamplingParams(max_tokens=1, temperature=0, logprobs=0))})
    assert len(calls) == 1


def test_prompt_logprobs_skip_the_prefix_cache(models, prompt):
    """A request for prompt logprobs needs every position's logits: it computes its whole prompt even when the prefix
    cache holds it (and gives the same values as a cold run); a plain request after it hits the cache."""
    engine = make_engine(models)
    cold = run(engine, {"cold": (prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))})
    hits = engine.pool.hit_tokens
    warm = run(engine, {"warm": (prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))})
    assert engine.pool.hit_tokens == hits, "a prompt-logprobs request took cached pages"
    a = [e.logprob for e in cold["cold"][0].prompt_logprobs[1:]]
    b = [e.logprob for e in warm["warm"][0].prompt_logprobs[1:]]
    assert a == b
    run(engine, {"plain": (prompt, SamplingParams(max_tokens=1, temperature=0))})
    assert engine.pool.hit_tokens > hits


def test_prompt_logprobs_survive_preemption(models, prompt):
    """A pool too small for both sequences: one is preempted mid-generation and recomputed; its prompt logprobs come
    once, complete, and equal those of a run alone."""
    alone = run(make_engine(models), {"a": (prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                                       prompt_logprobs=1))})["a"][0].prompt_logprobs
    engine = make_engine(models, kv_cache_memory=0.006, max_model_len=200, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=1)
    out = run(engine, {"a": (prompt, params), "b": (prompt[::-1], params)})
    assert engine.scheduler.num_preemptions > 0
    got = [o.prompt_logprobs for o in out["a"] if o.prompt_logprobs is not None]
    assert len(got) == 1 and None not in got[0][1:]
    assert np.allclose([e.logprob for e in got[0][1:]], [e.logprob for e in alone[1:]], atol=TOL)


def test_logit_bias_and_penalties_steer_greedy_tokens(models):
    """+100 on a token makes greedy pick it every step; a strong presence penalty stops a greedy loop repeating."""
    tok = models[2]
    engine = make_engine(models)
    ids = tok("1, 1, 1, 1, 1, 1, 1,").input_ids
    target = tok(" banana").input_ids[0]
    out = run(engine, {"plain": (ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)),
                       "bias": (ids, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                    logit_bias=((target, 100.0),), logprobs=0)),
                       "presence": (ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                        presence_penalty=2.0, repetition_penalty=1.5))})
    plain = [t for o in out["plain"] for t in o.token_ids]
    assert len(set(plain)) <= 3  # " ", "1" and "," over and over
    assert [t for o in out["bias"] for t in o.token_ids] == [target] * 3
    # the logprobs stay those of the raw model: " banana" is unlikely after the ones, whatever the bias made greedy take
    assert out["bias"][0].logprobs[0].logprob < -5
    presence = [t for o in out["presence"] for t in o.token_ids]
    assert set(presence) - set(plain), (plain, presence)


def _reference_penalties(logits, prompt, outputs, params):
    x = logits.clone()
    for token, b in params.logit_bias:
        x[token] += b
    counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=len(x)).float() if outputs \
        else torch.zeros(len(x))
    seen = counts > 0
    seen[torch.tensor(prompt)] = True
    r = params.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()


def test_penalties_match_their_definitions_and_leave_other_rows_alone():
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    logits = torch.randn(4, vocab, generator=gen) * 3
    specs = [dict(temperature=0.0),
             dict(repetition_penalty=1.7, logit_bias=((3, 2.5), (7, -100.0))),
             dict(frequency_penalty=0.8, presence_penalty=-0.5),
             dict(repetition_penalty=0.6, frequency_penalty=1.1, presence_penalty=1.9)]
    seqs = []
    for i, spec in enumerate(specs):
        seq = Sequence(f"r{i}", [1, 2, 5 + i, 2], SamplingParams(**spec))
        seq.output_ids = [9, 9, 11, 2 + i, 9][:i + 2]
        seqs.append(seq)
    seqs[3].output_ids.append(PENDING)  # its last token is still being sampled: the step's input holds it
    last = torch.tensor([0, 0, 0, 13])
    out = apply_penalties(logits, seqs, last)
    assert torch.equal(out[0], logits[0])
    for i in (1, 2, 3):
        outputs = [t if t != PENDING else 13 for t in seqs[i].output_ids]
        expected = _reference_penalties(logits[i], seqs[i].prompt_ids, outputs, seqs[i].params)
        assert torch.allclose(out[i], expected, atol=1e-5), i
    assert not torch.equal(out, logits)  # a new tensor: the raw logits stay for the logprobs


def test_gather_logprobs_chunks_like_one_pass(monkeypatch):
    import oscar_kv.engine.sampling as sampling

    logits = torch.randn(7, 30, generator=torch.Generator().manual_seed(2))
    targets = torch.tensor([0, 5, 29, 3, 3, 10, 1])
    whole = gather_logprobs(logits, targets, 4)
    monkeypatch.setattr(sampling, "CHUNK_ELEMENTS", 60)  # two rows per pass
    chunked = gather_logprobs(logits, targets, 4)
    lp = torch.log_softmax(logits, -1)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert torch.allclose(whole[0][:, 0], lp[torch.arange(7), targets])
    assert torch.equal(whole[1], lp.topk(4).indices)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path: Triton kernels, CUDA graphs, async copies")
@pytest.mark.parametrize("dtype", ["bf16", "int2"])
def test_gpu_logprobs_with_graphs_overlap_and_a_batch_that_does_not_ask(dtype):
    """On the GPU (Triton kernels, CUDA graphs for decode steps, the next step queued before the host reads the
    last): a small random-weight Llama in bfloat16.  Prompt logprobs over chunked prefill, sampled logprobs under
    graph replay, penalties reading a PENDING token, beside requests that ask for nothing; graphs and eager agree,
    and greedy tokens are their own top-1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscar_kv.artifacts import Rotations
    from oscar_kv.models import AttentionGeometry

    class Tok:
        eos_token_id = None

        def decode(self, ids, **kw):
            return " ".join(map(str, ids))

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    rot = Rotations.data_free(AttentionGeometry.of(cfg), "hadamard", 64) if dtype == "int2" else None
    prompt = [(7 * j) % 500 + 1 for j in range(600)]  # past the INT2 windows (64 + 256)
    with torch.no_grad():
        ref = torch.log_softmax(copy.deepcopy(model)(torch.tensor([prompt], device="cuda")).logits[0].float(), -1)
    results = {}
    for eager in (True, False):
        engine = LLMEngine(model, Tok(), rot, EngineConfig(kv_cache_dtype=dtype, kv_cache_memory=0.5,
                                                           max_model_len=1024, max_num_batched_tokens=128,
                                                           enforce_eager=eager))
        out = run(engine, {
            "lp": (prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=3,
                                          logprobs=4)),
            "pen": (prompt[:40], SamplingParams(max_tokens=12, temperature=0.8, seed=2, ignore_eos=True, logprobs=1,
                                                frequency_penalty=1.0, repetition_penalty=1.3,
                                                logit_bias=((17, 3.0),))),
            "plain": (prompt[:30], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
        })
        if eager:
            assert engine.runner.graphs is None
        else:
            assert engine.runner.graphs.graphs  # decode steps were replayed
        results[eager] = out
    for eager, out in results.items():
        entries = out["lp"][0].prompt_logprobs
        got = torch.tensor([e.logprob for e in entries[1:]])
        expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], device="cuda")].cpu()
        err = (got - expected).abs().max().item()
        print(f"\n{dtype} {'eager' if eager else 'graphs'}: prompt logprobs vs transformers (bf16 weights) "
              f"max |diff| {err:.3f}")
        assert err < (0.15 if dtype == "bf16" else 0.5)
        for rid in ("lp", "pen"):
            ids = [t for o in out[rid] for t in o.token_ids]
            lps = [e for o in out[rid] for e in o.logprobs]
            assert len(ids) == len(lps) == 12 and all(math.isfinite(e.logprob) for e in lps)
        lp_ids = [t for o in out["lp"] for t in o.token_ids]
        lp_entries = [e for o in out["lp"] for e in o.logprobs]
        assert all(e.top_ids[0] == t and e.top_logprobs[0] == e.logprob for e, t in zip(lp_entries, lp_ids))
        assert all(o.logprobs is None and o.prompt_logprobs is None for o in out["plain"])
    # graphs replay what eager steps compute: the same greedy tokens, logprobs within bf16 rounding
    for rid in ("lp", "plain"):
        assert [t for o in results[True][rid] for t in o.token_ids] == \
            [t for o in results[False][rid] for t in o.token_ids]
    a = [e.logprob for o in results[True]["lp"] for e in o.logprobs]
    b = [e.logprob for o in results[False]["lp"] for e in o.logprobs]
    assert np.allclose(a, b, atol=0.05)
