"""Needle prompts asked through the serving engine (paged pool, kernels, CUDA graphs): what `oscar-kv serve`
answers, beside the harness's reference path (tasks.niah_answer over the torch cache).

The semantics of the reference path, as far as serving allows: the haystack is prefilled in one chunk (every
token sees the others exactly) and stored in the pool; the question comes as a second request that hits the
prefix cache, so the question and the answer read the haystack as stored.  The engine shares only pages that
have left the recent window, so the second request recomputes the haystack's last ``recent_size`` (+ < one
page) tokens from the stored history, where the reference stores them as computed exactly.
"""

from __future__ import annotations

import re

import torch

from ..cache import unprepare_model
from ..engine import EngineConfig, LLMEngine, SamplingParams
from ..errors import ConfigError, OscarKVError
from ..models import AttentionGeometry
from .tasks import NeedlePrompt

ANSWER = re.compile(r"\d{7}")
MAX_NEW_TOKENS = 24  # as tasks.niah_answer
SERVED_SCHEMES = {"bf16": "bf16", "oscar": "int2"}  # harness scheme -> the engine's --kv-cache-dtype


class PrefixMissed(OscarKVError, RuntimeError):
    """The question's request did not reuse the stored haystack (the answer would not read the stored cache)."""


class ServedRequestFailed(OscarKVError, RuntimeError):
    """An engine request of the served evaluation finished with an error."""


def _pool_gb(model, tokens: int) -> float:
    """A pool for two sequences of ``tokens`` even if every page were BF16, with room for rounding to pages."""
    g = AttentionGeometry.of(model.config)
    per_token = 2 * g.num_layers * g.num_kv_heads * g.head_dim * 2  # K and V, bfloat16
    return 2 * (tokens + 1024) * per_token * 1.25 / 1e9


def _run(engine: LLMEngine, request_id: str, ids: list[int], max_tokens: int):
    seq = engine.add_request(request_id, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    while not seq.finished:
        for out in engine.step():
            if out.error:
                raise ServedRequestFailed(f"engine request {out.request_id} failed: {out.error}")
    return seq


def served_answers(model, tokenizer, rotations, scheme: str, prompts: list[NeedlePrompt], page_size: int = 16,
                   sink_size: int = 64, recent_size: int = 256) -> list[str]:
    """Each prompt's greedy answer (up to the first 7-digit number) from an engine serving ``scheme`` ("bf16" or
    "oscar", with ``rotations``).  Raises PrefixMissed if a question's request did not reuse the haystack's
    pages before its recent window."""
    answers = []
    for text in served_outputs(model, tokenizer, rotations, scheme, prompts, MAX_NEW_TOKENS, page_size, sink_size,
                               recent_size):
        m = ANSWER.search(text)
        answers.append(text[:m.end()] if m else text)
    return answers


def served_outputs(model, tokenizer, rotations, scheme: str, prompts: list[NeedlePrompt], max_tokens: int | list[int],
                   page_size: int = 16, sink_size: int = 64, recent_size: int = 256) -> list[str]:
    """Each prompt's greedy output text (``max_tokens`` tokens, one count or one per prompt, or up to EOS) from an
    engine serving ``scheme``; served_answers' checks."""
    if scheme not in SERVED_SCHEMES:
        raise ConfigError(f"the engine serves {', '.join(SERVED_SCHEMES)}, not {scheme!r}")
    budgets = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
    longest = max(len(p.haystack) + len(p.question) + b for p, b in zip(prompts, budgets))
    limit = getattr(model.config, "max_position_embeddings", None) or longest
    unprepare_model(model)
    cfg = EngineConfig(kv_cache_dtype=SERVED_SCHEMES[scheme], sink_size=sink_size, recent_size=recent_size,
                       page_size=page_size, max_model_len=min(longest, limit), max_num_seqs=2,
                       max_num_batched_tokens=max(longest, 2048), kv_cache_memory=_pool_gb(model, longest))
    engine = LLMEngine(model, tokenizer, rotations if scheme == "oscar" else None, cfg)
    outputs = []
    try:
        for i, (p, budget) in enumerate(zip(prompts, budgets)):
            _run(engine, f"haystack-{i}", p.haystack, 1)
            seq = _run(engine, f"question-{i}", p.haystack + p.question, budget)
            shareable = (len(p.haystack) - recent_size) // page_size * page_size
            if seq.prefix_hit_tokens < shareable:
                raise PrefixMissed(f"prompt {i}: the question reused {seq.prefix_hit_tokens} of the haystack's "
                                   f"{shareable} tokens before its recent window")
            outputs.append(tokenizer.decode(seq.output_ids, skip_special_tokens=True))
    finally:
        del engine
        unprepare_model(model)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return outputs
