"""The harness's tasks: teacher-forced KL / perplexity, needle in a haystack, per-layer attention error."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

import torch

from ..activations import LayerSample, causal_attention, relative_error
from ..cache import OscarCache, prepare_model, unprepare_model
from ..hf_compat import cache_kwargs
from ..rotation import rotate
from .schemes import Scheme
from .simulate import simulated_attention_from_forms, simulating, stored_forms

KL_START = 512  # positions before this are not scored (the cache is mostly BF16 there)


def prepare(model, scheme: Scheme) -> OscarCache:
    """Fold the scheme's value transform into the model and build a fresh cache for it."""
    unprepare_model(model)
    return OscarCache(model, scheme.rotations, scheme.settings)


LOGIT_CHUNK = 1024  # positions per lm_head call: full logits at 32K x 150K vocab would take ~20 GB


@torch.no_grad()
def reference_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """The exact model's final hidden states [T, H] (logits are formed chunk by chunk in ``kl_and_ppl``)."""
    unprepare_model(model)
    return model.model(ids.to(model.device), use_cache=False).last_hidden_state[0]


@torch.no_grad()
def kl_and_ppl(model, scheme: Scheme, ids: torch.Tensor, ref_hidden: torch.Tensor) -> dict[str, float]:
    """Mean KL(bf16 || scheme) and top-1 agreement after KL_START, and the scheme's perplexity.

    Args:
        model: the model; the scheme's cache is simulated over one teacher-forced forward (simulate.py).
        scheme: the scheme to score.
        ids: the text window.
        ref_hidden: the exact model's final hidden states of ``ids`` (reference_hidden).
    Shapes:
        ids: [1, T]; ref_hidden: [T, hidden size].
    Returns:
        {"kl", "top1_agreement", "ppl", "kl_by_position"}; kl_by_position: the mean KL of the positions in each
        power-of-two bin, keyed by the bin's end ("2048": positions [1024, 2048)), so how KL grows with the history
        a position sees can be read from one forward.
    """
    cache = prepare(model, scheme)
    ids = ids.to(model.device)
    with simulating(model, cache):
        hidden = model.model(ids, use_cache=False).last_hidden_state[0]
    start = min(KL_START, ids.shape[1] // 2)
    targets = ids[0, 1:]
    kl = top1 = nll = 0.0
    bins: dict[int, list[float]] = {}  # bin end -> [KL sum, positions]
    for c0 in range(0, ids.shape[1] - 1, LOGIT_CHUNK):
        c1 = min(c0 + LOGIT_CHUNK, ids.shape[1] - 1)
        lp = torch.log_softmax(model.lm_head(hidden[c0:c1]).float(), -1)
        nll += float(-lp.gather(-1, targets[c0:c1, None]).sum())
        s0 = max(c0, start - 1)
        if s0 < c1:
            ref_lp = torch.log_softmax(model.lm_head(ref_hidden[s0:c1]).float(), -1)
            mine = lp[s0 - c0:]
            per_position = kl_divergence(ref_lp, mine)
            kl += float(per_position.sum())
            _add_to_bins(bins, per_position, s0 + 1)  # logits at index i predict position i + 1
            top1 += float((ref_lp.argmax(-1) == mine.argmax(-1)).sum())
    scored = ids.shape[1] - start
    return {"kl": kl / scored, "top1_agreement": top1 / scored, "ppl": math.exp(nll / (ids.shape[1] - 1)),
            "kl_by_position": {str(end): total / n for end, (total, n) in sorted(bins.items())}}


@torch.no_grad()
def answer_reference(model, ids: torch.Tensor, answer_start: int) -> torch.Tensor:
    """The exact model's log-probabilities (float32 [A, vocab]) of the positions that predict ``ids[0,
    answer_start:]`` (the A tokens of a needle prompt's expected answer): simulated_answer_kl's reference."""
    hidden = reference_hidden(model, ids)[answer_start - 1:-1]
    return torch.log_softmax(model.lm_head(hidden).float(), -1)


@torch.no_grad()
def simulated_answer_kl(model, scheme: Scheme, ids: torch.Tensor, answer_start: int, reference: torch.Tensor) -> float:
    """Mean KL(exact || scheme) over a needle prompt's answer tokens (``ids[0, answer_start:]``), the scheme's cache
    simulated over one teacher-forced forward of the whole prompt (as kl_and_ppl): calibrate's needle probe.
    ``reference``: answer_reference of the same ids."""
    cache = prepare(model, scheme)
    with simulating(model, cache):
        hidden = model.model(ids.to(model.device), use_cache=False).last_hidden_state[0, answer_start - 1:-1]
    log_probs = torch.log_softmax(model.lm_head(hidden).float(), -1)
    return float(kl_divergence(reference, log_probs).mean())


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) per row, from two float32 log-probability tensors [..., vocab]."""
    return (reference.exp() * (reference - other)).sum(-1)


def _add_to_bins(bins: dict[int, list[float]], values: torch.Tensor, first: int) -> None:
    """Add ``values`` (positions first, first + 1, ...) into the power-of-two position bins [end / 2, end)."""
    last, end = first + values.shape[0], 2
    while end // 2 < last:
        lo, hi = max(end // 2, first), min(end, last)
        if lo < hi:
            entry = bins.setdefault(end, [0.0, 0])
            entry[0] += float(values[lo - first:hi - first].sum())
            entry[1] += hi - lo
        end *= 2


# ---- needle in a haystack ------------------------------------------------------------------------
NEEDLE = "The magic number is {number}. Remember it: the magic number is {number}."
QUESTION = "What is the magic number mentioned in the text above? Reply with the 7-digit number only."
ANSWER_PREFIX = "The magic number is"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
# multi-key NIAH: several keyed needles, the question names one of them
KEYED_NEEDLE = "The special magic number for {key} is {number}."
KEYED_QUESTION = ("What is the special magic number for {key} mentioned in the text above? "
                  "Reply with the 7-digit number only.")
KEYED_ANSWER_PREFIX = "The special magic number for {key} is"
KEYS = ("amber-falcon", "quiet-harbor", "silver-orchard", "paper-lantern", "copper-meadow", "northern-willow",
        "velvet-canyon", "hollow-tide")


@dataclass
class NeedlePrompt:
    """A haystack with needles, the question that follows it and the expected answer.

    ``spans``: token ranges [start, end) of every needle sentence in ``haystack``; ``target`` indexes the
    one the question asks about."""

    haystack: list[int]
    question: list[int]
    answer: str
    spans: list[tuple[int, int]]
    target: int = 0


def needle_prompt(tokenizer, filler: str, length: int, needles: list[tuple[float, str]], question: str,
                  answer_prefix: str, answer: str, target: int = 0, preface: str = "") -> NeedlePrompt:
    """A chat prompt of about ``length`` tokens with each needle sentence inserted at its depth.

    Args:
        tokenizer: the model's (its chat template, when it has one).
        filler: the text the haystack is cut from, sentence by sentence.
        length: the prompt's length in tokens, roughly.
        needles: (depth in 0..1, sentence) pairs.
        question: asked after the haystack.
        answer_prefix: appended after the prompt, so that the answer starts with the digits.
        answer: the expected answer.
        target: the index of the needle the question asks about.
        preface: an instruction before the haystack (part of the shared prefix).
    """
    sentences = re.split(r"(?<=[.!?])\s+", filler)
    budget = length - 60 - sum(len(tokenizer(n, add_special_tokens=False).input_ids) + 1 for _, n in needles)
    if preface:
        budget -= len(tokenizer(preface, add_special_tokens=False).input_ids)
    chosen, used = [], 0
    sizes = [len(ids) + 1 for ids in tokenizer(sentences, add_special_tokens=False).input_ids]  # one batched call
    for s, n in zip(sentences, sizes):
        if used + n > budget:
            break
        chosen.append(s)
        used += n
    order = sorted(range(len(needles)), key=lambda i: needles[i][0])
    parts, at = [], 0
    for i in order:
        cut = int(len(chosen) * needles[i][0])
        parts += chosen[at:cut] + [needles[i][1]]
        at = max(at, cut)
    parts += chosen[at:]
    text, split = chat_text(tokenizer, preface + " ".join(parts), question, answer_prefix)
    enc = tokenizer(text[:split], add_special_tokens=False, return_offsets_mapping=True)
    spans = []
    for _, sentence in needles:
        c0 = text.index(sentence)
        c1 = c0 + len(sentence)
        toks = [t for t, (a, b) in enumerate(enc["offset_mapping"]) if b > c0 and a < c1]
        spans.append((toks[0], toks[-1] + 1))
    return NeedlePrompt(enc["input_ids"], tokenizer(text[split:], add_special_tokens=False).input_ids, answer,
                        spans, target)


def chat_text(tokenizer, context: str, question: str, answer_prefix: str) -> tuple[str, int]:
    """The prompt's text and the character where the question starts.

    ``context`` then the question form the user's turn (through the chat template when the tokenizer has one);
    ``answer_prefix`` is appended after it, so the answer starts at once (fewer decode steps, same retrieval).
    Everything before the split is the haystack: prefilled once and shared by every scheme."""
    marker = "\n\n" + question
    content = context + marker
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = content + "\n"
    text += answer_prefix
    return text, text.rindex(marker)


def niah_prompt(tokenizer, filler: str, length: int, depth: float, number: str) -> NeedlePrompt:
    """Single-needle NIAH: one magic number at ``depth``."""
    return needle_prompt(tokenizer, filler, length, [(depth, NEEDLE.format(number=number))], QUESTION,
                         ANSWER_PREFIX, number)


def multikey_prompt(tokenizer, filler: str, length: int, seed: int, keys: int = 4) -> NeedlePrompt:
    """Multi-key NIAH: ``keys`` keyed numbers at spread depths; the question asks for one of them."""
    rng = random.Random(seed)
    names = rng.sample(KEYS, keys)
    numbers = needle_numbers(keys, seed)
    depths = [(i + rng.random()) / keys for i in range(keys)]
    target = rng.randrange(keys)
    needles = [(d, KEYED_NEEDLE.format(key=k, number=n)) for d, k, n in zip(depths, names, numbers)]
    return needle_prompt(tokenizer, filler, length, needles, KEYED_QUESTION.format(key=names[target]),
                         KEYED_ANSWER_PREFIX.format(key=names[target]), numbers[target], target)


@torch.no_grad()
def haystack_kv(model, ids: list[int]):
    """Exact K/V of the haystack from an unprepared model: [(k post-RoPE, v raw)] per layer."""
    from transformers import DynamicCache

    unprepare_model(model)
    cache = DynamicCache()  # no config: a model's sliding-window layers would keep only their last window tokens
    # one position's logits: all of them would be [T, vocab] float32 (40 GB at 64K for a 150K vocabulary)
    model(torch.tensor([ids], device=model.device), **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in cache.layers]


def fold_value_tensor(values: torch.Tensor, scheme: Scheme, layer: int) -> torch.Tensor:
    """(v - mu_V) @ R_V per head: what the folded v_proj produces, from raw values [B, Hkv, T, D]."""
    if scheme.rotations is None:
        return values
    rot = scheme.rotations.v_rotation[layer].to(values.device, values.dtype)
    mu = scheme.rotations.v_mean[layer].to(values.device, values.dtype)
    return rotate(values - mu[None, :, None], rot)


def stored_cache(model, scheme: Scheme, kv) -> OscarCache:
    """The scheme's cache after storing the haystack's exact K/V (as after a prefix-cache hit)."""
    cache = prepare(model, scheme)
    for i, (k, v) in enumerate(kv):
        layer = cache.layers[i]
        layer.update(k, fold_value_tensor(v, scheme, i))
        layer.chunk = None
    return cache


@torch.no_grad()
def niah_answer(model, tokenizer, scheme: Scheme, kv, question: list[int], max_new_tokens: int = 24) -> str:
    """Store the haystack's exact K/V in the scheme's cache, then ask the question through it (greedy).

    The haystack is prefilled once for all schemes (its hidden states are exact in every scheme, as
    in a prefix-cache hit); the question and the answer must read the needle from the stored cache.

    Args:
        kv: the haystack's exact K/V per layer (haystack_kv).
        question: the question's token ids (NeedlePrompt.question).
        max_new_tokens: the answer stops here, at EOS or at the first 7-digit number.
    Returns:
        The answer's text.
    """
    return greedy_answer(model, tokenizer, scheme, kv, question, max_new_tokens,
                         lambda text: re.search(r"\d{7}", text) is not None)  # an answer (right or wrong) is complete


@torch.no_grad()
def greedy_answer(model, tokenizer, scheme: Scheme, kv, question: list[int], max_new_tokens: int,
                  done=None) -> str:
    """niah_answer's decode with its own stop: greedy tokens through the scheme's cache after the stored
    haystack ``kv``, up to ``max_new_tokens``, EOS, or the first text for which ``done(text)`` is true."""
    cache = stored_cache(model, scheme, kv)
    ids = torch.tensor([question], device=model.device)
    out = []
    for _ in range(max_new_tokens):
        token = int(model(ids, **cache_kwargs(model, cache)).logits[0, -1].argmax())
        if token == tokenizer.eos_token_id:
            break
        out.append(token)
        if done is not None and done(tokenizer.decode(out, skip_special_tokens=True)):
            break
        ids = torch.tensor([[token]], device=model.device)
    return tokenizer.decode(out, skip_special_tokens=True)


@torch.no_grad()
def answer_log_probs(model, scheme: Scheme, kv, question: list[int], answer: list[int]) -> torch.Tensor:
    """Teacher-forced log-probabilities (float32 [len(answer), vocab]) of the positions that predict each token of
    the expected ``answer``, with the question then the answer through the scheme's cache after the stored haystack
    ``kv``.  A retrieval score with no sampling in it: where greedy decoding gets a needle right or wrong, these say
    by how much (needle_scores)."""
    cache = stored_cache(model, scheme, kv)
    ids = torch.tensor([question + answer[:-1]], device=model.device)
    logits = model(ids, **cache_kwargs(model, cache)).logits[0, len(question) - 1:]
    return torch.log_softmax(logits.float(), -1)


def needle_scores(log_probs: torch.Tensor, answer: list[int], reference: torch.Tensor | None) -> dict[str, float]:
    """A needle answer's teacher-forced scores (answer_log_probs): "answer_nll", the answer's negative
    log-likelihood in nats (all its tokens), and with the exact model's ``reference`` log-probs "answer_kl", the
    mean KL(reference || this) over the answer's tokens."""
    target = torch.tensor(answer, device=log_probs.device)[:, None]
    scores = {"answer_nll": float(-log_probs.gather(-1, target).sum())}
    if reference is not None:
        scores["answer_kl"] = float(kl_divergence(reference, log_probs).mean())
    return scores


def needle_numbers(count: int, seed: int) -> list[str]:
    """``count`` random 7-digit numbers, as text, from ``seed``."""
    rng = random.Random(seed)
    return [str(rng.randrange(1_000_000, 10_000_000)) for _ in range(count)]


# ---- per-layer attention error -------------------------------------------------------------------
def layer_attention_errors(scheme: Scheme, cache: OscarCache, samples: list[LayerSample]) -> list[float]:
    """Relative error of each layer's attention output vs exact, on bf16 activations, under the
    scheme's storage and decode semantics (windows included).  ``cache``: prepare(model, scheme);
    ``samples``: one LayerSample per layer (activations.capture_samples)."""
    errors = []
    for i, s in enumerate(samples):
        layer = cache.layers[i]
        q, k, v = s.q[None], s.k[None], s.v[None]
        exact = causal_attention(s.q, s.k, s.v, s.scale, s.window)
        forms = stored_forms(layer, k, fold_value_tensor(v, scheme, i))
        out = simulated_attention_from_forms(layer, q, forms, scaling=s.scale)[0]
        if scheme.rotations is not None:  # back from the value-rotated, centered space
            rot = scheme.rotations.v_rotation[i]
            hkv = s.k.shape[0]
            rot = rot.expand(hkv, *rot.shape[1:]) if rot.shape[0] == 1 else rot
            head_of = torch.arange(s.q.shape[0]) // (s.q.shape[0] // hkv)
            out = rotate(out, rot[head_of].transpose(-1, -2)) + scheme.rotations.v_mean[i][head_of][:, None]
        errors.append(round(relative_error(out, exact), 5))
    return errors


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(max(v, 1e-12)) for v in values) / len(values))
