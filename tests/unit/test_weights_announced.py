"""The broadcast off the servers' critical path (issue 50, part 5; ``spec.weights.transport: collective``):
the trainer's sender announces the version it holds before the trainer writes its broadcast, and the
orchestrator sends it to the servers from then on, checked against the model from the announcement; a server
whose send fails waits for the files before it reloads them, and files that never come leave it unverified,
never serving. Against the fake vLLM (:mod:`rlrun.rollout.fake`) and fake sends
(:class:`tests.unit.test_weights_in_memory.Transfers`)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rlrun.errors import WeightsMismatch
from rlrun.orchestrator.follower import WeightFollower
from rlrun.orchestrator.weights import weights_signature
from rlrun.probes import ProbeSequence
from rlrun.rollout import weight_load
from rlrun.rollout.client import RolloutClient
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir
from rlrun.training.weight_sender import WeightSender, held_copy
from rlrun.weight_requests import SendRequest, announce, read_announced
from safetensors.torch import load_file

from tests.unit.test_verification import publish, write_weights
from tests.unit.test_weights_in_memory import STATE, URL, Transfers, answered, opener

PROBE = [ProbeSequence([3, 4, 9], [None, None, -0.7])]


def signature_of(directory) -> dict:
    state = load_file(str(directory / "model.safetensors"))
    return {n: (str(t.dtype), tuple(t.shape)) for n, t in state.items()}


def test_the_sender_announces_the_version_it_holds_and_counts_its_sends(tmp_path):
    run_dir = RunDir(tmp_path)
    open_engine, _ = opener()
    sender = WeightSender(run_dir, timeout_s=5, open_engine=open_engine, poll_s=0.005).start()
    try:
        assert read_announced(run_dir) is None
        sender.hold(4, held_copy(STATE, torch.bfloat16), 2, PROBE)
        announced = read_announced(run_dir)
        assert (announced.version, announced.attempt, announced.probe) == (4, 2, PROBE)
        assert announced.signature == {"w": ("torch.bfloat16", (2, 3)), "b": ("torch.bfloat16", (3,))}
        assert answered(run_dir, SendRequest(URL, 4)).ok and not answered(run_dir, SendRequest(URL, 3)).ok
    finally:
        sender.stop()
    assert sender.totals["sends"] == 1 and sender.totals["bytes"] == 9 * 2 and sender.totals["failures"] == 0
    assert sender.totals["seconds"] > 0


@pytest.fixture
async def server(tmp_path):
    start = write_weights(tmp_path / "v0", seed=0)
    client = RolloutClient(URL, transport=fake_vllm_transport(weights=str(start)))
    yield client
    await client.aclose()


async def test_an_announced_version_is_sent_before_its_broadcast_is_written(tmp_path, server):
    run_dir = RunDir(tmp_path / "run")
    new = write_weights(tmp_path / "v1", seed=1)  # what the trainer holds; no broadcast yet
    transfers = Transfers(server, new)
    follower = WeightFollower(run_dir, 1, weights_signature(new), transfer=transfers.moves)
    announce(run_dir, 1, 1, signature_of(new), PROBE)
    push = await follower.follow([server])
    assert push.verified == [URL] and server.loaded_version == 1 and follower.version == 1
    assert push.loads[URL].path == "collective" and not run_dir.broadcast(1).exists()
    assert await follower.follow([server]) is None  # its broadcast, once written, is that version
    publish(run_dir, 1, seed=1)
    assert await follower.follow([server]) is None and transfers.calls == 1


async def test_an_announcement_of_another_attempt_or_an_older_version_is_not_followed(tmp_path, server):
    run_dir = RunDir(tmp_path / "run")
    new = write_weights(tmp_path / "v1", seed=1)
    transfers = Transfers(server, new)
    follower = WeightFollower(run_dir, 2, None, transfer=transfers.moves)
    announce(run_dir, 5, 1, signature_of(new), None)  # a dead attempt's trainer
    assert await follower.follow([server]) is None
    follower.version = 5
    announce(run_dir, 5, 2, signature_of(new), None)
    assert await follower.follow([server]) is None and transfers.calls == 0
    assert WeightFollower(run_dir, 2, None).announced() is None  # the file system's follower never reads it


async def test_an_announced_version_that_does_not_fit_the_model_touches_no_server(tmp_path, server):
    run_dir = RunDir(tmp_path / "run")
    new = write_weights(tmp_path / "v1", seed=1)
    transfers = Transfers(server, new)
    follower = WeightFollower(run_dir, 1, weights_signature(new), transfer=transfers.moves)
    wrong = {**signature_of(new), "q": ("torch.float32", (4, 8))}
    announce(run_dir, 1, 1, wrong, None)
    why = r"policy 1 as the trainer announced it: .*q: \('F32', \(4, 8\)\)"
    with pytest.raises(WeightsMismatch, match=why):
        await follower.follow([server])
    assert transfers.calls == 0 and server.loaded_version == 0


async def test_a_failed_send_waits_for_the_broadcast_then_reloads_it(tmp_path, server):
    run_dir = RunDir(tmp_path / "run")
    new = write_weights(tmp_path / "v1", seed=1)
    follower = WeightFollower(run_dir, 1, None, transfer=Transfers(server, new).refuses)
    announce(run_dir, 1, 1, signature_of(new), None)

    async def trainer_writes_the_files():
        await asyncio.sleep(0.3)
        await asyncio.to_thread(publish, run_dir, 1, 1)

    writing = asyncio.create_task(trainer_writes_the_files())
    push = await follower.follow([server])
    await writing
    assert push.verified == [URL] and server.loaded_version == 1
    assert push.loads[URL].path == "filesystem" and "not held" in push.loads[URL].fallback


async def test_a_send_whose_files_never_come_leaves_the_server_unverified(tmp_path, server, monkeypatch):
    monkeypatch.setattr(weight_load, "FILES_WAIT_S", 0.2)
    run_dir = RunDir(tmp_path / "run")
    new = write_weights(tmp_path / "v1", seed=1)
    follower = WeightFollower(run_dir, 1, None, transfer=Transfers(server, new).refuses)
    announce(run_dir, 1, 1, signature_of(new), None)  # then the trainer died
    push = await follower.follow([server])
    assert push.verified == [] and server.loaded_version < 0
    assert f"broadcast {run_dir.broadcast(1)} was not written within 0 s" in push.unverified[URL]
    # no files: nothing to catch up to, and the server still serves nothing
    assert await follower.catch_up([server]) == {} and server.loaded_version < 0
