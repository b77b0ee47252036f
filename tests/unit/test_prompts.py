"""Prompts that do not fit the context less ``sampling.max_tokens`` (issue 35): by default their tasks are passed over
— each recorded in the ledger (``task_dropped``, reason ``prompt_too_long``), counted per env in ``metrics.jsonl``,
and a dataset's count said once at the start — and the run trains on; ``rollout.overlong_prompts: refuse`` refuses a
dataset run at its start, before any request, instead of dying at task N. Before, one long row stopped the run."""

from __future__ import annotations

import json
import logging

import pytest
from rlrun.ledger import check_ledger
from rlrun.orchestrator.episodes import EpisodeBuilder, PromptTooLongError
from rlrun.orchestrator.prompts import fitting_eval_tasks
from rlrun.rundir import RunDir
from transformers import AutoTokenizer

from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator, run_to_the_end
from tests.unit.test_rollout_faults import Faults, events

WORDS = ["flat", "is", "better", "than", "nested", "simple", "complex", "sparse", "dense", "ugly", "special", "cases"]
#: Rows of the dataset whose prompt is 40 characters longer (tokens, for tiny-reverse): the context 64 less 24 is 40.
LONG = {0, 2, 5}


def spec(tmp_path, **rollout):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": ("x" * 40 if i in LONG else "") + f"{w}=", "answer": w[::-1]} for i, w in enumerate(WORDS)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return parse(
        "prompts",
        envs=[{"name": "dataset", "args": {"path": str(data), "shuffle": False}}],
        group_size=4,
        batch_size=8,
        max_steps=3,
        checkpoint={"interval": 1, "keep_last": 2},
        sampling={"max_tokens": 24},
        rollout=rollout,
    ).spec


async def test_overlong_prompts_are_passed_over_recorded_and_counted_and_the_run_trains_on(
    tmp_path, tiny_model, caplog
):
    run_dir = RunDir(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="rlrun.orchestrator.prompts"):
        orch = make_orchestrator(spec(tmp_path), run_dir, tiny_model, Faults())
        assert await run_to_the_end(orch) == 3
    dropped = events(run_dir, "task_dropped")
    first_epoch = [(e["env"], e["index"], e["reason"]) for e in dropped if e["index"] < len(WORDS)]
    assert first_epoch == [("dataset", i, "prompt_too_long") for i in sorted(LONG)]
    assert all(e["index"] % len(WORDS) in LONG for e in dropped)  # and only those, epoch after epoch
    assert not {e["task"] for e in events(run_dir, "dispatched")} & {e["index"] for e in dropped}
    (warning,) = caplog.records  # said once, at the start, with the count
    assert warning.getMessage().startswith(
        "3 of 12 train prompts of env dataset are longer than 40 tokens (the model's context less "
        "sampling.max_tokens): the longest is 47 tokens (task 2"
    )
    last = json.loads(run_dir.metrics.read_text().splitlines()[-1])
    assert last["prompts_too_long"] == len(dropped) and last["per_env"]["dataset"]["prompts_too_long"] == len(dropped)
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == 3, report.problems


async def test_refuse_stops_a_dataset_run_at_its_start_before_any_request(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path / "run")
    transport = Faults()
    orch = make_orchestrator(spec(tmp_path, overlong_prompts="refuse"), run_dir, tiny_model, transport)
    with pytest.raises(PromptTooLongError) as exc:
        await run_to_the_end(orch)
    assert str(exc.value).startswith("3 of 12 train prompts of env dataset are longer than 40 tokens")
    assert "tasks 0, 2, 5" in str(exc.value) and "rollout.overlong_prompts: filter" in str(exc.value)
    assert transport.completions == 0 and events(run_dir, "dispatched") == []


def test_held_out_tasks_that_do_not_fit_are_left_out_or_refused(tmp_path, tiny_model):
    run = spec(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    builder = EpisodeBuilder.from_spec(tokenizer, {}, run)
    from rlrun.envs.base import Task

    tasks = [Task("dataset", 0, "flat=", "talf"), Task("dataset", 1, "x" * 50, None)]
    assert fitting_eval_tasks(builder, tasks, "filter") == tasks[:1]
    with pytest.raises(PromptTooLongError, match="env dataset task 1: the prompt is 50 tokens"):
        fitting_eval_tasks(builder, tasks, "refuse")


def test_rlrun_local_refuses_before_any_process_starts(tmp_path, tiny_model):
    """``rlrun local`` runs the orchestrator's scan once the model is known, before the rollout server and trainer."""
    from rlrun.orchestrator.prompts import check_prompts

    from tests.support.launcher import make_launcher

    data = spec(tmp_path).envs[0].args["path"]
    envs = [{"name": "dataset", "args": {"path": data, "shuffle": False}}]
    launcher, out = make_launcher(
        tmp_path, envs=envs, rollout={"overlong_prompts": "refuse"}, sampling={"max_tokens": 24}
    )
    launcher.check_model = lambda run, _: check_prompts(run, str(tiny_model))  # the tiny model's tokenizer
    launcher.spec = launcher.spec.model_copy(
        update={"model": launcher.spec.model.model_copy(update={"builtin": None, "name": str(tiny_model)})}
    )
    assert launcher.run() == 2
    assert out.getvalue().startswith("error: 3 of 12 train prompts of env dataset are longer than 40 tokens")
    assert launcher.children == []
    check_prompts(spec(tmp_path), str(tiny_model))  # filter: the orchestrator passes them over, nothing to refuse
