"""The rlrun-operator Helm chart as the real helm binary renders it, and what tests compare it with.

:func:`render` runs ``helm template`` (cached per set of values); :func:`permissions` flattens
RBAC rules into ``(apiGroup, resource, verb)`` triples, the form in which the RBAC proof
(``tests/kube/test_rbac.py``) compares the chart's grants with the calls the operator made;
:func:`scrape_targets` is which pods a PodMonitor scrapes, as the Prometheus Operator selects them.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path

import yaml
from kubernetes_validate import utils as kv_utils

from tests.support.binaries import helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rlrun-operator"
CRD_DIR = CHART / "crds"
CRD_FILE = CRD_DIR / "rlrun.dev_rlruns.yaml"
DASHBOARD_FILE = CHART / "dashboards" / "rlrun.json"
RELEASE, NAMESPACE = "rlrun", "rlrun-system"
# The newest Kubernetes version kubernetes-validate has schemas for ("1.37.0"); helm renders for it too.
K8S_VERSION = kv_utils.latest_version()
HEALTH_PORT, METRICS_PORT = 8080, 9090
WATCHED = ("team-a", "team-b")
CLUSTER_SCOPED_RESOURCES = {"customresourcedefinitions", "namespaces", "nodes"}
#: Grants no API call of the operator needs, but admission does: the OwnerReferencesPermissionEnforcement
#: plugin (OpenShift and other hardened clusters) admits an object whose ownerReference sets
#: blockOwnerDeletion: true only if its creator may update the owner's finalizers subresource,
#: and every object the operator creates is owned by its RLRun that way. The RBAC proof
#: (tests/kube/test_rbac.py) asserts them granted in both modes without expecting a call.
ADMISSION_REQUIRED = frozenset({("rlrun.dev", "rlruns/finalizers", "update")})


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    """Run helm with no kubeconfig (nothing here may reach a cluster)."""
    env = {**os.environ, "KUBECONFIG": str(ROOT / ".cache" / "no-kubeconfig")}
    return subprocess.run([str(helm()), *args], capture_output=True, text=True, env=env, timeout=60, check=False)


def set_args(values: tuple[str, ...]) -> list[str]:
    """`--set` for each "key=value"; a value already spelled as a flag ("--set-json=k=v") passes as is."""
    return [arg for value in values for arg in ([value] if value.startswith("--") else ["--set", value])]


@functools.cache
def render(*values: str) -> tuple[dict, ...]:
    """The chart's objects (CRDs first) for `--set` values; cached, since objects are only read."""
    result = run_helm(
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        K8S_VERSION,
        "--include-crds",
        *set_args(values),
    )
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def only(objects, kind: str) -> dict:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def of_kind(objects, kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def operator_container(objects) -> dict:
    (container,) = only(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def permissions(rules: list[dict]) -> set[tuple[str, str, str]]:
    """A role's rules flattened to (apiGroup, resource, verb) triples, to compare sets of grants."""
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def namespaced(perms: set[tuple[str, str, str]]) -> set[tuple[str, str, str]]:
    return {p for p in perms if p[1] not in CLUSTER_SCOPED_RESOURCES}


def require_crd() -> None:
    assert CRD_FILE.is_file(), (
        f"{CRD_FILE.relative_to(ROOT)} is missing: run `rlrun crd` (it writes crds/ and the chart's crds/)"
    )


# --- PodMonitor (monitoring.coreos.com/v1) -----------------------------------------------------------

#: kubernetes-validate knows no Prometheus Operator CRDs: the PodMonitor fields the chart renders, as the CRD
#: (prometheus-operator v0.91, example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml) types
#: them, and no other field (the API server would prune a misspelt one without a word).
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_STRINGS = {"type": "array", "items": {"type": "string"}}
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "replacement": {"type": "string"},
        "separator": {"type": "string"},
        "action": {"enum": ["replace", "keep", "drop"]},  # what scrape_targets applies
    },
}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port", "path"],
    "properties": {
        "port": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 15},
        "path": {"type": "string", "pattern": "^/"},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "relabelings": {"type": "array", "items": _RELABEL},
    },
}
POD_MONITOR_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["key", "operator"],
                                "properties": {
                                    "key": {"type": "string"},
                                    "values": _STRINGS,
                                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                                },
                            },
                        },
                    },
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"}, "matchNames": _STRINGS},
                },
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
            },
        },
    },
}


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a LabelSelector matches ``labels``."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values):
            return False
        if (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


def _relabel(target: dict[str, str], rules: list[dict]) -> dict[str, str] | None:
    """Prometheus' relabeling of a target's labels (replace, keep and drop; regexes anchored); None: dropped."""
    for rule in rules:
        value = rule.get("separator", ";").join(target.get(name, "") for name in rule["sourceLabels"])
        found = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if (action == "drop" and found) or (action == "keep" and not found):
            return None
        if action == "replace" and found:
            target[rule["targetLabel"]] = found.expand(rule.get("replacement", "$1").replace("$", "\\"))
    return target


def scrape_targets(pod_monitor: dict, pod: dict, pod_namespace: str) -> list[dict[str, str]]:
    """The targets ``pod_monitor`` makes of ``pod`` (in ``pod_namespace``), as the Prometheus Operator's
    configuration does: the pod must match the selector and the namespace selector (none: the PodMonitor's own
    namespace), and each endpoint yields a target per container port of its name that its relabelings keep.
    Each target is its labels after relabeling (those starting ``__`` dropped, as Prometheus does), plus the
    port's ``port`` name, ``number`` and the endpoint's ``path``."""
    spec, meta = pod_monitor["spec"], pod["metadata"]
    namespaces = spec.get("namespaceSelector", {})
    if not namespaces.get("any") and pod_namespace not in namespaces.get(
        "matchNames", [pod_monitor["metadata"]["namespace"]]
    ):
        return []
    labels = meta.get("labels", {})
    if not _selects(spec["selector"], labels):
        return []
    meta_labels = {"__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in labels.items()}
    targets = []
    for endpoint in spec["podMetricsEndpoints"]:
        for container in pod["spec"]["containers"]:
            for port in container.get("ports", []):
                if port.get("name") != endpoint["port"]:
                    continue
                target = _relabel(
                    {**meta_labels, "namespace": pod_namespace, "container": container["name"]},
                    endpoint.get("relabelings", []),
                )
                if target is not None:
                    kept = {k: v for k, v in target.items() if not k.startswith("__")}
                    targets.append(
                        {**kept, "port": port["name"], "number": str(port["containerPort"]), "path": endpoint["path"]}
                    )
    return targets
