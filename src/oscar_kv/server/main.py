"""``oscar-kv serve``: :func:`run_server` starts the server of a :class:`~oscar_kv.config.ServeConfig` (every flag,
declared in config.py; the CLI derives its options from it).  ``BackgroundServer`` runs the same server in a thread
(tests, notebooks).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time

from ..config import ServeConfig
from ..errors import OscarKVError, user_message

log = logging.getLogger("oscar_kv.serve")


class ServeError(OscarKVError, ValueError):
    """The server cannot start; the message says what to do."""


def load_rotations(config: ServeConfig, model, tokenizer):
    """The artifact for ``config`` (provision.obtain: validated against the model), None for bf16 without one."""
    from ..artifacts import ArtifactError
    from ..provision import ArtifactMissing, obtain

    if not config.rotations and config.kv_cache_dtype == "bf16":
        return None
    try:
        return obtain(config.model, model, tokenizer, directory=config.rotations, calibrate=config.calibrate)
    except ArtifactMissing:
        raise ServeError(f"--kv-cache-dtype {config.kv_cache_dtype} needs --rotations DIR. Calibrate once with "
                         f"`oscar-kv calibrate --model {config.model} --output-dir DIR` and pass --rotations DIR, "
                         f"or pass --calibrate to calibrate now (cached), or use --kv-cache-dtype bf16.") from None
    except ArtifactError as exc:
        raise ServeError(user_message(exc)) from None


def build_engine(config: ServeConfig, model=None, tokenizer=None, rotations=None, tp=None):
    """Load (unless given) the model and artifact and build the engine; returns an ``EngineThread``.
    ``tp``: this process's parallel.TensorParallel (default: none); only rank 0 logs and warms up."""
    from ..engine import EngineThread, LLMEngine
    from ..models import default_dtype, load_model
    from ..parallel import SINGLE, local_device

    tp = tp or SINGLE
    config.validate()
    if config.api_key is None:
        config.api_key = os.environ.get("OSCAR_KV_API_KEY") or None
    device = local_device(config.device, tp.size)
    if model is None:
        started = time.perf_counter()
        try:
            # under --tp a rank loads the whole model on the CPU and moves only its slices to its GPU
            model, tokenizer = load_model(config.model, device="cpu" if tp.size > 1 else device,
                                          dtype=default_dtype(device))
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise ServeError(user_message(exc)) from None
        log.info("loaded %s (%s) in %.1f s", config.model, type(model).__name__, time.perf_counter() - started)
    if rotations is None:
        rotations = load_rotations(config, model, tokenizer)
    try:
        # under --tp the model is on the CPU until its slices move; otherwise the engine runs where the model is
        engine = LLMEngine(model, tokenizer, rotations, config.engine, tp, device if tp.size > 1 else None)
    except ValueError as exc:
        raise ServeError(user_message(exc)) from None
    if not tp.is_driver:
        return EngineThread(engine)  # it follows rank 0 (run_server); rank 0 logs and warms up for all
    g = rotations.geometry if rotations is not None else None
    log.info("model %s: %s%s", config.model_name,
             f"{g.num_layers} layers, {g.num_attention_heads} query / {g.num_kv_heads} KV heads, head dim "
             f"{g.head_dim}; rotations {rotations.source or 'calibrated now'}" if g
             else "BF16 cache, no rotations",
             f"; tensor parallel over {tp.size} {'GPUs' if device.startswith('cuda') else 'processes'}"
             if tp.size > 1 else "")
    for line in engine.describe():
        log.info(line)
    if engine.kernel_status is None:  # Triton kernels: compile them now, not during the first request
        log.info("warming up the kernels ...")
        log.info("kernels ready in %.1f s", engine.warm_up())
    log.info("max model len %d, max num seqs %d, max num batched tokens %d, prefix caching %s", engine.max_model_len,
             config.max_num_seqs, config.max_num_batched_tokens, "on" if config.enable_prefix_caching else "off")
    return EngineThread(engine)


def listen_socket(config: ServeConfig) -> socket.socket:
    """Bind --host:--port now, before the model loads, so that a taken port fails in a second with advice (the
    server listens on this very socket later).  Port 0 takes a free port and writes it into ``config``."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ServeError(f"--host {config.host}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait for TIME_WAIT
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = ("another server (an earlier oscar-kv serve?) listens there; stop it or choose another --port "
                "(make run PORT=...)" if exc.errno == errno.EADDRINUSE else exc.strerror)
        raise ServeError(f"cannot listen on {config.host}:{config.port}: {hint}") from None
    config.port = sock.getsockname()[1]
    return sock


def _uvicorn_server(config: ServeConfig, engine_thread):
    import uvicorn

    from .app import create_app

    app = create_app(engine_thread, config.model_names, config.api_key, config.max_body_mb)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # uvicorn would raise the signal again after its shutdown, killing the process before run_server's
            # cleanup (engine thread, tensor-parallel ranks); a graceful stop exits normally instead
            self.force_exit = self.should_exit
            self.should_exit = True

        async def shutdown(self, sockets=None) -> None:
            log.info("shutting down: no new requests; %g s for those in flight", config.shutdown_timeout)
            app.state.drain(config.shutdown_timeout)
            await super().shutdown(sockets)

    # uvicorn's own grace period only backs ours up: by then drain() has ended every request with an error
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level.lower(),
                        timeout_graceful_shutdown=config.shutdown_timeout + 5)
    return Server(uv)


def _stop_engine(engine_thread, timeout: float | None = None) -> None:
    """Stop the engine thread once its step in progress ends (a step cannot be interrupted, and the process must
    not exit while torch runs in it: on a CPU a prefill step can outlast --shutdown-timeout), then end the requests
    it still holds, so that the pool report counts leaked pages only."""
    engine = engine_thread.engine
    if engine.has_work():
        log.info("waiting for the engine's step in progress to end ...")
    engine_thread.stop(timeout)
    if engine_thread._thread.is_alive():
        log.warning("the engine's step did not end within %s s; its pages are not released", timeout)
        return
    for rid in list(engine.requests):  # the thread has stopped: this one owns the engine now
        engine.abort_request(rid, "the server stopped")
    pool = engine.pool
    log.info("stopped; KV pages still referenced: %d window + %d quantized", pool.window.used, pool.quant.used)


def run_server(config: ServeConfig, sock: socket.socket | None = None) -> None:
    """Start the OpenAI-compatible server and block until SIGTERM / SIGINT (graceful: --shutdown-timeout).
    ``sock``: --host:--port already bound (``listen_socket``; rank 0 only), else bound here.
    Raises ServeError with a message for the user when the configuration cannot work."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)  # the CLI configured warnings-only logging before
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config.validate()
    from .. import parallel

    try:
        tp = parallel.init(config.tp, config.device)
    except parallel.TensorParallelError as exc:
        if sock is not None:
            sock.close()
        raise ServeError(user_message(exc)) from None
    if not tp.is_driver:
        logging.getLogger().setLevel(logging.WARNING)  # rank 0 speaks for all
    if sock is None and tp.is_driver:
        sock = listen_socket(config)
    try:
        engine_thread = build_engine(config, tp=tp)
        if not tp.is_driver:
            engine_thread.engine.follow()  # until rank 0 shuts down
            return
        engine_thread.start()
        server = _uvicorn_server(config, engine_thread)
        log.info("serving '%s' on http://%s:%d/v1 (OpenAI API)%s", "', '".join(config.model_names), config.host, config.port,
                 "; API key required" if config.api_key else "")
        try:
            server.run(sockets=[sock])
        finally:
            _stop_engine(engine_thread)
            engine_thread.engine.shutdown()
    finally:
        if sock is not None:
            sock.close()
        parallel.shutdown(tp)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """The server in a daemon thread: ``start()`` returns once it accepts connections, ``stop()`` ends it."""

    def __init__(self, config: ServeConfig, model=None, tokenizer=None, rotations=None):
        self.config = config
        config.validate()
        self._socket = listen_socket(config)
        try:
            self.engine_thread = build_engine(config, model, tokenizer, rotations).start()
        except BaseException:
            self._socket.close()
            raise
        self.server = _uvicorn_server(config, self.engine_thread)  # signals: uvicorn listens on the main thread only
        self._thread = threading.Thread(target=self.server.run, args=([self._socket],), name="oscar-kv-http",
                                        daemon=True)

    @property
    def engine(self):
        return self.engine_thread.engine

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                self.stop()
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Shut down as on SIGTERM (requests in flight get --shutdown-timeout); wait at most ``timeout`` seconds."""
        self.server.should_exit = True
        self._thread.join(self.config.shutdown_timeout + 10 if timeout is None else timeout)
        _stop_engine(self.engine_thread, 60.0)
        self._socket.close()
