"""Long generation (``eval --tasks longgen``): a real-text prompt, then G greedy tokens decoded through each cache.

OSCAR's regime is the long answer: every decoded token joins the history, which migrates page by page from the
BF16 recent window into the quantized region while the model keeps reading it.  The prompt is prefilled once,
exactly, and stored in every scheme's cache (``tasks.stored_cache``: what a one-chunk prefill through
``OscarCache`` stores, whose chunk attends to itself exactly).  Then:

- BF16 decodes G tokens greedily through its own ``OscarCache`` (``greedy_continuation``): the reference
  continuation, with the final hidden state of every decode step (logits are formed chunk by chunk when scored:
  [G, vocab] float32 at G = 4K and a 150K vocabulary would be 2.4 GB).
- ``gen_kl``: each scheme is teacher-forced on BF16's continuation and scored by the mean KL(BF16 || scheme) of
  the next-token distributions of the decode steps (``teacher_forced_scores``; ``gen_top1`` beside it: the share of
  those steps whose greedy token is BF16's, since one near-tie ends a free-running agreement).  This runs the
  simulation of simulate.py in one forward of the continuation over the stored prompt, with the query positions
  starting after the prompt (``simulated_attention_from_forms(start=C)``): the prompt's keys and values are the
  exact prefill's, as stored, and each continuation token sees the quantized history the real cache holds after
  appending it.  (simulate.simulated_logits simulates a text decoded token by token from position 0, whose
  prompt K/V would carry the quantization error of its own earlier positions: not what a prefill stores.)
  tests/test_evaluate.py checks it against stepping the real cache token by token.
- ``gen_first_divergence``: the scheme decodes greedily through its real cache from the same stored prompt; the
  count of its tokens that equal BF16's before the first that does not (G when none departs).  Up to that
  token free-running and teacher-forced decoding feed the same tokens, so the loop stops there.

The first generated token comes from the prompt's exact prefill and is the same in every scheme; the KL is scored
over the G - 1 decode steps that follow it.  EOS does not stop a continuation: every scheme is scored over the
same G tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..activations import attention_override
from ..cache import OscarCache, unprepare_model
from ..hf_compat import cache_kwargs
from .schemes import Scheme
from .simulate import simulated_attention_from_forms, stored_forms
from .tasks import LOGIT_CHUNK, fold_value_tensor, kl_divergence, prepare, stored_cache

CONTINUATION_KEY = "oscar_kv_simulated_continuation"
_active: list[OscarCache] = []


@dataclass
class PrefilledPrompt:
    """A prompt prefilled once by the exact model, shared by every scheme.

    ``kv``: per layer (keys post-RoPE, values as the unfolded v_proj makes them), each [1, Hkv, C, D];
    ``first_token``: the greedy token of the prefill's last position (the first generated token)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    first_token: int


@dataclass
class Continuation:
    """Greedy tokens decoded after a prompt: ``tokens[0]`` from the prefill, ``tokens[j]`` (j >= 1) from the
    decode step that fed ``tokens[j - 1]``, whose final hidden state is ``hidden[j - 1]`` ([len(tokens) - 1, H])."""

    tokens: list[int]
    hidden: torch.Tensor


@torch.no_grad()
def prefill_prompt(model, ids: torch.Tensor) -> PrefilledPrompt:
    """The exact K/V of ``ids`` [1, C] and the greedy token after it, from the unprepared model.

    Every layer keeps every position (a cache without the model's config has no sliding layers)."""
    unprepare_model(model)
    past = DynamicCache()
    hidden = model.model(ids.to(model.device), **cache_kwargs(model.model, past), use_cache=True)
    hidden = hidden.last_hidden_state[0, -1]
    return PrefilledPrompt([(layer.keys, layer.values) for layer in past.layers], int(model.lm_head(hidden).argmax()))


@torch.no_grad()
def greedy_continuation(model, scheme: Scheme, prompt: PrefilledPrompt, length: int,
                        reference: list[int] | None = None, progress: bool = False) -> Continuation:
    """Decode greedily through the scheme's real cache after the stored prompt, one token per forward.

    Args:
        model: the model (prepared for the scheme here).
        scheme: the scheme whose ``OscarCache`` stores the prompt and every decoded token.
        prompt: the prefilled prompt (prefill_prompt).
        length: the number of tokens to generate, the prefill's first one included.
        reference: BF16's tokens; the decoding stops after the first token that departs from them.
        progress: show a progress bar over the decode steps.
    """
    cache = stored_cache(model, scheme, prompt.kv)
    tokens, hidden = [prompt.first_token], []
    for _ in tqdm(range(length - 1), desc=f"decoding {scheme.name}", leave=False, disable=not progress):
        if reference is not None and tokens[-1] != reference[len(tokens) - 1]:
            break
        step = torch.tensor([[tokens[-1]]], device=model.device)
        h = model.model(step, **cache_kwargs(model.model, cache)).last_hidden_state[0, -1]
        hidden.append(h)
        tokens.append(int(model.lm_head(h).argmax()))
    empty = torch.empty(0, model.config.hidden_size, device=model.device)
    return Continuation(tokens, torch.stack(hidden) if hidden else empty)


def first_divergence(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens of ``tokens`` equal ``reference``'s."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return min(len(tokens), len(reference))


def _continuation_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The forward's queries (the last ``query.shape[2]`` positions) under decode semantics over every key so far
    (the stored prompt's and their own), in the stored forms of the cache on top of ``_active``."""
    layer = _active[-1].layers[module.layer_idx]
    start = key.shape[2] - query.shape[2]
    out = simulated_attention_from_forms(layer, query, stored_forms(layer, key, value), start=start, scaling=scaling)
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


@torch.no_grad()
def teacher_forced_hidden(model, scheme: Scheme, prompt: PrefilledPrompt, tokens: list[int]) -> torch.Tensor:
    """Final hidden states [len(tokens), H] of feeding ``tokens`` after the stored prompt through the scheme's cache,
    simulated in one forward: the prompt's exact K/V (values folded for the scheme) are the past, and attention
    follows the cache's decode semantics (simulate.py) at positions C, C + 1, ..."""
    cache = prepare(model, scheme)
    past = DynamicCache()  # the forward appends the continuation's K/V to this copy, not to the prompt's
    for i, (k, v) in enumerate(prompt.kv):
        past.update(k, fold_value_tensor(v, scheme, i), i)
    ids = torch.tensor([tokens], device=model.device)
    with attention_override(model, CONTINUATION_KEY, _continuation_attention, cache, _active):
        return model.model(ids, **cache_kwargs(model.model, past), use_cache=True).last_hidden_state[0]


@torch.no_grad()
def step_scores(model, reference_hidden: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per step [T] (CPU): KL(reference || other) of the next-token distributions (float32), and whether the two
    pick the same greedy token (bool); from final hidden states [T, H], LOGIT_CHUNK positions per lm_head call."""
    kl, agree = [], []
    for c0 in range(0, hidden.shape[0], LOGIT_CHUNK):
        ref = torch.log_softmax(model.lm_head(reference_hidden[c0:c0 + LOGIT_CHUNK]).float(), -1)
        mine = torch.log_softmax(model.lm_head(hidden[c0:c0 + LOGIT_CHUNK]).float(), -1)
        kl.append(kl_divergence(ref, mine).cpu())
        agree.append((ref.argmax(-1) == mine.argmax(-1)).cpu())
    if not kl:
        return torch.zeros(0), torch.zeros(0, dtype=torch.bool)
    return torch.cat(kl), torch.cat(agree)


def teacher_forced_scores(model, scheme: Scheme, prompt: PrefilledPrompt,
                          reference: Continuation) -> tuple[torch.Tensor, torch.Tensor]:
    """Per decode step [G - 1], with the scheme teacher-forced on BF16's continuation: KL(BF16 || scheme), and
    whether the scheme's greedy token is BF16's (step_scores)."""
    hidden = teacher_forced_hidden(model, scheme, prompt, reference.tokens[:-1])
    return step_scores(model, reference.hidden, hidden)


def score_long_generation(model, schemes: list[Scheme], reference_scheme: Scheme, ids: torch.Tensor, gen_tokens: int,
                          progress: bool = False) -> dict[str, dict[str, float]]:
    """The longgen scores of every scheme on one prompt.

    Args:
        model: the model under test.
        schemes: the schemes to score (the reference among them is scored against its own run).
        reference_scheme: the BF16 scheme whose greedy continuation is the reference.
        ids: the prompt [1, C].
        gen_tokens: G, the tokens generated after the prompt (at least 2).
        progress: show progress bars over the decode steps.
    Returns:
        {scheme name: {"gen_kl", "gen_top1", "gen_first_divergence", "gen_agreement"}}: over the G - 1 decode steps
        teacher-forced on BF16's tokens, the mean KL and the share of steps whose greedy token is BF16's (one
        near-tie ends a free-running agreement early; this says whether it was one); then the scheme's own greedy
        tokens before its first departure from BF16's, and that count over G.
    """
    prompt = prefill_prompt(model, ids)
    reference = greedy_continuation(model, reference_scheme, prompt, gen_tokens, progress=progress)
    scores = {}
    for scheme in schemes:
        kl, top1 = teacher_forced_scores(model, scheme, prompt, reference)
        if scheme is reference_scheme:  # the same computation again would give the same tokens
            agreed = gen_tokens
        else:
            own = greedy_continuation(model, scheme, prompt, gen_tokens, reference=reference.tokens, progress=progress)
            agreed = first_divergence(own.tokens, reference.tokens)
        scores[scheme.name] = {"gen_kl": float(kl.mean()), "gen_top1": float(top1.float().mean()),
                               "gen_first_divergence": agreed, "gen_agreement": agreed / gen_tokens}
    return scores
