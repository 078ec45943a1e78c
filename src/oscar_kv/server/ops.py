"""The routes operators, load balancers and routers read: GET /health, GET /metrics, GET /v1/models."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .state import ServerState


def add_ops_routes(app: FastAPI, state: ServerState) -> None:
    names = state.names

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics_endpoint():  # a worker thread: reading the engine's state waits for the step in progress
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_auth(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": state.created,
                                            "owned_by": "oscar-kv", "root": names[0], "parent": None,
                                            "max_model_len": state.max_len} for name in names]}
