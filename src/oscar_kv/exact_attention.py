"""The unquantized attention of every exact forward oscar-kv runs (the reference of `eval` and of calibrate's checks,
the statistics' capture): transformers' SDPA, except where its grouped-query mode would run out of memory.

On CUDA, SDPA's grouped-query mode (``enable_gqa``) has a kernel for 16-bit inputs (flash) but not for float32: there
it falls back to the math kernel, which forms every query head's [T, T] scores at once: 48 GiB for Qwen2.5-1.5B's 12
heads at 32K, on top of the model (calibrate's float32 checks ran out of memory on a 140 GB GPU, benchmarks/NOTES.md,
run D35).  With the KV heads repeated, float32 runs in the memory-efficient kernel, which never forms them.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

EXACT_KEY = "oscar_kv_exact"  # the attention implementation name the model is set to for exact forwards


def exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: query [B, Hq, T, D], key / value [B, Hkv, S, D] -> ([B, T, Hq, D], None)."""
    groups = query.shape[1] // key.shape[1]
    if not (query.is_cuda and query.dtype == torch.float32 and groups > 1 and key.shape[2] == query.shape[2]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    # no mask means causal (sdpa_mask leaves it out only then); a sliding window or padding comes as a mask
    causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           is_causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_exact_attention() -> None:
    AttentionInterface.register(EXACT_KEY, exact_attention)
    AttentionMaskInterface.register(EXACT_KEY, sdpa_mask)


def use_exact_attention(model) -> None:
    """Run ``model``'s attention through exact_attention from now on."""
    register_exact_attention()
    if model.config._attn_implementation != EXACT_KEY:
        model.set_attn_implementation(EXACT_KEY)
