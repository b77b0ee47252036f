"""The orchestrator's control server (aiohttp, in the orchestrator's event loop).

| route | auth | what |
|---|---|---|
| ``GET /healthz`` | none | ``{"ok": true}`` while the loop runs (for probes) |
| ``GET /metrics`` | none | Prometheus' text format (:mod:`.prometheus`; ``docs/observability.md``) |
| ``GET /status`` | bearer | :class:`~rlrun.api.control.StatusReport` |
| ``POST /pause`` | bearer | stop dispatching and shipping, write the sink snapshot: :class:`.PauseResult` |
| ``PUT /rollout-endpoints`` | bearer | replace the set of rollout servers: :class:`.EndpointsUpdate` in and out |

The answers are the models of :mod:`rlrun.api.control`, the contract the operator parses.
Every route but ``/healthz`` and ``/metrics`` needs ``Authorization: Bearer <token>`` and answers 401
without it (or with any other token, non-ASCII bytes included); a failed pause answers 500 and a malformed body 400,
each ``{"error": "…"}``. The token comes from ``$RLRUN_CONTROL_TOKEN``. ``/metrics`` needs none, decided so: Prometheus
scrapes without custom headers by default, and the metrics are read-only counts (what ``/status`` controls stays
behind the token).
"""

from __future__ import annotations

import hmac
import logging
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from pydantic import ValidationError

from rlrun.api.control import EndpointsUpdate, PauseResult, StatusReport
from rlrun.orchestrator.prometheus import exposition
from rlrun.orchestrator.view import OrchestratorView

log = logging.getLogger(__name__)


class Controlled(Protocol):
    """What the control server serves (the orchestrator: :class:`rlrun.orchestrator.loop.Orchestrator`)."""

    def status(self) -> StatusReport:
        """``GET /status``."""
        ...

    async def pause(self) -> PauseResult:
        """``POST /pause``."""
        ...

    async def set_endpoints(self, endpoints: list[str]) -> None:
        """``PUT /rollout-endpoints``."""
        ...


class ControlServer:
    """Serves the routes above for ``orchestrator``; ``metrics``: the registry ``/metrics`` exposes (None: no
    ``/metrics``).

    Raises:
        ValueError: an empty ``token``.
    """

    def __init__(
        self, orchestrator: Controlled, host: str, port: int, token: str, metrics: CollectorRegistry | None = None
    ) -> None:
        if not token:
            raise ValueError("the control server needs a non-empty bearer token")
        self.orchestrator = orchestrator
        self.host = host
        self.port = port
        self.token = token
        self.metrics = metrics
        self._runner: web.AppRunner | None = None

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer "):
            return False
        # compared as bytes: compare_digest refuses str with non-ASCII characters (a TypeError, then a 500);
        # aiohttp hands undecodable header bytes over as surrogates, which this encoding gives back
        given = header[7:].strip().encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, self.token.encode("utf-8"))

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path not in ("/healthz", "/metrics") and not self._authorized(request):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return await handler(request)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            return web.json_response({"error": "no metrics here"}, status=404)
        return web.Response(body=exposition(self.metrics), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.orchestrator.status().model_dump(mode="json"))

    async def _pause(self, request: web.Request) -> web.Response:
        try:
            return web.json_response((await self.orchestrator.pause()).model_dump(mode="json"))
        except Exception as exc:
            log.exception("pause failed")
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)

    async def _endpoints(self, request: web.Request) -> web.Response:
        try:
            update = EndpointsUpdate.model_validate(await request.json())
        except (ValueError, ValidationError):
            return web.json_response({"error": 'body must be {"endpoints": ["http://host:port", ...]}'}, status=400)
        await self.orchestrator.set_endpoints(update.endpoints)
        return web.json_response(update.model_dump(mode="json"))

    async def start(self) -> int:
        """Start listening; returns the bound port (useful with port 0)."""
        app = web.Application(middlewares=[self._auth])
        app.add_routes(
            [
                web.get("/healthz", self._healthz),
                web.get("/metrics", self._metrics),
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
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()


def status_report(view: OrchestratorView) -> StatusReport:
    """What ``GET /status`` answers, read off the orchestrator's ``view``."""
    return StatusReport(
        phase=view.phase,
        attempt=view.attempt_number,
        run_dir_attempt=view.run_dir_attempt,
        step=view.step,
        policy_version=view.policy_version,
        max_steps=view.max_steps,
        last_checkpoint_step=view.last_checkpoint_step if view.last_checkpoint_step >= 0 else None,
        queued_traces=view.queued,
        open_groups=view.open_groups,
        finished_episodes_kept=view.finished_episodes_kept,
        inflight_samples=view.inflight_samples,
        resume_requests=view.requested_groups,
        last_checkpoint=view.last_checkpoint,
        last_pause=view.last_pause,
        resume=view.resume,
        rollout_endpoints=view.rollout_endpoints,
    )
