"""OpenAI-compatible HTTP server over the paged INT2 engine (``oscar-kv serve``).

  protocol.py  pydantic request models, OpenAI error body
  app.py       FastAPI routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics
  metrics.py   Prometheus collector reading the engine's counters
  main.py      ServeConfig (every flag, with help), run_server(config), BackgroundServer
"""

from .main import BackgroundServer, ServeConfig, ServeError, run_server

__all__ = ["BackgroundServer", "ServeConfig", "ServeError", "run_server"]
