"""A run that can never form a batch (every group's members get the same reward) warns once per attempt, then stops
with a permanent error that says how the groups split and what to change — instead of spinning for hours with a
growing journal (issue 36.1): the guard's counting, and the real Orchestrator over the fake rollout server with a
constant reward."""

from __future__ import annotations

import asyncio
import io
import logging
import re
from types import SimpleNamespace

import pytest
from rich.console import Console
from rlrun.api.control import ExitReport, write_exit_report
from rlrun.errors import classify_error
from rlrun.launcher.processes import ChildDied, death_report
from rlrun.orchestrator.journal_files import journal_root
from rlrun.orchestrator.no_signal import NoLearningSignal, NoSignalGuard
from rlrun.orchestrator.sink import SinkCounters
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir
from rlrun.training.fake import start_fake_trainer

from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator

LIMIT = 40


def half(completions, **kwargs):
    """A reward that scores every completion the same: no group ever has a reward spread."""
    return [0.5] * len(completions)


def spec(**overrides):
    envs = [{"name": "reverse-text", "rewards": [{"function": "tests.unit.test_no_signal:half"}]}]
    base = dict(group_size=4, batch_size=8, max_steps=3, envs=envs, checkpoint={"interval": 1, "keep_last": 2})
    return parse("no-signal", **{**base, **overrides}).spec


def counters(zero_spread: int, solved: int = 0, same_wrong: int = 0, batches: int = 0) -> SinkCounters:
    return SinkCounters(
        groups_rejected=zero_spread,
        groups_rejected_zero_spread=zero_spread,
        groups_rejected_solved=solved,
        groups_rejected_same_wrong=same_wrong,
        samples_shipped=8 * batches,
    )


def test_the_guard_warns_once_at_a_fifth_of_the_limit_and_stops_at_it_naming_the_split_and_the_knobs(caplog):
    guard = NoSignalGuard(spec(max_zero_spread_groups=LIMIT))
    guard.check(counters(0))  # the attempt counts from here
    with caplog.at_level(logging.WARNING, logger="rlrun.orchestrator.no_signal"):
        guard.check(counters(7))
        assert caplog.records == []
        guard.check(counters(8, solved=2, same_wrong=6))  # a fifth of 40
        guard.check(counters(30, solved=2, same_wrong=6))
    [warning] = caplog.records  # once per attempt
    assert "8 groups since the run began were rejected because every member got the same reward" in warning.message
    assert "25 % solved by every member" in warning.message and "75 % the very same wrong completion" in warning.message
    assert "Check the reward" in warning.message and "group_size (4" in warning.message
    assert "sampling.temperature (1" in warning.message
    assert "The run stops after 40 such groups (spec.max_zero_spread_groups: 40)" in warning.message
    with pytest.raises(NoLearningSignal, match=r"40 groups since the run began .* 10 % solved by every member") as exc:
        guard.check(counters(40, solved=4, same_wrong=6))
    assert "15 % the very same wrong" in str(exc.value) and "75 % every member scored the same" in str(exc.value)
    assert classify_error(exc.value) == (True, "NoLearningSignal")  # the orchestrator exits 78


def test_a_batch_starts_the_count_again_and_the_default_limit_is_fifty_batches_worth_of_groups():
    guard = NoSignalGuard(spec())  # batch 8 / group 4: 2 groups a batch
    assert (guard.limit, guard.warn_at) == (100, 20)
    guard.check(counters(0))
    guard.check(counters(99))
    guard.check(counters(99, batches=1))  # a batch was cut: the count starts again
    guard.check(counters(198, batches=1))
    with pytest.raises(NoLearningSignal, match=r"100 groups since batch 1 .*unset: 50 batches' worth of groups, 100"):
        guard.check(counters(199, batches=1))


async def test_a_run_with_a_constant_reward_warns_then_stops_with_a_permanent_error_its_journal_bounded(
    tmp_path, tiny_model, caplog
):
    run_dir = RunDir(tmp_path)
    orch = make_orchestrator(spec(max_zero_spread_groups=LIMIT), run_dir, tiny_model, fake_vllm_transport())
    stop = start_fake_trainer(run_dir, tiny_model, 3, 1, attempt=1)
    try:
        with (
            caplog.at_level(logging.WARNING, logger="rlrun.orchestrator.no_signal"),
            pytest.raises(NoLearningSignal) as exc,
        ):
            await asyncio.wait_for(orch.run(), 60)  # before: it spun at step 0 until the timeout
    finally:
        stop.set()
    [warning] = [r.message for r in caplog.records]
    assert "100 % every member scored the same without solving it" in warning
    stopped = re.match(r"no batch can form: (\d+) groups since the run began were rejected", str(exc.value))
    c, out = orch.sink.counters, orch.spec.rollout.max_inflight // 4  # groups in flight at most
    # looked at every poll (0.01 s here): the count reaches the limit with at most what arrived since the last look;
    # groups in flight may still land while the run winds down, after the count in the message was taken
    assert stopped and LIMIT <= int(stopped[1]) <= LIMIT + out
    assert int(stopped[1]) <= c.groups_rejected_zero_spread <= int(stopped[1]) + out
    assert orch.shipped == 0
    # the journal holds the rejected groups' episodes only up to the limit (and what was in flight), then the run stops
    assert c.episodes_finished <= (LIMIT + 2 * out) * 4
    journal_bytes = sum(f.stat().st_size for f in journal_root(run_dir).rglob("*") if f.is_file())
    assert journal_bytes < 400 * c.episodes_finished  # bytes per episode of a reverse-text prompt: ~200


def test_the_launcher_says_a_permanent_error_as_one_message_not_a_traceback(tmp_path):
    message = "NoLearningSignal: no batch can form: 40 groups since the run began were rejected …; check the reward"
    report = ExitReport(
        role="orchestrator", outcome="error", permanent=True, reason="NoLearningSignal", message=message
    )
    assert write_exit_report(report, tmp_path / "orchestrator-exit.json")
    log = tmp_path / "orchestrator.log"
    log.write_text("Traceback (most recent call last):\n  File …\n")
    child = SimpleNamespace(
        name="orchestrator",
        pid=4242,
        log_path=log,
        exit_report=tmp_path / "orchestrator-exit.json",
        tail=lambda n: log.read_text().splitlines()[-n:],
    )
    out = io.StringIO()
    for line in death_report(ChildDied(child, 78)):
        Console(file=out, width=1000).print(line)
    assert out.getvalue().splitlines() == [
        f"error: orchestrator stopped: {message}",
        f"(exit 78: retrying cannot heal it; its log: {log})",
    ]
    child.exit_report = tmp_path / "none.json"  # no report (killed, or an error retrying may heal): the log's tail
    printed = [str(line) for line in death_report(ChildDied(child, 1))]
    assert (
        printed[0].endswith(f"exited with code 1; last lines of {log}:")
        and printed[1] == "  Traceback (most recent call last):"
    )
