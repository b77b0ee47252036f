"""The operator's control client reads the orchestrator's answers as the contract's models, or refuses them."""

from __future__ import annotations

import json

import httpx
import pytest
from rlrun.api.control import PauseResult, StatusReport
from rlrun.api.control_client import ControlClient, ControlError

from tests.support.fake_orchestrator import default_pause_answer, default_status, resume_report

URL = "http://orchestrator:8080"


def client(answer, status_code: int = 200, seen: list | None = None) -> ControlClient:
    """A client whose every request is answered with ``answer`` (JSON) and recorded in ``seen``."""

    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return httpx.Response(status_code, json=answer)

    return ControlClient(URL, "token", transport=httpx.MockTransport(handle))


async def test_status_is_read_as_a_status_report_with_its_resume_report():
    answer = {
        **default_status(),
        "step": 12,
        "resume": resume_report(open_groups=2, requested_groups=1).model_dump(mode="json"),
    }
    report = await client(answer).status()
    assert isinstance(report, StatusReport) and report.step == 12
    assert report.resume is not None and report.resume.resumed_groups == 3


async def test_pause_is_read_as_a_pause_result_and_unknown_keys_are_ignored():
    paused = await client({**default_pause_answer(), "added_by_a_newer_orchestrator": 1}).pause(timeout_s=5)
    assert isinstance(paused, PauseResult)
    assert (paused.step, paused.queued_traces, paused.requested_groups) == (10, 104, 1)


async def test_set_endpoints_sends_the_contracts_body_and_returns_the_set_taken():
    seen: list[httpx.Request] = []
    taken = await client({"endpoints": ["http://10.0.0.7:8000"]}, seen=seen).set_endpoints(["http://10.0.0.7:8000"])
    assert taken == ["http://10.0.0.7:8000"]
    assert (seen[0].method, seen[0].url.path) == ("PUT", "/rollout-endpoints")
    assert json.loads(seen[0].content) == {"endpoints": ["http://10.0.0.7:8000"]}
    assert seen[0].headers["Authorization"] == "Bearer token"


@pytest.mark.parametrize(
    ("answer", "field"),
    [
        ({k: v for k, v in default_status().items() if k != "step"}, "step: Field required"),
        ({**default_status(), "phase": "sleeping"}, "phase: Input should be"),
        ({**default_status(), "resume": {"from_step": 3}}, "resume.shipped: Field required"),
    ],
)
async def test_an_answer_outside_the_contract_names_the_route_and_the_first_bad_field(answer, field):
    with pytest.raises(ControlError) as info:
        await client(answer).status()
    message = str(info.value)
    assert message.startswith(f"GET {URL}/status: the answer is not a StatusReport: {field}"), message


async def test_http_errors_are_control_errors():
    with pytest.raises(ControlError, match=r"POST http://orchestrator:8080/pause: HTTP 503"):
        await client({"error": "unavailable"}, status_code=503).pause(timeout_s=5)
