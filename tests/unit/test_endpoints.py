"""Rollout servers: a server gets a request only while it holds the current weights and is not reloading, and once
the vLLM it reports is within rlrun's pins; one that leaves (removed, benched) loses its requests at once, asked again
elsewhere and not counted as retries."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re

import httpx
import pytest
import torch
from rlrun import versions
from rlrun.ledger import Ledger
from rlrun.orchestrator.cancellation import settle
from rlrun.orchestrator.endpoints import DispatchError, EndpointMembership, RolloutPool, wait_until_healthy
from rlrun.orchestrator.follower import WeightFollower
from rlrun.orchestrator.groups import GroupRequest
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.source import TrainSource
from rlrun.orchestrator.weights import push_weights
from rlrun.rollout.client import RolloutClient, RolloutError
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir
from rlrun.versions import UnsupportedVersion
from safetensors.torch import save_file

from tests.support.dispatcher import ENV, drain, make_dispatcher, never_answers
from tests.support.samples import task


def membership(dispatcher, tmp_path) -> tuple[EndpointMembership, list]:
    """The membership of ``dispatcher``'s pool at policy 0 (nothing to catch up), and the cancellations it settles."""
    settled: list = []
    members = EndpointMembership()
    members.bind(
        dispatcher.pool, dispatcher.lose_on, WeightFollower(RunDir(tmp_path), 0, None), settled.extend, lambda: None
    )
    return members, settled


async def test_the_pick_is_the_least_loaded_server_holding_the_version_that_has_not_failed():
    pool = RolloutPool(["http://a", "http://b", "http://c"], lambda url: RolloutClient(url), retry_window_s=60)
    for url, version in (("http://a", 2), ("http://b", 2), ("http://c", 1)):
        pool.clients[url].loaded_version = version
    pool.load.update({"http://a": 3, "http://b": 5, "http://c": 0})  # "c" is idle but holds policy 1 only
    assert await pool.pick(set(), policy_version=2) == "http://a"
    assert await pool.pick({"http://a"}, policy_version=2) == "http://b"  # failed this request
    pool.note_failure("http://a")  # failed another request recently: passed over while another serves
    assert await pool.pick(set(), policy_version=2) == "http://b"
    assert await pool.pick({"http://b"}, policy_version=2) == "http://a"  # …but not left without a server
    assert await pool.pick(set(), policy_version=1) == "http://c"
    with pool.sending("http://c", 4) as client:
        assert client is pool.clients["http://c"] and pool.load["http://c"] == 4
    assert pool.load["http://c"] == 0
    with pytest.raises(RolloutError, match="no rollout server holds policy 3 yet"):
        await pool.pick(set(), policy_version=3)
    await pool.aclose()


async def test_a_request_goes_only_to_a_server_holding_its_policy_version():
    served = {"http://caught-up": 0, "http://joining": 0}

    def server(url: str) -> httpx.MockTransport:
        inner = fake_vllm_transport(error_rate=0.0)

        async def handle(request: httpx.Request) -> httpx.Response:
            served[url] += request.url.path == "/v1/completions"
            return await inner.handle_async_request(request)

        return httpx.MockTransport(handle)

    dispatcher, results = make_dispatcher({u: server(u) for u in served}, members_per_request=1)
    pool = dispatcher.pool
    pool.clients["http://caught-up"].loaded_version = 2  # "joining" still holds 0: its catch-up runs
    pool.load["http://caught-up"] = 100  # even much busier, the server holding policy 2 takes them all
    dispatcher.dispatch(GroupRequest(3, task(3), members=4), policy_version=2)
    got = await drain(results, 4)
    assert served == {"http://caught-up": 4, "http://joining": 0} and all(r.error is None for r in got)
    pool.clients["http://joining"].loaded_version = 2  # caught up: it gets its share again
    dispatcher.dispatch(GroupRequest(4, task(4), members=4), policy_version=2)
    await drain(results, 4)
    assert served["http://joining"] == 4
    await dispatcher.aclose()


async def test_wait_until_healthy_waits_for_endpoints_and_gives_up_on_a_dead_one():
    def health(ok: bool):
        return httpx.MockTransport(lambda request: httpx.Response(200 if ok else 503, json={}))

    dispatcher, _ = make_dispatcher({})
    pool = dispatcher.pool
    stop = asyncio.Event()
    waiting = asyncio.create_task(wait_until_healthy(pool, timeout_s=5, stop=stop))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # no endpoints yet: waits (no deadline)
    pool.client_factory = lambda url: RolloutClient(url, transport=health(True))
    pool.set_endpoints(["http://a/"])
    await asyncio.wait_for(waiting, 5)
    assert list(pool.clients) == ["http://a"]

    pool.client_factory = lambda url: RolloutClient(url, transport=health(False))
    pool.set_endpoints(["http://b"])
    with pytest.raises(DispatchError, match=r"not healthy after 1 s: \['http://b'\]"):
        await wait_until_healthy(pool, timeout_s=1, stop=stop)
    await dispatcher.aclose()


async def test_requests_on_a_removed_endpoint_end_at_once_and_their_group_goes_on_elsewhere_uncounted(tmp_path):
    transports = {"http://lost": never_answers(), "http://up": fake_vllm_transport(error_rate=0.0)}
    dispatcher, results = make_dispatcher(transports, timeout_s=600, retry_window_s=600)
    dispatcher.pool.set_endpoints(["http://lost"])  # the only server: the group's two requests wait on it
    source = TrainSource([(ENV, 1.0)], seed=0)
    ledger = Ledger(tmp_path, attempt=0, role="orchestrator")
    sink = TrainSink(group_size=4, batch_size=8, max_off_policy_steps=1, record=ledger.record)
    settled: list[int] = []
    members = EndpointMembership()
    members.bind(
        dispatcher.pool,
        dispatcher.lose_on,
        WeightFollower(RunDir(tmp_path / "run"), 0, None),
        lambda lost: settled.append(settle(lost, sink, source, dispatcher, ledger, max_group_retries=0)),
        lambda: None,
    )
    request = source.next_group(4)
    dispatcher.members_per_request = 2
    dispatcher.dispatch(request, policy_version=0)
    await asyncio.sleep(0.05)
    assert dispatcher.inflight_samples == 4
    t0 = asyncio.get_running_loop().time()
    await members.set(["http://up"])  # the node of "lost" is gone
    assert list(dispatcher.pool.clients) == ["http://up"]
    assert dispatcher.inflight == {} and dispatcher.cancelled_groups == 2
    assert settled == [2]  # both settled before the set returned, in one go
    assert source.retries(request.group_id) == 0  # a lost node is not the group's fault: no retry counted
    while source.resume_requests:  # re-requested with new member numbers, before any new task
        dispatcher.dispatch(source.next_group(4), policy_version=0)
    got = await drain(results, 2, timeout=1.0)
    assert asyncio.get_running_loop().time() - t0 < 1.0
    assert sorted(e.member for r in got for e in r.episodes) == [4, 5, 6, 7]
    assert {r.request.group_id for r in got} == {request.group_id} and all(r.error is None for r in got)
    ledger.flush()
    cancelled = [json.loads(line) for line in ledger.path.read_text().splitlines()]
    assert {(e["e"], e["reason"], e["error"]) for e in cancelled} == {
        ("cancelled", "lost", "rollout endpoint http://lost removed")
    }
    ledger.close()
    await dispatcher.aclose()


async def test_the_lost_requests_of_a_removed_endpoint_say_whether_their_group_has_others_out():
    dispatcher, _ = make_dispatcher({"http://lost": never_answers(), "http://up": never_answers()})
    dispatcher.pool.set_endpoints(["http://lost"])
    dispatcher.members_per_request = 2
    dispatcher.dispatch(GroupRequest(1, task(1), members=4), policy_version=0)
    await asyncio.sleep(0.05)
    change = dispatcher.pool.set_endpoints(["http://up"])
    assert change.removed == ["http://lost"] and [c.base_url for c in change.added] == ["http://up"]
    lost = dispatcher.lose_on(change.removed, "removed")
    # each says whether its group has other requests out once all of them are cancelled
    assert [(c.reason, c.request.first_member, c.others_out) for c in lost] == [("lost", 0, False), ("lost", 2, False)]
    assert dispatcher.lose_on(change.removed, "removed") == []  # cancelled once
    await dispatcher.aclose()


async def test_a_benched_endpoint_gets_no_requests_until_it_rejoins_and_the_endpoint_set_can_drop_it(tmp_path):
    transports = {"http://a": never_answers(), "http://b": fake_vllm_transport(error_rate=0.0)}
    dispatcher, _ = make_dispatcher(transports, timeout_s=600, retry_window_s=600)
    pool = dispatcher.pool
    members, settled = membership(dispatcher, tmp_path)
    pool.set_endpoints(["http://a"])
    dispatcher.dispatch(GroupRequest(1, task(), 2), policy_version=0)
    await asyncio.sleep(0.05)
    members.bench({"http://a": "ReadError: connection closed"})
    assert [(c.reason, c.error) for c in settled] == [
        ("lost", "rollout endpoint http://a benched (ReadError: connection closed)")
    ]
    assert dispatcher.inflight == {} and pool.clients == {}
    assert not pool.bench("http://a", "again")  # no longer in use: nothing to bench
    # The operator still lists it: it stays benched, not re-added with old weights.
    change = pool.set_endpoints(["http://a", "http://b"])
    assert [c.base_url for c in change.added] == ["http://b"] and list(pool.clients) == ["http://b"]
    assert pool.benched == {"http://a": "ReadError: connection closed"}
    assert pool.rejoin(RolloutClient("http://a", transport=transports["http://a"]))
    assert sorted(pool.clients) == ["http://a", "http://b"] and pool.load["http://a"] == 0
    pool.bench("http://a", "gone again")
    pool.set_endpoints(["http://b"])  # the operator drops it: it is forgotten and cannot rejoin
    assert pool.benched == {}
    assert not pool.rejoin(RolloutClient("http://a", transport=transports["http://a"]))
    assert list(pool.clients) == ["http://b"]
    await dispatcher.aclose()


async def test_no_completion_is_sent_to_a_server_in_its_reload_window_nor_out_when_it_pauses(tmp_path):
    # Issue 35.4: a server that had begun its reload was given requests (and requests out on it were paused over),
    # so completions came from weights other than those it held when they were sent. Two servers, one reloading
    # ten times slower; requests keep coming before, during and after the update.
    weights = tmp_path / "step_1"
    weights.mkdir()
    save_file({"w": torch.zeros(2)}, str(weights / "model.safetensors"))
    servers = {
        "http://fast": fake_vllm_transport(samples_per_s=40, error_rate=0.0, reload_s=0.05),
        "http://slow": fake_vllm_transport(samples_per_s=40, error_rate=0.0, reload_s=0.5),
    }
    dispatcher, results = make_dispatcher(servers, members_per_request=1)
    for g in range(4):  # 16 requests out on both servers when the update begins
        dispatcher.dispatch(GroupRequest(g, task(g), members=4), policy_version=0)
    await asyncio.sleep(0.05)
    update = asyncio.create_task(push_weights(list(dispatcher.pool.clients.values()), weights, 1, None))
    await asyncio.sleep(0.01)
    for g in range(4, 8):  # dispatched while the servers reload, labelled with the policy they held (the follower's)
        dispatcher.dispatch(GroupRequest(g, task(g), members=4), policy_version=0)
    got = []
    while not update.done():  # answered during the update: on the fast server, once it has resumed
        with contextlib.suppress(asyncio.TimeoutError):
            got.append(await asyncio.wait_for(results.get(), 0.02))
    assert (await update).unreachable == {}
    for g in range(8, 10):
        dispatcher.dispatch(GroupRequest(g, task(g), members=4), policy_version=1)
    during = {r.request.group_id for r in got if r.request.group_id >= 4}
    got += await drain(results, 40 - len(got))
    assert all(r.error is None for r in got) and len(got) == 40
    assert [(s.counts.sent_in_reload, s.counts.in_flight_at_pause, s.counts.reloads) for s in servers.values()] == [
        (0, 0, 1),
        (0, 0, 1),
    ]
    assert during  # the fast server served while the slow one still reloaded
    assert {c.loaded_version for c in dispatcher.pool.clients.values()} == {1}
    await dispatcher.aclose()


def reporting(version: str | None, reads: list[str], url: str, answer: asyncio.Event | None = None):
    """A fake vLLM whose ``GET /version`` reports ``version`` (None: 404, not vLLM; ``"503"``: an error status), each
    read recorded in ``reads`` as ``url``, answered once ``answer`` is set (None: at once)."""
    inner = fake_vllm_transport(error_rate=0.0, vllm_version=version if version not in (None, "503") else None)

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/version":
            reads.append(url)
            if answer is not None:
                await answer.wait()
            if version is None:
                return httpx.Response(404, json={"detail": "Not Found"})
            if version == "503":
                return httpx.Response(503, text="Service Unavailable")
        return await inner.handle_async_request(request)

    return httpx.MockTransport(handle)


async def test_a_first_server_reporting_another_vllm_ends_the_start_in_one_line_naming_it(tmp_path):
    reads: list[str] = []
    servers = {"http://a": reporting(versions.imitated_vllm(), reads, "a"), "http://b": reporting("0.11.0", reads, "b")}
    dispatcher, _ = make_dispatcher(servers)
    members, _ = membership(dispatcher, tmp_path)
    with pytest.raises(UnsupportedVersion) as refused:
        await members.start(timeout_s=5, stop=asyncio.Event())
    line = str(refused.value)
    assert line == versions.served_line(versions.supported(), "http://b", "0.11.0") and "\n" not in line
    assert line.startswith("rollout server http://b serves vLLM 0.11.0; rlrun ") and "supports vLLM ==0.32.0" in line
    assert list(dispatcher.pool.clients) == ["http://a"] and list(dispatcher.pool.refused) == ["http://b"]
    assert sorted(reads) == ["a", "b"]
    await dispatcher.aclose()


async def test_a_server_that_reports_no_vllm_version_is_refused_as_not_vllm(tmp_path):
    dispatcher, _ = make_dispatcher({"http://x": reporting(None, [], "x")})
    members, _ = membership(dispatcher, tmp_path)
    said = "rollout server http://x reports no vLLM version at GET /version: it is not vLLM, which reports it in "
    with pytest.raises(UnsupportedVersion, match="^" + re.escape(said + "every release rlrun supports; rlrun ")):
        await members.start(timeout_s=5, stop=asyncio.Event())
    await dispatcher.aclose()


async def test_a_server_added_later_of_another_vllm_is_refused_logged_never_used_and_read_once_while_listed(
    tmp_path, caplog
):
    reads: list[str] = []
    good, old = reporting(versions.imitated_vllm(), reads, "a"), reporting("0.11.0", reads, "old")
    dispatcher, results = make_dispatcher({"http://a": good, "http://old": old}, members_per_request=1)
    pool = dispatcher.pool
    pool.set_endpoints(["http://a"])
    members, _ = membership(dispatcher, tmp_path)
    await members.start(timeout_s=5, stop=asyncio.Event())
    with caplog.at_level(logging.ERROR, logger="rlrun.orchestrator.endpoints"):
        await members.set(["http://a", "http://old"])  # PUT /rollout-endpoints
        await members.set(["http://a", "http://old"])  # the operator sends the list again: not read again
    assert list(pool.clients) == ["http://a"] and list(pool.refused) == ["http://old"]
    assert reads == ["a", "old"]
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert line.startswith("refused: rollout server http://old serves vLLM 0.11.0; rlrun ")
    dispatcher.dispatch(GroupRequest(1, task(1), members=4), policy_version=0)
    assert all(r.error is None for r in await drain(results, 4))
    await members.set(["http://a"])  # no longer listed: forgotten, and read again if it comes back
    assert pool.refused == {}
    await members.set(["http://a", "http://old"])
    assert reads == ["a", "old", "old"] and list(pool.refused) == ["http://old"]
    await dispatcher.aclose()


async def test_no_request_goes_to_a_server_while_its_version_is_read(tmp_path):
    reads: list[str] = []
    answer = asyncio.Event()
    supported = versions.imitated_vllm()
    servers = {"http://a": reporting(supported, reads, "a"), "http://new": reporting(supported, reads, "new", answer)}
    dispatcher, _ = make_dispatcher(servers)
    pool = dispatcher.pool
    pool.set_endpoints(["http://a"])
    members, _ = membership(dispatcher, tmp_path)
    await members.start(timeout_s=5, stop=asyncio.Event())
    joining = asyncio.create_task(members.set(["http://a", "http://new"]))
    await asyncio.sleep(0.05)
    assert pool.vetting == {"http://new"} and "http://new" in pool.clients
    pool.load["http://a"] = 100  # even much busier, the server whose version is known takes the request
    assert await pool.pick(set(), policy_version=0) == "http://a"
    answer.set()
    await joining
    assert pool.vetting == set() and await pool.pick(set(), policy_version=0) == "http://new"
    await dispatcher.aclose()


async def test_a_server_whose_version_cannot_be_read_is_benched_and_read_when_it_answers(tmp_path, monkeypatch):
    reads: list[str] = []
    supported = versions.imitated_vllm()
    transports = {"http://a": reporting(supported, reads, "a"), "http://b": reporting("503", reads, "b")}
    dispatcher, _ = make_dispatcher(transports)
    pool = dispatcher.pool
    members, _ = membership(dispatcher, tmp_path)
    await members.start(timeout_s=5, stop=asyncio.Event())  # b answers 503: not refused, benched
    why = "GET /version: RolloutError: http://b/version: 503 Service Unavailable"
    assert list(pool.clients) == ["http://a"] and pool.benched == {"http://b": why}
    await members.rejoin_benched()
    assert "http://b" in pool.benched and reads == ["a", "b", "b"]  # still 503: still benched
    transports["http://b"] = reporting(supported, reads, "b")
    monkeypatch.setattr("rlrun.orchestrator.endpoints.REJOIN_EVERY_S", 0.0)
    await members.rejoin_benched()
    assert sorted(pool.clients) == ["http://a", "http://b"] and pool.benched == {} and pool.refused == {}
    await dispatcher.aclose()


async def test_the_override_admits_a_server_of_another_vllm_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(versions.ALLOW_ENV, "1")
    dispatcher, _ = make_dispatcher({"http://b": fake_vllm_transport(vllm_version="0.11.0")})
    members, _ = membership(dispatcher, tmp_path)
    with caplog.at_level(logging.WARNING, logger="rlrun.versions"):
        await members.start(timeout_s=5, stop=asyncio.Event())
    assert list(dispatcher.pool.clients) == ["http://b"] and dispatcher.pool.refused == {}
    assert "rollout server http://b serves vLLM 0.11.0" in caplog.text and "is set: going on" in caplog.text
    await dispatcher.aclose()
