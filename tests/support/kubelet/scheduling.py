"""Which node a pod may run on: the scheduler's filters that matter to the operator's pods (pure).

Checked, as kube-scheduler's filter plugins do: the node is Ready and not cordoned
(``NodeUnschedulable``), the pod's ``nodeSelector`` (``NodeAffinity``), its required node
affinity (``requiredDuringSchedulingIgnoredDuringExecution``: terms ORed, expressions ANDed,
operators ``In NotIn Exists DoesNotExist Gt Lt``), and every ``NoSchedule``/``NoExecute``
taint tolerated (``TaintToleration``). Not checked: resource requests (every node is this
machine), ports, volumes' topology, preferred affinity and ``PreferNoSchedule`` taints.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: The taint the node lifecycle controller puts on a cordoned node, tolerable like any other.
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"


def tolerates(tolerations: Iterable[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    """Whether one of ``tolerations`` tolerates ``taint`` (Kubernetes' ``Toleration.ToleratesTaint``)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("key") and t["key"] != taint.get("key"):
            continue
        if not t.get("key") and t.get("operator") != "Exists":
            continue  # an empty key matches every taint only with operator Exists
        if t.get("operator", "Equal") == "Exists" or t.get("value", "") == taint.get("value", ""):
            return True
    return False


def _expression_holds(expr: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values") or []
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt"):
        try:
            have, want = int(labels[key]), int(values[0])
        except (KeyError, IndexError, ValueError):
            return False
        return have > want if op == "Gt" else have < want
    raise ValueError(f"unknown node selector operator {op!r}")


def is_ready(node: Mapping[str, Any]) -> bool:
    """The node's ``Ready`` condition is ``True``."""
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def unfit_reason(pod: Mapping[str, Any], node: Mapping[str, Any]) -> str | None:
    """Why ``pod`` cannot be scheduled on ``node`` (a short phrase), or None when it can."""
    spec, labels = pod.get("spec") or {}, node["metadata"].get("labels") or {}
    tolerations = spec.get("tolerations") or []
    if not is_ready(node):
        return "node not ready"
    if (node.get("spec") or {}).get("unschedulable") and not tolerates(
        tolerations, {"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"}
    ):
        return "node unschedulable"
    for key, value in (spec.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return "node selector"
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if required:
        terms = required.get("nodeSelectorTerms") or []
        # an empty term matches no node (Kubernetes' rule), hence the ``t.get(...) and``
        if not any(
            t.get("matchExpressions") and all(_expression_holds(e, labels) for e in t["matchExpressions"])
            for t in terms
        ):
            return "node affinity"
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
            return f"untolerated taint {taint['key']}"
    return None


def choose_node(pod: Mapping[str, Any], nodes: Iterable[Mapping[str, Any]], load: Mapping[str, int]) -> str | None:
    """The node ``pod`` goes to: of those it fits, the one running fewest pods (``load``), then by name.

    Spreading is what keeps one node loss from taking every role of a run in these tests.
    """
    fitting = [n["metadata"]["name"] for n in nodes if unfit_reason(pod, n) is None]
    return min(fitting, key=lambda name: (load.get(name, 0), name)) if fitting else None
