"""kvgw's HTTP server: one listening socket, the connections (``protocol.py``), the ASGI app's lifespan,
and a graceful stop.

``HttpServer.serve`` runs until ``request_stop`` (SIGTERM and SIGINT call it when ``handle_signals``):
then it stops accepting, closes idle keep-alive connections, lets every request in flight finish for up
to ``shutdown_grace`` seconds (a connection closes after its current answer), aborts what is left, and
runs the app's lifespan shutdown. A start-up that fails (the lifespan's ``startup.failed``) ends
``serve`` with status 1 before the socket accepts anything; an app that ignores the lifespan protocol
is served as it is. A shutdown that does not finish within ``shutdown_grace`` either ends ``serve``
with status 1 (the process must not linger: its workers' data-directory lock, the socket).

One server per process: ``kvgw serve --workers N`` forks N processes that each run one on the same
listening socket (``gateway.serve``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.api.http import Message
from gateway.dataplane.cycle import ASGIApp
from gateway.dataplane.heads import CommonHeaders
from gateway.dataplane.lane import LookupLane
from gateway.dataplane.limits import ConnectionLimits
from gateway.dataplane.protocol import Connection

log = logging.getLogger("kvgw.http")


@dataclass
class ServerState:
    """What every connection of one server shares (event loop only)."""

    app: ASGIApp
    limits: ConnectionLimits
    lane: LookupLane | None = None
    access_log: bool = False
    clock: Callable[[], float] = time.perf_counter
    connections: set[Connection] = field(default_factory=set)
    open_by_client: collections.Counter[str] = field(default_factory=collections.Counter)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    common: CommonHeaders = field(default_factory=CommonHeaders)
    stopping: bool = False
    _all_closed: asyncio.Event | None = None

    def connection_closed(self) -> None:
        if not self.connections and self._all_closed is not None:
            self._all_closed.set()

    async def wait_all_closed(self) -> None:
        if self.connections:
            self._all_closed = asyncio.Event()
            await self._all_closed.wait()


class HttpServer:
    """The server for one app on one socket (see the module docstring)."""

    def __init__(self, state: ServerState, *, ssl_context: ssl.SSLContext | None = None,
                 shutdown_grace: float = 30.0, backlog: int = 2048) -> None:
        self.state = state
        self._ssl = ssl_context
        self._grace = shutdown_grace
        self._backlog = backlog
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.started = False

    def request_stop(self) -> None:
        """Stop serving (from any thread)."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.set)

    async def serve(self, sock: socket.socket, *, handle_signals: bool = False) -> int:
        """Serve on ``sock`` until stopped; the exit status (0, or 1 if the app failed to start)."""
        self._loop = loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        lifespan = Lifespan(self.state.app)
        if not await lifespan.startup():
            return 1
        if handle_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, self._stop.set)
        server = await loop.create_server(lambda: Connection(self.state), sock=sock, ssl=self._ssl,
                                          backlog=self._backlog)
        self.started = True
        try:
            await self._stop.wait()
        finally:
            await self._drain(server)
            try:
                await asyncio.wait_for(lifespan.shutdown(), self._grace)
            except TimeoutError:
                log.error("the app's shutdown did not finish within %g s: stopping without it", self._grace)
                return 1
        return 0

    async def _drain(self, server: asyncio.Server) -> None:
        state = self.state
        state.stopping = True
        server.close()
        for conn in list(state.connections):
            conn.shutdown()
        try:
            await asyncio.wait_for(state.wait_all_closed(), self._grace)
        except TimeoutError:
            log.warning("%d connection(s) still busy after %g s: closing them", len(state.connections), self._grace)
            for conn in list(state.connections):
                conn.transport.abort()
        for task in list(state.tasks):
            task.cancel()
        if state.tasks:
            await asyncio.wait(list(state.tasks), timeout=5)


class Lifespan:
    """The app's ASGI lifespan protocol: startup before serving, shutdown after."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._startup_done: asyncio.Future[bool] | None = None
        self._shutdown_done: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    async def startup(self) -> bool:
        loop = asyncio.get_running_loop()
        self._startup_done = loop.create_future()
        self._shutdown_done = loop.create_future()
        self._task = loop.create_task(self._run())
        await self._inbox.put({"type": "lifespan.startup"})
        return await self._startup_done

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        assert self._shutdown_done is not None
        await self._shutdown_done

    async def _run(self) -> None:
        scope: dict[str, Any] = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        try:
            await self._app(scope, self._inbox.get, self._send)
        except Exception:
            log.exception("the app's lifespan failed")
        finally:
            assert self._startup_done is not None and self._shutdown_done is not None
            if not self._startup_done.done():
                self._startup_done.set_result(True)  # an app without lifespan handling: serve it as it is
            if not self._shutdown_done.done():
                self._shutdown_done.set_result(None)

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        assert self._startup_done is not None and self._shutdown_done is not None
        if kind == "lifespan.startup.complete":
            self._startup_done.set_result(True)
        elif kind == "lifespan.startup.failed":
            log.error("start-up failed: %s", message.get("message", ""))
            self._startup_done.set_result(False)
        elif kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            if kind == "lifespan.shutdown.failed":
                log.error("shutdown failed: %s", message.get("message", ""))
            self._shutdown_done.set_result(None)


def run(server: HttpServer, sock: socket.socket) -> int:
    """Serve on ``sock`` in this thread, on a uvloop event loop, until SIGTERM or SIGINT; the exit
    status."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(server.serve(sock, handle_signals=True))
