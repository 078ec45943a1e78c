"""OpenAI request models (pydantic) and the error body.  Unknown fields are refused; fields the
engine does not implement are accepted only at their neutral value, so clients fail loudly."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..engine import SamplingParams

Finite = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Finite = 0.0
    frequency_penalty: Finite = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension (vLLM): keep generating past the end-of-sequence token

    @model_validator(mode="after")
    def _check(self):
        if self.n != 1:
            raise ValueError("only n=1 is supported")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must lie in [0, 2], got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise ValueError("presence_penalty, frequency_penalty and logit_bias are not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        stops = self.stops()
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return self

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def wanted_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.wanted_tokens() or default_max_tokens,
                              temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                              seed=self.seed, stop=self.stops(), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.max_completion_tokens is not None and self.max_completion_tokens <= 0:
            raise ValueError(f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}")
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs are not supported")
        return self

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("only one prompt per request is supported")
        if self.echo or self.suffix or self.logprobs or (self.best_of or 1) != 1:
            raise ValueError("echo, suffix, logprobs and best_of are not supported")
        return self


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
