"""Every way a run stops leaves a consistent ledger (issue 35, item 8): an error (an overlong prompt, rewards that
always fail, an env that raises) ends the attempt with what it held recorded as left over, and a kill leaves what it
held pending for the next attempt; ``rlrun ledger check`` passes after each, tasks included. The real Orchestrator
with fake rollout endpoints and the fake trainer."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from rlrun.ledger import check_ledger, read_ledger
from rlrun.orchestrator.episodes import PromptTooLongError
from rlrun.orchestrator.failing import RewardsFailing
from rlrun.orchestrator.loop import Orchestrator
from rlrun.rundir import RunDir
from rlrun.training.fake import start_fake_trainer

from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator, run_to_the_end
from tests.support.polling import wait_for_async


def spec(max_steps: int = 4, overlong_prompts: str = "filter", **faults):
    return parse(
        "stops",
        envs=[{"name": "tests.support.envs:Faulty", "args": faults}],
        group_size=4,
        batch_size=6,  # groups of 4: a batch leaves samples queued, which a stop must account for
        max_off_policy_steps=1,
        max_steps=max_steps,
        checkpoint={"interval": 2, "keep_last": 2},
        rollout={"members_per_request": 2, "max_inflight": 64, "overlong_prompts": overlong_prompts},
    ).spec


def events(run_dir: RunDir, kind: str) -> list[dict]:
    return [e for evs in read_ledger(run_dir.root / "ledger").values() for e in evs if e["e"] == kind]


async def stopped_by(error: type[BaseException], run_spec, run_dir: RunDir, model) -> Orchestrator:
    orch = make_orchestrator(run_spec, run_dir, model)
    with pytest.raises(error):
        await run_to_the_end(orch)
    return orch


@pytest.mark.parametrize(
    ("faults", "error", "says", "dropped"),
    [
        ({"long_at": 9, "overlong_prompts": "refuse"}, PromptTooLongError, "task 9: the prompt is 101 tokens", []),
        # filtered (the default): task 9 is passed over, recorded dropped, and the env raising at task 12 stops the run
        ({"long_at": 9, "raise_at": 12}, RuntimeError, "task 12: the env's data source is gone", [9]),
        ({"raise_at": 9}, RuntimeError, "task 9: the env's data source is gone", []),
        # tasks 0-4 give 20 episodes, never whole batches of 6: some are held (or dropped stale) at the stop, whatever
        # the timing (from task 6 on, 24 episodes could all train in 4 batches before the 64th failed request)
        ({"reward_fails_from": 5}, RewardsFailing, "the judge is unreachable", []),
    ],
    ids=["prompt_too_long_refused", "prompt_too_long_filtered", "env_raises", "rewards_failing"],
)
async def test_an_error_stop_records_what_the_attempt_held_and_the_ledger_checks(
    tmp_path, tiny_model, faults, error, says, dropped
):
    run_dir = RunDir(tmp_path)
    orch = await stopped_by(error, spec(max_steps=20, **faults), run_dir, tiny_model)
    [stopped] = events(run_dir, "stopped")
    assert stopped["outcome"] == "error" and says in stopped["error"] and stopped["step"] == orch.shipped
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok, report.problems
    assert report.tasks_checked and not report.interrupted and report.tasks >= 8
    # what the attempt held when it stopped is accounted for as left over: episodes and tasks; so are the episodes of
    # batches shipped that the (fake) trainer, stopped with the run, had not trained
    leftover = events(run_dir, "leftover")  # none when it held nothing (RewardsFailing between requests, at times)
    assert len(leftover) <= 1 and all(e["reason"] == "error" for e in leftover)
    ids = [i for e in leftover for i in e["ids"]]
    assert report.leftover == len(ids) == len(set(ids)) and report.finished > report.trained
    shipped = {e["step"] for e in events(run_dir, "shipped")}
    assert report.shipped_untrained == 6 * len(shipped - set(range(1, report.steps + 1)))
    assert report.tasks_leftover + report.tasks_trained + report.tasks_dropped == report.tasks
    assert [(e["index"], e["reason"]) for e in events(run_dir, "task_dropped")] == [
        (i, "prompt_too_long") for i in dropped
    ]


async def test_a_killed_run_holds_its_unfinished_work_pending_and_checks(tmp_path, tiny_model):
    """A SIGKILL writes nothing more: the ledger as it is at any instant of a run is what a kill leaves. The check
    counts what the attempt held as pending (the next attempt resumes it), not lost; after the run ends it is ok."""
    run_dir = RunDir(tmp_path / "run")
    orch = make_orchestrator(spec(max_steps=6), run_dir, tiny_model)
    stop = start_fake_trainer(run_dir, tiny_model, orch.max_steps, 2, attempt=1)
    run = asyncio.create_task(orch.run())
    try:
        held = lambda: orch.shipped >= 2 and orch.sink.finished_episodes_kept + len(orch.sink.queue) > 0  # noqa: E731
        await wait_for_async(held, 30, what="a step shipped with episodes queued or kept", every=0.001)
        killed = tmp_path / "killed"
        shutil.copytree(run_dir.root / "ledger", killed)  # on the loop: the files as a kill now would leave them
        assert await asyncio.wait_for(run, 60) == 6
    finally:
        stop.set()
    report = check_ledger(killed)
    assert report.ok and report.interrupted, report.problems
    assert report.pending > 0 and report.tasks_pending > 0 and report.tasks_checked
    done = check_ledger(run_dir.root / "ledger")
    assert done.ok and not done.interrupted and done.pending == 0 and done.steps == 6, done.problems
    assert done.tasks == done.tasks_trained + done.tasks_dropped + done.tasks_leftover


async def test_a_cancelled_run_stops_even_when_a_result_arrives_with_the_cancel(tmp_path, tiny_model):
    """``asyncio.wait_for`` before Python 3.12 returns a result that arrives in the loop iteration of a cancel instead
    of raising (gh-86296): the main loop's wait for results lost the cancel and the run went on for ever (seen as
    test_resumed_work's stand-in for a kill hanging, in about 1 full-file run in 4). Now the cancel stops the run, and
    the ledger says what it held."""
    run_dir = RunDir(tmp_path)
    orch = make_orchestrator(spec(), run_dir, tiny_model)
    run: asyncio.Task | None = None

    class CancelWithTheFirstResult(asyncio.Queue):
        def put_nowait(self, item) -> None:
            super().put_nowait(item)
            if item is not None and run is not None and not run.cancelling():
                run.cancel()

    orch.results = CancelWithTheFirstResult()
    run = asyncio.create_task(orch.run())
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 20)
    [stopped] = events(run_dir, "stopped")
    assert stopped["outcome"] == "interrupted" and stopped["step"] == 0
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and not report.interrupted and report.tasks_leftover == report.tasks > 0, report.problems


async def test_a_failing_run_closes_what_it_started_in_the_checklists_order(tmp_path, tiny_model, monkeypatch):
    """The run's teardown (an AsyncExitStack): the work stops, the checkpoint manager's last look, the ledger's last
    lines with the error, the dispatcher, the journal, the step metrics, the trackers, the ledger — in that order."""
    from rlrun.ledger import Ledger
    from rlrun.orchestrator import loop
    from rlrun.orchestrator.checkpointing import CheckpointManager
    from rlrun.orchestrator.dispatcher import Dispatcher
    from rlrun.orchestrator.evaluation import EvalRounds
    from rlrun.orchestrator.journal import Journal
    from rlrun.orchestrator.metrics import StepMetrics
    from rlrun.tracking.publisher import TrackerPublisher

    closed: list[str] = []

    def noting(cls, name: str, label: str):
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            closed.append(label)
            return original(*args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    for cls, name, label in [
        (EvalRounds, "cancel", "evaluation"),
        (CheckpointManager, "finish", "checkpoints"),
        (Dispatcher, "aclose", "dispatcher"),
        (Journal, "aclose", "journal"),
        (StepMetrics, "close", "metrics"),
        (TrackerPublisher, "close", "trackers"),
        (Ledger, "close", "ledger"),
    ]:
        noting(cls, name, label)
    monkeypatch.setattr(loop, "record_stop", lambda *args: closed.append(f"record_stop {args[-1]!r}"))

    def fail(self, version):
        raise RuntimeError("boom")

    monkeypatch.setattr(EvalRounds, "start", fail)  # the journal is open, the follower not yet running
    orch = make_orchestrator(spec(), RunDir(tmp_path), tiny_model)
    with pytest.raises(RuntimeError, match="boom"):
        await asyncio.wait_for(orch.run(), 60)
    assert orch.admission.stopped
    assert closed == [
        "evaluation",
        "checkpoints",
        "record_stop RuntimeError('boom')",
        "dispatcher",
        "journal",
        "metrics",
        "trackers",
        "ledger",
    ]
