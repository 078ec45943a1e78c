"""What the engine hands back: a ``RequestOutput`` per request and step, ``EngineStats`` for /metrics, and the
rules for a request's streamed text (where a stop string ends it, which tail is held back until it is known not
to start one).

Plain data and pure functions: ``LLMEngine`` (engine.py) fills them, the HTTP server (server/) reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Logprob


@dataclass
class RequestOutput:
    request_id: str
    text: str  # new text since the last output
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    logprobs: list[Logprob] | None = None  # one per token of token_ids, when the request asked (params.logprobs)
    # every prompt token's (the first None), on the request's first output, when it asked (params.prompt_logprobs)
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass
class EngineStats:
    running: int
    waiting: int
    pool_used_tokens: int
    pool_capacity_tokens: int
    pool_used_bytes: int
    pool_capacity_bytes: int
    window_pages_used: int
    window_pages: int
    quant_pages_used: int
    quant_pages: int
    cached_pages: int
    prefix_hit_rate: float
    prefix_hit_tokens: int
    prefix_queried_tokens: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    tokens_per_second: float
    finished: dict = field(default_factory=dict)


def stop_at(text: str, grown_from: int, stops: tuple[str, ...]) -> int:
    """Where the first stop string in ``text`` starts, or -1.  Only a stop string ending in the text past
    ``grown_from`` can be new (earlier ones were searched before): the search starts a stop string's length before."""
    start = max(0, grown_from - max((len(s) for s in stops), default=0))
    return min((i for i in (text.find(s, start) for s in stops if s) if i >= 0), default=-1)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` not to stream yet: a partial UTF-8 character, or a prefix of a stop string."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold
