"""The coordinator's web dashboard: one self-contained page, a JSON API and Prometheus metrics.

- ``/``: the page (``coordinator/static/``; no external scripts or fonts, so it works offline)
- ``/api/status``: the run as JSON (``coordinator.metrics.run_snapshot``)
- ``/metrics``: Prometheus text; every name starts with ``swarm_``

Anything else is answered with a JSON 404 (or 405 for a method other than GET/HEAD). Nothing served
holds a key, a certificate or the run's join token.

Example::

    dashboard = Dashboard(lambda: run_snapshot(store, run, peer_id), host="127.0.0.1", port=8080)
    await dashboard.start()
    print(dashboard.url)
    await dashboard.stop()
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from coordinator.metrics import prometheus_text
from protocols.errors import NetworkError

logger = logging.getLogger(__name__)

STATIC_FILES = {
    "/": ("dashboard.html", "text/html"),
    "/static/dashboard.js": ("dashboard.js", "application/javascript"),
    "/static/dashboard.css": ("dashboard.css", "text/css"),
}
SECURITY_HEADERS = {
    # Only this origin's own files: the page must not load or send anything elsewhere.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _json_error(status: int, message: str, path: str) -> web.Response:
    return web.json_response({"error": message, "status": status, "path": path}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    try:
        response = await handler(request)
    except web.HTTPNotFound:
        response = _json_error(404, f"no such page or API: {request.path}", request.path)
    except web.HTTPMethodNotAllowed:
        response = _json_error(405, f"{request.method} is not allowed here; use GET", request.path)
    except web.HTTPException as e:
        response = _json_error(e.status, e.reason, request.path)
    except Exception:
        logger.exception(f"dashboard failed to serve {request.path}")
        response = _json_error(500, "internal error at the coordinator; see its log", request.path)
    response.headers.update(SECURITY_HEADERS)
    return response


class Dashboard:
    """Serves the page, ``/api/status`` and ``/metrics`` from ``snapshot()``, fetched anew per request."""

    def __init__(self, snapshot: Callable[[], Awaitable[dict[str, Any]]], *, host: str, port: int):
        self.snapshot, self.host, self.port = snapshot, host, port
        self.url = ""
        self._runner: web.AppRunner | None = None
        package = resources.files("coordinator") / "static"
        self._files = {
            path: ((package / name).read_bytes(), content_type)
            for path, (name, content_type) in STATIC_FILES.items()
        }

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors])
        for path in self._files:
            app.router.add_get(path, self._static)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _static(self, request: web.Request) -> web.Response:
        body, content_type = self._files[request.path]
        return web.Response(body=body, content_type=content_type, charset="utf-8")

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(await self.snapshot())

    async def _metrics(self, request: web.Request) -> web.Response:
        body = prometheus_text(await self.snapshot())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as e:
            await self.stop()
            raise NetworkError(
                f"cannot serve the dashboard on {self.host}:{self.port}: {e.strerror or e}; "
                "pick another --dashboard-port"
            ) from None
        host, self.port = self._runner.addresses[0][:2]
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.url = f"http://{f'[{shown}]' if ':' in shown else shown}:{self.port}/"
        logger.info(
            f"dashboard at {self.url} (JSON at {self.url}api/status, Prometheus at {self.url}metrics)"
        )

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
