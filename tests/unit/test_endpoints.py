"""Rollout servers: a server gets a request only while it holds the current weights and is not reloading; one that
leaves (removed, benched) loses its requests at once, asked again elsewhere and not counted as retries."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
import torch
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
