"""What every route of one server shares: the engine, the names it serves, the tokenizer, the API key, the body
limit, the requests in flight and the shutdown state, with the checks each route runs first (key, admission,
model name, body size).  ``create_app`` (app.py) builds one ``ServerState`` and hands it to each group of routes.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field

from fastapi import Request

from ..engine import EngineThread, RequestOutput
from .logprobs import TokenStrings
from .metrics import ServerMetrics

MB = 2**20


class APIError(Exception):
    """An error with its HTTP status; app.py renders it as OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


@dataclass(eq=False)
class ServerState:
    engine: EngineThread
    names: list[str]  # the model names clients may send; the first is the default and labels the metrics
    api_key: str | None
    max_body_mb: float
    metrics: ServerMetrics = field(init=False)
    created: int = field(init=False)
    draining: bool = False  # SIGTERM: no new requests
    expired: bool = False  # the grace period has passed: requests still running were ended with an error
    # engine request id -> (the queue its handler reads outputs from, its choice); drain() ends them
    inflight: dict[str, tuple] = field(default_factory=dict)

    def __post_init__(self):
        self.metrics = ServerMetrics(self.engine, self.names[0])
        self.created = int(time.time())
        self.token_strings = TokenStrings(self.tokenizer)

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def max_body(self) -> int:
        return int(self.max_body_mb * MB)

    def drain(self, timeout: float) -> None:
        """Stop admitting; after ``timeout`` seconds end every request still running with an error."""
        self.draining = True

        def expire():
            self.expired = True
            message = f"the server shut down before the request finished (--shutdown-timeout {timeout:g} s)"
            self.engine.abort_all(message)  # frees their pages once the engine's step in progress ends ...
            for rid, (outputs, choice) in list(self.inflight.items()):  # ... but a step can outlast the grace
                outputs.put_nowait((choice, RequestOutput(rid, "", [], True, "error", 0, 0, message)))

        asyncio.get_running_loop().call_later(timeout, expire)

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "invalid API key: send 'Authorization: Bearer <key>'", "authentication_error",
                           "invalid_api_key")

    def check_admitting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", "server_error", "server_shutting_down")

    def check_model(self, name: str | None) -> str:
        """The model name to answer with: the request's, if it is one this server serves (None: the first)."""
        if name is None:
            return self.names[0]
        if name not in self.names:
            served = ", ".join(f"'{n}'" for n in self.names)
            raise APIError(404, f"the model '{name}' does not exist; this server serves {served}",
                           "not_found_error", "model_not_found", "model")
        return name

    async def read_body(self, request: Request) -> bytes:
        too_large = APIError(413, f"the request body exceeds the server's limit of {self.max_body_mb:g} MB "
                             "(--max-body-mb)", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:  # a chunked body that did not declare its length
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)
