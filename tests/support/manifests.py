"""Small, valid RLRun manifests for tests: the one place a test gets a manifest from.

:func:`manifest` is the document ``kubectl apply`` and ``rlrun local`` take: the builtin tiny
model and the ``reverse-text`` env, every other field defaulted by the spec unless a test
overrides it. ``base`` puts a preset under the overrides: :data:`SHORT_RUN`, a run that trains
a few steps in seconds on the tiny model (what the tests that start real processes use), or
:data:`PREEMPTION_RUN`. :func:`write_manifest` writes a manifest to a YAML file and :func:`parse`
gives the validated :class:`~rlrun.api.spec.RLRun`, e.g. ``write_manifest(path, base=SHORT_RUN,
max_steps=200)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from rlrun.api.spec import RLRun
from rlrun.manifest import parse_manifest

#: The smallest valid spec: the builtin tiny model and the reverse-text env.
MINIMAL_SPEC: dict[str, Any] = {"model": {"builtin": "tiny-reverse"}, "envs": [{"name": "reverse-text"}]}

#: A run of 6 steps of 16 samples (groups of 4), a checkpoint every 3 steps: seconds on the tiny model.
SHORT_RUN: dict[str, Any] = {
    "group_size": 4,
    "batch_size": 16,
    "max_off_policy_steps": 1,
    "max_steps": 6,
    "seed": 3,
    "checkpoint": {"interval": 3, "keep_last": 1},
    "rollout": {"replicas": 1, "max_inflight": 64},
}

#: What the preemption tests change in :data:`SHORT_RUN`: batch 18 with groups of 4 leaves overflow in the
#: queue, and 2 members per request leaves half-finished groups, so a pause always has work to keep.
PREEMPTION_RUN: dict[str, Any] = {
    **SHORT_RUN,
    "batch_size": 18,
    "max_off_policy_steps": 2,
    "checkpoint": {"interval": 4, "keep_last": 2},
    "rollout": {"replicas": 1, "max_inflight": 64, "members_per_request": 2},
}


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def rlrun_examples() -> list[Path]:
    """The RLRun manifests under ``examples/`` (every ``*.yaml`` whose first document is an RLRun: ``examples/kueue/``
    also holds Kueue's own objects, checked against Kueue's schemas in ``tests/kube/test_kueue.py``)."""

    def kind(path: Path) -> str | None:
        return (next(yaml.safe_load_all(path.read_text()), None) or {}).get("kind")

    return [p for p in sorted(EXAMPLES.glob("**/*.yaml")) if kind(p) == "RLRun"]


def manifest(name: str = "demo", base: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """An RLRun document named ``name``: :data:`MINIMAL_SPEC`, then ``base``'s top-level fields, then ``spec``'s."""
    body = {**MINIMAL_SPEC, **(base or {}), **spec}
    return {"apiVersion": "rlrun.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": name}, "spec": body}


def parse(name: str = "demo", base: dict[str, Any] | None = None, **spec: Any) -> RLRun:
    """:func:`manifest`, validated as ``rlrun`` reads it.

    Raises:
        rlrun.manifest.ManifestError: the overrides make it invalid (naming the field).
    """
    return parse_manifest(manifest(name, base, **spec))


def write_manifest(path: Path, name: str = "demo", base: dict[str, Any] | None = None, **spec: Any) -> Path:
    """Write :func:`manifest` as YAML to ``path``; returns ``path``."""
    path.write_text(yaml.safe_dump(manifest(name, base, **spec)))
    return path
