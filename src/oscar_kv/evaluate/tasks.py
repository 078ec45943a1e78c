"""The harness's tasks: teacher-forced KL / perplexity, needle in a haystack, per-layer attention error."""

from __future__ import annotations

import math
import random
import re

import torch

from ..activations import LayerSample, causal_attention, relative_error
from ..cache import OscarCache, prepare_model, unprepare_model
from .schemes import Scheme
from .simulate import simulated_attention_from_forms, simulated_logits, stored_forms

KL_START = 512  # positions before this are not scored (the cache is mostly BF16 there)


def prepare(model, scheme: Scheme) -> OscarCache:
    """Fold the scheme's value transform into the model and build a fresh cache for it."""
    unprepare_model(model)
    return OscarCache(model, scheme.rotations, scheme.settings)


@torch.no_grad()
def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    unprepare_model(model)
    return model(ids, use_cache=False).logits.float()


@torch.no_grad()
def kl_and_ppl(model, scheme: Scheme, ids: torch.Tensor, ref_logits: torch.Tensor) -> dict[str, float]:
    """Mean KL(bf16 || scheme) and top-1 agreement after KL_START, and the scheme's perplexity."""
    cache = prepare(model, scheme)
    logits = simulated_logits(model, cache, ids).float()
    start = min(KL_START, ids.shape[1] // 2)
    ref_lp = torch.log_softmax(ref_logits[:, start - 1:-1], -1)
    lp = torch.log_softmax(logits[:, start - 1:-1], -1)
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean()
    top1 = (ref_lp.argmax(-1) == lp.argmax(-1)).float().mean()
    targets = ids[:, 1:]
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, targets[..., None]).mean()
    return {"kl": float(kl), "top1_agreement": float(top1), "ppl": float(torch.exp(nll))}


# ---- needle in a haystack ------------------------------------------------------------------------
NEEDLE = "The magic number is {number}. Remember it: the magic number is {number}."
QUESTION = "What is the magic number mentioned in the text above? Reply with the 7-digit number only."
ANSWER_PREFIX = "The magic number is"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def niah_prompt(tokenizer, filler: str, length: int, depth: float, number: str) -> tuple[list[int], list[int]]:
    """(haystack ids, question ids) of a chat prompt of about ``length`` tokens with the needle at ``depth``."""
    sentences = re.split(r"(?<=[.!?])\s+", filler)
    budget = length - 80  # room for the chat template, needle and question
    chosen, used = [], 0
    for s in sentences:
        n = len(tokenizer(s, add_special_tokens=False).input_ids) + 1
        if used + n > budget:
            break
        chosen.append(s)
        used += n
    at = int(len(chosen) * depth)
    haystack = " ".join(chosen[:at] + [NEEDLE.format(number=number)] + chosen[at:])
    marker = "\n\n" + QUESTION
    content = haystack + marker
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = content + "\n"
    text += ANSWER_PREFIX  # the answer starts with the digits: fewer decode steps, same retrieval
    split = text.index(marker)
    return (tokenizer(text[:split], add_special_tokens=False).input_ids,
            tokenizer(text[split:], add_special_tokens=False).input_ids)


@torch.no_grad()
def haystack_kv(model, ids: list[int]):
    """Exact K/V of the haystack from an unprepared model: [(k post-RoPE, v raw)] per layer."""
    from transformers import DynamicCache

    unprepare_model(model)
    cache = DynamicCache(config=model.config)
    model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def fold_value_tensor(values: torch.Tensor, scheme: Scheme, layer: int) -> torch.Tensor:
    """(v - mu_V) @ R_V per head: what the folded v_proj produces, from raw values [B, Hkv, T, D]."""
    if scheme.rotations is None:
        return values
    rot = scheme.rotations.v_rotation[layer].to(values.dtype)
    rot = rot.expand(values.shape[1], *rot.shape[1:]) if rot.shape[0] == 1 else rot
    mu = scheme.rotations.v_mean[layer].to(values.dtype)
    return torch.einsum("bhtd,hde->bhte", values - mu[None, :, None], rot)


@torch.no_grad()
def niah_answer(model, tokenizer, scheme: Scheme, kv, question: list[int], max_new_tokens: int = 24) -> str:
    """Store the haystack's exact K/V in the scheme's cache, then ask the question through it (greedy).

    The haystack is prefilled once for all schemes (its hidden states are exact in every scheme, as
    in a prefix-cache hit); the question and the answer must read the needle from the stored cache.
    """
    cache = prepare(model, scheme)
    for i, (k, v) in enumerate(kv):
        layer = cache.layers[i]
        layer.update(k, fold_value_tensor(v, scheme, i))
        layer.chunk = None
    ids = torch.tensor([question])
    out = []
    for _ in range(max_new_tokens):
        token = int(model(ids, past_key_values=cache).logits[0, -1].argmax())
        if token == tokenizer.eos_token_id:
            break
        out.append(token)
        if re.search(r"\d{7}", tokenizer.decode(out)):  # an answer (right or wrong) is complete
            break
        ids = torch.tensor([[token]])
    return tokenizer.decode(out, skip_special_tokens=True)


def needle_numbers(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [str(rng.randrange(1_000_000, 10_000_000)) for _ in range(count)]


# ---- per-layer attention error -------------------------------------------------------------------
def layer_attention_errors(scheme: Scheme, cache: OscarCache, samples: list[LayerSample]) -> list[float]:
    """Relative error of each layer's attention output vs exact, on bf16 activations, under the
    scheme's storage and decode semantics (windows included)."""
    errors = []
    for i, s in enumerate(samples):
        layer = cache.layers[i]
        q, k, v = s.q[None], s.k[None], s.v[None]
        exact = causal_attention(s.q, s.k, s.v)
        forms = stored_forms(layer, k, fold_value_tensor(v, scheme, i))
        out = simulated_attention_from_forms(layer, q, forms)[0]
        if scheme.rotations is not None:  # back from the value-rotated, centered space
            rot = scheme.rotations.v_rotation[i]
            hkv = s.k.shape[0]
            rot = rot.expand(hkv, *rot.shape[1:]) if rot.shape[0] == 1 else rot
            head_of = torch.arange(s.q.shape[0]) // (s.q.shape[0] // hkv)
            out = torch.einsum("hte,hde->htd", out, rot[head_of]) + scheme.rotations.v_mean[i][head_of][:, None]
        errors.append(round(relative_error(out, exact), 5))
    return errors


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(max(v, 1e-12)) for v in values) / len(values))
