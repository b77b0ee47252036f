"""W&B, for real in offline mode (its ``wandb-core`` service is a child process): two attempts make one W&B run
whose steps only grow, each step once with its final values (rlrun.tracking)."""

from __future__ import annotations

from rlrun.rundir import RunDir
from rlrun.tracking.publisher import read_state

from tests.support.trackers import LOGGING, tensorboard_scalars, two_attempts, wandb_offline_runs


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
