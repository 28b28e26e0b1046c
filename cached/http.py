"""The admin HTTP app: ``/metrics`` (Prometheus), ``/healthz``, ``/readyz``, ``/status``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from .metrics import Metrics


class AdminHTTP:
    """An aiohttp site on ``host:port`` (port 0 picks a free one). An async context manager."""

    def __init__(
        self,
        address: str,
        metrics: Metrics,
        status: Callable[[], dict[str, Any]],
        ready: Callable[[], bool],
    ) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self._status = status
        self._ready = ready
        app = web.Application()
        app.router.add_get("/metrics", make_aiohttp_handler(metrics.registry))
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/status", self._status_handler)
        self._runner = web.AppRunner(app, access_log=None)

    async def __aenter__(self) -> AdminHTTP:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        # Port 0 picks a free port: read back the one the kernel chose.
        sockets = getattr(site._server, "sockets", None)
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()

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
        return web.json_response(self._status())
