"""OpenAI request models (pydantic), request parsing and the error body.  Unknown fields are refused; fields
the engine does not implement are accepted only at their neutral value, so clients fail loudly.  Every
refusal names the offending field (``param``), as OpenAI's API does.

Also vLLM's extensions that clients such as lm-eval-harness use: ``repetition_penalty``, ``ignore_eos``, ``top_k``,
``max_tokens: 0`` with ``echo`` (the prompt's logprobs only), several prompts in one completions request, and the
tokenizer endpoints' bodies (``TokenizeRequest``, ``DetokenizeRequest``)."""

from __future__ import annotations

import json
import re
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..engine import SamplingParams
from ..engine.sequence import MAX_LOGPROBS
from ..errors import OscarKVError

Finite = Annotated[float, Field(allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=-2**63, lt=2**63)]  # what torch's generators take
# Below this a temperature is greedy: the logits divided by it would overflow to inf (and sampling to NaN).
GREEDY_BELOW = 1e-5
MAX_N = 128  # choices per prompt (OpenAI's limit)
MAX_STOPS = 16  # OpenAI allows 4, vLLM any number; lm-eval adds the EOS string to a task's own stop strings


class RequestError(OscarKVError, ValueError):
    """A client mistake: ``param`` names the field (``messages[0].content``), None for the body as a whole."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class _Strict(BaseModel):
    # strict: JSON's types as written, so `"max_tokens": true`, `"stream": "yes"` or `"prompt": [true]` are refused
    # instead of read as 1, True and token 1
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _required(cls, v, info):  # only an assistant's turn may come without content (OpenAI: tool calls)
        if v is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"content is required for a message of role '{info.data['role']}'")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


def _at_least_one(cls, v, info):
    if v is not None and v < 1:
        raise ValueError(f"{info.field_name} must be at least 1, got {v}")
    return v


def _unsupported(cls, v, info):
    if v and not (info.field_name == "best_of" and v == 1):
        raise ValueError(f"{info.field_name} is not supported")
    return v


# Fields that routers add to every request they forward (vllm-router and sglang-router copy SGLang's request
# defaults into the body): accepted at the value that changes nothing here, refused otherwise.
ROUTER_DEFAULTS = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False,
                   "continue_final_message": False}


def _router_default(cls, v, info):
    neutral = ROUTER_DEFAULTS[info.field_name]
    if v is not None and v != neutral:
        raise ValueError(f"{info.field_name} is not supported (only {str(neutral).lower()})")
    return v


def _logprob_count(cls, v, info):
    if v is not None and not 0 <= v <= MAX_LOGPROBS:
        raise ValueError(f"{info.field_name} must lie in [0, {MAX_LOGPROBS}], got {v}")
    return v


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
    seed: Seed | None = None
    presence_penalty: Finite = 0.0
    frequency_penalty: Finite = 0.0
    repetition_penalty: Finite | None = None  # extension (vLLM): > 1 discourages tokens already seen, < 1 favours
    logit_bias: dict[str, Finite] | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension (vLLM): keep generating past the end-of-sequence token
    # what routers add (ROUTER_DEFAULTS): output text always skips special tokens, a stop string is always trimmed
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    return_hidden_states: bool | None = None

    _router = field_validator("no_stop_trim", "skip_special_tokens", "return_hidden_states")(_router_default)

    _positive = field_validator("max_tokens")(_at_least_one)

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if not 1 <= v <= MAX_N:
            raise ValueError(f"n must lie in [1, {MAX_N}], got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v, info):
        if not -2 <= v <= 2:
            raise ValueError(f"{info.field_name} must lie in [-2, 2], got {v}")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition(cls, v):
        if v is not None and not 0 < v <= 10:
            raise ValueError(f"repetition_penalty must lie in (0, 10], got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids (as strings), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must lie in [-100, 100], got {bias} for token {key}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if v is not None and not 0 <= v <= 2:
            raise ValueError(f"temperature must lie in [0, 2], got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        if v is not None and not 0 < v <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v is not None and v < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {v}")
        return v

    @field_validator("stream_options")
    @classmethod
    def _with_stream(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream=true")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOPS} non-empty strings")
        return v

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def wanted_tokens(self) -> int | None:
        return self.max_tokens

    def tokens_param(self) -> str:
        return "max_tokens"

    def check(self) -> None:
        """Rules over several fields (RequestError naming the field); pydantic has checked each field alone."""

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) for the engine: None for none, k for each token's own and the top k."""
        return None, None

    def sampling_params(self, default_max_tokens: int, index: int = 0) -> SamplingParams:
        """The engine's parameters for choice ``index`` of a prompt (a seed gives choice i the seed + i, as vLLM
        does for n > 1).  ``max_tokens: 0`` (echo only) runs one token, which the server drops."""
        temperature = 1.0 if self.temperature is None else self.temperature
        wanted = self.wanted_tokens()
        logprobs, prompt_logprobs = self.logprob_counts()
        return SamplingParams(max_tokens=max(wanted, 1) if wanted is not None else default_max_tokens,
                              temperature=0.0 if temperature < GREEDY_BELOW else temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                              seed=None if self.seed is None else self.seed + index, stop=self.stops(),
                              ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                              logit_bias=tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items()))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None
    continue_final_message: bool | None = None  # routers add it (ROUTER_DEFAULTS)
    # routers add these too; they steer a reasoning parser, which this server does not have: no effect
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None

    prompt_param: ClassVar[str] = "messages"
    _router_chat = field_validator("continue_final_message")(_router_default)
    _positive_chat = field_validator("max_completion_tokens")(_at_least_one)
    _top_logprobs = field_validator("top_logprobs")(_logprob_count)

    def check(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs: true", "top_logprobs")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def prompts(self, tokenizer) -> list[list[int]]:
        return [self.prompt_ids(tokenizer)]

    def prompt_ids(self, tokenizer) -> list[int]:
        from jinja2 import TemplateError

        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
        if not getattr(tokenizer, "chat_template", None):
            return list(tokenizer("\n".join(m["content"] for m in messages)).input_ids)
        try:
            return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      return_dict=True)["input_ids"])
        except TemplateError as exc:  # templates may refuse an order of roles
            raise RequestError(f"the model's chat template refuses these messages: {exc}", "messages") from None


class CompletionRequest(_Sampling):
    # a string, token ids, or a batch of either (each prompt gets n choices, numbered prompt-major)
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    prompt_param: ClassVar[str] = "prompt"
    _neutral_completion = field_validator("suffix", "best_of")(_unsupported)
    _logprobs = field_validator("logprobs")(_logprob_count)
    _positive = field_validator("max_tokens")(lambda cls, v: v)  # 0 is allowed with echo (checked below)

    def check(self) -> None:
        if self.max_tokens is not None and (self.max_tokens < 0 or (self.max_tokens == 0 and not self.echo)):
            raise RequestError(f"max_tokens must be at least 1 (0 only with echo: true), got {self.max_tokens}",
                               "max_tokens")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    def prompts(self, tokenizer) -> list[list[int]]:
        """Each prompt's token ids (strings are tokenized as the model's tokenizer does by default)."""
        prompt = self.prompt
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        return [list(tokenizer(p).input_ids) if isinstance(p, str) else list(p) for p in batch]

    def prompt_ids(self, tokenizer) -> list[int]:
        return self.prompts(tokenizer)[0]


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's body): a ``prompt``, or chat ``messages`` rendered by the model's chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (their template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("send either prompt or messages", "prompt")
        if self.continue_final_message and self.add_generation_prompt and self.messages is not None:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true",
                               "continue_final_message")

    def chat_text(self, tokenizer) -> str:
        from jinja2 import TemplateError

        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
        if not getattr(tokenizer, "chat_template", None):
            return "\n".join(m["content"] for m in messages)
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=self.add_generation_prompt,
                                                 continue_final_message=self.continue_final_message)
        except TemplateError as exc:
            raise RequestError(f"the model's chat template refuses these messages: {exc}", "messages") from None


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's body)."""

    model: str | None = None
    tokens: list[int]

    def check(self) -> None:
        pass


def parse_request(cls: type[_Strict], raw: bytes) -> _Strict:
    """The request in ``raw`` (JSON) as ``cls``, or a RequestError that says what is wrong and where."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise RequestError("malformed JSON body: nested too deeply") from None
    except ValueError as exc:  # also bytes that are not UTF-8, and integers of more than 4300 digits
        raise RequestError(f"malformed JSON body: {exc}") from None
    where = _lone_surrogate(data)
    if where is not None:  # JSON may escape one ("\ud800"); no tokenizer can encode it
        param = _param(where)
        raise RequestError(f"{param or 'the body'}: the text holds a lone UTF-16 surrogate, which is not valid "
                           "Unicode", param)
    try:
        body = cls.model_validate(data)
    except ValidationError as exc:
        raise RequestError(*_describe(exc)) from None
    body.check()
    return body


def _lone_surrogate(data, path: tuple = ()) -> tuple | None:
    """The path of the first string (value or key) that cannot be encoded as UTF-8."""
    if isinstance(data, str):
        try:
            data.encode()
        except UnicodeEncodeError:
            return path
    elif isinstance(data, list):
        for i, item in enumerate(data):
            found = _lone_surrogate(item, path + (i,))
            if found is not None:
                return found
    elif isinstance(data, dict):
        for key, item in data.items():
            for found in (_lone_surrogate(key, path), _lone_surrogate(item, path + (key,))):  # a key: name its parent
                if found is not None:  # () (the body itself) is a finding too
                    return found
    return None


# pydantic names the member of a union it tried (`str`, `list[int]`, `TextPart`) in an error's location
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*|[A-Z]\w*)$")


def _param(loc) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _UNION_MEMBER.match(part):
            out += f".{part}" if out else part
    return out or None


def _describe(exc: ValidationError) -> tuple[str, str | None]:
    parts: dict[str, list[str]] = {}  # "param: " -> its messages (a union's members each add one)
    first = None
    for err in exc.errors():
        param = _param(err["loc"])
        first = first or param
        if err["type"] == "extra_forbidden":
            parts.setdefault(f"unknown field '{param}'", [])
        else:
            parts.setdefault(f"{param}: " if param else "", []).append(err["msg"].removeprefix("Value error, "))
    message = "; ".join(head + " / ".join(dict.fromkeys(msgs)) for head, msgs in parts.items())
    return message or "invalid request", first


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
