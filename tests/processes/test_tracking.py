"""W&B, for real in offline mode (its ``wandb-core`` service is a child process): two attempts make one W&B run
whose steps only grow, each step once with its final values (rlrun.tracking)."""

from __future__ import annotations

from rlrun.rundir import RunDir
from rlrun.tracking.publisher import read_state

from tests.support.polling import wait_for
from tests.support.trackers import (
    LOGGING,
    attempt_lines,
    publisher,
    tensorboard_scalars,
    two_attempts,
    wandb_offline_runs,
)


def test_two_attempts_make_one_wandb_run_whose_steps_only_grow(tmp_path):
    run_dir = RunDir(tmp_path).ensure()
    two_attempts(run_dir, LOGGING)
    [(id1, rows1), (id2, rows2)] = wandb_offline_runs(run_dir)  # one offline run file per attempt…
    assert id1 == id2 == read_state(run_dir)["run_id"]  # …of one W&B run, resumed (`wandb sync` joins them)
    rows = rows1 + rows2
    assert [s for s, _ in rows] == list(range(1, 11))  # strictly increasing, every step once
    by_step = dict(rows)
    assert by_step[5]["rollout/reward_mean"] == 2.05 and by_step[7]["train/loss"] == -2.07  # the final values
    assert [by_step[s]["run/attempt"] for s in (4, 5)] == [1, 2] and by_step[5]["run/resumes"] == 1
    assert by_step[5]["run/resumed_groups"] == 3 and by_step[5]["run/resumed_samples"] == 7
    assert "run/resumed_groups" not in by_step[6]
    evals = [(r["eval/policy_version"], r["eval/greedy_solved"]) for _, r in rows if "eval/greedy_solved" in r]
    # each with a later row, one per row; W&B plots them against eval/policy_version. 6: the weights the run kept
    assert evals == [(0, 1.0), (2, 1.02), (6, 2.06), (10, 2.1)]
    assert [s for s, _ in tensorboard_scalars(run_dir)["rollout/reward_mean"]] == list(range(1, 11))
    state = read_state(run_dir)
    assert any("wandb sync" in where for where in state["locations"])


def test_the_last_evaluations_of_a_finished_run_get_rows_after_its_last_step(tmp_path):
    run_dir = RunDir(tmp_path).ensure()
    p = publisher(run_dir, [4], 1, logging={"wandb": LOGGING["wandb"]}, max_steps=4)
    p.start(None)
    attempt_lines(run_dir, 1, range(1, 5))
    wait_for(lambda: read_state(run_dir)["logged"]["wandb"].get("given") == 4, timeout=30)
    attempt_lines(run_dir, 1, range(0), evaluations=[2, 4])  # after the last checkpoint, as the final evaluation
    p.close()
    [(_, rows)] = wandb_offline_runs(run_dir)
    assert [s for s, _ in rows] == [1, 2, 3, 4, 5, 6]
    assert [(s, r["eval/policy_version"]) for s, r in rows if "eval/policy_version" in r] == [(5, 2), (6, 4)]
    assert read_state(run_dir)["logged"]["wandb"] == {"step": 4, "versions": [2, 4], "given": 6}
