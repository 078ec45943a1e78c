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

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine import EngineThread, RequestOutput
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, RequestError, error_body, parse_request

MB = 2**20


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


def create_app(engine: EngineThread, model_name: str, api_key: str | None = None, max_body_mb: float = 16.0) -> FastAPI:
    """The app; ``app.state.drain(seconds)`` starts a graceful shutdown (main.py calls it on SIGTERM)."""
    app = FastAPI(title="oscar-kv", description="OpenAI-compatible server with a 2-bit (OSCAR) KV cache")
    metrics = ServerMetrics(engine, model_name)
    tokenizer = engine.engine.tokenizer
    max_len = engine.engine.max_model_len
    max_body = int(max_body_mb * MB)
    created = int(time.time())
    shutdown = {"draining": False, "expired": False}
    inflight: dict[str, asyncio.Queue] = {}  # request id -> the queue its handler reads outputs from

    def drain(timeout: float) -> None:
        """Stop admitting; after ``timeout`` seconds end every request still running with an error."""
        shutdown["draining"] = True

        def expire():
            shutdown["expired"] = True
            message = f"the server shut down before the request finished (--shutdown-timeout {timeout:g} s)"
            engine.abort_all(message)  # frees their pages once the engine's step in progress ends ...
            for rid, outputs in list(inflight.items()):  # ... but a step can outlast the grace: tell clients now
                outputs.put_nowait(RequestOutput(rid, "", [], True, "error", 0, 0, message))

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
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "oscar-kv", "max_model_len": max_len}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, ChatCompletionRequest, "chat.completion", "chatcmpl")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, CompletionRequest, "text_completion", "cmpl")

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
        """Parse, validate and tokenize (in a worker thread): the body, its prompt ids and sampling parameters."""
        body = parse_request(cls, raw)
        if body.model != model_name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{model_name}'",
                           "not_found_error", "model_not_found", "model")
        ids = body.prompt_ids(tokenizer)
        if not ids:
            raise RequestError("the prompt is empty", body.prompt_param)
        if len(ids) >= max_len:
            raise RequestError(f"this model's maximum context length is {max_len} tokens; the prompt has {len(ids)} "
                               "tokens", body.prompt_param, "context_length_exceeded")
        wanted = body.wanted_tokens()
        if wanted is not None and len(ids) + wanted > max_len:
            raise RequestError(f"this model's maximum context length is {max_len} tokens; the prompt has {len(ids)} "
                               f"tokens and {body.tokens_param()} is {wanted} (at most {max_len - len(ids)})",
                               body.tokens_param(), "context_length_exceeded")
        try:
            engine.engine.validate(ids, body.sampling_params(default_max_tokens=max_len - len(ids)))
        except ValueError as exc:  # token ids outside the vocabulary
            raise RequestError(str(exc), body.prompt_param) from None
        return body, ids

    async def _serve(request: Request, cls, kind: str, prefix: str):
        arrival = time.monotonic()
        check_auth(request)
        check_admitting()
        body, ids = await asyncio.to_thread(_prepare, await _read_body(request), cls)
        check_admitting()
        rid = f"{prefix}-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        timer = metrics.timer(arrival)

        def on_output(out: RequestOutput) -> None:  # on the engine thread
            timer.observe(out)
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:  # the event loop has closed (shutdown; the client heard the end already)
                pass

        engine.submit(rid, ids, body.sampling_params(default_max_tokens=max_len - len(ids)), on_output)
        inflight[rid] = outputs
        watcher = asyncio.create_task(_abort_on_disconnect(request, rid))
        meta = dict(rid=rid, created=int(time.time()), model=model_name, kind=kind)
        if body.stream:
            return StreamingResponse(_stream(outputs, meta, body.include_usage, watcher),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(outputs, meta, watcher)

    async def _abort_on_disconnect(request: Request, rid: str) -> None:
        # The body has been read: receive() now returns only when the client has gone (or the response is
        # complete, when aborting is a no-op).  Output keeps flowing meanwhile, so this cannot be a poll.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        engine.abort(rid)

    def _failure(out: RequestOutput) -> tuple[int, dict]:
        if shutdown["expired"]:
            return 503, error_body(out.error, "server_error", code="server_shutting_down")
        return 500, error_body(f"the request failed: {out.error}", "server_error")

    async def _collect(outputs: asyncio.Queue, meta: dict, watcher: asyncio.Task):
        text, finished = [], None
        try:
            while finished is None:
                out = await outputs.get()
                text.append(out.text)
                if out.finished:
                    finished = out
        finally:
            watcher.cancel()
            inflight.pop(meta["rid"], None)
            if finished is None:  # cancelled (the server stops)
                engine.abort(meta["rid"])
        if finished.finish_reason == "abort":  # the client went away; nobody reads this
            return Response(status_code=499)
        if finished.finish_reason == "error":
            status, payload = _failure(finished)
            return JSONResponse(payload, status_code=status)
        content = "".join(text)
        if meta["kind"] == "chat.completion":
            choice = {"index": 0, "message": {"role": "assistant", "content": content},
                      "finish_reason": finished.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": content, "finish_reason": finished.finish_reason, "logprobs": None}
        return {"id": meta["rid"], "object": meta["kind"], "created": meta["created"], "model": meta["model"],
                "choices": [choice], "usage": _usage(finished)}

    async def _stream(outputs: asyncio.Queue, meta: dict, include_usage: bool, watcher: asyncio.Task):
        chat = meta["kind"] == "chat.completion"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, role: bool = False, usage=None, choices=True) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            payload = {"id": meta["rid"], "object": obj, "created": meta["created"], "model": meta["model"],
                       "choices": [choice] if choices else []}
            if include_usage:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        done = False
        try:
            if chat:
                yield chunk(None, None, role=True)
            while True:
                out = await outputs.get()
                if out.finish_reason in ("error", "abort"):
                    done = True
                    if out.finish_reason == "error":
                        yield f"data: {json.dumps(_failure(out)[1])}\n\n"
                    break
                if out.finished:
                    done = True
                    yield chunk(out.text, out.finish_reason)
                    if include_usage:
                        yield chunk(None, None, usage=_usage(out), choices=False)
                    break
                if out.text:
                    yield chunk(out.text, None)
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            inflight.pop(meta["rid"], None)
            if not done:  # the client went away (or the server stops): free the request's pages
                engine.abort(meta["rid"])

    return app


def _usage(out: RequestOutput) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}
