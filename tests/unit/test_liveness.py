"""Liveness of rollout servers: requests a server reports not working on are asked again within seconds, never
those of a server that works or cannot say; a run that stops moving logs its accounting once per stall."""

from __future__ import annotations

import asyncio
import time

import pytest
from rlrun.orchestrator import liveness
from rlrun.orchestrator.groups import GroupRequest

from tests.support.dispatcher import Mute, make_dispatcher
from tests.support.samples import task


@pytest.mark.parametrize("running", [3, None])  # slow but working; or cannot say
async def test_the_guard_never_fires_on_a_server_that_works_or_cannot_say(running, quick_guard):
    dispatcher, _ = make_dispatcher({"http://slow:1": Mute(running=running)})
    settled: list = []
    guard = liveness.LivenessGuard()
    guard.bind(dispatcher, settled.extend)
    dispatcher.dispatch(GroupRequest(1, task(), 4), policy_version=0)
    for _ in range(20):  # 2 s of looks: 4 × the time it takes to declare a mute server's requests lost
        await asyncio.sleep(0.1)
        await guard.check()
    assert settled == [] and guard.lost_requests == 0 and dispatcher.inflight_samples == 4
    await dispatcher.aclose()


async def test_a_server_warming_up_gets_the_longer_window(monkeypatch, quick_guard):
    """vLLM's counts read 0 during its first (long) engine steps after start: a server whose process started
    within WARMUP_S is declared lost only after WARMUP_CONFIRM_S, one started earlier after CONFIRM_S."""
    monkeypatch.setattr(liveness, "WARMUP_CONFIRM_S", 1.5)
    now = time.time()
    servers = {
        "http://fresh:1": Mute(running=0, started_at=now - 5),
        "http://old:1": Mute(running=0, started_at=now - 600),
    }
    declared: dict[str, float] = {}
    for url, server in servers.items():
        dispatcher, _ = make_dispatcher({url: server})
        guard = liveness.LivenessGuard()
        t0 = time.monotonic()
        guard.bind(dispatcher, lambda lost, url=url, t0=t0: declared.setdefault(url, time.monotonic() - t0))
        dispatcher.dispatch(GroupRequest(1, task(), 4), policy_version=0)
        while url not in declared and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.05)
            await guard.check()
        await dispatcher.aclose()
    assert declared["http://old:1"] < 1.2  # grace 0.2 + confirm 0.5 (+ a look)
    assert 1.5 < declared["http://fresh:1"] < 2.5  # grace 0.2 + warm-up confirm 1.5


async def test_the_stall_report_names_the_accounting_once_per_stall(monkeypatch, caplog):
    monkeypatch.setattr(liveness, "STALL_REPORT_S", 0.2)
    state = {"progress": (3, 100)}
    guard = liveness.LivenessGuard()
    guard.bind(None, None, lambda: state["progress"], lambda: {"queue": 124, "open_groups": {7: {"finished": 4}}})
    assert not guard.check_stall()  # first look: the clock starts
    await asyncio.sleep(0.25)
    with caplog.at_level("ERROR", logger=liveness.__name__):
        assert guard.check_stall()
    assert "'queue': 124" in caplog.text and "has not moved for" in caplog.text
    await asyncio.sleep(0.25)
    assert not guard.check_stall()  # once per stall
    state["progress"] = (3, 104)  # an episode finished: the run moved
    assert not guard.check_stall()
    await asyncio.sleep(0.25)
    assert guard.check_stall() and guard.stalls_reported == 2
    state["progress"] = None  # paused or done: never a stall
    await asyncio.sleep(0.25)
    assert not guard.check_stall() and not guard.check_stall()
