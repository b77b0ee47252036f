"""End-to-end fixtures: a ``LocalCluster`` per test (API emulator, three fake nodes whose pods are
real processes, the real ``rlrun operator`` process), its volume pre-seeded with the tiny model."""

from __future__ import annotations

import pytest

from tests.support.kubelet import LocalCluster

from .runs import OPERATOR_ENV, seed_model


@pytest.fixture
def cluster(tmp_path, cache_dir):
    with LocalCluster(tmp_path / "cluster", operator_env=OPERATOR_ENV) as c:
        seed_model(c, cache_dir)
        try:
            yield c
        finally:
            # what happened, for a failing test's report
            print("\n".join(f"{t:.1f} {what}" for t, what in c.timeline))
