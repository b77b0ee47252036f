"""Fake orchestrator control servers for operator tests: every run's routes behind one local port.

The operator reaches run ``ns/name`` at ``{url}/{ns}/{name}`` (its ``orchestrator_url``
setting is pointed at :attr:`FakeOrchestrators.url_template`). Each run answers
``GET /status`` from :attr:`FakeRun.status`, records ``PUT /rollout-endpoints`` and
``POST /pause`` calls (answering :attr:`FakeRun.pause_answer`), and checks the bearer token
against the one set in :attr:`FakeRun.token` (None: first token seen is remembered and
required afterwards). A run marked ``reachable = False`` answers 503.

The answers start as the contract's models (:mod:`rlrun.api.control`) write them, so the
fake cannot drift from the contract; a test that breaks one on purpose sees the operator
refuse it. :func:`resume_report` is the one resume report of every tier's tests (operator, launcher, trackers).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from rlrun.api.control import EndpointsUpdate, PauseResult, ResumeReport, StatusReport


def default_status() -> dict[str, Any]:
    """A running attempt 0 at step 0, as :class:`~rlrun.api.control.StatusReport` writes it."""
    return StatusReport(phase="running", attempt=0, step=0, policy_version=0, max_steps=100).model_dump(mode="json")


def default_pause_answer() -> dict[str, Any]:
    """A snapshot at step 10, as :class:`~rlrun.api.control.PauseResult` writes it."""
    return PauseResult(
        step=10,
        path="/var/lib/rlrun/run/checkpoints/step_10/orchestrator/progress.pt",
        seconds=0.25,
        time=1_800_000_000.0,
        queued_traces=104,
        open_groups=3,
        requested_groups=1,
        finished_episodes_kept=8,
    ).model_dump(mode="json")


#: the counts of a :class:`~rlrun.api.control.ResumeReport` that put nothing back
NOTHING_PUT_BACK = dict.fromkeys(
    (
        "queued_traces",
        "open_groups",
        "requested_groups",
        "finished_episodes_kept",
        "dropped_stale",
        "members_requested",
        "progress_only_would_lose",
    ),
    0,
)


def resume_report(from_step: int = 10, **fields: Any) -> ResumeReport:
    """The report of an attempt resumed from the checkpoint of step ``from_step`` (10: the snapshot of
    :func:`default_pause_answer`) that put back nothing but what ``fields`` say (``shipped`` defaults to
    ``from_step``; any field of :class:`~rlrun.api.control.ResumeReport`). ``.model_dump(mode="json")`` is its
    form in ``GET /status``; the launcher and the trackers read the model itself."""
    return ResumeReport(
        **{"shipped": from_step, **NOTHING_PUT_BACK, "time": 1_800_000_000.0, **fields}, from_step=from_step
    )


@dataclass
class FakeRun:
    """The state one fake orchestrator serves and the calls it received.

    ``status`` and ``pause_answer`` start as the contract's models write them; tests change
    their keys (the names of :mod:`rlrun.api.control`).
    """

    status: dict[str, Any] = field(default_factory=default_status)
    token: str | None = None
    reachable: bool = True
    endpoint_puts: list[list[str]] = field(default_factory=list)
    pauses: int = 0
    pause_answer: dict[str, Any] = field(default_factory=default_pause_answer)
    #: seconds ``POST /pause`` takes to answer (the snapshot's time)
    pause_delay: float = 0.0


class FakeOrchestrators:
    """An aiohttp server in its own thread serving :class:`FakeRun` s by ``(namespace, name)``."""

    def __init__(self) -> None:
        self.runs: dict[tuple[str, str], FakeRun] = {}
        self.lock = threading.Lock()
        self._port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._runner: web.AppRunner | None = None

    @property
    def url_template(self) -> str:
        """The operator's ``orchestrator_url`` setting for this server."""
        return f"http://127.0.0.1:{self._port}/{{namespace}}/{{name}}"

    def run(self, namespace: str, name: str) -> FakeRun:
        """The fake of run ``namespace/name`` (created on first use)."""
        with self.lock:
            return self.runs.setdefault((namespace, name), FakeRun())

    def _authorized(self, run: FakeRun, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer "):
            return False
        if run.token is None:
            run.token = header[7:]
        return header[7:] == run.token

    async def _handle(self, request: web.Request) -> web.Response:
        run = self.run(request.match_info["ns"], request.match_info["name"])
        if not run.reachable:
            return web.json_response({"error": "unavailable"}, status=503)
        if not self._authorized(run, request):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        route = (request.method, request.match_info["route"])
        if route == ("GET", "status"):
            return web.json_response(run.status)
        if route == ("PUT", "rollout-endpoints"):
            update = EndpointsUpdate.model_validate(await request.json())
            run.endpoint_puts.append(update.endpoints)
            run.status["rollout_endpoints"] = sorted(update.endpoints)
            return web.json_response(update.model_dump(mode="json"))
        if route == ("POST", "pause"):
            run.pauses += 1
            run.status["phase"] = "pausing"
            await asyncio.sleep(run.pause_delay)
            run.status["phase"] = "paused"
            return web.json_response(run.pause_answer)
        return web.json_response({"error": "no such route"}, status=404)

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_route("*", "/{ns}/{name}/{route}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self._port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def __enter__(self) -> FakeOrchestrators:
        self._thread = threading.Thread(target=self._serve, name="fake-orchestrators", daemon=True)
        self._thread.start()
        self._started.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)
