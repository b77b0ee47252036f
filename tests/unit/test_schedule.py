"""``spec.optimizer.lr_schedule``: the factor against hand-computed values and transformers' own schedules
(:mod:`rlrun.training.schedule`); the trainer logs the rate each step trains with, keeps the scheduler in its
checkpoint part, and a resumed trainer trains every later step at the rate of the uninterrupted one (a part
written before schedules too: derived from the step)."""

from __future__ import annotations

import json

import pytest
import torch
from rlrun.batch import write_batch
from rlrun.checkpoint import save_orchestrator_progress
from rlrun.errors import CheckpointMismatch
from rlrun.identity import run_identity
from rlrun.rundir import RunDir
from rlrun.training.schedule import lr_factor, schedule_of
from rlrun.training.trainer import Trainer
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from tests.support.manifests import parse
from tests.support.samples import sample


def factor(count, schedule, warmup=2, horizon=10, floor=0.0):
    return lr_factor(count, schedule=schedule, warmup_steps=warmup, horizon=horizon, min_lr_ratio=floor)


def test_the_factor_by_hand():
    # W = 2, N = 10: warmup 0, 1/2; then p = (c − 2) / 8
    assert [factor(c, "cosine", floor=0.1) for c in (0, 1, 2, 6, 10, 12)] == pytest.approx(
        [0.0, 0.5, 1.0, 0.1 + 0.9 * 0.5, 0.1, 0.1]  # c = 6: p = 1/2, ½(1 + cos π/2) = 1/2; past N: the floor
    )
    assert [factor(c, "linear") for c in (0, 1, 2, 4, 6, 10, 11)] == pytest.approx([0, 0.5, 1, 0.75, 0.5, 0, 0])
    assert [factor(c, "linear", floor=0.2) for c in (4, 10)] == pytest.approx([0.2 + 0.8 * 0.75, 0.2])
    assert [factor(c, "constant", warmup=4) for c in (0, 2, 4, 100)] == pytest.approx([0, 0.5, 1, 1])
    assert factor(0, "cosine", warmup=0) == 1.0  # no warmup: step 1 trains at lr


@pytest.mark.parametrize(
    ("schedule", "floor", "reference"),
    [
        ("constant", 0.0, lambda opt: get_constant_schedule_with_warmup(opt, 3)),
        ("linear", 0.0, lambda opt: get_linear_schedule_with_warmup(opt, 3, 12)),
        ("cosine", 0.0, lambda opt: get_cosine_with_min_lr_schedule_with_warmup(opt, 3, 12, min_lr_rate=0.0)),
        ("cosine", 0.15, lambda opt: get_cosine_with_min_lr_schedule_with_warmup(opt, 3, 12, min_lr_rate=0.15)),
    ],
)
def test_the_factor_is_transformers_schedule(schedule, floor, reference):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = reference(opt).lr_lambdas[0]
    ours = [factor(c, schedule, warmup=3, horizon=12, floor=floor) for c in range(13)]
    assert ours == pytest.approx([theirs(c) for c in range(13)])


def _train(trainer: Trainer, steps: range) -> list[float]:
    """Train ``steps`` on small batches; the ``lr`` of each."""
    rates = []
    for step in steps:
        batch = [sample(step, 0, step - 1, 0.5), sample(step, 1, step - 1, -0.5)]
        write_batch(trainer.run_dir.rollout_batch(step), step, batch, pad_id=0)
        rates.append(trainer.train_step(step)["lr"])
        trainer.step = step
    return rates


@pytest.mark.parametrize("old_part", [False, True], ids=["with-scheduler-state", "part-without-it"])
def test_a_resumed_trainer_trains_each_step_at_the_rate_of_the_uninterrupted_run(tmp_path, tiny_model, old_part):
    optimizer = {"lr": 0.01, "lr_schedule": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}
    spec = parse("sched", max_steps=6, optimizer=optimizer).spec
    expected = [0.01 * schedule_of(spec)(s - 1) for s in range(1, 7)]  # 0, 0.005, 0.01, then the decay
    # step 6: p = (5 − 2) / (6 − 2) = 0.75, ½(1 + cos 0.75π) = 0.146447, 0.1 + 0.9 · 0.146447 = 0.231802
    assert expected[:3] == pytest.approx([0.0, 0.005, 0.01]) and expected[5] == pytest.approx(0.00231802)
    whole = Trainer(spec, RunDir(tmp_path / "whole"), str(tiny_model))
    assert _train(whole, range(1, 7)) == pytest.approx(expected)
    whole.ledger.close()

    run_dir = RunDir(tmp_path / "run")
    first = Trainer(spec, run_dir, str(tiny_model), max_steps=3)  # --max-steps: the horizon stays spec.max_steps
    assert _train(first, range(1, 4)) == pytest.approx(expected[:3])
    first.checkpoint(3)
    first.ledger.close()
    progress = run_dir.trainer_checkpoint(3) / "progress.json"
    saved = json.loads(progress.read_text())
    assert saved["lr_scheduler"]["last_epoch"] == 3 and saved["lr_scheduler"]["base_lrs"] == [0.01]
    if old_part:  # written before schedules: no scheduler state (and a constant rate, so no schedule settings)
        del saved["lr_scheduler"]
        progress.write_text(json.dumps(saved))
    save_orchestrator_progress(run_dir, 3, {"step": 3, "shipped": 3, "identity": run_identity(spec)})
    resumed = Trainer(spec, run_dir, str(tiny_model), resume=True)
    assert resumed.step == 3 and resumed.lr_scheduler.last_epoch == 3
    assert _train(resumed, range(4, 7)) == pytest.approx(expected[3:])
    resumed.ledger.close()
    # and the weights: the same updates as the uninterrupted run's
    for (name, a), b in zip(whole.policy.model.named_parameters(), resumed.policy.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
    # the schedule is not safe to change: a trainer resuming with another refuses (it exits 78), naming the field
    other = parse("sched", max_steps=6, optimizer={**optimizer, "lr_schedule": "linear"}).spec
    with pytest.raises(CheckpointMismatch, match=r"spec.optimizer.lr_schedule: checkpoint has 'cosine'"):
        Trainer(other, run_dir, str(tiny_model), resume=True)


def test_a_sharded_part_restores_the_schedule_as_an_unsharded_one_does(tmp_path):
    """A DCP part (what several ranks write; here one process, no process group) carries the scheduler state in its
    ``progress.json`` too, and the trainer's restore path puts the optimizer at the next step's rate."""
    from rlrun.training.distributed import init_from_env
    from rlrun.training.parts import SCHEDULER_KEY, restore_part
    from rlrun.training.policy import Policy
    from rlrun.training.schedule import new_optimizer, new_scheduler, restore_scheduler
    from rlrun.training.sharded_checkpoint import save_sharded

    spec = parse("dcp", max_steps=10, optimizer={"lr": 0.01, "lr_schedule": "linear", "warmup_steps": 2}).spec
    dp = init_from_env(env={})

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = new_optimizer(model, spec)
        return model, optimizer, new_scheduler(optimizer, spec)

    model, optimizer, scheduler = build()
    for _ in range(3):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
    progress = {SCHEDULER_KEY: scheduler.state_dict()}
    part = tmp_path / "trainer"
    save_sharded(
        part, model, optimizer, dp, 3, 1, extra=lambda tmp: (tmp / "progress.json").write_text(json.dumps(progress))
    )
    model2, optimizer2, scheduler2 = build()
    restore_part(part, 3, Policy(model2, torch.float32, identity={}), optimizer2, spec, dp)
    restore_scheduler(scheduler2, optimizer2, json.loads((part / "progress.json").read_text())[SCHEDULER_KEY], 3, "p")
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 7 / 8)
    assert scheduler2.state_dict() == scheduler.state_dict()


def test_a_part_without_scheduler_state_is_restored_from_its_step_and_says_so_once(caplog):
    from rlrun.training.schedule import new_optimizer, new_scheduler, restore_scheduler

    spec = parse("old", max_steps=10, optimizer={"lr": 0.01, "lr_schedule": "linear", "warmup_steps": 2}).spec
    optimizer = new_optimizer(torch.nn.Linear(3, 2), spec)
    scheduler = new_scheduler(optimizer, spec)
    caplog.set_level("INFO", logger="rlrun.training.schedule")
    restore_scheduler(scheduler, optimizer, None, 3, "checkpoints/step_3/trainer")
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 7 / 8)  # λ(3): derived, correctly
    (line,) = [r.getMessage() for r in caplog.records if "LR scheduler" in r.getMessage()]
    assert line == (
        "checkpoints/step_3/trainer holds no LR scheduler state (a part written before schedules): "
        "its position is derived from step 3, the next step trains at lr 0.00875"
    )
    caplog.clear()
    restore_scheduler(scheduler, optimizer, scheduler.state_dict(), 3, "checkpoints/step_3/trainer")
    assert not [r for r in caplog.records if "LR scheduler" in r.getMessage()]  # with its state: nothing said
