"""POST /v1/chat/completions and /v1/completions: parse and tokenize in a worker thread, submit one engine
request per choice (prompts x n), then answer with one body (``_collect``) or server-sent events (``_stream``).

Every request, streaming or not, is aborted as soon as its client disconnects: a task waits for the disconnect
message.  Outputs arrive on the engine thread and reach the handler through an asyncio queue.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine import RequestOutput
from .logprobs import CompletionLogprobs, chat_content
from .protocol import ChatCompletionRequest, CompletionRequest, RequestError, error_body, parse_request
from .state import ServerState


def add_completion_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(state, request, ChatCompletionRequest, "chat.completion", "chatcmpl")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(state, request, CompletionRequest, "text_completion", "cmpl")


def _prepare(state: ServerState, raw: bytes, cls):
    """Parse, validate and tokenize (in a worker thread): the body, its prompts' ids, the model name to answer
    with."""
    body = parse_request(cls, raw)
    model = state.check_model(body.model)
    prompts = body.prompts(state.tokenizer)
    where = body.prompt_param
    for ids in prompts:
        if not ids:
            raise RequestError("the prompt is empty", where)
        if len(ids) >= state.max_len:
            raise RequestError(f"this model's maximum context length is {state.max_len} tokens; the prompt has "
                               f"{len(ids)} tokens", where, "context_length_exceeded")
        wanted = body.wanted_tokens()
        if wanted is not None and len(ids) + wanted > state.max_len:
            raise RequestError(f"this model's maximum context length is {state.max_len} tokens; the prompt has "
                               f"{len(ids)} tokens and {body.tokens_param()} is {wanted} (at most "
                               f"{state.max_len - len(ids)})", body.tokens_param(), "context_length_exceeded")
        try:
            state.engine.engine.validate(ids, body.sampling_params(default_max_tokens=state.max_len - len(ids)))
        except ValueError as exc:  # token ids outside the vocabulary (the prompt's, or logit_bias's)
            raise RequestError(str(exc), "logit_bias" if "logit_bias" in str(exc) else where) from None
    return body, prompts, model


async def _serve(state: ServerState, request: Request, cls, kind: str, prefix: str):
    arrival = time.monotonic()
    state.check_auth(request)
    state.check_admitting()
    body, prompts, model = await asyncio.to_thread(_prepare, state, await state.read_body(request), cls)
    state.check_admitting()
    rid = f"{prefix}-{uuid.uuid4().hex}"
    loop = asyncio.get_running_loop()
    outputs: asyncio.Queue[tuple[_Choice, RequestOutput]] = asyncio.Queue()
    chat = kind == "chat.completion"
    echo = getattr(body, "echo", False)
    choices = []
    for p, ids in enumerate(prompts):
        echoed = None
        if echo:  # a text prompt is echoed as sent, token ids as they decode
            raw = body.prompt if isinstance(body.prompt, str) else body.prompt[p] if isinstance(body.prompt[0], str) \
                else None
            echoed = raw if raw is not None else state.tokenizer.decode(ids)
        for j in range(body.n):
            index = p * body.n + j
            choices.append(_Choice(index, rid if len(prompts) * body.n == 1 else f"{rid}-{index}", ids, echoed,
                                   body.wanted_tokens() == 0,
                                   None if chat or body.logprobs is None else CompletionLogprobs(state.token_strings)))
    for choice in choices:
        j = choice.index % body.n
        params = body.sampling_params(default_max_tokens=state.max_len - len(choice.ids), index=j)
        timer = state.metrics.timer(arrival)
        state.engine.submit(choice.rid, choice.ids, params, _callback(choice, outputs, loop, timer))
        state.inflight[choice.rid] = (outputs, choice)
    watcher = asyncio.create_task(_abort_on_disconnect(state, request, choices))
    meta = dict(rid=rid, created=int(time.time()), model=model, kind=kind, prompt_tokens=sum(map(len, prompts)),
                logprobs=body.logprob_counts()[0] is not None)
    if body.stream:
        return StreamingResponse(_stream(state, outputs, choices, meta, body.include_usage, watcher),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _collect(state, outputs, choices, meta, watcher)


def _callback(choice: "_Choice", outputs: asyncio.Queue, loop, timer):
    def on_output(out: RequestOutput) -> None:  # on the engine thread
        timer.observe(out)
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, (choice, out))
        except RuntimeError:  # the event loop has closed (shutdown; the client heard the end already)
            pass

    return on_output


async def _abort_on_disconnect(state: ServerState, request: Request, choices: list["_Choice"]) -> None:
    # The body has been read: receive() now returns only when the client has gone (or the response is
    # complete, when aborting is a no-op).  Output keeps flowing meanwhile, so this cannot be a poll.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for choice in choices:
        state.engine.abort(choice.rid)


def _end(state: ServerState, choices: list["_Choice"], done: bool) -> None:
    for choice in choices:
        state.inflight.pop(choice.rid, None)
        if not done and choice.final is None:  # cancelled, failed elsewhere, or the client went away
            state.engine.abort(choice.rid)


def _failure(state: ServerState, out: RequestOutput) -> tuple[int, dict]:
    if state.expired:
        return 503, error_body(out.error, "server_error", code="server_shutting_down")
    return 500, error_body(f"the request failed: {out.error}", "server_error")


async def _collect(state: ServerState, outputs: asyncio.Queue, choices: list["_Choice"], meta: dict,
                   watcher: asyncio.Task):
    left, failed = len(choices), None
    try:
        while left and failed is None:
            choice, out = await outputs.get()
            choice.take(out)
            if out.finished:
                left -= 1
                if out.finish_reason in ("error", "abort"):
                    failed = out
    finally:
        watcher.cancel()
        _end(state, choices, done=False)
    if failed is not None and failed.finish_reason == "abort":  # the client went away; nobody reads this
        return Response(status_code=499)
    if failed is not None:
        status, payload = _failure(state, failed)
        return JSONResponse(payload, status_code=status)
    chat = meta["kind"] == "chat.completion"
    result = []
    for c in choices:
        text, token_ids, logprobs = c.visible(c.text, c.token_ids, c.logprobs)
        if chat:
            lp = {"content": chat_content(token_ids, logprobs, state.token_strings)} if meta["logprobs"] else None
            result.append({"index": c.index, "message": {"role": "assistant", "content": text},
                           "finish_reason": c.finish_reason, "logprobs": lp})
        else:
            lp = None
            if c.completion is not None:
                lp = c.completion.block(c.ids + token_ids, c.prompt_logprobs + logprobs) if c.echoed is not None \
                    else c.completion.block(token_ids, logprobs)
            result.append({"index": c.index, "text": (c.echoed or "") + text, "finish_reason": c.finish_reason,
                           "logprobs": lp})
    return {"id": meta["rid"], "object": meta["kind"], "created": meta["created"], "model": meta["model"],
            "choices": result, "usage": _usage(meta["prompt_tokens"], choices)}


async def _stream(state: ServerState, outputs: asyncio.Queue, choices: list["_Choice"], meta: dict, include_usage: bool,
                  watcher: asyncio.Task):
    chat = meta["kind"] == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(choice_payloads: list[dict], usage=None) -> str:
        payload = {"id": meta["rid"], "object": obj, "created": meta["created"], "model": meta["model"],
                   "choices": choice_payloads}
        if include_usage:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    def piece(c: "_Choice", out: RequestOutput) -> dict | None:
        """The chunk of one output of choice ``c`` (None: nothing to send yet)."""
        text, token_ids, logprobs = c.visible(out.text, out.token_ids, out.logprobs or [])
        finish = c.finish_reason if out.finished else None
        if chat:
            if not (text or finish or (meta["logprobs"] and token_ids)):
                return None
            lp = {"content": chat_content(token_ids, logprobs, state.token_strings)} if meta["logprobs"] else None
            return {"index": c.index, "delta": {"content": text} if text else {}, "finish_reason": finish,
                    "logprobs": lp}
        lp = None
        if c.echoed is not None and not c.started:  # the prompt (and its logprobs) comes first
            c.started = True
            text = c.echoed + text
            if c.completion is not None:
                lp = c.completion.block(c.ids + token_ids, (out.prompt_logprobs or c.prompt_logprobs) + logprobs)
        elif c.completion is not None:
            lp = c.completion.block(token_ids, logprobs)
        if not (text or finish or (lp and lp["tokens"])):
            return None
        return {"index": c.index, "text": text, "finish_reason": finish, "logprobs": lp}

    done = False
    try:
        if chat:
            yield event([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                          "logprobs": None} for c in choices])
        left = len(choices)
        while left:
            c, out = await outputs.get()
            if out.finish_reason in ("error", "abort"):
                if out.finish_reason == "error":
                    yield f"data: {json.dumps(_failure(state, out)[1])}\n\n"
                break
            c.take(out)
            payload = piece(c, out)
            if payload is not None:
                yield event([payload])
            if out.finished:
                left -= 1
        else:
            done = True
            if include_usage:
                yield event([], usage=_usage(meta["prompt_tokens"], choices))
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        _end(state, choices, done)


def _usage(prompt_tokens: int, choices: list["_Choice"]) -> dict:
    """Each prompt counted once, every choice's generated tokens (none where max_tokens is 0)."""
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


@dataclass(eq=False)
class _Choice:
    """One choice of a response: one engine request (a prompt, and which of its n samples), and what it has given."""

    index: int
    rid: str
    ids: list[int]  # the prompt
    echoed: str | None  # the prompt's text, echoed before the completion (completions with echo)
    echo_only: bool  # max_tokens 0: the one token the engine ran is dropped
    completion: CompletionLogprobs | None  # completions with logprobs: the legacy object's running state
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    final: RequestOutput | None = None
    started: bool = False  # streaming: its first chunk went out

    def take(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = list(out.prompt_logprobs)
        if out.finished:
            self.final = out

    def visible(self, text: str, token_ids: list[int], logprobs: list) -> tuple[str, list[int], list]:
        """What the client sees of these outputs: nothing generated when max_tokens is 0."""
        return ("", [], []) if self.echo_only else (text, token_ids, logprobs)

    @property
    def finish_reason(self) -> str | None:
        if self.final is None:
            return None
        return "length" if self.echo_only else self.final.finish_reason

    @property
    def completion_tokens(self) -> int:
        return 0 if self.echo_only or self.final is None else self.final.completion_tokens
