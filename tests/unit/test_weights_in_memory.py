"""Weights in memory (issue 50, ``spec.weights.transport: collective``): the trainer's sender answers each send
request of the run directory with a round from the version it holds, or says why not (another version held; a
failed round, after which the server's engine is dropped and the next request opens a new one); the orchestrator's
weight update then verifies the server against what was sent, and on any failure — a refusal, no answer in time, a
digest that differs — warns, counts a fallback and reloads the same version from its files, verified against the
files: no server resumes unverified. Against the fake vLLM (:mod:`rlrun.rollout.fake`, which serves the directory it
reloaded last) and a fake engine for the sender (the real one: ``tests/integration/test_weight_transfer.py``)."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
import torch
from rlrun.api.spec import RLRunSpec
from rlrun.orchestrator import weight_transfer
from rlrun.orchestrator.follower import WeightFollower
from rlrun.orchestrator.prometheus import OrchestratorCollector
from rlrun.orchestrator.weight_transfer import TrainerTransfer, TransportUnsupported, check_routes
from rlrun.orchestrator.weights import push_weights
from rlrun.rollout.client import RolloutClient
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rollout.server import vllm_command
from rlrun.rundir import RunDir
from rlrun.training.weight_sender import WeightSender, held_copy
from rlrun.weight_requests import (
    SendRequest,
    Sent,
    TransferFailed,
    WeightLoad,
    read_result,
    stopped_marker,
    write_request,
)
from rlrun.weights_digest import Digest, files_digest, tensor_digest

from tests.support.manifests import parse
from tests.unit.test_verification import publish, write_weights

URL = "http://rollout-0"


def digest_of(state: dict[str, torch.Tensor]) -> Digest:
    return sum((tensor_digest(t) for t in state.values()), Digest())


class FakeEngine:
    """An engine of :mod:`rlrun.training.weight_sender`'s kind: sends by digesting, or fails as told."""

    def __init__(self, server: str, fail: bool) -> None:
        self.server, self.fail, self.closed, self.versions = server, fail, False, []

    def send(self, state, version):
        if self.fail:
            raise RuntimeError("gloo: Connection closed by peer")
        self.versions.append(version)
        return digest_of(state), sum(t.numel() * t.element_size() for t in state.values()), {"broadcast": 0.01}

    def shutdown(self):
        self.closed = True


def opener(failing: set[str] = frozenset()):
    engines: list[FakeEngine] = []

    def open_engine(server, state, timeout_s):
        engines.append(FakeEngine(server, server in failing))
        return engines[-1]

    return open_engine, engines


def answered(run_dir: RunDir, request: SendRequest, timeout_s: float = 10.0):
    write_request(run_dir, request)
    deadline = time.monotonic() + timeout_s
    while (result := read_result(run_dir, request.id)) is None:
        assert time.monotonic() < deadline, "the sender did not answer"
        time.sleep(0.01)
    return result


STATE = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}


def test_the_sender_answers_a_request_for_the_version_it_holds_with_what_it_sent_and_refuses_any_other(tmp_path):
    run_dir = RunDir(tmp_path)
    open_engine, engines = opener()
    sender = WeightSender(run_dir, timeout_s=5, open_engine=open_engine, poll_s=0.005).start()
    try:
        nothing = answered(run_dir, SendRequest(URL, 1))
        assert (nothing.ok, nothing.error) == (False, "version 1 not held; holds None")
        sender.hold(2, held_copy(STATE, torch.float32), 1)
        result = answered(run_dir, SendRequest(URL, 2))
        assert result.ok and result.version == 2 and result.error == ""
        assert Digest.from_json(result.sent_digest) == digest_of(STATE)
        assert result.bytes == 9 * 4 and "init" in result.seconds and "broadcast" in result.seconds
        stale = answered(run_dir, SendRequest(URL, 1))
        assert (stale.ok, stale.error) == (False, "version 1 not held; holds 2")
        again = answered(run_dir, SendRequest(URL, 2))
        assert again.ok and "init" not in again.seconds  # the server's engine is kept
        assert len(engines) == 1 and engines[0].versions == [2, 2]
    finally:
        sender.stop()
    assert engines[0].closed and stopped_marker(run_dir).is_file()


def test_a_failed_round_drops_the_servers_engine_and_the_next_request_opens_a_new_one(tmp_path):
    run_dir = RunDir(tmp_path)
    failing = {URL}
    open_engine, engines = opener(failing)
    sender = WeightSender(run_dir, timeout_s=5, open_engine=open_engine, poll_s=0.005).start()
    sender.hold(3, held_copy(STATE, torch.float32), 1)
    try:
        failed = answered(run_dir, SendRequest(URL, 3))
        assert not failed.ok and failed.error == "RuntimeError: gloo: Connection closed by peer"
        assert engines[0].closed and sender.engines == {}
        failing.clear()  # the server restarted: a new group
        assert answered(run_dir, SendRequest(URL, 3)).ok
        assert len(engines) == 2 and sender.engines == {URL: engines[1]}
    finally:
        sender.stop()


def test_what_the_trainer_holds_is_a_copy_in_the_served_dtype_not_its_live_parameters():
    live = {"w": torch.ones(4), "step": torch.tensor([3])}
    held = held_copy(live, torch.bfloat16)
    live["w"].add_(1.0)  # the next optimizer step
    assert held["w"].dtype == torch.bfloat16 and torch.equal(held["w"], torch.ones(4, dtype=torch.bfloat16))
    assert held["step"].dtype == live["step"].dtype


async def test_the_orchestrator_gets_what_the_trainer_sent_and_a_stopped_sender_fails_at_once(tmp_path):
    run_dir = RunDir(tmp_path)
    open_engine, _ = opener()
    sender = WeightSender(run_dir, timeout_s=5, open_engine=open_engine, poll_s=0.005).start()
    sender.hold(1, held_copy(STATE, torch.float32), 1)
    transfer = TrainerTransfer(run_dir, timeout_s=5, poll_s=0.005)
    try:
        sent = await transfer(URL, 1)
        assert sent.digest == digest_of(STATE) and sent.bytes == 36
        with pytest.raises(TransferFailed, match="the trainer did not send: version 2 not held; holds 1"):
            await transfer(URL, 2)
    finally:
        sender.stop()
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="weight sender has stopped"):
        await transfer(URL, 1)
    assert time.monotonic() - t0 < 1.0
    folder = tmp_path / "weight_transfer"
    assert list((folder / "requests").iterdir()) == [] and list((folder / "results").iterdir()) == []


async def test_no_answer_within_the_timeout_is_a_transfer_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_transfer, "MARGIN_S", 0.0)
    with pytest.raises(TransferFailed, match="no answer from the trainer within 0 s"):
        await TrainerTransfer(RunDir(tmp_path), timeout_s=0.1, poll_s=0.01)(URL, 1)


class Transfers:
    """Fake ``transfer(url, version)`` callables for the client, against the fake vLLM."""

    def __init__(self, client: RolloutClient, new) -> None:
        self.client, self.new, self.calls = client, new, 0

    def digest(self) -> Digest:
        return files_digest(self.new, torch.float32)

    async def moves(self, url, version):  # a round that works: the server then holds the new weights
        self.calls += 1
        await self.client.reload_weights(str(self.new))
        return Sent(self.digest(), 1234, {"broadcast": 0.1})

    async def refuses(self, url, version):
        self.calls += 1
        raise TransferFailed(f"the trainer did not send: version {version} not held; holds 0")

    async def moves_nothing(self, url, version):  # vLLM #57022: "ok", nothing loaded
        self.calls += 1
        return Sent(self.digest(), 1234, {})


@pytest.mark.parametrize("how", ["refuses", "moves_nothing", "times_out"])
async def test_any_failure_in_memory_falls_back_to_the_files_with_one_warning_and_is_verified(
    tmp_path, caplog, monkeypatch, how
):
    start, new = write_weights(tmp_path / "v0", seed=0), write_weights(tmp_path / "v1", seed=1)
    fake = fake_vllm_transport(weights=str(start))
    client = RolloutClient(URL, transport=fake)
    transfers = Transfers(client, new)
    if how == "times_out":
        monkeypatch.setattr(weight_transfer, "MARGIN_S", 0.0)
        transfer = TrainerTransfer(RunDir(tmp_path / "run"), timeout_s=0.05, poll_s=0.01)
    else:
        transfer = getattr(transfers, how)
    try:
        with caplog.at_level(logging.WARNING, logger="rlrun.rollout.weight_load"):
            push = await push_weights([client], new, 1, None, transfer)
    finally:
        await client.aclose()
    assert push.verified == [URL] and client.loaded_version == 1 and fake.counts.version == "1"
    load = push.loads[URL]
    assert load.path == "filesystem" and load.fallback and load.bytes == sum(f.stat().st_size for f in new.iterdir())
    [warning] = [r.getMessage() for r in caplog.records if r.name == "rlrun.rollout.weight_load"]
    assert warning.startswith(f"rollout server {URL}: policy 1 in memory failed (") and "from the files" in warning
    if how == "moves_nothing":  # the digest caught it: the server held the old weights
        assert "it serves other weights" in load.fallback


async def test_a_round_in_memory_that_moved_the_weights_counts_without_touching_the_files(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    start = write_weights(tmp_path / "v0", seed=0)
    new = publish(run_dir, 1, seed=1)
    fake = fake_vllm_transport(weights=str(start))
    client = RolloutClient(URL, transport=fake)
    transfers = Transfers(client, new)
    follower = WeightFollower(run_dir, 1, None, transfer=transfers.moves)
    try:
        push = await follower.follow([client])
    finally:
        await client.aclose()
    assert push.verified == [URL] and client.loaded_version == 1 and transfers.calls == 1
    assert push.loads[URL].path == "collective" and push.loads[URL].fallback is None
    line = follower.transfers.line()
    assert line["collective"]["updates"] == 1 and line["collective"]["bytes"] == 1234
    assert line["filesystem"]["updates"] == 0 and line["fallbacks"] == 0


async def test_a_catch_up_reloads_the_files_whatever_the_transport(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    start = write_weights(tmp_path / "v0", seed=0)
    new = publish(run_dir, 1, seed=1)
    client = RolloutClient(URL, transport=fake_vllm_transport(weights=str(start)))
    transfers = Transfers(client, new)
    follower = WeightFollower(run_dir, 1, None, transfer=transfers.refuses)
    follower.version = 1
    try:
        await follower.catch_up([client])
    finally:
        await client.aclose()
    assert transfers.calls == 0 and follower.transfers.line()["filesystem"]["updates"] == 1


def test_the_prometheus_series_by_path_count_both_paths_and_the_fallbacks():
    totals = weight_transfer.TransferTotals()
    totals.add(WeightLoad("collective", 0.5, 100))
    totals.add(WeightLoad("filesystem", 1.5, 300, fallback="no answer"))

    class Anything:  # every other field of the view
        def __getattr__(self, name):
            return Anything()

        def __call__(self, *args):
            return Anything()

    view = Anything()
    view.weight_transfer = totals.line()
    collector = OrchestratorCollector(lambda: view)
    values = {k: v for k, v in collector.values().items() if k.startswith("rlrun_weight_transfer")}
    assert values == {
        "rlrun_weight_transfer_seconds": {"filesystem": 1.5, "collective": 0.5},
        "rlrun_weight_transfer_bytes": {"filesystem": 300, "collective": 100},
        "rlrun_weight_transfer_updates": {"filesystem": 1, "collective": 1},
        "rlrun_weight_transfer_fallbacks": 1,
    }


async def test_servers_without_vllms_weight_transfer_routes_are_refused_at_start_naming_the_setting():
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "dev":
            return httpx.Response(200, json={"world_size": 1})
        return httpx.Response(404, json={"detail": "Not Found"})

    transport = httpx.MockTransport(answer)
    await check_routes(["http://dev"], transport)
    with pytest.raises(TransportUnsupported) as info:
        await check_routes(["http://dev", "http://plain"], transport)
    assert str(info.value).startswith(
        "spec.weights.transport is collective but http://plain answered GET /get_world_size with 404"
    )
    assert "\n" not in str(info.value) and info.value.permanent


def test_a_collective_run_serves_with_rlruns_engine_and_the_default_does_not():
    spec: RLRunSpec = parse(weights={"transport": "collective"}).spec
    argv = vllm_command(spec, "/m", "127.0.0.1", 8000, gpu=False)
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "rlrun_gloo"}'
    assert "--weight-transfer-config" not in vllm_command(parse().spec, "/m", "127.0.0.1", 8000, gpu=False)
