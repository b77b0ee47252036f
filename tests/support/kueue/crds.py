"""Kueue's CustomResourceDefinitions (Kueue v0.13, ``kueue.x-k8s.io/v1beta1``), as the API emulator serves them.

Written from Kueue's Go API types (``apis/kueue/v1beta1/*_types.go`` of kubernetes-sigs/kueue: their
kubebuilder markers give the scopes, short names, printer columns, defaults, enums and bounds), reduced
to what a job integration reads and writes: the Workload's spec and admission status in full, the pod
template and the rarely used parts (``preemption``, ``flavorFungibility``, admission checks' states,
``requeueState``) kept as objects that preserve unknown fields. The CEL rules Kueue declares on the
fields kept are copied; the emulator does not evaluate them (``tests/support/crd_validation.cel_violations``
can). A status write is validated like any other: a condition must be a whole ``metav1.Condition``
(type, status, reason, message, lastTransitionTime).
"""

from __future__ import annotations

from typing import Any

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta1"

#: RFC 1123 subdomain (names Kueue references: queues, flavors, priority classes) and label (pod set names)
_SUBDOMAIN = {
    "type": "string",
    "maxLength": 253,
    "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
}
_POD_SET_NAME = {"type": "string", "maxLength": 63, "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
#: resource.Quantity as controller-gen writes it
_QUANTITY = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "pattern": (
        r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
        r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
    ),
    "x-kubernetes-int-or-string": True,
}
_RESOURCE_LIST = {"type": "object", "additionalProperties": _QUANTITY}
_ANY_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

#: metav1.Condition
CONDITION_SCHEMA = {
    "type": "object",
    "required": ["lastTransitionTime", "message", "reason", "status", "type"],
    "properties": {
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "message": {"type": "string", "maxLength": 32768},
        "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
        "reason": {
            "type": "string",
            "minLength": 1,
            "maxLength": 1024,
            "pattern": r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        },
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "type": {
            "type": "string",
            "maxLength": 316,
            "pattern": (
                r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
            ),
        },
    },
}

_TOLERATION = {
    "type": "object",
    "properties": {
        "effect": {"type": "string"},
        "key": {"type": "string"},
        "operator": {"type": "string"},
        "tolerationSeconds": {"type": "integer", "format": "int64"},
        "value": {"type": "string"},
    },
}
_TAINT = {
    "type": "object",
    "required": ["effect", "key"],
    "properties": {
        "effect": {"type": "string"},
        "key": {"type": "string"},
        "timeAdded": {"type": "string", "format": "date-time"},
        "value": {"type": "string"},
    },
}
_LABEL_SELECTOR = {
    "type": "object",
    "x-kubernetes-map-type": "atomic",
    "properties": {
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"type": "string"},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
        "matchLabels": _STRING_MAP,
    },
}


def _map_list(items: dict[str, Any], key: str = "name", max_items: int | None = None, **extra: Any) -> dict[str, Any]:
    """A ``+listType=map`` list of ``items`` keyed by ``key``."""
    bound = {"maxItems": max_items} if max_items is not None else {}
    return {
        "type": "array",
        "items": items,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": [key],
        **bound,
        **extra,
    }


_WORKLOAD_SPEC = {
    "type": "object",
    "required": ["podSets"],
    "properties": {
        "podSets": _map_list(
            {
                "type": "object",
                "required": ["count", "template"],
                "properties": {
                    "name": {**_POD_SET_NAME, "default": "main"},
                    "template": {
                        "type": "object",
                        "description": (
                            "the pod template (corev1.PodTemplateSpec): "
                            "its containers' requests × count are what Kueue counts"
                        ),
                        "x-kubernetes-preserve-unknown-fields": True,
                    },
                    "count": {"type": "integer", "format": "int32", "minimum": 0, "default": 1},
                    "minCount": {"type": "integer", "format": "int32", "minimum": 1},
                    "topologyRequest": _ANY_OBJECT,
                },
                "x-kubernetes-validations": [
                    {
                        "rule": "has(self.minCount) ? self.minCount <= self.count : true",
                        "message": "minCount should be positive and less or equal to count",
                    }
                ],
            },
            max_items=8,
            minItems=1,
        ),
        "queueName": _SUBDOMAIN,
        "priorityClassName": _SUBDOMAIN,
        "priority": {"type": "integer", "format": "int32"},
        "priorityClassSource": {
            "type": "string",
            "enum": ["kueue.x-k8s.io/workloadpriorityclass", "scheduling.k8s.io/priorityclass", ""],
            "default": "",
        },
        "active": {"type": "boolean", "default": True},
        "maximumExecutionTimeSeconds": {"type": "integer", "format": "int32", "minimum": 1},
    },
    "x-kubernetes-validations": [
        {
            "rule": "has(self.priorityClassName) ? has(self.priority) : true",
            "message": "priority should not be nil when priorityClassName is set",
        }
    ],
}

_POD_SET_ASSIGNMENT = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {**_POD_SET_NAME, "default": "main"},
        "flavors": {"type": "object", "additionalProperties": _SUBDOMAIN},
        "resourceUsage": _RESOURCE_LIST,
        "count": {"type": "integer", "format": "int32", "minimum": 0},
        "topologyAssignment": _ANY_OBJECT,
    },
}

_WORKLOAD_STATUS = {
    "type": "object",
    "properties": {
        "admission": {
            "type": "object",
            "required": ["clusterQueue", "podSetAssignments"],
            "properties": {
                "clusterQueue": _SUBDOMAIN,
                "podSetAssignments": _map_list(_POD_SET_ASSIGNMENT, max_items=8),
            },
        },
        "conditions": _map_list(CONDITION_SCHEMA, key="type"),
        "requeueState": {
            "type": "object",
            "properties": {
                "count": {"type": "integer", "format": "int32", "minimum": 0},
                "requeueAt": {"type": "string", "format": "date-time"},
            },
        },
        "reclaimablePods": _map_list(
            {
                "type": "object",
                "required": ["count", "name"],
                "properties": {"name": _POD_SET_NAME, "count": {"type": "integer", "format": "int32", "minimum": 0}},
            },
            max_items=8,
        ),
        "admissionChecks": _map_list(
            {**_ANY_OBJECT, "required": ["lastTransitionTime", "message", "name", "state"]}, max_items=8
        ),
        "resourceRequests": _map_list(
            {
                "type": "object",
                "required": ["name"],
                "properties": {"name": _POD_SET_NAME, "resources": _RESOURCE_LIST},
            },
            max_items=8,
        ),
        "accumulatedPastExexcutionTimeSeconds": {"type": "integer", "format": "int32"},
    },
}

_CLUSTER_QUEUE_SPEC = {
    "type": "object",
    "properties": {
        "resourceGroups": {
            "type": "array",
            "maxItems": 16,
            "x-kubernetes-list-type": "atomic",
            "items": {
                "type": "object",
                "required": ["coveredResources", "flavors"],
                "properties": {
                    "coveredResources": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 64},
                    "flavors": _map_list(
                        {
                            "type": "object",
                            "required": ["name", "resources"],
                            "properties": {
                                "name": _SUBDOMAIN,
                                "resources": _map_list(
                                    {
                                        "type": "object",
                                        "required": ["name", "nominalQuota"],
                                        "properties": {
                                            "name": {"type": "string"},
                                            "nominalQuota": _QUANTITY,
                                            "borrowingLimit": _QUANTITY,
                                            "lendingLimit": _QUANTITY,
                                        },
                                    },
                                    max_items=64,
                                    minItems=1,
                                ),
                            },
                        },
                        max_items=64,
                        minItems=1,
                    ),
                },
                "x-kubernetes-validations": [
                    {
                        "rule": "self.flavors.all(x, size(x.resources) == size(self.coveredResources))",
                        "message": "flavors must have the same number of resources as the coveredResources",
                    }
                ],
            },
        },
        "cohort": _SUBDOMAIN,
        "queueingStrategy": {"type": "string", "enum": ["StrictFIFO", "BestEffortFIFO"], "default": "BestEffortFIFO"},
        "namespaceSelector": _LABEL_SELECTOR,
        "flavorFungibility": {**_ANY_OBJECT, "default": {}},
        "preemption": {**_ANY_OBJECT, "default": {}},
        "admissionChecks": {"type": "array", "items": {"type": "string"}},
        "admissionChecksStrategy": _ANY_OBJECT,
        "stopPolicy": {"type": "string", "enum": ["None", "Hold", "HoldAndDrain"], "default": "None"},
        "fairSharing": _ANY_OBJECT,
    },
}


def _crd(
    kind: str,
    plural: str,
    scope: str,
    schema: dict[str, Any],
    short_names: list[str] | None = None,
    columns: list[tuple[str, str, str, str]] = (),
    status: bool = True,
) -> dict[str, Any]:
    """One ``apiextensions.k8s.io/v1`` CRD of Kueue's group; ``columns``: (name, JSONPath, type, description)."""
    names: dict[str, Any] = {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower()}
    if short_names:
        names["shortNames"] = short_names
    version: dict[str, Any] = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
        "additionalPrinterColumns": [
            {"name": n, "jsonPath": path, "type": t, "description": d} for n, path, t, d in columns
        ],
    }
    if status:
        version["subresources"] = {"status": {}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {"group": GROUP, "names": names, "scope": scope, "versions": [version]},
    }


def _object(spec: dict[str, Any] | None = None, status: bool = True, **top: Any) -> dict[str, Any]:
    properties: dict[str, Any] = dict(top)
    if spec is not None:
        properties["spec"] = spec
    if status:
        properties["status"] = _ANY_OBJECT
    return {"type": "object", "properties": properties}


WORKLOAD_CRD = _crd(
    "Workload",
    "workloads",
    "Namespaced",
    {"type": "object", "properties": {"spec": _WORKLOAD_SPEC, "status": _WORKLOAD_STATUS}},
    short_names=["wl"],
    columns=[
        ("Queue", ".spec.queueName", "string", "Name of the queue this workload was submitted to"),
        (
            "Reserved in",
            ".status.admission.clusterQueue",
            "string",
            "Name of the ClusterQueue where the workload is reserving quota",
        ),
        ("Admitted", ".status.conditions[?(@.type=='Admitted')].status", "string", "Admission status"),
        ("Finished", ".status.conditions[?(@.type=='Finished')].status", "string", "Workload finished"),
        ("Age", ".metadata.creationTimestamp", "date", "Time this workload was created"),
    ],
)
RESOURCE_FLAVOR_CRD = _crd(
    "ResourceFlavor",
    "resourceflavors",
    "Cluster",
    _object(
        {
            "type": "object",
            "properties": {
                "nodeLabels": {**_STRING_MAP, "maxProperties": 8, "x-kubernetes-map-type": "atomic"},
                "nodeTaints": {"type": "array", "items": _TAINT, "maxItems": 8, "x-kubernetes-list-type": "atomic"},
                "tolerations": {
                    "type": "array",
                    "items": _TOLERATION,
                    "maxItems": 8,
                    "x-kubernetes-list-type": "atomic",
                },
                "topologyName": _SUBDOMAIN,
            },
        },
        status=False,
    ),
    short_names=["flavor", "flavors", "rf"],
    status=False,
)
CLUSTER_QUEUE_CRD = _crd(
    "ClusterQueue",
    "clusterqueues",
    "Cluster",
    _object(_CLUSTER_QUEUE_SPEC),
    short_names=["cq"],
    columns=[
        ("Cohort", ".spec.cohort", "string", "Cohort that this ClusterQueue belongs to"),
        ("Pending Workloads", ".status.pendingWorkloads", "integer", "Number of pending workloads"),
        (
            "Admitted Workloads",
            ".status.admittedWorkloads",
            "integer",
            "Number of admitted workloads that haven't finished yet",
        ),
    ],
)
LOCAL_QUEUE_CRD = _crd(
    "LocalQueue",
    "localqueues",
    "Namespaced",
    _object(
        {
            "type": "object",
            "properties": {
                "clusterQueue": _SUBDOMAIN,
                "stopPolicy": {"type": "string", "enum": ["None", "Hold", "HoldAndDrain"], "default": "None"},
            },
        }
    ),
    short_names=["queue", "queues", "lq"],
    columns=[
        ("ClusterQueue", ".spec.clusterQueue", "string", "Backing ClusterQueue"),
        ("Pending Workloads", ".status.pendingWorkloads", "integer", "Number of pending workloads"),
        (
            "Admitted Workloads",
            ".status.admittedWorkloads",
            "integer",
            "Number of admitted workloads that haven't finished yet",
        ),
    ],
)
WORKLOAD_PRIORITY_CLASS_CRD = _crd(
    "WorkloadPriorityClass",
    "workloadpriorityclasses",
    "Cluster",
    {
        "type": "object",
        "required": ["value"],
        "properties": {"value": {"type": "integer", "format": "int32"}, "description": {"type": "string"}},
    },
    columns=[("Value", ".value", "integer", "Value of workloadPriorityClass's Priority")],
    status=False,
)

#: The CRDs a job integration meets: Workload, ResourceFlavor, ClusterQueue, LocalQueue, WorkloadPriorityClass.
KUEUE_CRDS: list[dict[str, Any]] = [
    WORKLOAD_CRD,
    RESOURCE_FLAVOR_CRD,
    CLUSTER_QUEUE_CRD,
    LOCAL_QUEUE_CRD,
    WORKLOAD_PRIORITY_CLASS_CRD,
]
