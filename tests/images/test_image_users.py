"""Each image runs as its non-root user, as the chart's and the operator's securityContexts run it, and ``rlrun``
works with the root file system read-only (``readOnlyRootFilesystem: true``); nothing of the build's pip
configuration is left in an image."""

from __future__ import annotations

import pytest

from tests.support.images import CPU_IMAGE, OPERATOR_IMAGE, Container, image_config, run_read_only

#: image → the uid:gid it runs as (the chart's securityContext; ``rlrun_operator.pods.RUN_AS_USER``)
USERS = {OPERATOR_IMAGE: "65532:65532", CPU_IMAGE: "1000:1000"}


@pytest.mark.parametrize("image", USERS)
def test_image_runs_rlrun_as_its_non_root_user_with_a_read_only_root(images, image):
    assert image_config(image)["User"] == USERS[image]
    done = run_read_only(image, ["sh", "-c", "id -u; id -g; rlrun --help; touch /rlrun-probe"])
    lines = done.stdout.splitlines()
    assert lines[:2] == USERS[image].split(":"), done.stdout[-2000:]
    assert "Preemption-safe asynchronous RL" in done.stdout, done.stdout[-2000:]
    assert "Read-only file system" in lines[-1]  # the root really was read-only


@pytest.mark.parametrize("image", USERS)
def test_image_keeps_no_trace_of_the_build_s_pip_configuration(images, image):
    with Container(image) as container:
        done = container.run(["sh", "-c", "ls -a /run; python -m pip config list; echo done"])
    assert done.returncode == 0 and done.stdout.rstrip().endswith("done"), done.stdout
    assert "rlrun-build" not in done.stdout
    assert "cert" not in done.stdout and "find-links" not in done.stdout and "index-url" not in done.stdout
