"""A Kueue stand-in for the kube tier: Kueue's CRDs and the Workload transitions of its scheduler and workload
controller.

The real Kueue cannot run without a Kubernetes control plane; this plays Kueue v0.13's documented Workload
API (``kueue.x-k8s.io/v1beta1``) against the API emulator (``tests/support/kube``), with Kueue's own
condition types, reasons and messages. ``crds`` (the CRDs), ``quota`` (flavor assignment and quota, pure),
``conditions`` (the status transitions, pure), ``standin`` (``KueueStandIn``: the controller thread and
what tests ask of Kueue: evict, hold, release). Each module says how it differs from Kueue.
"""

from . import conditions
from .crds import KUEUE_CRDS
from .standin import CLUSTER_QUEUES, FLAVORS, LOCAL_QUEUES, PRIORITY_CLASSES, WORKLOADS, KueueStandIn

__all__ = [
    "CLUSTER_QUEUES",
    "FLAVORS",
    "KUEUE_CRDS",
    "LOCAL_QUEUES",
    "PRIORITY_CLASSES",
    "WORKLOADS",
    "KueueStandIn",
    "conditions",
]
