"""The admin HTTP app: ``/metrics`` (Prometheus), ``/healthz``, ``/readyz``, ``/status``,
``/history``, and the dashboard at ``/`` (docs/observability.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from importlib import resources
from typing import Any, cast

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from .metrics import Metrics
from .owners import anonymous

# The dashboard's files (package data, cached/dashboard/) and their types. A fixed list:
# nothing else under /dashboard/ is served, whatever the path asks for.
DASHBOARD_FILES = {
    "index.html": "text/html",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "favicon.svg": "image/svg+xml",
}
# The page and its assets load from this address only: no CDN, no web font, no inline
# script (nodes are often offline, and a browser enforcing this proves it).
DASHBOARD_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; font-src 'none'; object-src 'none'; frame-ancestors 'none'; "
    "base-uri 'none'; form-action 'none'"
)
_PAGE_HEADERS = {
    "Content-Security-Policy": DASHBOARD_CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def dashboard_files() -> dict[str, bytes]:
    """The dashboard's files, read from the installed package."""
    root = resources.files("cached") / "dashboard"
    return {name: (root / name).read_bytes() for name in DASHBOARD_FILES}


class AdminHTTP:
    """An aiohttp site on ``host:port`` (port 0 picks a free one). An async context manager.

    ``history`` answers ``GET /history`` (:meth:`cached.history.History.snapshot`); without
    it the dashboard gets no samples and draws no charts.
    """

    def __init__(
        self,
        address: str,
        metrics: Metrics,
        status: Callable[[], dict[str, Any]],
        ready: Callable[[], bool],
        history: Callable[[], dict[str, Any]] | None = None,
        *,
        max_connections: int = 64,
    ) -> None:
        host, _, port = address.rpartition(":")
        self.max_connections = max_connections
        self.refused = 0  # connections closed at once, past max_connections
        self._site: asyncio.Server | None = None
        self.host, self.port = host.strip("[]"), int(port)
        self._status = status
        self._ready = ready
        self._history = history
        # Read once: a few kB, and the page keeps working if the package is replaced.
        self._files = dashboard_files()
        app = web.Application()
        app.router.add_get("/metrics", make_aiohttp_handler(metrics.registry))
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/status", self._status_handler)
        app.router.add_get("/history", self._history_handler)
        app.router.add_get("/", self._page)
        app.router.add_get("/dashboard/{name}", self._asset)
        self._runner = web.AppRunner(app, access_log=None)

    async def __aenter__(self) -> AdminHTTP:
        await self._runner.setup()
        # Not aiohttp's TCPSite: its protocol factory takes every connection, and each is a
        # descriptor that any local user can open (cached/descriptors.py).
        self._site = await asyncio.get_running_loop().create_server(
            self._protocol, self.host, self.port
        )
        # Port 0 picks a free port: read back the one the kernel chose.
        if self._site.sockets:
            self.port = self._site.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._site is not None:
            self._site.close()
        await self._runner.cleanup()

    def _protocol(self) -> asyncio.BaseProtocol:
        """aiohttp's handler for a new connection, or past max_connections open ones a
        protocol that closes it at once."""
        server = self._runner.server
        assert server is not None
        if len(server.connections) >= self.max_connections:
            self.refused += 1
            return _Shut()
        return server()

    @property
    def url(self) -> str:
        """Where the admin app listens."""
        return f"http://{self.host}:{self.port}"

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _readyz(self, _request: web.Request) -> web.Response:
        ready = self._ready()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def _status_handler(self, _request: web.Request) -> web.Response:
        # Anyone on the node who reaches the port may ask: no plan's name or user.
        return web.json_response(anonymous(self._status()))

    async def _history_handler(self, _request: web.Request) -> web.Response:
        if self._history is None:
            return web.json_response({"interval_s": None, "keep_s": None, "samples": []})
        return web.json_response(self._history())

    async def _page(self, _request: web.Request) -> web.Response:
        return self._file("index.html")

    async def _asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in DASHBOARD_FILES or name == "index.html":
            raise web.HTTPNotFound(text="no such dashboard file\n")
        return self._file(name)

    def _file(self, name: str) -> web.Response:
        return web.Response(
            body=self._files[name],
            content_type=DASHBOARD_FILES[name],
            charset="utf-8",
            headers=_PAGE_HEADERS,
        )


class _Shut(asyncio.Protocol):
    """A connection past the cap: closed as soon as it is made."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; both have abort().
        cast(asyncio.Transport, transport).abort()
