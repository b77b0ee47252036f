"""The rlrun-operator Helm chart as the real helm binary renders it, and what tests compare it with.

:func:`render` runs ``helm template`` (cached per set of values); :func:`permissions` flattens
RBAC rules into ``(apiGroup, resource, verb)`` triples, the form in which the RBAC proof
(``tests/kube/test_rbac.py``) compares the chart's grants with the calls the operator made.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import yaml
from kubernetes_validate import utils as kv_utils

from tests.support.binaries import helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rlrun-operator"
CRD_DIR = CHART / "crds"
CRD_FILE = CRD_DIR / "rlrun.dev_rlruns.yaml"
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
        "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", K8S_VERSION,
        "--include-crds", *set_args(values),
    )  # fmt: skip
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
