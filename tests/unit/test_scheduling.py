"""The fake nodes' scheduler filters (``tests.support.kubelet.scheduling``), as kube-scheduler's plugins decide."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.kubelet.scheduling import UNSCHEDULABLE_TAINT, choose_node, is_ready, tolerates, unfit_reason

SPOT = {"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule"}


def node(
    name: str = "node-1",
    ready: str = "True",
    labels: dict[str, str] | None = None,
    taints: list[dict[str, Any]] | None = None,
    unschedulable: bool = False,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"taints": taints or []}
    if unschedulable:
        spec["unschedulable"] = True
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "spec": spec,
        "status": {"conditions": [{"type": "MemoryPressure", "status": "False"}, {"type": "Ready", "status": ready}]},
    }


def pod(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": [{"name": "c"}], **spec}}


def required(*terms: list[dict[str, Any]]) -> dict[str, Any]:
    """``affinity`` with a required node affinity of ``terms`` (each a list of match expressions)."""
    selector = {"nodeSelectorTerms": [{"matchExpressions": t} for t in terms]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": selector}}


def expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": operator, **({"values": list(values)} if values else {})}


# -- tolerates ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toleration", "expected"),
    [
        ({"key": "k", "operator": "Equal", "value": "v", "effect": "NoSchedule"}, True),
        ({"key": "k", "value": "v", "effect": "NoSchedule"}, True),  # operator defaults to Equal
        ({"key": "k", "value": "v"}, True),  # no effect: every effect
        ({"key": "k", "operator": "Equal", "value": "w", "effect": "NoSchedule"}, False),
        ({"key": "k", "operator": "Equal", "effect": "NoSchedule"}, False),  # "" ≠ "v"
        ({"key": "k", "operator": "Exists", "effect": "NoSchedule"}, True),
        ({"key": "k", "operator": "Exists"}, True),
        ({"key": "other", "operator": "Exists"}, False),
        ({"operator": "Exists"}, True),  # empty key + Exists: everything
        ({"key": "", "operator": "Exists", "effect": "NoSchedule"}, True),
        ({"operator": "Exists", "effect": "NoExecute"}, False),
        ({"value": "v"}, False),  # empty key needs Exists
        ({"operator": "Equal", "value": "v", "effect": "NoSchedule"}, False),
        ({"key": "k", "operator": "Exists", "effect": "NoExecute"}, False),  # effect mismatch
        ({"key": "k", "operator": "Equal", "value": "v", "effect": "PreferNoSchedule"}, False),
    ],
)
def test_tolerates_one_taint(toleration, expected):
    assert tolerates([toleration], {"key": "k", "value": "v", "effect": "NoSchedule"}) is expected


def test_tolerates_a_taint_without_value_by_equal_without_value():
    assert tolerates([{"key": "k", "operator": "Equal", "effect": "NoSchedule"}], {"key": "k", "effect": "NoSchedule"})
    assert not tolerates([{"key": "k", "value": "x"}], {"key": "k", "effect": "NoSchedule"})


def test_tolerates_when_any_of_several_tolerations_does():
    taint = {"key": "k", "value": "v", "effect": "NoExecute"}
    assert tolerates([{"key": "a", "operator": "Exists"}, {"key": "k", "operator": "Exists"}], taint) is True
    assert tolerates([{"key": "a", "operator": "Exists"}, {"key": "b", "operator": "Exists"}], taint) is False
    assert tolerates([], taint) is False


# -- unfit_reason ----------------------------------------------------------------------------------


def test_a_plain_pod_fits_a_ready_node():
    assert is_ready(node()) is True
    assert unfit_reason(pod(), node()) is None


@pytest.mark.parametrize("status", ["False", "Unknown"])
def test_a_node_that_is_not_ready_fits_nothing(status):
    assert is_ready(node(ready=status)) is False
    assert unfit_reason(pod(), node(ready=status)) == "node not ready"
    tolerant = pod(tolerations=[{"operator": "Exists"}])
    assert unfit_reason(tolerant, node(ready=status)) == "node not ready"


def test_a_node_without_conditions_is_not_ready():
    bare = {"metadata": {"name": "n"}, "spec": {}}
    assert is_ready(bare) is False
    assert unfit_reason(pod(), bare) == "node not ready"


def test_a_cordoned_node_fits_only_pods_tolerating_unschedulable():
    cordoned = node(unschedulable=True)
    assert unfit_reason(pod(), cordoned) == "node unschedulable"
    tolerant = pod(tolerations=[{"key": UNSCHEDULABLE_TAINT, "operator": "Exists", "effect": "NoSchedule"}])
    assert unfit_reason(tolerant, cordoned) is None
    assert unfit_reason(pod(tolerations=[{"operator": "Exists"}]), cordoned) is None
    other = pod(tolerations=[{"key": "other", "operator": "Exists"}])
    assert unfit_reason(other, cordoned) == "node unschedulable"


def test_node_selector_needs_every_label():
    gpu = node(labels={"accelerator": "h100", "zone": "a"})
    assert unfit_reason(pod(nodeSelector={"accelerator": "h100"}), gpu) is None
    assert unfit_reason(pod(nodeSelector={"accelerator": "h100", "zone": "a"}), gpu) is None
    assert unfit_reason(pod(nodeSelector={"accelerator": "h100", "zone": "b"}), gpu) == "node selector"
    assert unfit_reason(pod(nodeSelector={"accelerator": "a100"}), gpu) == "node selector"
    assert unfit_reason(pod(nodeSelector={"accelerator": "h100"}), node()) == "node selector"


def test_lost_nodes_merged_as_not_in_hostname_are_avoided():
    """The operator adds ``kubernetes.io/hostname NotIn [lost nodes]`` to every term of a replacement pod."""
    lost = expr("kubernetes.io/hostname", "NotIn", "node-1", "node-3")
    p = pod(affinity=required([lost]))
    assert unfit_reason(p, node("node-1")) == "node affinity"
    assert unfit_reason(p, node("node-2")) is None
    assert unfit_reason(p, node("node-3")) == "node affinity"
    # merged into the user's own terms: each term keeps its own expressions AND the NotIn
    zone_a = expr("zone", "In", "a")
    zone_b = expr("zone", "In", "b")
    merged = pod(affinity=required([zone_a, lost], [zone_b, lost]))
    assert unfit_reason(merged, node("node-1", labels={"zone": "a"})) == "node affinity"
    assert unfit_reason(merged, node("node-2", labels={"zone": "a"})) is None
    assert unfit_reason(merged, node("node-2", labels={"zone": "b"})) is None
    assert unfit_reason(merged, node("node-2", labels={"zone": "c"})) == "node affinity"
    assert unfit_reason(merged, node("node-3", labels={"zone": "b"})) == "node affinity"


def test_not_in_holds_for_a_node_without_the_label():
    p = pod(affinity=required([expr("pool", "NotIn", "spot")]))
    assert unfit_reason(p, node()) is None
    assert unfit_reason(p, node(labels={"pool": "spot"})) == "node affinity"
    assert unfit_reason(p, node(labels={"pool": "ondemand"})) is None


def test_affinity_terms_are_ored_and_expressions_anded():
    p = pod(affinity=required([expr("a", "In", "1"), expr("b", "In", "2")], [expr("c", "Exists")]))
    assert unfit_reason(p, node(labels={"a": "1", "b": "2"})) is None
    assert unfit_reason(p, node(labels={"a": "1"})) == "node affinity"
    assert unfit_reason(p, node(labels={"b": "2"})) == "node affinity"
    assert unfit_reason(p, node(labels={"a": "1", "b": "3"})) == "node affinity"
    assert unfit_reason(p, node(labels={"c": ""})) is None
    assert unfit_reason(p, node(labels={"a": "0", "c": "x"})) is None
    assert unfit_reason(p, node()) == "node affinity"


@pytest.mark.parametrize(
    ("expression", "labels", "fits"),
    [
        (expr("zone", "In", "a", "b"), {"zone": "b"}, True),
        (expr("zone", "In", "a", "b"), {"zone": "c"}, False),
        (expr("zone", "In", "a"), {}, False),
        (expr("gpu", "Exists"), {"gpu": "h100"}, True),
        (expr("gpu", "Exists"), {"gpu": ""}, True),
        (expr("gpu", "Exists"), {}, False),
        (expr("gpu", "DoesNotExist"), {}, True),
        (expr("gpu", "DoesNotExist"), {"gpu": "h100"}, False),
        (expr("cores", "Gt", "8"), {"cores": "16"}, True),
        (expr("cores", "Gt", "8"), {"cores": "8"}, False),
        (expr("cores", "Gt", "8"), {"cores": "4"}, False),
        (expr("cores", "Gt", "8"), {}, False),
        (expr("cores", "Gt", "8"), {"cores": "many"}, False),
        (expr("cores", "Lt", "8"), {"cores": "4"}, True),
        (expr("cores", "Lt", "8"), {"cores": "8"}, False),
    ],
)
def test_affinity_operators(expression, labels, fits):
    expected = None if fits else "node affinity"
    assert unfit_reason(pod(affinity=required([expression])), node(labels=labels)) == expected


def test_an_unknown_affinity_operator_is_an_error():
    with pytest.raises(ValueError, match="unknown node selector operator 'Near'"):
        unfit_reason(pod(affinity=required([expr("zone", "Near", "a")])), node())


def test_affinity_without_terms_fits_nothing_and_empty_affinity_everything():
    none = pod(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}})
    assert unfit_reason(none, node()) == "node affinity"
    assert unfit_reason(pod(affinity={}), node()) is None
    assert unfit_reason(pod(affinity={"nodeAffinity": {}}), node()) is None


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute"])
def test_an_untolerated_taint_keeps_pods_off(effect):
    taint = {"key": "node.kubernetes.io/unreachable", "effect": effect}
    tainted = node(taints=[taint])
    assert unfit_reason(pod(), tainted) == "untolerated taint node.kubernetes.io/unreachable"
    tolerant = pod(tolerations=[{"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": effect}])
    assert unfit_reason(tolerant, tainted) is None


def test_the_spot_taint_keeps_pods_off_and_names_itself():
    assert unfit_reason(pod(), node(taints=[SPOT])) == "untolerated taint aws-node-termination-handler/spot-itn"


def test_the_first_untolerated_taint_is_named():
    taints = [{"key": "a", "effect": "NoSchedule"}, {"key": "b", "effect": "NoExecute"}]
    assert unfit_reason(pod(), node(taints=taints)) == "untolerated taint a"
    assert unfit_reason(pod(tolerations=[{"key": "a", "operator": "Exists"}]), node(taints=taints)) == (
        "untolerated taint b"
    )


def test_prefer_no_schedule_taints_are_ignored():
    assert unfit_reason(pod(), node(taints=[{"key": "soft", "effect": "PreferNoSchedule"}])) is None


def test_checks_come_in_order_readiness_cordon_selector_affinity_taints():
    p = pod(nodeSelector={"x": "1"}, affinity=required([expr("y", "Exists")]))
    assert unfit_reason(p, node(ready="False", unschedulable=True, taints=[SPOT])) == "node not ready"
    assert unfit_reason(p, node(unschedulable=True, taints=[SPOT])) == "node unschedulable"
    assert unfit_reason(p, node(taints=[SPOT])) == "node selector"
    assert unfit_reason(p, node(labels={"x": "1"}, taints=[SPOT])) == "node affinity"
    fits_labels = {"x": "1", "y": "2"}
    assert unfit_reason(p, node(labels=fits_labels, taints=[SPOT])) == f"untolerated taint {SPOT['key']}"
    assert unfit_reason(p, node(labels=fits_labels)) is None


# -- choose_node -----------------------------------------------------------------------------------


def test_choose_the_least_loaded_fitting_node():
    nodes = [node("node-1"), node("node-2"), node("node-3")]
    assert choose_node(pod(), nodes, {"node-1": 2, "node-2": 1, "node-3": 3}) == "node-2"
    assert choose_node(pod(), nodes, {"node-1": 1, "node-2": 1}) == "node-3"  # unlisted: 0


def test_choose_breaks_ties_by_name():
    nodes = [node("node-c"), node("node-a"), node("node-b")]
    assert choose_node(pod(), nodes, {}) == "node-a"
    assert choose_node(pod(), nodes, {"node-a": 1}) == "node-b"
    assert choose_node(pod(), nodes, {"node-a": 1, "node-b": 1, "node-c": 1}) == "node-a"


def test_choose_skips_nodes_the_pod_does_not_fit_even_when_less_loaded():
    nodes = [node("node-1", taints=[SPOT]), node("node-2", ready="Unknown"), node("node-3")]
    assert choose_node(pod(), nodes, {"node-1": 0, "node-2": 0, "node-3": 5}) == "node-3"
    avoid = pod(affinity=required([expr("kubernetes.io/hostname", "NotIn", "node-3")]))
    assert choose_node(avoid, nodes, {}) is None


def test_choose_nothing_when_no_node_fits_or_there_is_none():
    assert choose_node(pod(), [node("node-1", unschedulable=True)], {}) is None
    assert choose_node(pod(), [], {}) is None
