"""A resume whose algorithm settings (optimizer and LR schedule, loss, advantage) differ from the checkpoint's
names each field and refuses (``CheckpointMismatch``: the roles exit 78), but for the fields marked safe to change
(logged); a checkpoint written before these settings were recorded compares only those added since, as defaults."""

from __future__ import annotations

import logging

import pytest
from rlrun.errors import CheckpointMismatch
from rlrun.identity import SAFE_TO_CHANGE, algorithm_settings, check_compatible, run_identity

from tests.support.manifests import parse

COSINE = {"lr_schedule": "cosine", "warmup_steps": 5, "min_lr_ratio": 0.1}


def spec(**fields):
    return parse(**fields).spec


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            {"optimizer": {**COSINE, "lr_schedule": "linear"}},
            "spec.optimizer.lr_schedule: checkpoint has 'cosine', manifest has 'linear'",
        ),
        (
            {"optimizer": {**COSINE, "warmup_steps": 10}},
            "spec.optimizer.warmup_steps: checkpoint has 5, manifest has 10",
        ),
        (
            {"optimizer": {**COSINE, "min_lr_ratio": 0.0}},
            "spec.optimizer.min_lr_ratio: checkpoint has 0.1, manifest has 0.0",
        ),
        ({"optimizer": {**COSINE, "lr": 1e-4}}, "spec.optimizer.lr: checkpoint has 0.0003, manifest has 0.0001"),
        (
            {"optimizer": COSINE, "max_steps": 200},
            "spec.max_steps: checkpoint has 100, manifest has 200 (the horizon of spec.optimizer.lr_schedule",
        ),
        (
            {"optimizer": {**COSINE, "betas": [0.9, 0.95]}},
            "spec.optimizer.betas: checkpoint has [0.9, 0.99], manifest has [0.9, 0.95]",
        ),
        (
            {"optimizer": COSINE, "loss": {"ratio_clip": 0.3}},
            "spec.loss.clip_low: checkpoint has 0.2, manifest has 0.3",
        ),
        (
            {"optimizer": COSINE, "loss": {"clip_high": 0.28}},
            "spec.loss.clip_high: checkpoint has 0.2, manifest has 0.28",
        ),
        (
            {"optimizer": COSINE, "loss": {"objective": "gspo"}},
            "spec.loss.objective: checkpoint has 'ppo_clip', manifest has 'gspo'",
        ),
        (
            {"optimizer": COSINE, "loss": {"importance_correction": {"mode": "mask"}}},
            "spec.loss.importance_correction.mode: checkpoint has 'none', manifest has 'mask'",
        ),
        (
            {"optimizer": COSINE, "advantage": {"baseline": "leave_one_out"}},
            "spec.advantage.baseline: checkpoint has 'group_mean', manifest has 'leave_one_out'",
        ),
        (
            {"optimizer": COSINE, "advantage": {"std_normalize": True}},
            "spec.advantage.std_normalize: checkpoint has False, manifest has True",
        ),
        (
            {"optimizer": COSINE, "advantage": {"min_std": 0.05}},
            "spec.advantage.min_std: checkpoint has 0.1, manifest has 0.05",
        ),
    ],
)
def test_a_changed_algorithm_setting_is_refused_by_name(change, named):
    saved = run_identity(spec(optimizer=COSINE))
    with pytest.raises(CheckpointMismatch) as info:
        check_compatible(saved, spec(**change), "ckpt")
    assert named in str(info.value)
    assert "a resume may change spec.optimizer.max_grad_norm" in str(info.value)


def test_what_may_change_is_logged_not_refused(caplog):
    saved = run_identity(spec(optimizer=COSINE, max_steps=100))
    with caplog.at_level(logging.WARNING, logger="rlrun.checkpoint"):
        check_compatible(saved, spec(optimizer={**COSINE, "max_grad_norm": 0.5}, max_steps=100), "ckpt")
    assert "spec.optimizer.max_grad_norm changed since ckpt (1.0 → 0.5), allowed" in caplog.text
    assert set(SAFE_TO_CHANGE) == {"optimizer.max_grad_norm"}
    # a constant rate has no horizon: max_steps may change (a run extended), as before
    check_compatible(run_identity(spec(max_steps=100)), spec(max_steps=300), "ckpt")


def test_the_clip_is_compared_as_it_acts_whichever_field_sets_it():
    saved = run_identity(spec(optimizer=COSINE))  # no clip set: 0.2 on both sides
    check_compatible(saved, spec(optimizer=COSINE, loss={"ratio_clip": 0.2}), "ckpt")
    check_compatible(saved, spec(optimizer=COSINE, loss={"clip_low": 0.2, "clip_high": 0.2}), "ckpt")


def test_the_deprecated_alias_is_compared_as_the_field_it_sets():
    saved = run_identity(spec(loss={"std_normalize_advantages": True}))
    check_compatible(saved, spec(advantage={"std_normalize": True}), "ckpt")  # moved to the new name: same run
    with pytest.raises(CheckpointMismatch, match=r"spec.advantage.std_normalize: checkpoint has True"):
        check_compatible(saved, spec(), "ckpt")
    assert "loss.std_normalize_advantages" not in algorithm_settings(spec(loss={"std_normalize_advantages": True}))


def test_a_checkpoint_from_before_the_settings_compares_those_added_since_as_their_defaults():
    old = run_identity(spec())
    del old["algorithm"]  # written before issue 38: lr, betas, ratio_clip, std normalisation… were not recorded
    check_compatible(old, spec(optimizer={"lr": 1e-4}, advantage={"std_normalize": True}), "old")  # unknown: kept
    with pytest.raises(CheckpointMismatch, match=r"spec.optimizer.lr_schedule: checkpoint has 'constant'"):
        check_compatible(old, spec(optimizer=COSINE), "old")  # it could only have had the default
    with pytest.raises(CheckpointMismatch, match=r"spec.advantage.baseline: checkpoint has 'group_mean'"):
        check_compatible(old, spec(advantage={"baseline": "leave_one_out"}), "old")
    # a setting added after the checkpoint was written (absent from its record): its default
    newer = run_identity(spec())
    del newer["algorithm"]["advantage.min_std"]
    check_compatible(newer, spec(), "ckpt")
    with pytest.raises(CheckpointMismatch, match=r"spec.advantage.min_std: checkpoint has 0.1, manifest has 0.2"):
        check_compatible(newer, spec(advantage={"min_std": 0.2}), "ckpt")
