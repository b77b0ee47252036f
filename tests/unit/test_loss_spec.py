"""``spec.loss``: the published recipes' settings pass the CRD and the spec alike, the clip's shorthand resolves to
both sides, and the step computes with exactly what the manifest says (the contradictions refused are in
``test_crd.py``'s ``INVALID``)."""

from __future__ import annotations

import pytest
from rlrun.api.algorithm import LossSpec
from rlrun.manifest import parse_manifest
from rlrun.training.objectives import LossSettings

from tests.support.manifests import manifest, parse
from tests.unit.test_crd import crd_errors

RECIPES = {
    "dapo": {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "token_mean"},
    "dr-grpo": {"aggregation": "constant"},
    "gspo": {"objective": "gspo", "clip_low": 0.0003, "clip_high": 0.0004, "aggregation": "sequence_mean"},
    "cispo": {"objective": "cispo", "clip_low": 1.0, "clip_high": 4.0},
    "ppo-dual-kl": {"ratio_clip": 0.2, "dual_clip": 3.0, "kl_coef": 0.001, "kl_estimator": "k2"},
    "tis": {"importance_correction": {"mode": "truncate", "cap": 2.0}},
    "mis-sequence": {"importance_correction": {"mode": "mask", "level": "sequence", "low": 0.999, "high": 1.001}},
}


@pytest.mark.parametrize("loss", RECIPES.values(), ids=RECIPES.keys())
def test_recipe_settings_pass_the_crd_and_the_spec_and_survive_the_operators_round_trip(loss):
    doc = manifest(loss=loss)
    assert crd_errors(doc) == []
    run = parse_manifest(doc)
    # the operator hands pods the dumped spec (None for what is unset): it parses to the same settings
    again = parse(**run.spec.model_dump(mode="json"))
    assert again.spec.loss == run.spec.loss


@pytest.mark.parametrize(
    ("loss", "low", "high"),
    [({}, 0.2, 0.2), ({"ratio_clip": 0.3}, 0.3, 0.3), ({"clip_high": 0.28}, 0.2, 0.28), ({"clip_low": 0.1}, 0.1, 0.2)],
)
def test_the_clip_shorthand_and_the_defaults_resolve_to_both_sides(loss, low, high):
    spec = LossSpec(**loss)
    assert (spec.epsilon_low, spec.epsilon_high) == (low, high)


def test_the_step_computes_with_the_manifests_loss():
    run = parse(
        batch_size=32,
        sampling={"max_tokens": 48},
        loss={
            "objective": "gspo",
            "clip_high": 0.28,
            "dual_clip": 3.0,
            "aggregation": "constant",
            "kl_coef": 0.01,
            "kl_estimator": "k1",
            "importance_correction": {"mode": "mask", "level": "sequence", "low": 0.9, "high": 1.2},
        },
    )
    assert LossSettings.from_spec(run.spec) == LossSettings(
        objective="gspo",
        epsilon_low=0.2,
        epsilon_high=0.28,
        dual_clip=3.0,
        aggregation="constant",
        constant=32 * 48,
        kl_coef=0.01,
        kl_estimator="k1",
        correction="mask",
        correction_level="sequence",
        cap=2.0,
        low=0.9,
        high=1.2,
    )
    assert LossSettings.from_spec(parse().spec) == LossSettings(constant=64 * 24)  # today's loss
