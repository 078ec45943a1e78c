"""The OpenAI-compatible HTTP API over an ``EngineThread`` (FastAPI; SSE streaming).

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics.
Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input
(malformed JSON, wrong types, unknown fields, out-of-range values, too-long prompts), 401 for a
wrong API key, 404 for an unknown model, 500 when the engine fails a request.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineThread, RequestOutput
from .metrics import make_registry, render
from .protocol import ChatCompletionRequest, CompletionRequest, error_body

DISCONNECT_POLL_S = 0.5


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown field '{where}'")
        else:
            msg = err.get("msg", "invalid value").removeprefix("Value error, ")
            parts.append(f"{where}: {msg}" if where else msg)
        param = param or (loc[0] if loc else None)
    return "; ".join(parts) or "invalid request", param


def create_app(engine: EngineThread, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="oscar-kv", description="OpenAI-compatible server with a 2-bit (OSCAR) KV cache")
    registry = make_registry(engine, model_name)
    tokenizer = engine.engine.tokenizer
    max_len = engine.engine.max_model_len
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _describe_validation(exc)
        return JSONResponse(error_body(message, param=param), status_code=400)

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

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{model_name}'",
                           "not_found_error", "model_not_found", "model")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(render(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "oscar-kv", "max_model_len": max_len}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_auth(request)
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        else:
            ids = tokenizer("\n".join(m["content"] for m in messages)).input_ids
        return await _serve(request, body, list(ids), "chat.completion", "chatcmpl")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_auth(request)
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str):
            prompt = prompt[0]
        ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        return await _serve(request, body, ids, "text_completion", "cmpl")

    async def _serve(request: Request, body, ids: list[int], kind: str, prefix: str):
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(ids) >= max_len:
            raise APIError(400, f"this model's maximum context length is {max_len} tokens; the prompt has "
                                f"{len(ids)} tokens", param="messages" if kind == "chat.completion" else "prompt",
                           code="context_length_exceeded")
        params = body.sampling_params(default_max_tokens=max_len - len(ids))
        rid = f"{prefix}-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        try:
            engine.submit(rid, ids, params, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out))
        except ValueError as exc:
            raise APIError(400, str(exc), param="max_tokens" if "max_tokens" in str(exc) else None) from None
        meta = dict(rid=rid, created=int(time.time()), model=model_name, kind=kind)
        if body.stream:
            return StreamingResponse(_stream(outputs, meta, body.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(request, outputs, meta)

    async def _collect(request: Request, outputs: asyncio.Queue, meta: dict):
        text, finished = [], None
        try:
            while finished is None:
                try:
                    out = await asyncio.wait_for(outputs.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                text.append(out.text)
                if out.finished:
                    finished = out
        finally:
            if finished is None:
                engine.abort(meta["rid"])
        if finished.finish_reason == "error":
            raise APIError(500, f"the request failed: {finished.error}", "server_error")
        content = "".join(text)
        if meta["kind"] == "chat.completion":
            choice = {"index": 0, "message": {"role": "assistant", "content": content},
                      "finish_reason": finished.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": content, "finish_reason": finished.finish_reason, "logprobs": None}
        return {"id": meta["rid"], "object": meta["kind"], "created": meta["created"], "model": meta["model"],
                "choices": [choice], "usage": _usage(finished)}

    async def _stream(outputs: asyncio.Queue, meta: dict, include_usage: bool):
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
                if out.finish_reason == "error":
                    done = True
                    yield f"data: {json.dumps(error_body(f'the request failed: {out.error}', 'server_error'))}\n\n"
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
            if not done:  # the client went away (or the server stops): free the request's pages
                engine.abort(meta["rid"])

    return app


def _usage(out: RequestOutput) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}
