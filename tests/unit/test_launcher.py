"""``rlrun local``'s decisions and messages, without starting anything: what a preemption step the run
never reaches does, how a restored batch is shown, a resume of a finished run, the resume report read
from the ledger, the trainer steps recomputed. (What it does with child processes:
``tests/processes/test_launcher.py``.)"""

from __future__ import annotations

import io
import json
import time

import pytest
from rich.console import Console
from rlrun.api.tracking import LoggingSpec
from rlrun.launcher import local
from rlrun.launcher.preemption import preemption_skip_reason, resume_report_from_ledger, steps_recomputed
from rlrun.launcher.progress import (
    eval_cell,
    eval_dropped_line,
    eval_report,
    label_restored,
    model_line,
    progress_cells,
    published_line,
    summary_table,
    tracker_lines,
    tracker_plan,
)
from rlrun.rundir import RunDir, end_torn_line, read_metrics

from tests.support.fake_orchestrator import resume_report
from tests.support.launcher import RESUMED, complete_checkpoint, make_launcher, metrics_row, write_ledger
from tests.support.manifests import parse, write_manifest

# -- --preempt-at-step K the run never reaches ----------------------------------------------------


@pytest.mark.parametrize("k", [6, 7, 60])
def test_preemption_at_or_past_the_last_step_is_skipped(k):
    reason = preemption_skip_reason(k, last_step=6, resumed_from=None)
    assert reason == (f"--preempt-at-step {k} is not before the run's last step 6: nothing would be left to preempt")


def test_preemption_before_the_last_step_happens():
    assert preemption_skip_reason(5, last_step=6, resumed_from=None) is None
    assert preemption_skip_reason(5, last_step=6, resumed_from=4) is None


def test_preemption_at_or_before_the_resumed_checkpoint_is_skipped():
    reason = preemption_skip_reason(4, last_step=10, resumed_from=4)
    assert reason is not None and "not after step 4, the checkpoint this run resumes from" in reason


def test_last_step_is_max_steps_override(tmp_path):
    launcher, _ = make_launcher(tmp_path, max_steps=4, preempt_at_step=4)
    assert launcher.max_steps == 4
    assert "last step 4" in preemption_skip_reason(launcher.drill.at_step, launcher.max_steps, None)


# -- restored batches in the progress line and the table ------------------------------------------


def test_restored_batches_are_the_rows_before_a_resumed_attempt_generates():
    rows = [
        metrics_row(3, 1, 0.5, 900.0),
        metrics_row(4, 2, None, 0.0, 0.004),  # shipped from the restored queue
        metrics_row(5, 2, None, 0.0, 0.003),  # a second one
        metrics_row(6, 2, 0.6, 800.0),
        metrics_row(7, 2, None, 0.0, 0.002),  # shipped from the queue mid-attempt: nothing restored
    ]
    label_restored(rows[:2], generating := set())
    label_restored(rows[2:], generating)  # rows arrive in pieces
    assert [r["restored"] for r in rows] == [False, True, True, False, False]


def test_progress_cells_of_a_restored_row_say_restored_not_zero():
    row = {**metrics_row(4, 2, None, 0.0, 0.004), "restored": True}
    cells = progress_cells(row, max_steps=6, elapsed_s=12.0)
    assert cells[:3] == ["step 4/6", "reward — (restored batch)", "— tok/s"]
    assert all("0.000" not in c and "0 tok/s" not in c for c in cells)


def test_progress_cells_of_other_rows():
    assert progress_cells(metrics_row(5, 1, 0.4567, 812.4), 6, 1.0)[1:3] == ["reward 0.457", "812 tok/s"]
    none_scored = {**metrics_row(7, 2, None, 0.0, 0.002), "restored": False}
    assert progress_cells(none_scored, 6, 1.0)[1:3] == ["reward — (none scored)", "0 tok/s"]
    assert progress_cells({}, 6, 0.0)[:3] == ["step 0/6", "reward —", "0 tok/s"]


def test_progress_cells_show_the_groups_solved_and_the_trainers_mismatch_kl():
    row = {**metrics_row(5, 1, 0.4567, 812.4), "solved_all": 0.25, "solved_none": 0.125}
    cells = progress_cells(row, 6, 1.0, {"step": 5, "mismatch_kl": 0.00123})
    assert cells[1:5] == ["reward 0.457", "solved all/none 0.25/0.12", "mismatch KL 0.0012", "812 tok/s"]
    # the trainer's newest line is of another step (it trains step 5 after the orchestrator ships it): named
    assert progress_cells(row, 6, 1.0, {"step": 4, "mismatch_kl": 0.00123})[3] == "mismatch KL 0.0012 (step 4)"
    assert progress_cells(metrics_row(5, 1, 0.4567, 812.4), 6, 1.0)[1:3] == ["reward 0.457", "812 tok/s"]


def table_text(rows, max_rows=20, trained=None) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(summary_table(rows, max_rows=max_rows, trained=trained))
    return console.file.getvalue()


def test_summary_table_shows_solved_truncated_and_the_mismatch_kl_of_each_step():
    rows = [
        {**metrics_row(s, 1, 0.5, 900.0, 1.0), "solved_all": s / 10, "solved_none": 0.5, "truncated_fraction": 0.25}
        for s in (1, 2)
    ]
    label_restored(rows, set())
    text = table_text(rows, max_rows=1, trained={1: {"mismatch_kl": 0.001}, 2: {"mismatch_kl": 0.003}})
    header = " ".join(x for x in text.splitlines() if "┃" in x)
    assert all(word in header for word in ("solved", "all/none", "trun-", "cated", "mismatch", "KL"))
    cells = [c.strip() for c in next(x for x in text.splitlines() if "1–2" in x).split("│")]
    assert cells[3:5] == ["0.15/0.50", "0.25"] and cells[-2] == "0.0020"


def test_trackers_are_named_at_the_start_and_located_at_the_end(tmp_path):
    logging = LoggingSpec.model_validate(
        {"wandb": {"project": "p", "entity": "team", "mode": "offline"}, "tensorboard": {}}
    )
    run_dir = RunDir(tmp_path)
    plan = tracker_plan(logging, run_dir)
    assert plan[0].startswith("experiment trackers (each step once its checkpoint is complete): W&B (offline): ")
    assert "project team/p" in plan[0] and plan[1] == f"TensorBoard: tensorboard --logdir {tmp_path}/tensorboard"
    assert tracker_plan(LoggingSpec(), run_dir) == [] and tracker_lines(run_dir) == []
    state = {"run_id": "x", "locations": ["/r/tb/x (…)"], "errors": ["wandb could not start (RuntimeError: no key); …"]}
    run_dir.tracking.write_text(json.dumps(state))
    assert tracker_lines(run_dir) == [
        "experiment tracker: /r/tb/x (…)",
        "experiment tracker wandb could not start (RuntimeError: no key); …",
    ]


def test_a_lora_run_says_what_trains_at_the_start_and_what_each_policy_version_weighed_at_the_end():
    lora = parse("t", model={"builtin": "tiny-reverse", "lora": {"rank": 16, "alpha": 32}}).spec.model.lora
    assert model_line("/m/tiny", None) == "model: /m/tiny"
    assert model_line("/m/tiny", lora) == (
        "model: /m/tiny, frozen: trains a LoRA adapter of rank 16, alpha 32 on q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj; each policy version reaches the rollout servers as an adapter, with no pause"
    )
    trained = {1: {"broadcast_bytes": 532671}, 2: {"broadcast_bytes": 532671, "mismatch_kl": 0.1}}
    assert published_line(trained, lora) == "published per policy version: 532.7 kB (the LoRA adapter alone)"
    assert (
        published_line({2: {"broadcast_bytes": 2500945}}, None) == "published per policy version: 2.5 MB (every weight)"
    )
    assert published_line({1: {"loss": 0.1}}, lora) is None  # a trainer from before broadcast_bytes


def test_summary_table_counts_restored_batches_in_neither_reward_nor_tokens_per_s():
    rows = [
        metrics_row(3, 1, 0.5, 900.0, 1.0),
        metrics_row(4, 2, None, 0.0, 0.004),
        metrics_row(5, 2, 0.7, 600.0, 2.0),
        metrics_row(6, 2, None, 0.0, 0.002),  # none scored mid-attempt: 0 tokens in 2 ms
    ]
    label_restored(rows, set())
    one_row = table_text(rows, max_rows=1).splitlines()
    line = next(x for x in one_row if "3–6" in x)
    # reward: mean of 0.5 and 0.7; tokens/s: (900·1 + 600·2 + 0) / (1 + 2 + 0.002) = 699.5
    assert "0.600" in line and "700" in line.split("│")[-2]
    per_step = table_text(rows)
    restored_line = next(x for x in per_step.splitlines() if x.strip("│ ").startswith("4 "))
    assert "— (restored)" in restored_line and restored_line.split("│")[-2].strip() == "—"


# -- --resume of a finished run ---------------------------------------------------------------------


def test_resume_of_a_complete_run_says_so_and_starts_nothing(tmp_path):
    launcher, out = make_launcher(tmp_path, resume=True)
    rd = RunDir(tmp_path / "run")
    complete_checkpoint(rd, 3)
    complete_checkpoint(rd, 6)
    assert launcher.run() == 0
    text = out.getvalue()
    assert "already complete" in text and "step 6" in text and "holds 6 trained steps" in text
    assert "last step is 6" in text and "no process started" in text
    assert launcher.children == []
    assert not (rd.root / "attempts.jsonl").exists() and not rd.logs.exists()


def test_resume_with_a_larger_max_steps_continues(tmp_path):
    from rlrun.launcher.preflight import already_complete, resume_step

    launcher, _ = make_launcher(tmp_path, max_steps=8, resume=True)
    complete_checkpoint(RunDir(tmp_path / "run"), 6)
    assert resume_step(launcher.run_dir) == 6
    assert already_complete(launcher.run_dir, 6, launcher.max_steps) is None


# -- the resume report of an attempt that finished at once ------------------------------------------


def test_resume_report_is_read_from_the_ledger(tmp_path):
    rd = RunDir(tmp_path)
    expected = resume_report(4, **RESUMED)
    events = [
        {"e": "resumed", "from_attempt": 1, "snapshot_line": 40, "step": 4, "report": expected.model_dump(mode="json")},
        {"e": "redispatch_requested", "group": 3, "members": [2, 3], "first_member": 2},
    ]
    write_ledger(rd, 2, events, torn_tail=True)
    assert resume_report_from_ledger(rd.root / "ledger", 2) == expected
    assert resume_report_from_ledger(rd.root / "ledger", 3) is None  # no such attempt


def test_a_start_over_has_no_resume_report(tmp_path):
    rd = RunDir(tmp_path)
    write_ledger(rd, 2, [{"e": "resumed", "from_attempt": 1, "snapshot_line": -1, "step": 0, "removed_batches": []}])
    assert resume_report_from_ledger(rd.root / "ledger", 2) is None


# -- a pause that meets an orchestrator which has just exited ------------------------------------------


def test_read_metrics_skips_a_torn_line_and_keeps_a_partial_tail_for_later(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # step 2 was torn by a kill, and the next attempt appended step 3 to the same line
    path.write_text('{"step": 1}\n{"step": 2, "rew{"step": 3}\n{"step": 4}\n{"step": 5')
    rows, offset = read_metrics(path)
    assert rows == [{"step": 1}, {"step": 4}]
    with open(path, "a") as fh:
        fh.write("}\n")
    assert read_metrics(path, offset) == ([{"step": 5}], path.stat().st_size)


# -- Child.signal_group ---------------------------------------------------------------------------


# -- the trainer's notice and trainer-only restarts -----------------------------------------------


def write_trainer_ledger(rd: RunDir, attempt: int, steps: list[int], torn_tail: bool = False) -> None:
    (rd.root / "ledger").mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"e": "trained", "step": s, "ids": [f"g{s}/0"]}) + "\n" for s in steps)
    (rd.root / "ledger" / f"attempt-{attempt}.trainer.jsonl").write_text(text + ('{"e": "trai' if torn_tail else ""))


def test_steps_recomputed_counts_every_training_of_a_step_after_its_first(tmp_path):
    rd = RunDir(tmp_path)
    write_trainer_ledger(rd, 1, [1, 2, 3, 4, 5], torn_tail=True)  # killed after step 5
    write_trainer_ledger(rd, 2, [4, 5, 6])  # resumed from checkpoint 3: steps 4 and 5 again
    assert steps_recomputed(rd.root / "ledger") == 2
    write_trainer_ledger(rd, 2, [6])  # resumed from 5, saved on notice: nothing again
    assert steps_recomputed(rd.root / "ledger") == 0


def test_a_restarted_trainer_ends_its_predecessors_torn_line_before_appending(tmp_path):
    path = tmp_path / "attempt-1.trainer.jsonl"
    path.write_text('{"e": "trained", "step": 1}\n{"e": "trai')
    end_torn_line(path)
    end_torn_line(path)  # a whole last line is left as it is
    with open(path, "a") as fh:
        fh.write('{"e": "trained", "step": 2}\n')
    assert path.read_text().splitlines()[-1] == '{"e": "trained", "step": 2}'
    end_torn_line(tmp_path / "missing.jsonl")  # nothing to do
    assert not (tmp_path / "missing.jsonl").exists()


def test_only_without_preempt_at_step_is_refused(tmp_path):
    from rlrun import cli
    from typer.testing import CliRunner

    manifest = write_manifest(tmp_path / "m.yaml", "t")
    result = CliRunner().invoke(
        cli.app, ["local", str(manifest), "--only", "trainer", "--run-dir", str(tmp_path / "r")]
    )
    assert result.exit_code == 2 and "--only needs --preempt-at-step" in result.output
    result = CliRunner().invoke(cli.app, ["local", str(manifest), "--only", "nodes", "--preempt-at-step", "2"])
    assert result.exit_code == 2


def test_the_summary_shows_held_out_evaluation_first_to_last():
    first = {
        "policy_version": 0,
        "tasks": 100,
        "samples_per_task": 2,
        "greedy_solved": 0.11,
        "greedy_reward": 0.11,
        "sampled_reward": 0.03,
        "pass_at_k": 0.06,
    }
    last = {**first, "policy_version": 120, "greedy_solved": 0.4, "greedy_reward": 0.4, "pass_at_k": 0.3}
    assert eval_report([first]) == [] and eval_cell([]) is None
    lines = eval_report([first, {**first, "policy_version": 60}, last])
    assert lines[0] == "held-out evaluation, 100 tasks, policy 0 → 120:"
    assert "greedy solved (exact match)" in lines[1] and lines[1].endswith("0.110 → 0.400 (+0.290)")
    assert lines[4].strip().startswith("pass@2")
    assert eval_cell([first, last]) == "held-out solved 0.400 (v120)"


def test_a_dropped_evaluation_round_is_a_console_line_and_in_the_progress_cell():
    rows = [{"step": s, "attempt": 1, "eval_rounds_dropped": d} for s, d in ((1, 0), (2, 0), (3, 1), (4, 1))]
    lines = [eval_dropped_line(a, b) for a, b in zip([{}, *rows], rows, strict=False)]
    assert lines == [None, None, lines[2], None] and lines[2].startswith(
        "held-out evaluation: 1 round(s) dropped by step 3 (1 this attempt; logs/orchestrator.log says which"
    )
    resumed = {"step": 5, "attempt": 2, "eval_rounds_dropped": 1}  # a new attempt counts from 0
    assert eval_dropped_line(rows[-1], resumed) is not None and eval_dropped_line({}, {"step": 1}) is None
    assert eval_cell([], rows[2]) == "1 eval round(s) dropped" and eval_cell([], rows[0]) is None
    evaluated = {"policy_version": 2, "greedy_solved": 0.5}
    assert eval_cell([evaluated], rows[3]) == "held-out solved 0.500 (v2), 1 eval round(s) dropped"


# -- refusals said once, before any process starts (issue 36) -----------------------------------------


def test_a_lora_target_the_model_lacks_is_refused_before_any_process_starts(
    tmp_path, cache_dir, tiny_model, monkeypatch
):
    """``rlrun local`` makes the trainer's target check on the model (built from its config on the meta device) once
    the model is known: exit 2, the field and the nearest name, no process started, nothing in the run directory."""
    from rlrun import cli
    from rlrun.rundir import holds_a_run
    from rlrun.training.lora_targets import check_targets
    from typer.testing import CliRunner

    def started(*_):
        raise AssertionError("a process was started")

    monkeypatch.setattr(local.LocalLauncher, "start_all", started)
    lora = {"rank": 8, "target_modules": ["v_proj", "qproj"]}
    manifest = write_manifest(tmp_path / "m.yaml", "t", model={"builtin": "tiny-reverse", "lora": lora})
    run_dir = tmp_path / "r"
    argv = ["local", str(manifest), "--run-dir", str(run_dir), "--cache-dir", str(cache_dir)]
    result = CliRunner().invoke(cli.app, argv)
    assert result.exit_code == 2, result.output
    assert (
        "spec.model.lora.target_modules[1]: 'qproj' names no module of Qwen3ForCausalLM; did you mean 'q_proj'?"
        in result.output
    )
    assert not holds_a_run(RunDir(run_dir))
    # a target the model has passes the check (the launcher goes on to start the processes)
    lora["target_modules"] = ["v_proj", "q_proj"]
    write_manifest(tmp_path / "m.yaml", "t", model={"builtin": "tiny-reverse", "lora": lora})
    result = CliRunner().invoke(cli.app, argv)
    assert "a process was started" in repr(result.exception), result.output
    # a hub id not in this machine's cache is left to the trainer (nothing is downloaded before the run starts)
    check_targets(
        parse("t", model={"name": "no-such-org/no-such-model", "lora": lora}).spec, "no-such-org/no-such-model"
    )


def test_eval_of_a_step_without_a_checkpoint_lists_the_steps_it_can_evaluate(tmp_path):
    from rlrun.launcher.evaluate import EvalError, checkpoint_step

    rd = RunDir(tmp_path)
    complete_checkpoint(rd, 3)
    complete_checkpoint(rd, 6)
    assert checkpoint_step(rd, 6) == 6 and checkpoint_step(rd, None) == 6 and checkpoint_step(rd, 0) == 0
    with pytest.raises(EvalError) as exc:
        checkpoint_step(rd, 5)
    assert (
        str(exc.value) == f"no checkpoint of step 5 in {rd.checkpoints}; --step can be 0, 3, 6 (0: the starting model)"
    )


def test_eval_of_a_lora_run_picks_the_steps_whose_trainer_part_holds_the_adapter(tmp_path):
    from rlrun.adapter_format import ADAPTER_WEIGHTS_FILE
    from rlrun.launcher.evaluate import EvalError, checkpoint_step, evaluable_steps, weights_file

    from tests.support.adapters import write_adapter

    rd = RunDir(tmp_path)
    complete_checkpoint(rd, 3)  # full weights: not what a LoRA run evaluates
    write_adapter(rd.trainer_checkpoint(5))
    lora = parse(model={"builtin": "tiny-reverse", "lora": {"rank": 2}}).spec
    assert weights_file(lora) == ADAPTER_WEIGHTS_FILE and weights_file(parse().spec) == "model.safetensors"
    assert evaluable_steps(rd, ADAPTER_WEIGHTS_FILE) == [0, 5] and evaluable_steps(rd) == [0, 3]
    assert checkpoint_step(rd, 5, ADAPTER_WEIGHTS_FILE) == 5
    with pytest.raises(EvalError, match="--step can be 0, 5"):
        checkpoint_step(rd, 3, ADAPTER_WEIGHTS_FILE)


def test_a_resume_over_changed_data_is_refused_before_any_process_starts(tmp_path):
    """Issue 36: the refusal came from the orchestrator, after the rollout server and the trainer had started."""
    from rlrun.checkpoint import save_orchestrator_progress
    from rlrun.envs import make_env
    from rlrun.identity import run_identity

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}=", "answer": str(i)}) + "\n" for i in range(8)))
    launcher, out = make_launcher(
        tmp_path, max_steps=8, resume=True, envs=[{"name": "dataset", "args": {"path": str(data)}}]
    )
    rd = RunDir(tmp_path / "run")
    complete_checkpoint(rd, 3)
    identity = run_identity(launcher.spec, {e.name: make_env(e) for e in launcher.spec.envs})
    save_orchestrator_progress(rd, 3, {"step": 3, "shipped": 3, "source": {"cursor": 30}, "identity": identity})
    data.write_text(data.read_text().replace('"7"', '"seven"'))  # one answer edited since the checkpoint
    assert launcher.run() == 2
    text = out.getvalue()
    assert text.startswith("error: ") and "belongs to a run with different settings; refusing to resume" in text
    assert "env dataset: its data changed since the checkpoint" in text and "Traceback" not in text
    assert launcher.children == [] and not (rd.root / "attempts.jsonl").exists()


class ExitsLater:
    """A role process that exits 0 once ``after_s`` seconds have passed (what ``_follow`` polls)."""

    def __init__(self, name: str, after_s: float) -> None:
        self.name = name
        self.at = time.monotonic() + after_s

    def poll(self) -> int | None:
        return 0 if time.monotonic() >= self.at else None


def test_a_log_gets_a_progress_line_every_heartbeat_while_no_step_lands(tmp_path, monkeypatch):
    """Before the first step (a start, an evaluation round) a log is never silent for long: a line at least every
    ``HEARTBEAT_S`` (10 s; 0.3 s here), where it used to wait for the first step's line."""
    launcher, out = make_launcher(tmp_path)
    launcher.run_dir.ensure()
    monkeypatch.setattr(local, "HEARTBEAT_S", 0.3)
    trainer, orch = ExitsLater("trainer", 1.4), ExitsLater("orchestrator", 1.4)
    launcher.children = [trainer, orch]
    assert launcher._follow(trainer, orch) == []
    beats = [line for line in out.getvalue().splitlines() if line.startswith("step 0/6  reward —")]
    assert 2 <= len(beats) <= 5, out.getvalue()
