"""One-shot generation with the OSCAR cache (the ``generate`` command and ``make run``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .artifacts import Rotations
from .cache import CacheSettings, OscarCache
from .errors import ConfigError
from .hf_compat import cache_kwargs
from .memory import KVFootprint


@dataclass
class GenerationResult:
    text: str
    prompt_tokens: int
    new_tokens: int
    footprint: KVFootprint
    seconds: float


def build_prompt(tokenizer, prompt: str, chat: bool = True) -> torch.Tensor:
    """Token ids of ``prompt``, wrapped in the model's chat template when it has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    return ids


@torch.no_grad()
def generate(model, tokenizer, prompt: str, rotations: Rotations | None, settings: CacheSettings,
             max_new_tokens: int = 64, chat: bool = True, temperature: float = 0.0, seed: int = 0) -> GenerationResult:
    import time

    ids = build_prompt(tokenizer, prompt, chat).to(model.device)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and ids.shape[1] + max_new_tokens > limit:
        raise ConfigError(f"the prompt has {ids.shape[1]} tokens; with {max_new_tokens} new tokens it exceeds "
                          f"the model's context of {limit}")
    cache = OscarCache(model, rotations, settings)
    torch.manual_seed(seed)
    sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                         max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id, top_p=None, top_k=None,
                         **sampling)
    new = out[0, ids.shape[1]:]
    return GenerationResult(tokenizer.decode(new, skip_special_tokens=True).strip(), ids.shape[1], len(new),
                            cache.footprint(), time.perf_counter() - started)


def memory_line(result: GenerationResult) -> str:
    fp = result.footprint
    bf16 = fp.elements * 2
    return (f"KV cache for {result.prompt_tokens + result.new_tokens - 1} tokens: BF16 {bf16 / 2**20:.2f} MiB, "
            f"this cache {fp.total_bytes / 2**20:.2f} MiB ({bf16 / max(fp.total_bytes, 1):.2f}x smaller; "
            f"windows {fp.window_bytes / 2**20:.2f} MiB + quantized {fp.quantized_bytes / 2**20:.2f} MiB), "
            f"{fp.bits_per_element:.2f} bits/element")
