"""exact_attention: transformers' SDPA, with float32 grouped-query attention on CUDA run without the [T, T] scores."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from oscar_kv.exact_attention import EXACT_KEY, exact_attention

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _Layer(torch.nn.Module):  # what the attention functions read from a model's attention module
    is_causal = True
    num_key_value_groups = 3


def _qkv(t: int, device: str, dtype=torch.float32, hq: int = 6, hkv: int = 2, d: int = 64):
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(1, h, t, d, device=device, dtype=dtype, generator=g) for h in (hq, hkv, hkv)]


@pytest.mark.slow
def test_a_loaded_or_unprepared_model_runs_exact_attention_and_its_logits_are_sdpa_s(smol, model):
    """load_model and unprepare_model set the model to EXACT_KEY; its forward is SDPA's (on the CPU, the same call)."""
    from oscar_kv.cache import unprepare_model

    assert model.config._attn_implementation == EXACT_KEY
    unprepare_model(model)
    assert model.config._attn_implementation == EXACT_KEY
    ids = torch.arange(100, 164)[None]
    with torch.no_grad():
        exact = model(ids).logits
        model.set_attn_implementation("sdpa")
        try:
            plain = model(ids).logits
        finally:
            model.set_attn_implementation(EXACT_KEY)
    assert torch.equal(exact, plain)


def test_a_small_grouped_query_model_forward_is_unchanged():
    """A random GQA model: the same logits through exact_attention as through SDPA, causal and with padding."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = LlamaForCausalLM(config).eval().to(device)
    ids = torch.randint(0, 64, (2, 40), device=device)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        plain = [model(ids).logits, model(ids, attention_mask=mask).logits]
        from oscar_kv.exact_attention import use_exact_attention
        use_exact_attention(model)
        exact = [model(ids).logits, model(ids, attention_mask=mask).logits]
    for e, p in zip(exact, plain):
        torch.testing.assert_close(e[:, 7:], p[:, 7:], atol=1e-5, rtol=1e-5)


@cuda
@pytest.mark.parametrize("window", [None, 300])
def test_float32_gqa_on_cuda_matches_sdpa(window):
    """The float32 CUDA branch (KV heads repeated) against transformers' SDPA, causal and with a sliding window."""
    q, k, v = _qkv(1000, "cuda")
    mask = None
    if window is not None:
        pos = torch.arange(1000, device="cuda")
        mask = ((pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window))[None, None]
    ours, _ = exact_attention(_Layer(), q, k, v, mask, scaling=0.125)
    ref, _ = sdpa_attention_forward(_Layer(), q, k, v, mask, scaling=0.125)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


@cuda
def test_float32_gqa_on_cuda_never_forms_every_head_s_scores():
    """At 16K tokens and 6 query heads the [T, T] scores of every head are 6 GiB in float32; the branch stays under
    a tenth of that above its inputs and output (SDPA's grouped-query mode took the math kernel and formed them)."""
    q, k, v = _qkv(16384, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, _ = exact_attention(_Layer(), q, k, v, None, scaling=0.125)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    scores = 6 * 16384 ** 2 * 4
    assert extra < scores / 10, f"{extra / 2**30:.2f} GiB above the inputs"
    assert torch.isfinite(out).all()
