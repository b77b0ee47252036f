"""``spec.optimizer``'s LR schedule and ``spec.advantage``: defaults, the rules that span fields (refused by the CRD
and by ``rlrun.manifest``, naming the same field), and ``loss.std_normalize_advantages`` read as the deprecated
alias of ``advantage.std_normalize`` with a warning (``rlrun validate``; ``rlrun local`` loads the same way)."""

from __future__ import annotations

import json

import pytest
from rlrun import cli
from rlrun.manifest import ManifestError, parse_manifest
from typer.testing import CliRunner

from tests.support.crd_validation import apply_defaults
from tests.support.manifests import manifest, parse, write_manifest
from tests.unit.test_crd import SPEC_SCHEMA, crd_errors


def test_defaults_are_todays_behaviour():
    spec = parse().spec
    assert (spec.optimizer.lr_schedule, spec.optimizer.warmup_steps, spec.optimizer.min_lr_ratio) == ("constant", 0, 0)
    assert (spec.advantage.baseline, spec.advantage.std_normalize, spec.advantage.min_std) == ("group_mean", False, 0.1)
    assert spec.deprecations == []
    defaulted = apply_defaults(SPEC_SCHEMA, manifest()["spec"])  # the API server fills in the same
    assert defaulted["optimizer"]["lr_schedule"] == "constant" and defaulted["advantage"]["min_std"] == 0.1
    assert "std_normalize" not in defaulted["advantage"]  # no CRD default: CEL must tell whether it was set


INVALID = [
    # (spec change, field the CRD names, field rlrun.manifest names)
    ({"optimizer": {"lr_schedule": "step"}}, "spec.optimizer.lr_schedule", "spec.optimizer.lr_schedule"),
    ({"optimizer": {"warmup_steps": -1}}, "spec.optimizer.warmup_steps", "spec.optimizer.warmup_steps"),
    ({"optimizer": {"warmup_steps": 10}, "max_steps": 10}, "spec.optimizer.warmup_steps", "spec.optimizer"),
    (
        {"optimizer": {"min_lr_ratio": 1.5, "lr_schedule": "cosine"}},
        "spec.optimizer.min_lr_ratio",
        "spec.optimizer.min_lr_ratio",
    ),
    ({"optimizer": {"min_lr_ratio": 0.1}}, "spec.optimizer.min_lr_ratio", "spec.optimizer.min_lr_ratio"),
    ({"advantage": {"baseline": "rloo"}}, "spec.advantage.baseline", "spec.advantage.baseline"),
    ({"advantage": {"min_std": 0}}, "spec.advantage.min_std", "spec.advantage.min_std"),
    ({"advantage": {"std_normalize": "yes"}}, "spec.advantage.std_normalize", "spec.advantage.std_normalize"),
    (
        {"loss": {"std_normalize_advantages": True}, "advantage": {"std_normalize": False}},
        "spec.advantage.std_normalize",
        "spec.advantage",
    ),
]


@pytest.mark.parametrize(("change", "crd_field", "spec_field"), INVALID, ids=[str(c[0]) for c in INVALID])
def test_invalid_settings_are_refused_naming_the_field(change, crd_field, spec_field):
    doc = manifest(**change)
    errors = crd_errors(doc)
    assert any(e.startswith(f"{crd_field}:") for e in errors), errors
    with pytest.raises(ManifestError) as info:
        parse_manifest(doc)
    assert any(e.startswith(f"{spec_field}:") for e in info.value.errors), info.value.errors


@pytest.mark.parametrize(
    "change",
    [
        {"optimizer": {"lr_schedule": "cosine", "warmup_steps": 9, "min_lr_ratio": 0.1}, "max_steps": 10},
        {"optimizer": {"lr_schedule": "linear", "min_lr_ratio": 1}},
        {"optimizer": {"lr_schedule": "constant", "warmup_steps": 3, "min_lr_ratio": 0}},
        {"advantage": {"baseline": "leave_one_out", "std_normalize": True, "min_std": 0.05}},
        {"loss": {"std_normalize_advantages": True}, "advantage": {"std_normalize": True}},
    ],
    ids=str,
)
def test_valid_settings_pass_both(change):
    assert crd_errors(manifest(**change)) == [] and parse_manifest(manifest(**change))


def test_the_deprecated_alias_sets_advantage_std_normalize_and_rlrun_validate_warns(tmp_path):
    spec = parse(loss={"std_normalize_advantages": True}).spec
    assert spec.advantage.std_normalize is True
    assert parse(loss={"std_normalize_advantages": False}, advantage={"baseline": "leave_one_out"}).spec.advantage == (
        parse(advantage={"baseline": "leave_one_out", "std_normalize": False}).spec.advantage
    )
    path = write_manifest(tmp_path / "m.yaml", loss={"std_normalize_advantages": True})
    result = CliRunner().invoke(cli.app, ["validate", str(path)], catch_exceptions=False)
    assert result.exit_code == 0
    assert result.stderr.startswith("warning: spec.loss.std_normalize_advantages is deprecated")
    assert "spec.advantage.std_normalize (true)" in result.stderr
    assert json.loads(result.stdout)["spec"]["advantage"]["std_normalize"] is True
    quiet = CliRunner().invoke(cli.app, ["validate", str(write_manifest(tmp_path / "n.yaml"))])
    assert quiet.exit_code == 0 and quiet.stderr == ""
