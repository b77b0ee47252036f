"""A Kueue eviction with real processes: the run is admitted by Kueue (its stand-in,
``tests/support/kueue``), trains on the admitted flavor's node, is evicted mid-generation with samples queued
and groups open, pauses and snapshots, stops, gives its quota back, and is readmitted on another flavor: the
next attempt resumes (``--resume``) and finishes, with ``rlrun ledger check`` proving no finished episode was
lost or trained twice. The operator is the real ``rlrun operator`` process with its Kueue integration on.
"""

from __future__ import annotations

import pytest
from rlrun_operator.naming import QUEUE_LABEL

from tests.cluster.test_node_loss import bound_nodes
from tests.support.polling import wait_for
from tests.support.scenarios import (
    NAME,
    OPERATOR_ENV,
    apply,
    ledger_check,
    manifest,
    wait_for_end,
    wait_for_generation,
    wait_for_training,
)

pytestmark = pytest.mark.timeout(600)

WORKLOAD = f"rlrun-{NAME}"
#: Two flavors, each a pool of one fake node (its hostname label); the ClusterQueue first offers only ``pool-a``.
FLAVORS = {"pool-a": "node-1", "pool-b": "node-2"}
QUOTA = {"cpu": "64", "memory": "256Gi"}


@pytest.fixture
def operator_env() -> dict[str, str]:
    return {**OPERATOR_ENV, "RLRUN_OPERATOR_KUEUE_ENABLED": "1"}


@pytest.fixture
def kueue(cluster):
    """Kueue's stand-in on the cluster: flavors ``pool-a`` and ``pool-b``, ClusterQueue ``cq`` (``pool-a`` only)
    and LocalQueue ``team-q``."""
    from tests.support.kueue import KueueStandIn

    standin = KueueStandIn(cluster.kube, cluster.namespace)
    standin.install()
    for flavor, node in FLAVORS.items():
        standin.flavor(flavor, node_labels={"kubernetes.io/hostname": node})
    standin.cluster_queue("cq", {"pool-a": QUOTA})
    standin.local_queue("team-q", "cq")
    with standin:
        yield standin


def condition(status: dict, type_: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_a_kueue_eviction_pauses_gives_the_quota_back_and_resumes_on_another_flavor(cluster, kueue):
    doc = manifest(max_steps=12)
    doc["metadata"]["labels"] = {QUEUE_LABEL: "team-q"}
    apply(cluster, doc)
    wait_for_training(cluster, 5)
    assert set(bound_nodes(cluster, 0).values()) == {"node-1"}  # the admitted flavor's node
    kueue.hold(WORKLOAD)  # it waits, queued, once evicted: the ClusterQueue changes meanwhile
    before = wait_for_generation(cluster)
    kueue.evict(WORKLOAD, reason="Preempted", message="Preempted to accommodate a higher priority workload")
    print(f"evicted at step {before.step} (policy {before.policy_version})")

    queued = wait_for(
        lambda: (s := cluster.status(NAME)).get("phase") == "Queued" and not cluster.pods(NAME) and s, 120, "Queued"
    )
    assert queued["recovery"]["trigger"] == "KueueEviction" and queued["recovery"]["reason"] == "Preempted"
    assert "queued traces" in queued["recovery"]["pause"], queued["recovery"]  # the snapshot was written
    assert condition(queued, "Admitted")["status"] == "False"
    workload = kueue.workload(WORKLOAD)
    assert "admission" not in workload["status"]  # the quota was given back, as Kueue's job integrations do
    assert kueue.condition(WORKLOAD, "QuotaReserved")["reason"] == "Pending"

    kueue.cluster_queue("cq", {"pool-b": QUOTA})  # pool-a is taken: readmission lands on the other flavor
    kueue.release(WORKLOAD)
    status = wait_for_end(cluster)
    assert set(bound_nodes(cluster, 1).values()) == {"node-2"}
    assert status["preemptions"] == 1 and status["suspensions"] == 0 and status["failures"] == 0
    assert status["lastResume"]["attempt"] == 1 and status["lastResume"]["fromStep"] >= 4
    assert status["lastResume"]["groups"] > 0 and status["resumedGroups"] == status["lastResume"]["groups"]
    assert status["queue"]["flavors"] and "pool-b" in str(status["queue"]["flavors"])
    finished = wait_for(lambda: kueue.condition(WORKLOAD, "Finished"), 10, "the Workload Finished")
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded")  # the quota is Kueue's again
    print(ledger_check(cluster))
