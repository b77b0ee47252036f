"""The cluster tier: a ``LocalCluster`` per test (API emulator, three fake nodes whose pods are real
processes, the real ``rlrun operator`` process), its volume pre-seeded with the tiny model.

Its rollout pods serve the fake vLLM (:data:`~tests.support.kubelet.FAKE_ROLLOUT_IMAGE_ENV`) unless the
test is marked ``vllm``: then they run real vLLM-CPU.
"""

from __future__ import annotations

import pytest

from tests.support.kubelet import FAKE_ROLLOUT_IMAGE_ENV, LocalCluster
from tests.support.scenarios import OPERATOR_ENV, seed_model


@pytest.fixture
def operator_env() -> dict[str, str]:
    """The ``RLRUN_OPERATOR_*`` settings of the cluster's operator process (a test module overrides this fixture
    to run it otherwise, e.g. with the Kueue integration on)."""
    return OPERATOR_ENV


@pytest.fixture
def cluster(request, tmp_path, cache_dir, operator_env):
    image_env = {} if request.node.get_closest_marker("vllm") else FAKE_ROLLOUT_IMAGE_ENV
    with LocalCluster(tmp_path / "cluster", operator_env=operator_env, image_env=image_env) as c:
        seed_model(c, cache_dir)
        try:
            yield c
        finally:
            # what happened, for a failing test's report
            print("\n".join(f"{t:.1f} {what}" for t, what in c.timeline))
