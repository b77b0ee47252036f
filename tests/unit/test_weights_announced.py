"""The broadcast off the servers' critical path (issue 50, part 5; ``spec.weights.transport: collective``):
the trainer's sender announces the version it holds before the trainer writes its broadcast, and the
orchestrator sends it to the servers from then on, checked against the model from the announcement; a server
whose send fails waits for the files before it reloads them, and files that never come leave it unverified,
never serving. Against the fake vLLM (:mod:`rlrun.rollout.fake`) and fake sends
(:class:`tests.unit.test_weights_in_memory.Transfers`)."""

from __future__ import annotations

import time

import pytest
import torch
from rlrun.errors import WeightsMismatch
from rlrun.orchestrator import weight_transfer
from rlrun.orchestrator.follower import WeightFollower
from rlrun.orchestrator.weight_transfer import SenderWatch, TrainerTransfer
from rlrun.orchestrator.weights import weights_signature
from rlrun.probes import ProbeSequence
from rlrun.rollout.client import RolloutClient
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir, publish_broadcast, write_meta
from rlrun.training.weight_sender import WeightSender, held_copy
from rlrun.weight_requests import SendRequest, TransferFailed, announce, beat, read_announced
from safetensors.torch import load_file

from tests.unit.test_verification import publish, write_weights
from tests.unit.test_weights_in_memory import STATE, URL, Transfers, answered, opener

PROBE = [ProbeSequence([3, 4, 9], [None, None, -0.7])]


def signature_of(directory) -> dict:
    state = load_file(str(directory / "model.safetensors"))
    return {n: (str(t.dtype), tuple(t.shape)) for n, t in state.items()}


def publish_by(run_dir: RunDir, version: int, seed: int, sender: str):
    """``broadcasts/step_<version>/`` as the trainer writes one it announced: its meta names the sender."""

    def fill(tmp):
        write_weights(tmp, seed)
        write_meta(tmp, version, 1, sender=sender)

    return publish_broadcast(run_dir.broadcast(version), fill, 1)[0]


def test_the_sender_announces_the_version_it_holds_and_counts_its_sends(tmp_path):
    run_dir = RunDir(tmp_path)
    open_engine, _ = opener()
    sender = WeightSender(run_dir, timeout_s=5, open_engine=open_engine, poll_s=0.005).start()
    try:
        assert read_announced(run_dir) is None
        sender.hold(4, held_copy(STATE, torch.bfloat16), 2, PROBE)
        announced = read_announced(run_dir)
        assert (announced.version, announced.attempt, announced.probe) == (4, 2, PROBE)
        assert announced.sender == sender.id
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
    announce(run_dir, 1, 1, "sender-a", signature_of(new), PROBE)
    push = await follower.follow([server])
    assert push.verified == [URL] and server.loaded_version == 1 and follower.version == 1
    assert push.loads[URL].path == "collective" and not run_dir.broadcast(1).exists()
    assert await follower.follow([server]) is None  # its broadcast, once written, is that version
    publish_by(run_dir, 1, 1, "sender-a")
    assert await follower.follow([server]) is None and transfers.calls == 1


async def test_an_announcement_of_another_attempt_or_an_older_version_is_not_followed(tmp_path, server):
    run_dir = RunDir(tmp_path / "run")
    new = write_weights(tmp_path / "v1", seed=1)
    transfers = Transfers(server, new)
    follower = WeightFollower(run_dir, 2, None, transfer=transfers.moves)
    announce(run_dir, 5, 1, "sender-a", signature_of(new), None)  # a dead attempt's trainer
    assert await follower.follow([server]) is None
    follower.version = 5
    announce(run_dir, 5, 2, "sender-b", signature_of(new), None)
    assert await follower.follow([server]) is None and transfers.calls == 0
    assert WeightFollower(run_dir, 2, None).announced() is None  # the file system's follower never reads it


async def test_an_announced_version_that_does_not_fit_the_model_touches_no_server(tmp_path, server):
    run_dir = RunDir(tmp_path / "run")
    new = write_weights(tmp_path / "v1", seed=1)
    transfers = Transfers(server, new)
    follower = WeightFollower(run_dir, 1, weights_signature(new), transfer=transfers.moves)
    wrong = {**signature_of(new), "q": ("torch.float32", (4, 8))}
    announce(run_dir, 1, 1, "sender-a", wrong, None)
    why = r"policy 1 as the trainer announced it: .*q: \('F32', \(4, 8\)\)"
    with pytest.raises(WeightsMismatch, match=why):
        await follower.follow([server])
    assert transfers.calls == 0 and server.loaded_version == 0


async def test_a_send_failed_before_the_files_are_written_benches_the_server_until_they_are(tmp_path, server):
    """No wait inside the pause: the server resumes serving nothing, is benched, and its catch-up reloads the
    files once the trainer has written them."""
    run_dir = RunDir(tmp_path / "run")
    new = write_weights(tmp_path / "v1", seed=1)
    follower = WeightFollower(run_dir, 1, None, transfer=Transfers(server, new).refuses)
    announce(run_dir, 1, 1, "sender-a", signature_of(new), None)
    push = await follower.follow([server])
    assert push.verified == [] and server.loaded_version < 0 and follower.version == 1
    assert "before its files were written" in push.unreachable[URL] and "not held" in push.unreachable[URL]
    assert await follower.catch_up([server]) == {URL: "policy 1's files are not written yet"}
    publish(run_dir, 1, seed=1)  # the trainer's write ends
    assert await follower.catch_up([server]) == {} and server.loaded_version == 1


@pytest.mark.parametrize("writer", ["sender-a", "sender-b"])
async def test_a_version_sent_ahead_and_then_written_by_a_restarted_trainer_is_reloaded_from_its_files(
    tmp_path, server, writer
):
    """The trainer died between announcing policy 1 and writing it; the one restarted in its place retrained
    it and wrote its own: the servers sent the first are benched and caught up from the files. Written by the
    sender that announced it: nothing to do, and the older broadcasts go only once the newest is written."""
    run_dir = RunDir(tmp_path / "run")
    new = write_weights(tmp_path / "v1", seed=1)
    publish_by(run_dir, 0, 0, "sender-a")
    follower = WeightFollower(run_dir, 1, None, transfer=Transfers(server, new).moves)
    announce(run_dir, 1, 1, "sender-a", signature_of(new), None)
    assert (await follower.follow([server])).loads[URL].path == "collective"
    assert run_dir.broadcast(0).is_dir()  # the newest is not written yet: the older one stays
    assert await follower.follow([server]) is None
    publish_by(run_dir, 1, 2 if writer == "sender-b" else 1, writer)
    again = await follower.follow([server])
    if writer == "sender-a":
        assert again is None and not run_dir.broadcast(0).exists()  # the newest written: the older one goes
        return
    assert "restarted" in again.unreachable[URL] and again.verified == []
    assert await follower.follow([server]) is None  # said once
    assert await follower.catch_up([server]) == {} and server.loaded_version == 1


async def test_a_gone_senders_announcement_is_not_followed_and_a_request_to_it_fails_fast(tmp_path, server):
    """A killed trainer leaves no stopped marker: its heartbeat stops. The servers keep the policy they hold
    rather than pause for a send nobody will make, and a request already out fails once the beat is silent."""
    run_dir = RunDir(tmp_path / "run")
    new = write_weights(tmp_path / "v1", seed=1)
    transfer = TrainerTransfer(run_dir, timeout_s=60, poll_s=0.01)
    transfer.sender.silent_s = 0.3
    follower = WeightFollower(run_dir, 1, None, transfer=transfer, sender=transfer.sender)
    announce(run_dir, 1, 1, "sender-a", signature_of(new), None)
    beat(run_dir, "sender-a", 7)  # the last beat of a trainer killed since
    assert await follower.follow([server]) is None and server.loaded_version == 0
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="weight sender is gone"):
        await transfer(URL, 1)
    assert time.monotonic() - t0 < 5


def test_a_running_sender_beats_and_is_seen_alive(tmp_path):
    run_dir = RunDir(tmp_path)
    sender = WeightSender(run_dir, timeout_s=5, open_engine=opener()[0], poll_s=0.005).start()
    watch = SenderWatch(run_dir)
    try:
        deadline = time.monotonic() + 10
        while not watch.alive():
            assert time.monotonic() < deadline, "no beat seen to change"
            time.sleep(0.2)
    finally:
        sender.stop()


async def test_a_version_that_reached_no_server_and_has_no_files_sends_the_servers_back_to_the_one_before(
    tmp_path, server
):
    """Its trainer died while sending: rather than bench every server on a version nothing can give them, they
    reload the previous version's files and the follower stays at it."""
    run_dir = RunDir(tmp_path / "run")
    new = write_weights(tmp_path / "v2", seed=2)
    publish_by(run_dir, 1, 1, "sender-a")
    follower = WeightFollower(run_dir, 1, None, transfer=Transfers(server, new).refuses)
    assert (await follower.follow([server])).verified == [URL] and server.loaded_version == 1
    announce(run_dir, 2, 1, "sender-a", signature_of(new), None)
    back = await follower.follow([server])
    assert back.verified == [URL] and back.loads[URL].path == "filesystem"
    assert server.loaded_version == 1 and follower.version == 1
    # with no server in use (all benched) there is nothing to send back: the version moves, as before
    assert (await follower.follow([])).verified == [] and follower.version == 2
    assert await follower.follow([]) is None


def test_a_beat_seen_after_a_long_gap_is_dated_at_the_look_before_it(tmp_path, monkeypatch):
    """Looks may be a training step apart: a sender whose last beats came after the previous look but that has
    been dead for long is not taken for alive; one beating is, at the next look."""
    run_dir, now = RunDir(tmp_path), [0.0]
    monkeypatch.setattr(weight_transfer.time, "monotonic", lambda: now[0])
    watch = SenderWatch(run_dir, silent_s=15)
    beat(run_dir, "sender-a", 1)
    assert not watch.alive()  # first look: no change seen yet
    beat(run_dir, "sender-a", 2)  # its last beat, then it died
    now[0] = 40.0
    assert not watch.alive()
    now[0] = 41.0
    assert not watch.alive()
    beat(run_dir, "sender-b", 0)  # a restarted trainer's sender, its count from 0 again
    now[0] = 41.5
    assert watch.alive()
