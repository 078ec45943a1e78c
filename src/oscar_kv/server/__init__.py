"""OpenAI-compatible HTTP server over the paged INT2 engine (``oscar-kv serve``).

  protocol.py          pydantic request models, OpenAI error body
  app.py               create_app: the shared state, the error handlers, the route groups below
  state.py             ServerState: what every route shares (engine, names, key, body limit, shutdown)
  completions.py       /v1/chat/completions, /v1/completions (one body or server-sent events)
  tokenizer_routes.py  /tokenizer_info, /tokenize, /detokenize (vLLM's shapes)
  ops.py               /health, /metrics, /v1/models
  logprobs.py          logprobs in OpenAI's chat and legacy completions shapes
  metrics.py           Prometheus collector reading the engine's counters
  main.py              ServeConfig (every flag, with help), run_server(config), BackgroundServer
"""

from .main import BackgroundServer, ServeConfig, ServeError, run_server

__all__ = ["BackgroundServer", "ServeConfig", "ServeError", "run_server"]
