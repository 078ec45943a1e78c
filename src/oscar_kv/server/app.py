"""The OpenAI-compatible HTTP API over an ``EngineThread`` (FastAPI; SSE streaming).

``create_app`` builds the shared ``ServerState`` (state.py) and adds the routes in groups:
  completions.py       POST /v1/chat/completions, POST /v1/completions
  tokenizer_routes.py  GET /tokenizer_info, POST /tokenize, POST /detokenize (vLLM's shapes)
  ops.py               GET /health, GET /metrics, GET /v1/models
Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (``param``
names the field), 401 for a wrong API key (checked before the body is read), 404 for an unknown model,
413 for a body over ``max_body_mb``, 500 when the engine fails a request, 503 while the server shuts down.

The event loop only moves bytes: parsing, validation and tokenization run in worker threads (the
tokenizer releases the GIL), so a huge body does not stall other clients.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine import EngineThread
from .completions import add_completion_routes
from .ops import add_ops_routes
from .protocol import RequestError, error_body
from .state import APIError, ServerState
from .tokenizer_routes import add_tokenizer_routes, tokenizer_info_of

__all__ = ["APIError", "create_app", "tokenizer_info_of"]


def create_app(engine: EngineThread, model_name: str | list[str], api_key: str | None = None,
               max_body_mb: float = 16.0) -> FastAPI:
    """The app; ``app.state.drain(seconds)`` starts a graceful shutdown (main.py calls it on SIGTERM).
    ``model_name``: the name clients send, or several (each is accepted and listed; metrics carry the first)."""
    app = FastAPI(title="oscar-kv", description="OpenAI-compatible server with a 2-bit (OSCAR) KV cache")
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    state = ServerState(engine, names, api_key, max_body_mb)
    app.state.drain = state.drain
    add_error_handlers(app)
    add_ops_routes(app, state)
    add_tokenizer_routes(app, state)
    add_completion_routes(app, state)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's body, whatever raised it."""

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
