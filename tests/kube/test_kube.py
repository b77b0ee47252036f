"""``rlrun_operator.kube``: the operator's API calls against the emulator, with the real ``kubernetes`` client."""

from __future__ import annotations

import copy

import pytest
from rlrun_operator.kube import Kube


def pod(name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": "node-a",  # scheduled: deleting it is graceful unless it has ended
            "terminationGracePeriodSeconds": 45,
            "containers": [{"name": "trainer", "image": "rlrun:dev"}],
        },
    }


#: A container status the client's ``V1ContainerStatus`` model refuses (no image, imageID, ready,
#: restartCount): what the tests' kubelet stand-ins wrote, and what the delete answer carries back.
CONTAINER = {"name": "trainer", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}


@pytest.mark.parametrize(("phase", "graceful"), [("Failed", False), ("Running", True)])
def test_create_and_delete_do_not_depend_on_the_clients_models_accepting_the_answer(kube, api, phase, graceful):
    ops, name = Kube(api), f"demo-trainer-{phase.lower()}"
    assert ops.create(pod(name)) is True
    assert ops.create(copy.deepcopy(pod(name))) is False  # exists: idempotent by name
    status = {"phase": phase, "containerStatuses": [CONTAINER]}
    kube.patch("pods", name, {"status": status}, "default", subresource="status")
    ops.delete_pod("default", name)  # the answer would fail the client's model round trip
    left = kube.get("pods", name, "default")
    if graceful:  # deleted with the grace period it was created with: the kubelet finishes it
        assert left["metadata"]["deletionTimestamp"] and left["metadata"]["deletionGracePeriodSeconds"] == 45
    else:  # an ended pod goes at once, as the API server does
        assert left is None
    ops.delete_pod("default", "gone")  # a missing pod is fine
