"""A LoRA run's sync (issue 40): each policy version reaches a rollout server as adapter ``policy-vN-<token>``
(a name never used before: issue 47) with no pause; a request names the newest adapter its server holds (≥ the
version it is labelled with); an old adapter is unloaded only once no request naming it is out, and its
broadcast kept until then; a server that lost its adapters (it restarted) gets no request above policy 0 until
it is caught up. Against the fake vLLM (:mod:`rlrun.rollout.fake`), which answers the adapter routes and an
unknown adapter as vLLM 0.32 does."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil

import httpx
import pytest
from rlrun.adapter_format import adapter_signature
from rlrun.api.spec import SamplingSpec
from rlrun.orchestrator.endpoints import EndpointMembership
from rlrun.orchestrator.follower import WeightFollower
from rlrun.orchestrator.groups import GroupRequest
from rlrun.orchestrator.weights import AdapterReference, push_weights
from rlrun.rollout.adapters import AdapterRegistry, new_adapter_name
from rlrun.rollout.client import Expected, RolloutClient, RolloutError, WeightsUnverified
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir

from tests.support.adapters import BASE, LORA, publish_adapter, write_adapter
from tests.support.dispatcher import drain, make_dispatcher
from tests.support.samples import task

PROMPT = [5, 6, 7, 1]
REFERENCE = AdapterReference(LORA, adapter_signature(BASE, LORA))


class Server(httpx.AsyncBaseTransport):
    """The fake vLLM, recording every path asked and the model each completion names as it arrives (:attr:`arrived`),
    holding each completion while :attr:`gate` is clear (the fake records it in ``counts.served`` once let through)."""

    def __init__(self) -> None:
        self.inner = fake_vllm_transport(error_rate=0.0)
        self.counts = self.inner.counts
        self.paths: list[str] = []
        self.arrived: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_unloads = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if request.url.path == "/v1/completions":
            self.arrived.append(json.loads(request.content)["model"])
            await self.gate.wait()
        if request.url.path == "/v1/unload_lora_adapter" and self.fail_unloads:
            return httpx.Response(500, text="boom")
        return await self.inner.handle_async_request(request)


async def until(condition, what: str, timeout_s: float = 5.0) -> None:
    """Return once ``condition()`` holds (looked at after every other task ran); fail after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0)


def stems(names) -> list[str]:
    """The adapter names without their token (``policy-v2-1a2b3c4d`` → ``policy-v2``), in order."""
    return [re.sub(r"-[0-9a-f]{8}$", "", n) for n in names]


async def settled(client: RolloutClient) -> None:
    """Once the client's background unloads are done."""
    await until(lambda: not client._unloads, "the unloads done")


def test_the_registry_names_the_newest_and_releases_an_old_adapter_after_its_last_request():
    reg = AdapterRegistry()
    assert reg.name() == "policy" and re.fullmatch(r"policy-v3-[0-9a-f]{8}", new_adapter_name(3))
    assert new_adapter_name(3) != new_adapter_name(3)  # never the same name twice
    assert reg.loaded(1, "/b/1", "a1") == []
    reg.sent("a1")
    reg.sent("a1")
    assert reg.loaded(2, "/b/2", "a2") == [] and reg.name() == "a2"  # two requests still name v1
    assert reg.answered("a1") == [] and reg.held == {1: "/b/1", 2: "/b/2"}
    assert reg.answered("a1") == ["a1"] and reg.held == {2: "/b/2"}
    reg.sent("a2")
    assert reg.answered("a2") == []  # the newest is never released
    assert reg.loaded(4, "/b/4", "a4") == ["a2"] and reg.newest == 4
    reg.sent("a4")  # version 4 loaded again (a catch-up) under a new name: the old one goes after its last
    assert reg.loaded(4, "/b/4", "a4b") == [] and reg.name() == "a4b"
    assert reg.answered("a4") == ["a4"] and reg.names == {4: "a4b"}


async def test_an_update_loads_the_adapter_with_no_pause_and_requests_name_the_newest(tmp_path):
    server = Server()
    client = RolloutClient("http://s", transport=server)
    try:
        await client.complete(PROMPT, SamplingSpec())
        assert await client.update_adapter(str(write_adapter(tmp_path / "1")), 1)
        await client.complete(PROMPT, SamplingSpec())
        assert await client.update_adapter(str(write_adapter(tmp_path / "2")), 2)
        await client.complete(PROMPT, SamplingSpec())
        assert not await client.update_adapter(str(tmp_path / "1"), 1)  # a late catch-up never goes back
        await settled(client)
    finally:
        await client.aclose()
    assert stems(server.counts.served) == ["policy", "policy-v1", "policy-v2"]
    assert client.loaded_version == 2 and server.counts.version == "2"
    assert list(server.counts.adapters.values()) == [str(tmp_path / "2")]
    assert stems(server.counts.adapters) == ["policy-v2"] and stems(server.counts.unloaded) == ["policy-v1"]
    # no reload window: nothing paused, reloaded or reset (the one RPC asks for the loaded adapter's digest)
    assert not {"/pause", "/resume", "/reset_prefix_cache"} & set(server.paths)


async def test_a_request_out_finishes_on_its_adapter_which_is_unloaded_only_after_it_answers(tmp_path):
    server = Server()
    client = RolloutClient("http://s", transport=server, drain_s=30.0)
    try:
        await client.update_adapter(str(write_adapter(tmp_path / "1")), 1)
        server.gate.clear()
        out = asyncio.ensure_future(client.complete(PROMPT, SamplingSpec()))
        await until(lambda: stems(server.arrived) == ["policy-v1"], "a request naming policy-v1")
        # the update neither waits for it (drain_s 30 s) nor unloads its adapter
        await asyncio.wait_for(client.update_adapter(str(write_adapter(tmp_path / "2")), 2), 1.0)
        assert not client.reloading and stems(server.counts.adapters) == ["policy-v1", "policy-v2"]
        second = asyncio.ensure_future(client.complete(PROMPT, SamplingSpec()))
        await until(lambda: len(server.arrived) == 2, "a second request")
        assert stems(server.arrived) == ["policy-v1", "policy-v2"] and server.counts.unloaded == []
        server.gate.set()
        await out
        await second
        await settled(client)
    finally:
        await client.aclose()
    assert stems(server.counts.unloaded) == ["policy-v1"] and stems(server.counts.adapters) == ["policy-v2"]
    assert client.adapters.held == {2: str(tmp_path / "2")} and not client.adapters.out


async def test_an_unload_that_fails_is_logged_and_the_completion_stands(tmp_path, caplog):
    server = Server()
    server.fail_unloads = True
    client = RolloutClient("http://s", transport=server)
    try:
        await client.update_adapter(str(write_adapter(tmp_path / "1")), 1)
        server.gate.clear()
        out = asyncio.ensure_future(client.complete(PROMPT, SamplingSpec()))
        await until(lambda: server.arrived, "a request")
        await client.update_adapter(str(write_adapter(tmp_path / "2")), 2)
        server.gate.set()
        with caplog.at_level(logging.WARNING, logger="rlrun.rollout.client"):
            [completion] = await out
            await settled(client)
    finally:
        await client.aclose()
    assert completion.token_ids == [7, 6, 5, 0]
    assert "unloading adapter policy-v1-" in caplog.text and client.adapters.held.keys() == {2}


async def test_a_server_that_lost_its_adapters_drops_to_policy_0_until_the_catch_up_loads_the_adapter_again(tmp_path):
    """A restart on the same address: the client's 404 for its adapter resets it, and the orchestrator's periodic
    look (:meth:`EndpointMembership.catch_up_lagging`) gives it the current adapter from the broadcast."""
    server = Server()
    dispatcher, results = make_dispatcher({"http://s": server}, members_per_request=4)
    run_dir = RunDir(tmp_path)
    publish_adapter(run_dir, 3, attempt=0)
    follower = WeightFollower(run_dir, 0, REFERENCE)
    assert await follower.follow(list(dispatcher.pool.clients.values())) is not None
    client = dispatcher.pool.clients["http://s"]
    assert client.loaded_version == 3 and stems(server.counts.adapters) == ["policy-v3"]
    server.counts.adapters.clear()  # the server restarted: its adapters are gone
    with pytest.raises(RolloutError, match="404"):
        await client.complete(PROMPT, SamplingSpec())
    assert client.loaded_version == 0 and client.adapters.held == {}
    members = EndpointMembership()
    members.bind(dispatcher.pool, dispatcher.lose_on, follower, lambda lost: None, lambda: None)
    await members.catch_up_lagging()
    assert client.loaded_version == 3 and stems(server.counts.adapters) == ["policy-v3"]
    assert list(server.counts.adapters.values()) == [str(run_dir.broadcast(3))]
    dispatcher.dispatch(GroupRequest(1, task(1), members=4), policy_version=3)
    [result] = await drain(results, 1)
    assert result.error is None and stems(server.counts.served)[-1] == "policy-v3"
    await dispatcher.aclose()


async def test_a_request_labelled_v_names_an_adapter_of_v_or_newer(tmp_path):
    """The version rule: the dispatcher sends a request labelled ``v`` only to a server holding ``v`` or newer, and
    the request names the newest adapter that server holds."""
    servers = {"http://old": Server(), "http://new": Server()}
    dispatcher, results = make_dispatcher(servers, members_per_request=1)
    for url, versions in (("http://old", [1]), ("http://new", [1, 2])):
        for v in versions:
            await dispatcher.pool.clients[url].update_adapter(str(write_adapter(tmp_path / str(v))), v)
    dispatcher.dispatch(GroupRequest(1, task(1), members=4), policy_version=2)
    dispatcher.dispatch(GroupRequest(2, task(2), members=4), policy_version=1)
    got = await drain(results, 8)
    await dispatcher.aclose()
    assert all(r.error is None for r in got)
    by_label = {r.request.group_id: {e.policy_version for e in r.episodes} for r in got}
    assert by_label == {1: {2}, 2: {1}}  # the label is the dispatch version, not the adapter's
    old, new = servers["http://old"].counts.served, servers["http://new"].counts.served
    # a request labelled 1 on the new server gets v2: newer
    assert set(stems(old)) <= {"policy-v1"} and set(stems(new)) == {"policy-v2"}
    assert len(old) + len(new) == 8 and len(new) >= 4  # every request labelled 2 went to the server holding 2


async def test_the_follower_loads_each_broadcast_as_an_adapter_and_prunes_only_those_no_server_holds(tmp_path):
    server = Server()
    client = RolloutClient("http://s", transport=server)
    run_dir = RunDir(tmp_path)
    follower = WeightFollower(run_dir, 0, REFERENCE)
    try:
        assert await follower.begin([client], None, "unused") == {}  # policy 0 is the base: nothing to load
        assert server.paths == []
        publish_adapter(run_dir, 1, attempt=0)
        await follower.follow([client])
        server.gate.clear()
        out = asyncio.ensure_future(client.complete(PROMPT, SamplingSpec()))  # names policy-v1
        await until(lambda: server.arrived, "a request")
        publish_adapter(run_dir, 2, attempt=0)
        await follower.follow([client])
        assert run_dir.broadcast(1).is_dir()  # policy-v1 still serves a request: vLLM may reload it from there
        server.gate.set()
        await out
        await settled(client)
        publish_adapter(run_dir, 3, attempt=0)
        await follower.follow([client])
    finally:
        await client.aclose()
    assert follower.version == 3 and stems(server.counts.served) == ["policy-v1"]
    assert sorted(p.name for p in run_dir.broadcasts.iterdir()) == ["step_3"]
    assert stems(server.counts.unloaded) == ["policy-v1", "policy-v2"]


async def test_an_adapter_that_does_not_fit_is_refused_before_any_server_is_touched(tmp_path):
    server = Server()
    client = RolloutClient("http://s", transport=server)
    try:
        with pytest.raises(Exception, match="r is 4"):
            await push_weights([client], write_adapter(tmp_path / "r4", r=4), 1, REFERENCE)
    finally:
        await client.aclose()
    assert server.paths == [] and client.loaded_version == 0


async def test_an_adapter_version_is_read_from_disk_once_and_its_directory_may_go_meanwhile(tmp_path):
    """Issue 47: loaded with ``load_inplace``, vLLM 0.32 read the adapter again at every engine step (40 reads
    for 20 completions of 2 tokens) and died when its directory went. Now each version is a name the server
    never had, loaded without ``load_inplace``: one read per load, however many completions, and a deleted or
    re-published broadcast never reaches the server mid-generation (the fake reads an in-place adapter at each
    completion, as vLLM)."""
    server = Server()
    client = RolloutClient("http://s", transport=server)
    adapter = write_adapter(tmp_path / "1")
    try:
        await client.update_adapter(str(adapter), 1)
        for _ in range(20):
            await client.complete(PROMPT, SamplingSpec(max_tokens=2))
        reads = server.counts.adapter_reads
        write_adapter(adapter)  # re-published in place (other A), then gone
        shutil.rmtree(adapter)
        answers = [await client.complete(PROMPT, SamplingSpec(max_tokens=2)) for _ in range(5)]
    finally:
        await client.aclose()
    assert reads == 1 and server.counts.adapter_reads == 1 and server.counts.adapter_loads == 1
    assert len(answers) == 5 and not server.counts.inplace
    assert stems(server.counts.served) == ["policy-v1"] * 25


async def test_an_adapter_that_is_not_the_published_one_is_unloaded_and_the_previous_one_serves(tmp_path):
    """The adapter the workers hold is checked against the published files (``rlrun_adapter_digest``): one
    that differs does not count — it is unloaded, the update raises, and requests keep naming the adapter
    before it."""
    server = Server()
    client = RolloutClient("http://s", transport=server)
    try:
        await client.update_adapter(str(write_adapter(tmp_path / "1")), 1)
        first = client.adapters.name()
        other = Expected(write_adapter(tmp_path / "other"), adapter=True)  # what the trainer published, say
        with pytest.raises(WeightsUnverified, match=r"adapter policy-v2-\w+ loaded from .* is not the"):
            await client.update_adapter(str(write_adapter(tmp_path / "2")), 2, other)
        await client.complete(PROMPT, SamplingSpec())
        await settled(client)
    finally:
        await client.aclose()
    assert client.loaded_version == 1 and client.adapters.name() == first and server.counts.version == "1"
    assert list(server.counts.adapters) == [first] and stems(server.counts.unloaded) == ["policy-v2"]
    assert server.counts.served == [first]
