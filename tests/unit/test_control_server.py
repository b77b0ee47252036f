"""The orchestrator's control server, on the real Orchestrator with instant fake rollout endpoints."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from rlrun.api.control import PauseResult, StatusReport
from rlrun.checkpoint import latest_complete_checkpoint
from rlrun.orchestrator.control import ControlServer
from rlrun.rundir import RunDir

from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator, trainer_start_part

TOKEN = "s3cret-token"


@pytest.fixture
def orchestrator(tmp_path, tiny_model):
    spec = parse(
        "ctl", group_size=4, batch_size=10, max_steps=50, rollout={"max_inflight": 16, "members_per_request": 2}
    ).spec
    run_dir = RunDir(tmp_path / "run")
    trainer_start_part(run_dir, tiny_model)  # a pause pairs its snapshot with it
    return make_orchestrator(spec, run_dir, tiny_model, attempt=0, poll_s=0.05, control_port=0, control_token=TOKEN)


async def test_status_and_pause_need_the_token_and_pause_writes_a_complete_checkpoint(orchestrator):
    run = asyncio.create_task(orchestrator.run())
    while orchestrator.shipped < 2:  # no trainer: flow control stops it after v + 1 + k = 2 batches
        assert not run.done(), run.exception() if run.done() else None
        await asyncio.sleep(0.01)
    base = f"http://127.0.0.1:{orchestrator.control.port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=base) as http:
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/status")).status_code == 401
        assert (await http.post("/pause", headers={"Authorization": "Bearer wrong"})).status_code == 401
        status = (await http.get("/status", headers=auth)).json()
        assert status["phase"] == "running" and status["step"] == 2
        paused = (await http.post("/pause", headers=auth)).json()
        PauseResult.model_validate(paused)  # the contract the operator parses
        assert paused["step"] == 0 and paused["queued_traces"] == len(orchestrator.sink.queue)
        assert (await http.post("/pause", headers=auth)).json() == paused  # idempotent
        status = (await http.get("/status", headers=auth)).json()
        assert status["phase"] == "paused" and status["last_pause"] == paused
        assert StatusReport.model_validate(status).last_checkpoint.reason == "pause"
        bad = await http.put("/rollout-endpoints", headers=auth, json={"endpoints": "nope"})
        assert bad.status_code == 400
    shipped = orchestrator.shipped
    orchestrator.request_stop()
    await asyncio.wait_for(run, 10)
    ckpt = latest_complete_checkpoint(orchestrator.run_dir)
    assert ckpt.step == 0 and ckpt.orchestrator["shipped"] == shipped == 2
    assert (
        len(ckpt.orchestrator["sink"]["emitted_train_groups"]) + ckpt.orchestrator["sink"]["pending_batch"]["count"]
        >= 0
    )
    assert ckpt.orchestrator["sink"]["pending_batch"]["count"] == paused["queued_traces"]


async def test_without_endpoints_it_waits_for_the_operator_to_send_them(orchestrator):
    """On Kubernetes the orchestrator starts with no rollout URL; ``PUT /rollout-endpoints`` starts the work."""
    orchestrator.rollout_urls = []
    run = asyncio.create_task(orchestrator.run())
    while orchestrator.control is None or orchestrator.control.port == 0 or orchestrator.dispatcher is None:
        await asyncio.sleep(0.01)
    base = f"http://127.0.0.1:{orchestrator.control.port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=base) as http:
        await asyncio.sleep(0.5)
        status = (await http.get("/status", headers=auth)).json()
        assert status["phase"] == "starting" and status["rollout_endpoints"] == [] and status["step"] == 0
        put = await http.put("/rollout-endpoints", headers=auth, json={"endpoints": ["http://fake-rollout:2/"]})
        assert put.status_code == 200
        while orchestrator.shipped < 1:
            assert not run.done(), run.exception() if run.done() else None
            await asyncio.sleep(0.01)
        status = (await http.get("/status", headers=auth)).json()
        assert status["phase"] == "running" and status["rollout_endpoints"] == ["http://fake-rollout:2"]
    orchestrator.request_stop()
    await asyncio.wait_for(run, 10)


async def test_pause_before_starting_writes_nothing_and_stop_ends_the_wait(orchestrator):
    """Suspending a run whose rollout servers never came up: no empty snapshot, and SIGTERM's stop ends it."""
    orchestrator.rollout_urls = []
    run = asyncio.create_task(orchestrator.run())
    while orchestrator.control is None or orchestrator.control.port == 0 or orchestrator.dispatcher is None:
        await asyncio.sleep(0.01)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{orchestrator.control.port}") as http:
        paused = (await http.post("/pause", headers=auth)).json()
        assert paused["step"] is None and paused["queued_traces"] == 0 and "nothing to save" in paused["note"]
        assert (await http.get("/status", headers=auth)).json()["phase"] == "paused"
    orchestrator.request_stop()
    assert await asyncio.wait_for(run, 5) == 0
    assert not orchestrator.run_dir.orchestrator_checkpoint(0).exists()  # nothing was written


class _Stub:
    """A :class:`~rlrun.orchestrator.control.Controlled` that is never reached: only the auth is under test."""

    def status(self) -> StatusReport:
        raise AssertionError("an unauthorized request reached the route")

    async def pause(self) -> PauseResult:
        raise AssertionError("an unauthorized request reached the route")

    async def set_endpoints(self, endpoints: list[str]) -> None:
        raise AssertionError("an unauthorized request reached the route")


@pytest.mark.parametrize(
    "header",
    [
        "Bearer s3cret-tokén".encode(),  # UTF-8
        "Bearer s3cret-tokén".encode("latin-1"),  # not even UTF-8
        b"Bearer \xff\xfe",
    ],
)
async def test_a_non_ascii_token_is_refused_with_401_not_a_500(header):
    server = ControlServer(_Stub(), "127.0.0.1", 0, TOKEN)
    port = await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            answer = await http.get("/status", headers={"Authorization": header})
        assert answer.status_code == 401 and answer.json() == {"error": "missing or wrong bearer token"}
    finally:
        await server.stop()
