"""The routes operators, load balancers and routers read: GET /health, GET /metrics, GET /v1/models, GET /get_load.

/health is the readiness probe too: the socket accepts connections only once the model is loaded and warmed up,
and a draining server (SIGTERM) answers 503 so that a router stops sending it requests.  /get_load is the
endpoint sglang-router and vllm-router poll for their power-of-two policy (and their own /get_loads).
"""

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

    @app.get("/get_load")
    def get_load():  # a worker thread, as /metrics
        s = state.engine.stats()
        # vllm-router reads {"load": int}; ours is the engine's requests, running + waiting, i.e. the sum of the
        # vllm:num_requests_running and vllm:num_requests_waiting gauges on /metrics (the router's own load
        # count is requests in flight too); the two parts and the KV use ride along for people reading it
        return {"load": s.running + s.waiting, "num_requests_running": s.running,
                "num_requests_waiting": s.waiting,
                "kv_cache_usage_perc": s.pool_used_bytes / s.pool_capacity_bytes if s.pool_capacity_bytes else 0.0}

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_auth(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": state.created,
                                            "owned_by": "oscar-kv", "root": names[0], "parent": None,
                                            "max_model_len": state.max_len} for name in names]}
