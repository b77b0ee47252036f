"""Experiment trackers (rlrun.tracking): each step logged once, as its final values, to one tracker run across
attempts — read back from W&B's offline files and TensorBoard's event files."""

from __future__ import annotations

import json

import pytest
from rlrun.manifest import ManifestError, parse_manifest
from rlrun.rundir import RunDir
from rlrun.tracking import backends
from rlrun.tracking.publisher import read_state, tracker_run_id
from rlrun.tracking.steps import FinalSteps, scalars

from tests.support.manifests import manifest
from tests.support.trackers import LOGGING, attempt_lines, publisher, resume_report, tensorboard_scalars, two_attempts


def test_scalars_are_prefixed_flattened_and_numbers_only():
    line = {"step": 3, "reward_mean": 0.5, "reward/env": 1, "per_env": {"a": {"n": 2}}, "x": None, "ok": True}
    assert scalars(line, "rollout", {"step"}) == {
        "rollout/reward_mean": 0.5, "reward/env": 1.0, "rollout/per_env/a/n": 2.0,
    }  # fmt: skip


def test_a_step_is_taken_once_a_checkpoint_holds_it_with_the_last_lines_values(tmp_path):
    run_dir = RunDir(tmp_path).ensure()
    attempt_lines(run_dir, 1, range(1, 7), evaluations=[0])  # attempt 1 trains to 6, its checkpoint is at 4
    final = FinalSteps(run_dir)
    steps, evaluations = final.take(through=4)
    assert [s for s, _ in steps] == [1, 2, 3, 4] and [v for v, _ in evaluations] == [0]
    assert steps[0][1] == {
        "rollout/reward_mean": 1.01, "reward/env": 0.5, "rollout/per_env/env/finished": 1.0, "train/loss": -1.01,
        "run/attempt": 1.0,
    }  # fmt: skip
    attempt_lines(run_dir, 2, range(5, 9), evaluations=[5])  # lost abruptly: attempt 2 trains 5 and 6 again
    steps, evaluations = final.take(through=8)
    assert [(s, v["rollout/reward_mean"], v["train/loss"], v["run/attempt"]) for s, v in steps] == [
        (5, 2.05, -2.05, 2.0), (6, 2.06, -2.06, 2.0), (7, 2.07, -2.07, 2.0), (8, 2.08, -2.08, 2.0),
    ]  # fmt: skip
    assert evaluations == [(5, {"eval/policy_version": 5.0, "eval/greedy_solved": 0.5})]
    assert final.take(through=8) == ([], [])


def test_two_attempts_log_each_step_once_with_its_final_values_to_tensorboard(tmp_path):
    run_dir = RunDir(tmp_path).ensure()
    two_attempts(run_dir, {"tensorboard": {}})
    tb = tensorboard_scalars(run_dir.tensorboard)
    assert [s for s, _ in tb["rollout/reward_mean"]] == list(range(1, 11))
    assert dict(tb["train/loss"])[6] == pytest.approx(-2.06)  # attempt 2's: attempt 1's step 6 never checkpointed
    assert [v for _, v in tb["run/attempt"]] == [1] * 4 + [2] * 6
    assert [s for s, _ in tb["run/resumed_groups"]] == [5] and dict(tb["run/resumes"])[5] == 1
    assert [s for s, _ in tb["eval/greedy_solved"]] == [0, 10]  # at the step each evaluated
    state = read_state(run_dir)
    assert (state["logged"], state["resumed_attempts"]) == ({"tensorboard": {"step": 10, "version": 10}}, [2])


def test_steps_logged_but_not_recorded_by_a_killed_attempt_are_not_shown_twice(tmp_path):
    run_dir = RunDir(tmp_path).ensure()
    committed = [6]
    first = publisher(run_dir, committed, attempt=1, logging={"tensorboard": {}})
    first.start(None)
    attempt_lines(run_dir, 1, range(1, 7))
    first.close()
    state = read_state(run_dir)
    state["logged"]["tensorboard"]["step"] = 3  # killed before recording 4–6
    run_dir.tracking.write_text(json.dumps(state))
    second = publisher(run_dir, committed, attempt=2, logging={"tensorboard": {}})
    second.start(resume_report(6))
    attempt_lines(run_dir, 2, range(7, 9))
    committed[0] = 8
    second.close()
    tb = tensorboard_scalars(run_dir.tensorboard)
    assert [s for s, _ in tb["rollout/reward_mean"]] == list(range(1, 9))  # 4–6 again, purged once


def test_the_tracker_run_id_is_the_run_uid_or_one_kept_in_the_run_directory(tmp_path):
    assert tracker_run_id("0b6e2c1a-9f3e-4c1d-8a7b-1234567890ab", {}) == "0b6e2c1a-9f3e-4c1d-8a7b-1234567890ab"
    assert tracker_run_id("a/b:c", {"run_id": "x"}) == "a-b-c"
    assert tracker_run_id(None, {"run_id": "kept"}) == "kept"
    assert len(tracker_run_id(None, {})) == 16
    run_dir = RunDir(tmp_path).ensure()
    ids = []
    for attempt in (1, 2):
        p = publisher(run_dir, [0], attempt, logging={"tensorboard": {}})
        p.start(None)
        p.close()
        ids.append(read_state(run_dir)["run_id"])
    assert ids[0] == ids[1]  # rlrun local: made once, kept in tracking.json
    p = publisher(run_dir, [0], 3, run_uid="new-uid", logging={"tensorboard": {}})
    p.start(None)
    p.close()
    assert read_state(run_dir)["run_id"] == "new-uid"  # a new RLRun over the same volume: a new tracker run


def test_no_tracker_configured_starts_no_thread_and_writes_nothing(tmp_path):
    run_dir = RunDir(tmp_path).ensure()
    p = publisher(run_dir, [3], attempt=1, logging={"wandb": {"project": "p", "mode": "disabled"}})
    p.start(None)
    p.close()
    assert p._thread is None and not run_dir.tracking.exists()


def test_a_tracker_that_fails_to_start_costs_only_the_logging(tmp_path, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no network")

    monkeypatch.setattr("rlrun.tracking.publisher.open_trackers", broken)
    run_dir = RunDir(tmp_path).ensure()
    p = publisher(run_dir, [3], attempt=1)
    p.start(None)
    p.close()
    assert "experiment trackers could not start (RuntimeError: no network)" in caplog.text


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


class Buffered:
    """A tracker like W&B: what it is given is durable only once it has closed (here: closing fails, as a killed
    process never closes)."""

    name, location, durable_on_flush = "wandb", "fake", False

    def __init__(self, logged: list[int], fail_close: bool) -> None:
        self.logged, self.fail_close = logged, fail_close

    def log(self, step, values):
        self.logged.append(step)

    def evaluation(self, step, version, values):
        pass

    def event(self, step, text):
        pass

    def flush(self):
        pass

    def close(self):
        if self.fail_close:
            raise RuntimeError("killed")


def test_steps_a_tracker_never_confirmed_are_logged_again_by_the_next_attempt(tmp_path, monkeypatch):
    run_dir = RunDir(tmp_path).ensure()
    logged: list[int] = []
    fail = [True]
    monkeypatch.setattr("rlrun.tracking.publisher.open_trackers", lambda *args: [Buffered(logged, fail_close=fail[0])])
    attempt_lines(run_dir, 1, range(1, 5))
    first = publisher(run_dir, [4], 1, logging={"wandb": {"project": "p", "mode": "offline"}})
    first.start(None)
    first.close()
    assert logged == [1, 2, 3, 4] and read_state(run_dir)["logged"]["wandb"]["step"] == 0  # never confirmed
    fail[0] = False
    attempt_lines(run_dir, 2, range(5, 7))
    second = publisher(run_dir, [6], 2, logging={"wandb": {"project": "p", "mode": "offline"}})
    second.start(resume_report(4))
    second.close()
    assert logged == [1, 2, 3, 4, 1, 2, 3, 4, 5, 6]  # W&B keeps the first of each (a step not past its last)
    assert read_state(run_dir)["logged"]["wandb"] == {"step": 6, "version": -1}
