"""The OpenAI-compatible HTTP API over an ``EngineThread`` (FastAPI; SSE streaming).

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics.
Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (``param``
names the field), 401 for a wrong API key (checked before the body is read), 404 for an unknown model,
413 for a body over ``max_body_mb``, 500 when the engine fails a request, 503 while the server shuts down.

The event loop only moves bytes: parsing, validation and tokenization run in worker threads (the
tokenizer releases the GIL), so a huge body does not stall other clients.  Every request, streaming or
not, is aborted as soon as its client disconnects: a task waits for the disconnect message.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine import EngineThread, RequestOutput
from .logprobs import CompletionLogprobs, TokenStrings, chat_content
from .metrics import ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestError, TokenizeRequest,
                       error_body, parse_request)

MB = 2**20


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


def create_app(engine: EngineThread, model_name: str | list[str], api_key: str | None = None,
               max_body_mb: float = 16.0) -> FastAPI:
    """The app; ``app.state.drain(seconds)`` starts a graceful shutdown (main.py calls it on SIGTERM).
    ``model_name``: the name clients send, or several (each is accepted and listed; metrics carry the first)."""
    app = FastAPI(title="oscar-kv", description="OpenAI-compatible server with a 2-bit (OSCAR) KV cache")
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    metrics = ServerMetrics(engine, names[0])
    tokenizer = engine.engine.tokenizer
    token_strings = TokenStrings(tokenizer)
    max_len = engine.engine.max_model_len
    tokenizer_config = tokenizer_info_of(tokenizer, max_len)
    max_body = int(max_body_mb * MB)
    created = int(time.time())
    shutdown = {"draining": False, "expired": False}
    inflight: dict[str, tuple] = {}  # engine request id -> (the queue its handler reads outputs from, its choice)

    def drain(timeout: float) -> None:
        """Stop admitting; after ``timeout`` seconds end every request still running with an error."""
        shutdown["draining"] = True

        def expire():
            shutdown["expired"] = True
            message = f"the server shut down before the request finished (--shutdown-timeout {timeout:g} s)"
            engine.abort_all(message)  # frees their pages once the engine's step in progress ends ...
            for rid, (outputs, choice) in list(inflight.items()):  # ... but a step can outlast the grace: tell clients now
                outputs.put_nowait((choice, RequestOutput(rid, "", [], True, "error", 0, 0, message)))

        asyncio.get_running_loop().call_later(timeout, expire)

    app.state.drain = drain

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return JSONResponse(error_body(exc.message, param=exc.param, code=exc.code), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):  # left while sending its body: nothing to log
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid API key: send 'Authorization: Bearer <key>'", "authentication_error",
                           "invalid_api_key")

    def check_admitting() -> None:
        if shutdown["draining"]:
            raise APIError(503, "the server is shutting down", "server_error", "server_shutting_down")

    @app.get("/health")
    async def health():
        if shutdown["draining"]:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics_endpoint():  # a worker thread: reading the engine's state waits for the step in progress
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "oscar-kv",
                                            "root": names[0], "parent": None, "max_model_len": max_len}
                                           for name in names]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, ChatCompletionRequest, "chat.completion", "chatcmpl")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, CompletionRequest, "text_completion", "cmpl")

    # ---- the tokenizer (vLLM's endpoints and shapes; lm-eval's remote tokenizer reads them) ----------------------
    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        check_auth(request)
        return tokenizer_config

    @app.post("/tokenize")
    async def tokenize(request: Request):
        check_auth(request)
        return await asyncio.to_thread(_tokenize, await _read_body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        check_auth(request)
        return await asyncio.to_thread(_detokenize, await _read_body(request))

    def _check_model(name: str | None) -> str:
        """The model name to answer with: the request's, if it is one this server serves (None: the first)."""
        if name is None:
            return names[0]
        if name not in names:
            served = ", ".join(f"'{n}'" for n in names)
            raise APIError(404, f"the model '{name}' does not exist; this server serves {served}",
                           "not_found_error", "model_not_found", "model")
        return name

    def _tokenize(raw: bytes) -> dict:
        body = parse_request(TokenizeRequest, raw)
        _check_model(body.model)
        if body.messages is not None:
            text = body.chat_text(tokenizer)
            ids = tokenizer(text, add_special_tokens=bool(body.add_special_tokens)).input_ids
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tokenizer(body.prompt, add_special_tokens=add).input_ids
        ids = list(ids)
        return {"count": len(ids), "max_model_len": max_len, "tokens": ids,
                "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}

    def _detokenize(raw: bytes) -> dict:
        body = parse_request(DetokenizeRequest, raw)
        _check_model(body.model)
        vocab = engine.engine.model.config.vocab_size
        if any(not 0 <= t < len(tokenizer) and not 0 <= t < vocab for t in body.tokens):
            raise RequestError(f"token ids must lie in [0, {max(vocab, len(tokenizer))})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    # ---- completions ----------------------------------------------------------------------------------------------
    async def _read_body(request: Request) -> bytes:
        too_large = APIError(413, f"the request body exceeds the server's limit of {max_body_mb:g} MB (--max-body-mb)",
                             code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:  # a chunked body that did not declare its length
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _prepare(raw: bytes, cls):
        """Parse, validate and tokenize (in a worker thread): the body, its prompts' ids, the model name to answer
        with."""
        body = parse_request(cls, raw)
        model = _check_model(body.model)
        prompts = body.prompts(tokenizer)
        where = body.prompt_param
        for ids in prompts:
            if not ids:
                raise RequestError("the prompt is empty", where)
            if len(ids) >= max_len:
                raise RequestError(f"this model's maximum context length is {max_len} tokens; the prompt has "
                                   f"{len(ids)} tokens", where, "context_length_exceeded")
            wanted = body.wanted_tokens()
            if wanted is not None and len(ids) + wanted > max_len:
                raise RequestError(f"this model's maximum context length is {max_len} tokens; the prompt has "
                                   f"{len(ids)} tokens and {body.tokens_param()} is {wanted} (at most "
                                   f"{max_len - len(ids)})", body.tokens_param(), "context_length_exceeded")
            try:
                engine.engine.validate(ids, body.sampling_params(default_max_tokens=max_len - len(ids)))
            except ValueError as exc:  # token ids outside the vocabulary (the prompt's, or logit_bias's)
                raise RequestError(str(exc), "logit_bias" if "logit_bias" in str(exc) else where) from None
        return body, prompts, model

    async def _serve(request: Request, cls, kind: str, prefix: str):
        arrival = time.monotonic()
        check_auth(request)
        check_admitting()
        body, prompts, model = await asyncio.to_thread(_prepare, await _read_body(request), cls)
        check_admitting()
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
                echoed = raw if raw is not None else tokenizer.decode(ids)
            for j in range(body.n):
                index = p * body.n + j
                choices.append(_Choice(index, rid if len(prompts) * body.n == 1 else f"{rid}-{index}", ids, echoed,
                                       body.wanted_tokens() == 0,
                                       None if chat or body.logprobs is None else CompletionLogprobs(token_strings)))
        for choice in choices:
            j = choice.index % body.n
            params = body.sampling_params(default_max_tokens=max_len - len(choice.ids), index=j)
            engine.submit(choice.rid, choice.ids, params, _callback(choice, outputs, loop, metrics.timer(arrival)))
            inflight[choice.rid] = (outputs, choice)
        watcher = asyncio.create_task(_abort_on_disconnect(request, choices))
        meta = dict(rid=rid, created=int(time.time()), model=model, kind=kind, prompt_tokens=sum(map(len, prompts)),
                    logprobs=body.logprob_counts()[0] is not None)
        if body.stream:
            return StreamingResponse(_stream(outputs, choices, meta, body.include_usage, watcher),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(outputs, choices, meta, watcher)

    def _callback(choice: "_Choice", outputs: asyncio.Queue, loop, timer):
        def on_output(out: RequestOutput) -> None:  # on the engine thread
            timer.observe(out)
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, (choice, out))
            except RuntimeError:  # the event loop has closed (shutdown; the client heard the end already)
                pass

        return on_output

    async def _abort_on_disconnect(request: Request, choices: list["_Choice"]) -> None:
        # The body has been read: receive() now returns only when the client has gone (or the response is
        # complete, when aborting is a no-op).  Output keeps flowing meanwhile, so this cannot be a poll.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for choice in choices:
            engine.abort(choice.rid)

    def _end(choices: list["_Choice"], done: bool) -> None:
        for choice in choices:
            inflight.pop(choice.rid, None)
            if not done and choice.final is None:  # cancelled, failed elsewhere, or the client went away
                engine.abort(choice.rid)

    def _failure(out: RequestOutput) -> tuple[int, dict]:
        if shutdown["expired"]:
            return 503, error_body(out.error, "server_error", code="server_shutting_down")
        return 500, error_body(f"the request failed: {out.error}", "server_error")

    async def _collect(outputs: asyncio.Queue, choices: list["_Choice"], meta: dict, watcher: asyncio.Task):
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
            _end(choices, done=False)
        if failed is not None and failed.finish_reason == "abort":  # the client went away; nobody reads this
            return Response(status_code=499)
        if failed is not None:
            status, payload = _failure(failed)
            return JSONResponse(payload, status_code=status)
        chat = meta["kind"] == "chat.completion"
        result = []
        for c in choices:
            text, token_ids, logprobs = c.visible(c.text, c.token_ids, c.logprobs)
            if chat:
                lp = {"content": chat_content(token_ids, logprobs, token_strings)} if meta["logprobs"] else None
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

    async def _stream(outputs: asyncio.Queue, choices: list["_Choice"], meta: dict, include_usage: bool,
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
                lp = {"content": chat_content(token_ids, logprobs, token_strings)} if meta["logprobs"] else None
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
                        yield f"data: {json.dumps(_failure(out)[1])}\n\n"
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
            _end(choices, done)

    return app


def _usage(prompt_tokens: int, choices: list["_Choice"]) -> dict:
    """Each prompt counted once, every choice's generated tokens (none where max_tokens is 0)."""
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def tokenizer_info_of(tokenizer, max_model_len: int) -> dict:
    """``GET /tokenizer_info``: the tokenizer's configuration as vLLM gives it (tokenizer_config.json's fields), with
    ``model_max_length`` the server's context (what it accepts, not the tokenizer file's often huge number)."""
    info = {"tokenizer_class": type(tokenizer).__name__}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        info[name] = None if token is None else str(token)
    info.update(model_max_length=max_model_len, max_model_len=max_model_len, vocab_size=len(tokenizer),
                add_bos_token=getattr(tokenizer, "add_bos_token", None),
                add_eos_token=getattr(tokenizer, "add_eos_token", None),
                clean_up_tokenization_spaces=getattr(tokenizer, "clean_up_tokenization_spaces", None),
                chat_template=getattr(tokenizer, "chat_template", None))
    return info


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
