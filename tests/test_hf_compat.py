"""Our call sites pass the cache under the name the installed transformers takes (hf_compat.cache_kwargs):
``cache`` from 5.24 on, where ``past_key_values`` warns on every call (removed in 5.40), ``past_key_values`` before.
Each test here turns that deprecation warning into an error."""

import pytest
import torch

from oscar_kv.hf_compat import cache_keyword, cache_kwargs

DEPRECATION = "error:.*past_key_values.*:FutureWarning"


def test_the_keyword_is_read_off_the_forward_signature():
    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return past_key_values

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=None):
            return cache

    assert cache_keyword(Old()) == "past_key_values" and cache_keyword(New()) == "cache"
    marker = object()
    assert Old()(1, **cache_kwargs(Old(), marker)) is marker and New()(1, **cache_kwargs(New(), marker)) is marker


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def test_installed_transformers_keyword_matches_its_forward(tiny_llama):
    import inspect

    for module in (tiny_llama, tiny_llama.model):
        assert cache_keyword(module) in inspect.signature(type(module).forward).parameters


@pytest.mark.filterwarnings(DEPRECATION)
def test_forwards_with_our_cache_do_not_warn(tiny_llama):
    """A prefill and decode steps through OscarCache (nothing quantized: the logits equal the cache-less forward's),
    and the evaluation's exact-K/V forwards (model and model.model)."""
    from oscar_kv.cache import CacheSettings, OscarCache, unprepare_model
    from oscar_kv.evaluate.generation import prefill_prompt
    from oscar_kv.evaluate.tasks import haystack_kv

    ids = torch.randint(0, 96, (1, 24))
    with torch.no_grad():
        full = tiny_llama(ids).logits
        cache = OscarCache(tiny_llama, None, CacheSettings("bf16", window_dtype=torch.float32))
        try:
            parts = [tiny_llama(ids[:, :20], **cache_kwargs(tiny_llama, cache)).logits]
            parts += [tiny_llama(ids[:, i:i + 1], **cache_kwargs(tiny_llama, cache)).logits for i in range(20, 24)]
        finally:
            unprepare_model(tiny_llama)
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=2e-5, rtol=1e-4)
    assert len(haystack_kv(tiny_llama, ids[0].tolist())) == 2
    assert 0 <= prefill_prompt(tiny_llama, ids).first_token < 96


@pytest.mark.slow
@pytest.mark.filterwarnings(DEPRECATION)
def test_generate_does_not_warn(smol):
    """generation.generate (what `oscar-kv generate` and `demo` run) through model.generate() with the cache."""
    from oscar_kv.cache import CacheSettings, unprepare_model
    from oscar_kv.generation import generate

    lm, tok = smol
    try:
        result = generate(lm, tok, "What is the capital of France?", None, CacheSettings("bf16"), max_new_tokens=6)
    finally:
        unprepare_model(lm)
    assert "Paris" in result.text
