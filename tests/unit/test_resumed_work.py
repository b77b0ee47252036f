"""What a resume puts back is trained (issue 35): the saved groups of a pause whatever the policy the trainer's
checkpoint restores, every task the journal replay moves the cursor past, the trainer's save on notice paired
with the pause snapshot when SIGTERM reaches both, and the weights a restarted trainer resumed from made available
to the followers. The real Orchestrator with fake rollout endpoints, the fake trainer or (last test) the real one."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading

import pytest
from rlrun.checkpoint import latest_complete_checkpoint, load_orchestrator_progress
from rlrun.envs import ReverseTextEnv
from rlrun.ledger import check_ledger, has_stopped, read_ledger
from rlrun.orchestrator.episodes import tokenizer_codec
from rlrun.orchestrator.liveness import stall_accounting
from rlrun.orchestrator.snapshot import unpack
from rlrun.orchestrator.source import TrainSource
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir
from rlrun.samples import episode_id
from rlrun.training.fake import start_fake_trainer
from rlrun.training.parts import republish
from rlrun.training.trainer import Trainer
from transformers import AutoTokenizer

from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator
from tests.support.polling import wait_for_async

SEEDS = range(3)


def spec(seed: int = 0, max_steps: int = 12):
    return parse(
        "resumed",
        group_size=4,
        batch_size=8,
        max_off_policy_steps=2,
        max_steps=max_steps,
        seed=seed,
        checkpoint={"interval": 4, "keep_last": 3},
        rollout={"members_per_request": 2, "max_inflight": 64},
    ).spec


def attempt_events(run_dir: RunDir, attempt: int) -> list[dict]:
    return read_ledger(run_dir.root / "ledger").get((attempt, "orchestrator"), [])


def saved_groups(run_dir: RunDir, step: int) -> set[int]:
    """The groups a checkpoint's snapshot keeps: queued samples', open groups, requested (emitted or waiting)."""
    state = load_orchestrator_progress(run_dir, step)
    snap = unpack(state["sink"], state["tensors"])
    requested = [*snap.emitted_train_groups, *(r for r in state["source"]["resume_requests"])]
    return (
        {s.trace.group_id for s in snap.pending_batch}
        | {g for g, _, _ in snap.open_groups}
        | {r.group_id if hasattr(r, "group_id") else r["group_id"] for r in requested}
    )


@pytest.mark.parametrize("seed", SEEDS)
async def test_saved_groups_are_trained_after_resuming_from_an_older_trainer_checkpoint(tmp_path, tiny_model, seed):
    """Paused at policy P with open and requested groups, the newest trainer checkpoint older (4 < P: a trainer lost
    abruptly, or its save on notice unpaired): the servers restart on policy 4, and a saved group's members asked
    of it would be stale almost at once (issue 35: cancelled within 0.15 s, the groups abandoned, one with 2 kept
    episodes). Nothing is dispatched until the trainer has retrained up to P, and every saved group trains."""
    run_spec, run_dir = spec(seed), RunDir(tmp_path)
    first = make_orchestrator(run_spec, run_dir, tiny_model, fake_vllm_transport(samples_per_s=200, seed=seed))
    stop = start_fake_trainer(run_dir, tiny_model, first.max_steps, 4, attempt=1)
    run = asyncio.create_task(first.run())
    try:

        def busy() -> bool:  # past checkpoint 4, the trainer keeping up, with groups open and groups requested
            o = first
            # requested as the snapshot counts them: requests out (or to send again) of a group with nothing finished
            # (requests in flight may all be the second halves of open groups: then it has none)
            if not (5 <= o.shipped <= 7 and o.policy_version >= max(5, o.shipped - 1) and o.sink.open_groups):
                return False
            out = {r.group_id for r in [*o.dispatcher.emitted_requests(), *o.source.resume_requests]}
            # the checkpoint lock free: the pause takes it without yielding, so it captures this very state
            return bool(out - o.sink.open_groups.keys()) and not o.checkpoints.lock.locked()

        await wait_for_async(busy, 30, what="a busy moment after checkpoint 4", every=0.001)
        stop.set()  # the trainer is lost: its newest part stays 4
        paused = await first.pause()
        first.request_stop()
        await asyncio.wait_for(run, 10)
    finally:
        stop.set()
    policy, shipped = load_orchestrator_progress(run_dir, 4)["policy_version"], first.shipped
    assert paused.step == 4 and policy > 4 and paused.open_groups and paused.requested_groups
    saved = saved_groups(run_dir, 4)
    # the next attempt: its trainer restarts from checkpoint 4 and retrains 5..shipped from the kept batch files,
    # slowly (it starts a second late), while the orchestrator could already dispatch at policy 4 or 5
    second = make_orchestrator(
        run_spec, run_dir, tiny_model, fake_vllm_transport(samples_per_s=200, seed=seed + 10), attempt=2, resume=True
    )
    run = asyncio.create_task(second.run())
    await asyncio.sleep(1.0)
    stop = start_fake_trainer(run_dir, tiny_model, second.max_steps, 4, attempt=2, first_step=4)
    try:
        assert await asyncio.wait_for(run, 60) == 12
    finally:
        stop.set()
    assert second.resume_report.from_step == 4 and second.resume_report.shipped == shipped
    events = attempt_events(run_dir, 2)
    dispatched = [e for e in events if e["e"] == "dispatched"]
    assert min(e["v"] for e in dispatched) >= policy  # asked of weights as new as at the pause, never policy 4
    assert [e for e in events if e["e"] in ("abandoned", "cancelled") and e["group"] in saved] == []
    trained = {
        i
        for (_, role), evs in read_ledger(run_dir.root / "ledger").items()
        if role == "trainer"
        for e in evs
        if e["e"] == "trained"
        for i in e["ids"]
    }
    rejected = {e["group"] for e in events if e["e"] == "rejected" and e["reason"] == "zero_advantage"}
    for g in saved - rejected:  # a group with zero reward spread teaches nothing: rejected, not lost
        assert any(i.startswith(f"{g}/") for i in trained), f"saved group {g} never trained"
    stale = [i for e in events if e["e"] == "dropped_stale" for i in e["ids"]]
    assert not [i for i in stale if int(i.split("/")[0]) in saved]
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.tasks_checked, report.problems


async def test_a_task_in_flight_when_the_attempt_died_is_requested_again_not_skipped_by_the_replay(
    tmp_path, tiny_model
):
    """An attempt dies (no pause, nothing checkpointed past step 0) with task 2's request in flight and tasks 0, 1
    and 3 journaled: the replay moves the cursor to 4. Task 2 must be requested again, not passed over."""
    run_spec, run_dir = spec(max_steps=3), RunDir(tmp_path)
    encode = tokenizer_codec(AutoTokenizer.from_pretrained(str(tiny_model)))[0]
    task_2 = TrainSource([(ReverseTextEnv(), 1.0)], run_spec.seed).task_at(2)
    hung, prompt_2 = fake_vllm_transport(seed=1), list(encode(task_2.prompt))
    answer = hung.handle_async_request

    async def hang_task_2(request):
        if request.url.path == "/v1/completions" and json.loads(request.content)["prompt"] == prompt_2:
            await asyncio.sleep(3600)
        return await answer(request)

    hung.handle_async_request = hang_task_2
    first = make_orchestrator(run_spec, run_dir, tiny_model, hung)
    run = asyncio.create_task(first.run())
    finished = lambda: {e["id"] for e in attempt_events(run_dir, 1) if e["e"] == "finished"}  # noqa: E731
    journaled = {episode_id(g, m) for g in (0, 1, 3) for m in range(4)}  # what the replay puts back (>= 12)
    await wait_for_async(lambda: journaled <= finished(), 30, what="groups 0, 1 and 3 journaled")
    assert not any(i.startswith("2/") for i in finished())
    run.cancel()  # no trainer ran: no checkpoint past step 0 exists, so this is what a kill leaves to resume from
    with pytest.raises(asyncio.CancelledError):
        await run
    assert latest_complete_checkpoint(run_dir) is None
    second = make_orchestrator(run_spec, run_dir, tiny_model, fake_vllm_transport(seed=2), attempt=2, resume=True)
    run = asyncio.create_task(second.run())
    await wait_for_async(lambda: second.phase != "starting", 30, what="the start-over")  # the dead batches removed
    stop = start_fake_trainer(run_dir, tiny_model, second.max_steps, 4, attempt=2)
    try:
        assert await asyncio.wait_for(run, 60) == 3
    finally:
        stop.set()
    assert second.source.cursor > 4
    events = attempt_events(run_dir, 2)
    again = [(e["first_member"], e["members"]) for e in events if e["e"] == "dispatched" and e["group"] == 2]
    assert again == [(0, 4)]  # the whole group, before any new task
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.tasks_checked and report.replayed >= 12, report.problems


async def test_sigterm_to_a_paused_orchestrator_and_its_trainer_pairs_the_trainers_save_on_notice(tmp_path, tiny_model):
    """The operator pauses the orchestrator, then deletes every pod at once: both get SIGTERM. The trainer finishes
    its step (0.5 s here) and saves it; the paused orchestrator waits for that save and pairs it with the pause
    snapshot before it exits, so the next attempt resumes from the step saved on notice (issue 35: it exited at
    once, leaving the part unpaired and the resume older than the policy the snapshot was taken at)."""
    run_spec, run_dir = spec(), RunDir(tmp_path)
    orch = make_orchestrator(run_spec, run_dir, tiny_model, fake_vllm_transport(samples_per_s=200))
    notice = threading.Event()
    stop = start_fake_trainer(run_dir, tiny_model, orch.max_steps, 4, attempt=1, notice=notice, notice_s=0.5)
    run = asyncio.create_task(orch.run())
    try:
        await wait_for_async(lambda: orch.shipped >= 6 and orch.policy_version >= 5, 30, what="step 6 shipped")
        paused = await orch.pause()  # the operator's POST /pause
        assert paused.step == 4
        notice.set()  # the pods deleted: SIGTERM to the trainer and to this process's orchestrator together
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(run, 30) == orch.shipped
        stopped = lambda: has_stopped(run_dir.root / "ledger", 1, "trainer")  # noqa: E731
        await wait_for_async(stopped, 10, what="the trainer's save on notice")  # whenever the orchestrator exited
    finally:
        stop.set()
    trainer_stop = [e for e in read_ledger(run_dir.root / "ledger")[(1, "trainer")] if e["e"] == "stopped"]
    [saved] = [e["saved"] for e in trainer_stop]
    assert 5 <= saved <= orch.shipped
    assert latest_complete_checkpoint(run_dir).step == saved  # paired: the next attempt resumes there
    paired = load_orchestrator_progress(run_dir, saved)
    assert paired["ledger_line"] == load_orchestrator_progress(run_dir, 4)["ledger_line"]  # the pause snapshot


async def test_a_restarted_trainer_publishes_the_weights_it_resumed_from_so_a_held_orchestrator_catches_up(
    tmp_path, tiny_model
):
    """Weight pushes held by an evaluation round, the orchestrator at policy 0 (synchronous: batch 2 needs policy
    1), the trainer restarted from checkpoint 1 after broadcast 1 was removed: the trainer waits for batch 2 and the
    orchestrator for policy 1, which was on disk only in the checkpoint (issue 35: policy 3, checkpoint 4). The
    resuming trainer publishes it as broadcast 1 (idempotently), and the run ends."""
    run_spec = parse(
        "republish",
        group_size=4,
        batch_size=8,
        max_off_policy_steps=0,
        max_steps=2,
        seed=1,
        checkpoint={"interval": 1, "keep_last": 2},
        evaluation={"enabled": True, "interval": 1, "tasks": 2},
    ).spec
    run_dir = RunDir(tmp_path)
    transport, hold = fake_vllm_transport(seed=1), threading.Event()
    answer = transport.handle_async_request

    async def held_greedy(request):  # an evaluation round's greedy requests wait while `hold` is set
        if request.url.path == "/v1/completions" and json.loads(request.content).get("temperature") == 0:
            while hold.is_set():
                await asyncio.sleep(0.01)
        return await answer(request)

    transport.handle_async_request = held_greedy
    hold.set()  # the round evaluating policy 0 holds the pushes
    first = Trainer(run_spec, run_dir, str(tiny_model), attempt=1)
    orch = make_orchestrator(run_spec, run_dir, tiny_model, transport)
    run = asyncio.create_task(orch.run())
    train = asyncio.create_task(asyncio.to_thread(first.run))
    try:
        complete = lambda: getattr(latest_complete_checkpoint(run_dir), "step", None) == 1  # noqa: E731
        await wait_for_async(complete, 60, what="checkpoint 1")
        assert orch.policy_version == 0 and orch.evaluation.holding and first.step == 1
        first.notice()  # the trainer is lost (it waits for batch 2, which policy 0 cannot buy)
        assert await asyncio.wait_for(train, 30) == 1
        shutil.rmtree(run_dir.broadcast(1))  # gone: only checkpoint 1 holds policy 1
        # what the stall report would say if nothing came: which policy is missing, and where it is not
        waiting = stall_accounting(orch.view(detail=True))["waiting_for"]
        assert waiting.startswith("policy 1: the servers hold 0; newest broadcast of this attempt: None (weight pushes")
        second = await asyncio.to_thread(Trainer, run_spec, run_dir, str(tiny_model), resume=True, attempt=1)
        assert second.step == 1 and (run_dir.broadcast(1) / "model.safetensors").is_file()
        published = (run_dir.broadcast(1) / "model.safetensors").stat().st_mtime_ns
        republish(run_dir, 1, second.attempt)  # idempotent: this attempt's broadcast stays as it is
        assert (run_dir.broadcast(1) / "model.safetensors").stat().st_mtime_ns == published
        train = asyncio.create_task(asyncio.to_thread(second.run))
        hold.clear()  # the round ends: the follower finds broadcast 1
        assert await asyncio.wait_for(train, 60) == 2
        assert await asyncio.wait_for(run, 60) == 2
    finally:
        hold.clear()
        first.notice()
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == 2, report.problems
    # each trainer's ledger says when it ran (what a paused orchestrator told to stop waits for)
    lives = [
        (e["e"], e.get("outcome"), e.get("saved"))
        for e in read_ledger(run_dir.root / "ledger")[(1, "trainer")]
        if e["e"] in ("started", "stopped")
    ]
    assert lives == [
        ("started", None, None),
        ("stopped", "interrupted", None),
        ("started", None, None),
        ("stopped", "complete", None),
    ]
