"""Graceful shutdown of ``autodeploy serve``.

On SIGTERM or SIGINT the server stops accepting connections and answers 503 to new requests on
open ones (``/health`` too, so load balancers move on); the requests in flight may finish for up to
``drain_timeout`` seconds; then the rest are ended: a stream gets an error event and ``data: [DONE]``,
a non-streaming request a 503. The process then exits with status 0 (uvicorn on its own re-raises
the signal after its shutdown, so the process died of it, and after a fixed 5 s it cancelled the
streams mid-write). A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from .async_engine import ServerShuttingDownError
from .serving_common import ServerState

log = logging.getLogger("autodeploy.serve")

POLL_SECONDS = 0.05
UVICORN_MARGIN_SECONDS = 5.0  # uvicorn's own wait (it cancels what is left) ends this long after the drain


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains the engine's requests on the first signal, then exits normally."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        config.timeout_graceful_shutdown = drain_timeout + UVICORN_MARGIN_SECONDS
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self.drained = asyncio.Event()

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler (also callable from another thread). Unlike uvicorn's, it does not keep
        the signal to re-raise after the shutdown: a drained server exits with status 0."""
        if self.should_exit:
            self.force_exit = True
            return
        self.should_exit = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        self.state.draining = True
        asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        engine = self.state.engine
        deadline = asyncio.get_running_loop().time() + self.drain_timeout
        while engine is not None and engine.num_streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(POLL_SECONDS)
        if engine is not None and engine.num_streams:
            log.warning("shutting down: ending %d request(s) still running after the %g s drain timeout",
                        engine.num_streams, self.drain_timeout)
            engine.end_all_streams(ServerShuttingDownError(
                f"the server is shutting down: this request was ended after the {self.drain_timeout:g} s drain timeout"))
        self.drained.set()
