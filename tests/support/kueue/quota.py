"""What Kueue's scheduler decides for one Workload: its pod sets' requests and the flavors that hold them (pure).

Invariant: a Workload is assigned only if every pod set fits, in one flavor per resource group, in the
quota its ClusterQueue has left (``nominalQuota`` minus what the workloads reserving quota there use,
minus what this workload's earlier pod sets took); otherwise the message says why, in Kueue's words.

Follows Kueue v0.13's ``pkg/scheduler/flavorassigner`` (``assignFlavors``, ``findFlavorForPodSetResource``,
``fitsResourceQuota``, ``Assignment.Message``) and ``pkg/workload`` (a pod set's requests: the pod's
requests, a container's limits standing in for missing requests, × count), reduced to one ClusterQueue
without cohort: no borrowing, no preemption, no topology, no partial admission. Flavors are tried in order
and the first where every requested resource of the group fits wins (flavor fungibility's default,
``whenCanPreempt: TryNextFlavor``); a flavor must tolerate the pod set's taints and match its node
selector / required node affinity on the flavors' label keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kubernetes.utils.quantity import parse_quantity

#: resources Kueue counts in units of 1/1000 (``MilliValue``); every other resource in whole units (``Value``)
_MILLI = {"cpu"}
_DECIMAL_SUFFIXES = {-9: "n", -6: "u", -3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}
_BINARY_SUFFIXES = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]

#: (flavor, resource) → amount, in the units of :func:`amount`
Usage = dict[tuple[str, str], int]


def amount(resource: str, quantity: str | int | float) -> int:
    """A Kubernetes quantity as Kueue counts it: millis for cpu (``"500m"`` → 500), else whole units rounded up.

    Raises:
        ValueError: not a quantity.
    """
    value = parse_quantity(quantity)
    return math.ceil(value * 1000) if resource in _MILLI else math.ceil(value)


def quantity(resource: str, value: int) -> str:
    """:func:`amount`'s inverse in Kubernetes' canonical form (``resource.Quantity.String()``): ``"1500m"``, ``"4"``,
    ``"8Gi"``; memory, ephemeral storage and huge pages in binary suffixes when exact (``ResourceQuantityString``)."""
    binary = resource in ("memory", "ephemeral-storage") or resource.startswith("hugepages-")
    if binary and abs(value) >= 1024:
        exponent = 0
        while value % 1024 == 0 and exponent < len(_BINARY_SUFFIXES) - 1:
            value //= 1024
            exponent += 1
        return f"{value}{_BINARY_SUFFIXES[exponent]}"
    if value == 0:
        return "0"
    exponent = -3 if resource in _MILLI else 0
    while value % 10 == 0 and exponent < 18:
        value //= 10
        exponent += 1
    shown = exponent - exponent % 3  # Go rounds the exponent down to a multiple of 3
    return f"{value * 10 ** (exponent - shown)}{_DECIMAL_SUFFIXES[shown]}"


def pod_requests(template: dict[str, Any]) -> dict[str, int]:
    """One pod's requests (:func:`amount` units): the containers' sum, at least each init container's, plus overhead.

    A container's limit stands in for a request it lacks (as the API server defaults it). Restartable
    (sidecar) init containers are counted as containers. Source: ``k8s.io/component-helpers/resource``
    ``PodRequests``, which Kueue uses.
    """
    spec = template.get("spec") or {}

    def requests(container: dict[str, Any]) -> dict[str, int]:
        resources = container.get("resources") or {}
        merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        return {name: amount(name, q) for name, q in merged.items()}

    total: dict[str, int] = {}
    sidecars: dict[str, int] = {}
    inits: dict[str, int] = {}
    for container in spec.get("containers") or []:
        for name, value in requests(container).items():
            total[name] = total.get(name, 0) + value
    for container in spec.get("initContainers") or []:
        for name, value in requests(container).items():
            if container.get("restartPolicy") == "Always":
                sidecars[name] = sidecars.get(name, 0) + value
            else:  # an init container runs beside the sidecars started before it
                inits[name] = max(inits.get(name, 0), value + sidecars.get(name, 0))
    for name in {*total, *sidecars, *inits}:
        total[name] = max(total.get(name, 0) + sidecars.get(name, 0), inits.get(name, 0))
    for name, q in (spec.get("overhead") or {}).items():
        total[name] = total.get(name, 0) + amount(name, q)
    return total


def pod_set_requests(pod_set: dict[str, Any]) -> dict[str, int]:
    """A pod set's requests: :func:`pod_requests` × ``count`` (``pods`` is added by :func:`assign` when covered)."""
    count = pod_set.get("count", 1)
    return {name: value * count for name, value in pod_requests(pod_set.get("template") or {}).items()}


# -- placement: taints and node selectors against a flavor -----------------------------------------------


def _tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    """``corev1.Toleration.ToleratesTaint``."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    if toleration.get("operator") == "Exists":
        return True
    return bool(toleration.get("key")) and toleration.get("value", "") == taint.get("value", "")


def _taint_string(taint: dict[str, Any]) -> str:
    """``corev1.Taint.ToString``: ``key=value:effect``, or ``key:effect`` without a value."""
    value = f"={taint['value']}" if taint.get("value") else ""
    return f"{taint['key']}{value}:{taint.get('effect', '')}"


def expression_matches(expression: dict[str, Any], labels: dict[str, str]) -> bool:
    """A node selector requirement / label selector requirement (In, NotIn, Exists, DoesNotExist) on ``labels``.

    Raises:
        ValueError: another operator (Gt, Lt: not played here).
    """
    key, op, values = expression["key"], expression["operator"], expression.get("values") or []
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    raise ValueError(f"node selector operator {op!r} is not played by the Kueue stand-in")


def _placement_mismatch(pod_spec: dict[str, Any], flavor: dict[str, Any], label_keys: set[str]) -> str | None:
    """Why ``flavor`` cannot hold pods of ``pod_spec`` (None: it can), as ``findFlavorForPodSetResource`` says it."""
    name, fspec = flavor["metadata"]["name"], flavor.get("spec") or {}
    tolerations = [*(pod_spec.get("tolerations") or []), *(fspec.get("tolerations") or [])]
    for taint in fspec.get("nodeTaints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not any(_tolerates(t, taint) for t in tolerations):
            return f"untolerated taint {_taint_string(taint)} in flavor {name}"
    labels = fspec.get("nodeLabels") or {}
    selector = {k: v for k, v in (pod_spec.get("nodeSelector") or {}).items() if k in label_keys}
    matches = all(labels.get(k) == v for k, v in selector.items())
    affinity = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    # Only expressions on the flavors' label keys count; a term left empty matches every flavor (terms are ORed).
    terms = [
        [e for e in term.get("matchExpressions") or [] if e["key"] in label_keys]
        for term in affinity.get("nodeSelectorTerms") or []
    ]
    if terms and all(terms):
        matches = matches and any(all(expression_matches(e, labels) for e in term) for term in terms)
    return None if matches else f"flavor {name} doesn't match node affinity"


# -- the assignment -------------------------------------------------------------------------------------

FIT, PREEMPT, NO_FIT = "fit", "preempt", "noFit"


@dataclass
class Assignment:
    """What the flavor assigner found for a Workload.

    Attributes:
        pod_set_assignments: ``status.admission.podSetAssignments`` when every pod set fits, else None.
        message: why it does not fit (Kueue's ``Assignment.Message()``), '' when it does.
        usage: what it would take, (flavor, resource) → amount.
    """

    pod_set_assignments: list[dict[str, Any]] | None
    message: str
    usage: Usage


def _flavor_for_group(
    group: dict[str, Any],
    requests: dict[str, int],
    pod_spec: dict[str, Any],
    flavors: dict[str, dict[str, Any]],
    free: Usage,
    nominal: Usage,
    taken: Usage,
) -> tuple[str | None, str, list[str]]:
    """(flavor, mode, reasons) for the requested resources of one resource group: the first flavor that fits,
    else the best one that would fit after preemption (mode ``preempt``), else none (``noFit``)."""
    # the keys a pod set's node selector is matched on: every label any flavor of the group has
    label_keys = {
        key
        for entry in group["flavors"]
        for key in ((flavors.get(entry["name"]) or {}).get("spec") or {}).get("nodeLabels") or {}
    }
    reasons: list[str] = []
    best, best_mode = None, NO_FIT
    for entry in group["flavors"]:
        name = entry["name"]
        if name not in flavors:
            reasons.append(f"flavor {name} not found")
            continue
        mismatch = _placement_mismatch(pod_spec, flavors[name], label_keys)
        if mismatch:
            reasons.append(mismatch)
            continue
        mode = FIT
        for resource, value in requests.items():
            need = value + taken.get((name, resource), 0)
            limit, available = nominal.get((name, resource), 0), free.get((name, resource), 0)
            if need > limit:
                reasons.append(
                    f"insufficient quota for {resource} in flavor {name}, request > maximum capacity "
                    f"({quantity(resource, need)} > {quantity(resource, limit)})"
                )
                mode = NO_FIT
                break
            if need > available:
                reasons.append(
                    f"insufficient unused quota for {resource} in flavor {name}, "
                    f"{quantity(resource, need - available)} more needed"
                )
                mode = PREEMPT
        if mode == FIT:
            return name, FIT, []
        if mode == PREEMPT and best is None:
            best, best_mode = name, PREEMPT
    return best, best_mode, reasons


def assign(
    workload: dict[str, Any], cluster_queue: dict[str, Any], flavors: dict[str, dict[str, Any]], used: Usage
) -> Assignment:
    """Assign flavors to every pod set of ``workload`` in ``cluster_queue``, given what other workloads use there.

    Args:
        flavors: the ResourceFlavors by name.
        used: (flavor, resource) → amount reserved in this ClusterQueue by the other workloads.
    """
    groups = (cluster_queue.get("spec") or {}).get("resourceGroups") or []
    nominal: Usage = {
        (f["name"], r["name"]): amount(r["name"], r["nominalQuota"])
        for g in groups
        for f in g["flavors"]
        for r in f["resources"]
    }
    free = {key: limit - used.get(key, 0) for key, limit in nominal.items()}
    covers_pods = any("pods" in g["coveredResources"] for g in groups)
    taken: Usage = {}
    assignments, messages, modes = [], [], []
    for pod_set in workload["spec"]["podSets"]:
        name, count = pod_set.get("name", "main"), pod_set.get("count", 1)
        requests = pod_set_requests(pod_set)
        if covers_pods:
            requests["pods"] = count
        pod_spec = (pod_set.get("template") or {}).get("spec") or {}
        chosen: dict[str, str] = {}
        reasons: list[str] = []
        mode = FIT
        for resource in requests:
            if resource in chosen:
                continue
            group = next((g for g in groups if resource in g["coveredResources"]), None)
            if group is None:
                reasons, mode = [f"resource {resource} unavailable in ClusterQueue"], NO_FIT
                break
            in_group = {r: v for r, v in requests.items() if r in group["coveredResources"]}
            flavor, group_mode, group_reasons = _flavor_for_group(
                group, in_group, pod_spec, flavors, free, nominal, taken
            )
            reasons += group_reasons
            if flavor is None:
                mode = NO_FIT
                break
            mode = PREEMPT if PREEMPT in (mode, group_mode) else FIT
            chosen.update(dict.fromkeys(in_group, flavor))
        if reasons or mode != FIT:
            messages.append(f"couldn't assign flavors to pod set {name}: {', '.join(sorted(reasons))}")
        modes.append(mode)
        if mode == NO_FIT:  # Kueue stops at the first pod set no flavor can hold
            break
        for resource, flavor in chosen.items():
            taken[flavor, resource] = taken.get((flavor, resource), 0) + requests[resource]
        assignments.append(
            {
                "name": name,
                "flavors": chosen,
                "resourceUsage": {r: quantity(r, v) for r, v in requests.items()},
                "count": count,
            }
        )
    if all(m == FIT for m in modes):
        return Assignment(assignments, "", taken)
    return Assignment(None, "; ".join(messages), taken)


def reserved_usage(workload: dict[str, Any]) -> Usage:
    """What an admitted workload holds: its ``podSetAssignments``' ``resourceUsage`` on their flavors."""
    usage: Usage = {}
    for psa in ((workload.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []:
        for resource, q in (psa.get("resourceUsage") or {}).items():
            flavor = (psa.get("flavors") or {}).get(resource)
            if flavor is not None:
                usage[flavor, resource] = usage.get((flavor, resource), 0) + amount(resource, q)
    return usage
