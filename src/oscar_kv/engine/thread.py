"""The engine thread: drives one ``LLMEngine`` (engine.py) for the HTTP server.

``LLMEngine`` is single-threaded.  ``EngineThread`` owns one and runs its ``step`` in a daemon thread, taking
requests and aborts from other threads (the server's event loop) through a queue, and handing every output to
the callback given with its request.  A lock keeps ``stats`` (other threads) from reading the engine
while the thread steps it or adds to it.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Callable

import torch

from .outputs import EngineStats, RequestOutput
from .sequence import SamplingParams

if TYPE_CHECKING:
    from .engine import LLMEngine

log = logging.getLogger(__name__)


class EngineThread:
    """Runs an ``LLMEngine`` in a daemon thread; thread-safe ``submit`` / ``abort`` / ``stats``."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._callbacks: dict[str, Callable[[RequestOutput], None]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="oscar-kv-engine", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> "EngineThread":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               callback: Callable[[RequestOutput], None]) -> None:
        """Validate (ValueError for the client) and queue a request; outputs go to ``callback``."""
        self.engine.validate(prompt_ids, params)
        self._inbox.put(("add", request_id, prompt_ids, params, callback))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def abort_all(self, error: str) -> None:
        """End every request submitted so far with finish reason "error" and ``error`` (graceful shutdown)."""
        self._inbox.put(("abort_all", error))
        self._wake.set()

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            self._drain()
            if not self.engine.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            with self._lock:
                outputs = self.engine.step()
            for out in outputs:
                self._emit(out)

    def _drain(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                if item[0] == "add":
                    _, rid, prompt, params, callback = item
                    try:
                        self.engine.add_request(rid, prompt, params)
                        self._callbacks[rid] = callback
                    except ValueError as exc:
                        callback(RequestOutput(rid, "", [], True, "error", len(prompt), 0, str(exc)))
                elif item[0] == "abort":
                    out = self.engine.abort_request(item[1])
                    if out is not None:
                        self._emit(out)
                else:
                    for rid in list(self.engine.requests):
                        self._emit(self.engine.abort_request(rid, item[1]))

    def _emit(self, out: RequestOutput) -> None:
        callback = self._callbacks.get(out.request_id)
        if out.finished:
            self._callbacks.pop(out.request_id, None)
        if callback is not None:
            try:
                callback(out)
            except Exception:  # a closed client must not stop the engine
                log.exception("output callback failed for %s", out.request_id)
