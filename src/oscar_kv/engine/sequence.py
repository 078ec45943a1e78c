"""A request as the engine sees it: tokens, sampling parameters, its pages, and its text so far."""

from __future__ import annotations

import enum
import hashlib
import itertools
import math
import os
from dataclasses import dataclass, field
from typing import NamedTuple

from ..errors import RequestError

MAX_LOGPROBS = 20  # the most alternatives a request may ask for per token (vLLM's default --max-logprobs)


class Logprob(NamedTuple):
    """One token's log-probability under the model's raw distribution (log_softmax of the logits, before
    penalties, logit bias and temperature), and the ``k`` most likely tokens at its position, most likely first."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for.  ``temperature == 0`` is greedy (argmax, no randomness)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # log-probabilities (sampling.py, runner.py): None asks for none, k >= 0 for each token's own plus the top k
    logprobs: int | None = None  # of every sampled token
    prompt_logprobs: int | None = None  # of every prompt token after the first (the prefix cache is skipped)
    # applied on the device before temperature / top-k / top-p, in this order: logit_bias, repetition, frequency and
    # presence penalties (vLLM's and OpenAI's definitions; sampling.apply_penalties)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs

    def __post_init__(self):
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise RequestError(f"{name} must lie in [0, {MAX_LOGPROBS}], got {k}")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise RequestError(f"{name} must be a finite number, got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise RequestError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if any(not math.isfinite(b) for _, b in self.logit_bias):
            raise RequestError("logit_bias values must be finite numbers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Its logits change before sampling (penalties or logit bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrivals = itertools.count()
# the last output id of a sequence whose next token a step still in flight on the device will give (engine.py:
# the next step is scheduled and launched before the host waits for that token)
PENDING = -1


@dataclass(eq=False)
class Sequence:
    """One request.  Its KV cache is ``pages`` (logical page i -> physical page id) plus ``int2_pages``:
    logical pages [sink_pages, sink_pages + int2_pages) live in the quantized pool, all others in the
    window pool (see block_pool.py).  ``num_computed`` tokens have K/V in the cache."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    pages: list[int] = field(default_factory=list)
    int2_pages: int = 0
    block_row: int = -1  # its row of the pool's device block tables while running (block_table.py)
    num_computed: int = 0
    registered_pages: int = 0  # leading pages already offered to the prefix cache
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    finish_reason: str | None = None
    text: str = ""  # output text (stop strings cut), as far as it is final
    detokenizer: object = None  # detokenize.IncrementalText over output_ids (set by the engine)
    sent_chars: int = 0
    arrival: int = field(default_factory=lambda: next(_arrivals))
    sample_seed: int = 0  # the seed of its sampling noise (sampling.py), in [0, 2^62)
    output_logprobs: list[Logprob] = field(default_factory=list)  # one per output id, when params.logprobs is set
    # prompt_logprobs[p]: of prompt token p given the tokens before it (None for p = 0 and until computed)
    prompt_logprobs: list[Logprob | None] | None = None
    prompt_logprobs_next: int = 0  # the first prompt position whose logits no launched step has computed yet
    prompt_logprobs_sent: bool = False
    prompt_mask: object = None  # bool [vocab] on the device: its prompt's tokens (sampling.py, repetition_penalty)
    _page_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self):
        if not self.prompt_ids:
            raise RequestError("the prompt is empty")
        if not self.params.greedy:
            seed = self.params.seed if self.params.seed is not None else int.from_bytes(os.urandom(8), "little")
            self.sample_seed = seed % (1 << 62)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)

    @property
    def wants_prompt_logits(self) -> bool:
        """Some prompt position's logits are still to be computed for its prompt logprobs: the prefix cache must not
        skip them (scheduler.py)."""
        return self.prompt_logprobs is not None and self.prompt_logprobs_next < len(self.prompt_ids) - 1

    @property
    def pending(self) -> bool:
        """Its last token is still being sampled on the device (``PENDING``)."""
        return bool(self.output_ids) and self.output_ids[-1] == PENDING

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_range(self, start: int, end: int) -> list[int]:
        """``tokens[start:end]`` without building the whole token list (per step: O(end - start), not O(context))."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def page_hash(self, index: int, page_size: int) -> bytes:
        """Chained hash of the tokens of pages [0, index]: equal hashes mean equal token prefixes."""
        while len(self._page_hashes) <= index:
            i = len(self._page_hashes)
            parent = self._page_hashes[-1] if self._page_hashes else b""
            chunk = self.token_range(i * page_size, (i + 1) * page_size)
            if len(chunk) < page_size:
                raise ValueError("only full pages have a hash")
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(b",".join(str(t).encode() for t in chunk))
            self._page_hashes.append(h.digest())
        return self._page_hashes[index]
