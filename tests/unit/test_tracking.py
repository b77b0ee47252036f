"""Experiment trackers (rlrun.tracking): each step logged once, as its final values, to one tracker run across
attempts — read back from W&B's offline files and TensorBoard's event files."""

from __future__ import annotations

import json
import shutil

import pytest
from rlrun.launcher.progress import tracker_lines
from rlrun.manifest import ManifestError, parse_manifest
from rlrun.orchestrator.metrics import StepMetrics
from rlrun.rundir import RunDir
from rlrun.tracking import backends
from rlrun.tracking.backends import Cursor
from rlrun.tracking.publisher import read_state, tracker_run_id
from rlrun.tracking.steps import FinalSteps, scalars

from tests.support.fake_orchestrator import resume_report
from tests.support.manifests import manifest
from tests.support.trackers import LOGGING, PUT_BACK, attempt_lines, publisher, tensorboard_scalars, two_attempts


def test_scalars_are_prefixed_flattened_and_numbers_only():
    line = {"step": 3, "reward_mean": 0.5, "reward/env": 1, "per_env": {"a": {"n": 2}}, "x": None, "ok": True}
    assert scalars({**line, "huge": 10**400, "s": "text"}, "rollout", {"step"}) == {
        "rollout/reward_mean": 0.5,
        "reward/env": 1.0,
        "rollout/per_env/a/n": 2.0,
    }


def test_a_step_is_taken_once_a_checkpoint_holds_it_with_the_last_lines_values(tmp_path):
    run_dir = RunDir(tmp_path).ensure()
    attempt_lines(run_dir, 1, range(1, 7), evaluations=[0, 5, 6])  # attempt 1 trains to 6, its checkpoint is at 4
    with open(run_dir.metrics, "a") as fh:
        fh.write("[1, 2]\n")  # JSON, but no line of a step: skipped, nothing after it lost
    final = FinalSteps(run_dir)
    steps, evaluations = final.take(through=4)
    assert [s for s, _ in steps] == [1, 2, 3, 4] and [v for v, _ in evaluations] == [0]  # 5, 6: not final yet
    assert steps[0][1] == {
        "rollout/reward_mean": 1.01,
        "reward/env": 0.5,
        "rollout/per_env/env/finished": 1.0,
        "train/loss": -1.01,
        "run/attempt": 1.0,
    }
    attempt_lines(run_dir, 2, range(5, 11), evaluations=[6, 10, 2])  # lost abruptly: 5 and 6 trained again
    steps, evaluations = final.take(through=8)
    assert [(s, v["rollout/reward_mean"], v["train/loss"], v["run/attempt"]) for s, v in steps] == [
        (5, 2.05, -2.05, 2.0),
        (6, 2.06, -2.06, 2.0),
        (7, 2.07, -2.07, 2.0),
        (8, 2.08, -2.08, 2.0),
    ]
    # the evaluation of 6 by the weights the run kept (attempt 2's); 2 came late, out of order, and is not lost;
    # 5 was evaluated by attempt 1 only, whose weights of step 5 attempt 2 trained again: never logged
    assert evaluations == [
        (2, {"eval/policy_version": 2.0, "eval/greedy_solved": 2.02}),
        (6, {"eval/policy_version": 6.0, "eval/greedy_solved": 2.06}),
    ]
    assert final.take(through=8) == ([], [])
    assert [v for v, _ in final.take(through=10)[1]] == [10]


def test_two_attempts_log_each_step_once_with_its_final_values_to_tensorboard(tmp_path):
    run_dir = RunDir(tmp_path).ensure()
    two_attempts(run_dir, {"tensorboard": {}})
    tb = tensorboard_scalars(run_dir)
    assert [s for s, _ in tb["rollout/reward_mean"]] == list(range(1, 11))
    assert dict(tb["train/loss"])[6] == pytest.approx(-2.06)  # attempt 2's: attempt 1's step 6 never checkpointed
    assert [v for _, v in tb["run/attempt"]] == [1] * 4 + [2] * 6
    assert [s for s, _ in tb["run/resumed_groups"]] == [5] and dict(tb["run/resumes"])[5] == 1
    evaluated = [(s, round(v, 4)) for s, v in tb["eval/greedy_solved"]]  # float32 in the event file
    assert evaluated == [(0, 1.0), (2, 1.02), (6, 2.06), (10, 2.1)]  # at the step each evaluated; 6: attempt 2's
    state = read_state(run_dir)
    assert state["logged"] == {"tensorboard": {"step": 10, "versions": [0, 2, 6, 10], "given": 10}}
    assert state["resumed_attempts"] == [2] and state["errors"] == []


def test_steps_logged_but_not_recorded_by_a_killed_attempt_are_not_shown_twice(tmp_path):
    run_dir = RunDir(tmp_path).ensure()
    committed = [6]
    first = publisher(run_dir, committed, attempt=1, logging={"tensorboard": {}})
    first.start(None)
    attempt_lines(run_dir, 1, range(1, 7), evaluations=[0, 5])
    first.close()
    state = read_state(run_dir)
    state["logged"]["tensorboard"] = {"step": 3, "versions": [0]}  # killed before recording 4–6 and version 5
    run_dir.tracking.write_text(json.dumps(state))
    second = publisher(run_dir, committed, attempt=2, logging={"tensorboard": {}})
    second.start(resume_report(6, **PUT_BACK))
    attempt_lines(run_dir, 2, range(7, 9))
    committed[0] = 8
    second.close()
    tb = tensorboard_scalars(run_dir)
    assert [s for s, _ in tb["rollout/reward_mean"]] == list(range(1, 9))  # 4–6 again, purged once
    assert [s for s, _ in tb["eval/greedy_solved"]] == [0, 5]


def test_the_tracker_run_id_is_the_run_uid_or_one_kept_in_the_run_directory(tmp_path):
    assert tracker_run_id("0b6e2c1a-9f3e-4c1d-8a7b-1234567890ab", {}) == "0b6e2c1a-9f3e-4c1d-8a7b-1234567890ab"
    assert tracker_run_id("a/b:c", {"run_id": "x"}) == "a-b-c"
    assert tracker_run_id(None, {"run_id": "kept"}) == "kept"
    assert len(tracker_run_id(None, {})) == 16 and len(tracker_run_id(None, {"run_id": ["no"]})) == 16
    run_dir = RunDir(tmp_path).ensure()
    attempt_lines(run_dir, 1, range(1, 3))
    ids = []
    for attempt in (1, 2):
        p = publisher(run_dir, [2], attempt, logging={"tensorboard": {}})
        p.start(None)
        p.close()
        ids.append(read_state(run_dir)["run_id"])
    assert ids[0] == ids[1]  # rlrun local: made once, kept in tracking.json
    p = publisher(run_dir, [2], 3, run_uid="new-uid", logging={"tensorboard": {}})
    p.start(None)
    p.close()
    # a new RLRun over the same volume: a new tracker run, in a TensorBoard run of its own
    assert read_state(run_dir)["run_id"] == "new-uid"
    for run_id in (ids[0], "new-uid"):
        assert [s for s, _ in tensorboard_scalars(run_dir, run_id)["rollout/reward_mean"]] == [1, 2]


def test_a_tracking_file_of_the_wrong_shape_counts_as_new(tmp_path):
    run_dir = RunDir(tmp_path).ensure()
    attempt_lines(run_dir, 1, range(1, 3))
    for bad in ('{"run_id": 5, "logged": [], "resumed_attempts": "x"}', "[]", "not json"):
        run_dir.tracking.write_text(bad)
        p = publisher(run_dir, [2], 1, run_uid="uid", logging={"tensorboard": {}})
        p.start(resume_report(0, **PUT_BACK))
        p.close()
        assert read_state(run_dir)["logged"]["tensorboard"]["step"] == 2, bad
    assert Cursor.from_json({"step": "3", "versions": [1, "2", True]}) == Cursor(0, {1}, 0)


def test_no_tracker_configured_starts_no_thread_and_writes_nothing(tmp_path):
    run_dir = RunDir(tmp_path).ensure()
    p = publisher(run_dir, [3], attempt=1, logging={"wandb": {"project": "p", "mode": "disabled"}})
    p.start(None)
    p.close()
    assert p._thread is None and not run_dir.tracking.exists()


class Buffered:
    """A tracker like W&B: what it is given is durable only once it has closed. ``fail`` makes one of its
    calls raise (``close``: as a killed process never closes)."""

    name, location, durable_on_flush = "wandb", "fake", False

    def __init__(self, steps: list[int], logged: Cursor, fail: str | None) -> None:
        self.steps, self.logged, self.fail = steps, Cursor(logged.step, set(logged.versions)), fail

    def log(self, step, values):
        if self.fail == "log" and step == 2:
            raise RuntimeError("lost the network")
        self.steps.append(step)
        self.logged.step = step

    def evaluation(self, version, values):
        self.logged.versions.add(version)

    def event(self, step, text):
        pass

    def flush(self):
        pass

    def close(self, finished):
        if self.fail == "close":
            raise RuntimeError("killed")


def fake_wandb(monkeypatch, steps: list[int], fail: str | None) -> None:
    real = backends.open_tracker

    def open_tracker(tracker, spec, run_dir, run_id, logged, name, config):
        if tracker != "wandb":
            return real(tracker, spec, run_dir, run_id, logged, name, config)
        if fail == "start":
            raise RuntimeError("no API key")
        return Buffered(steps, logged, fail)

    monkeypatch.setattr("rlrun.tracking.publisher.open_tracker", open_tracker)


def test_steps_a_tracker_never_confirmed_are_logged_again_by_the_next_attempt(tmp_path, monkeypatch):
    run_dir = RunDir(tmp_path).ensure()
    steps: list[int] = []
    fake_wandb(monkeypatch, steps, fail="close")
    attempt_lines(run_dir, 1, range(1, 5))
    wandb_only = {"wandb": {"project": "p", "mode": "offline"}}
    first = publisher(run_dir, [4], 1, logging=wandb_only)
    first.start(None)
    first.close()
    assert steps == [1, 2, 3, 4] and read_state(run_dir)["logged"]["wandb"]["step"] == 0  # never confirmed
    fake_wandb(monkeypatch, steps, fail=None)
    attempt_lines(run_dir, 2, range(5, 7))
    second = publisher(run_dir, [6], 2, logging=wandb_only)
    second.start(resume_report(4, **PUT_BACK))
    second.close()
    assert steps == [1, 2, 3, 4, 1, 2, 3, 4, 5, 6]  # W&B keeps the first of each (a step less than its current)
    assert read_state(run_dir)["logged"]["wandb"] == {"step": 6, "versions": [], "given": 6}


@pytest.mark.parametrize("fail", ["start", "log"])
def test_a_failing_tracker_costs_neither_the_run_nor_the_other_tracker(tmp_path, monkeypatch, fail):
    run_dir = RunDir(tmp_path).ensure()
    steps: list[int] = []
    fake_wandb(monkeypatch, steps, fail)
    attempt_lines(run_dir, 1, range(1, 5), evaluations=[0])
    p = publisher(run_dir, [4], 1)
    p.start(None)
    p.close()
    assert [s for s, _ in tensorboard_scalars(run_dir)["rollout/reward_mean"]] == [1, 2, 3, 4]
    state = read_state(run_dir)
    assert state["logged"]["tensorboard"] == {"step": 4, "versions": [0], "given": 4}
    assert state["logged"]["wandb"]["step"] == 0  # nothing confirmed: the next attempt logs it all again
    what = "could not start (RuntimeError: no API key)" if fail == "start" else "failed to log (RuntimeError: lost"
    assert len(state["errors"]) == 1 and state["errors"][0].startswith(f"wandb {what}")
    assert len(state["locations"]) == (1 if fail == "start" else 2)


def test_the_metrics_file_of_a_killed_attempt_gets_its_torn_line_ended(tmp_path):
    run_dir = RunDir(tmp_path).ensure()
    run_dir.metrics.write_text('{"step": 1, "attempt": 1}\n{"step": 2, "att')  # killed mid-line
    metrics = StepMetrics(run_dir.metrics, attempt=2)
    metrics.start()
    metrics.close()
    assert run_dir.metrics.read_text().endswith('"att\n')


def test_a_configured_tracker_that_is_not_installed_is_refused_with_the_manifest(monkeypatch):
    monkeypatch.setattr(backends, "find_spec", lambda name: None if name == "wandb" else object())
    data = manifest(logging=LOGGING)
    with pytest.raises(ManifestError) as err:
        parse_manifest(data)
    assert err.value.errors == ["spec.logging.wandb: wandb is not installed: pip install 'rlrun[tracking]'"]
    assert parse_manifest(data, checks="static").spec.logging.wandb.project == "rlrun-test"  # the operator's check


def test_a_bad_project_name_is_refused_naming_the_field():
    data = manifest(logging={"wandb": {"project": "my project/x"}})
    with pytest.raises(ManifestError) as err:
        parse_manifest(data)
    assert err.value.errors[0].startswith("spec.logging.wandb.project:")


def test_a_tracker_left_out_for_an_attempt_keeps_what_it_logged(tmp_path, monkeypatch):
    run_dir = RunDir(tmp_path).ensure()
    fake_wandb(monkeypatch, [], fail=None)
    attempt_lines(run_dir, 1, range(1, 4))
    for attempt, logging, committed in (
        (1, {"tensorboard": {}}, 3),
        (2, {"wandb": LOGGING["wandb"]}, 5),
        (3, LOGGING, 7),
    ):
        attempt_lines(run_dir, attempt, range(committed - 1, committed + 1))
        p = publisher(run_dir, [committed], attempt, logging=logging)
        p.start(resume_report(committed - 2, **PUT_BACK) if attempt > 1 else None)
        p.close()
    assert [s for s, _ in tensorboard_scalars(run_dir)["rollout/reward_mean"]] == list(range(1, 8))  # each once
    assert read_state(run_dir)["logged"]["tensorboard"]["step"] == 7


def test_a_copied_run_directory_logs_to_a_tracker_run_of_its_own_and_says_so(tmp_path, caplog):
    original = RunDir(tmp_path / "runs" / "a").ensure()
    attempt_lines(original, 1, range(1, 5))
    first = publisher(original, [4], 1, logging={"tensorboard": {}})
    first.start(None)
    first.close()
    run_id = read_state(original)["run_id"]
    shutil.copytree(original.root, tmp_path / "elsewhere")  # copied, then both resumed: two writers
    copy = RunDir(tmp_path / "elsewhere")
    ids = {}
    for rd, steps in ((original, range(5, 7)), (copy, range(5, 8))):
        attempt_lines(rd, 2, steps)
        p = publisher(rd, [steps[-1]], 2, logging={"tensorboard": {}})
        p.start(resume_report(4, **PUT_BACK))
        p.close()
        ids[rd.root] = read_state(rd)["run_id"]
    assert ids[original.root] == run_id and ids[copy.root] != run_id  # never into the original's tracker run
    (said,) = [r.getMessage() for r in caplog.records if "is a copy of" in r.getMessage()]
    assert said == (
        f"run directory {copy.root.resolve()} is a copy of {original.root.resolve()} (not the directory its "
        f"tracking.json was made in): it logs to tracker run {ids[copy.root]} of its own, not to "
        f"{original.root.resolve()}'s run {run_id}"
    )
    assert read_state(copy)["copy_of"] == {"path": str(original.root.resolve()), "run_id": run_id}
    assert tracker_lines(copy)[0] == f"experiment trackers: {said}"  # rlrun local's summary says it too
    # the copy's run holds its whole history (the original's steps up to the copy included)
    assert [s for s, _ in tensorboard_scalars(copy)["rollout/reward_mean"]] == list(range(1, 8))
    assert [s for s, _ in tensorboard_scalars(original)["rollout/reward_mean"]] == list(range(1, 7))
    moved = RunDir(tmp_path / "moved")
    copy.root.rename(moved.root)  # a move keeps the directory (its inode): the same tracker run
    caplog.clear()
    p = publisher(moved, [7], 3, logging={"tensorboard": {}})
    p.start(resume_report(7, **PUT_BACK))
    p.close()
    assert read_state(moved)["run_id"] == ids[copy.root] and "is a copy of" not in caplog.text
    assert read_state(moved)["home"]["path"] == str(moved.root.resolve())
