"""The orchestrator's control server (aiohttp, in the orchestrator's event loop).

| route | auth | what |
|---|---|---|
| ``GET /healthz`` | none | 200 while the loop runs (for probes) |
| ``GET /status`` | bearer | step, policy version, queue sizes, open groups, last snapshot, last resume report |
| ``POST /pause`` | bearer | stop dispatching and shipping, write the sink snapshot, answer its counts |
| ``PUT /rollout-endpoints`` | bearer | replace the set of rollout servers (``{"endpoints": [url, …]}``) |

Every route but ``/healthz`` needs ``Authorization: Bearer <token>`` and answers 401
without it. The token comes from ``$RLRUN_CONTROL_TOKEN`` (or ``--control-token-file``).
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

log = logging.getLogger(__name__)


class ControlServer:
    """Serves the routes above for ``orchestrator`` (an :class:`~rlrun.orchestrator.loop.Orchestrator`)."""

    def __init__(self, orchestrator, host: str, port: int, token: str) -> None:
        if not token:
            raise ValueError("the control server needs a non-empty bearer token")
        self.orchestrator = orchestrator
        self.host = host
        self.port = port
        self.token = token
        self._runner: web.AppRunner | None = None

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        return header.startswith("Bearer ") and hmac.compare_digest(header[7:].strip(), self.token)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path != "/healthz" and not self._authorized(request):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return await handler(request)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.orchestrator.status())

    async def _pause(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(await self.orchestrator.pause())
        except Exception as exc:
            log.exception("pause failed")
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)

    async def _endpoints(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            endpoints = body["endpoints"]
            if not isinstance(endpoints, list) or not all(isinstance(e, str) and e for e in endpoints):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": 'body must be {"endpoints": ["http://host:port", ...]}'}, status=400)
        await self.orchestrator.set_endpoints(endpoints)
        return web.json_response({"endpoints": endpoints})

    async def start(self) -> int:
        """Start listening; returns the bound port (useful with port 0)."""
        app = web.Application(middlewares=[self._auth])
        app.add_routes(
            [
                web.get("/healthz", self._healthz),
                web.get("/status", self._status),
                web.post("/pause", self._pause),
                web.put("/rollout-endpoints", self._endpoints),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        log.info("control server on http://%s:%d", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
