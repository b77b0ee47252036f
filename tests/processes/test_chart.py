"""The rlrun-operator Helm chart, linted and rendered by the real helm binary.

What holds: every object the chart renders (the CRD included) is valid against the Kubernetes
schemas of the newest version kubernetes-validate carries; the operator runs as non-root with its
probes on the health port; it is granted the same namespaced rules whether it watches all
namespaces (ClusterRole) or a list of them (a Role in each, plus a ClusterRole for the
cluster-scoped reads only); and values.schema.json turns a bad value into a helm error naming it.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
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
#: (tests/reconcile/test_rbac.py) asserts them granted in both modes without expecting a call.
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


# --- helm lint -------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [(), (f"watchNamespaces={{{','.join(WATCHED)}}}",)], ids=["all-ns", "watched-ns"])
def test_chart_passes_strict_lint(values):
    result = run_helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *set_args(values))
    assert result.returncode == 0, f"helm lint --strict failed:\n{result.stdout}{result.stderr}"


# --- every rendered object is valid Kubernetes ------------------------------------------------------

RENDER_CASES = {
    "defaults": (),
    "watched-ns": (f"watchNamespaces={{{','.join(WATCHED)}}}",),
    "metrics-disabled": ("metrics.enabled=false",),
    "existing-sa": ("serviceAccount.create=false", "serviceAccount.name=ops"),
    "disruption": ("disruptionTaints={example.com/spot-reclaim}", "forceDeleteAfterSeconds=null"),
    "scheduling": (
        "nodeSelector.pool=system",
        "tolerations[0].key=dedicated",
        "tolerations[0].operator=Exists",
        "priorityClassName=system-cluster-critical",
        "imagePullSecrets[0].name=regcred",
        "podAnnotations.team=ml",
        "podLabels.team=ml",
    ),
}


@pytest.mark.parametrize("values", list(RENDER_CASES.values()), ids=list(RENDER_CASES))
def test_every_rendered_object_is_valid_against_the_kubernetes_schemas(values):
    require_crd()
    objects = render(*values)
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole"} <= {o["kind"] for o in objects}
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = ".".join(str(p) for p in err.absolute_path)
            pytest.fail(
                f"{obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {K8S_VERSION} at {path}: {err.message}"
            )


def test_chart_ships_the_generated_rlrun_crd():
    require_crd()
    (crd,) = [doc for doc in yaml.safe_load_all(CRD_FILE.read_text()) if doc]
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["metadata"]["name"] == "rlruns.rlrun.dev"
    assert crd["spec"]["scope"] == "Namespaced"
    assert (crd["spec"]["names"]["kind"], crd["spec"]["names"]["plural"]) == ("RLRun", "rlruns")
    # What NOTES.txt tells people to apply must be a kind this CRD serves.
    example = yaml.safe_load((ROOT / "examples" / "reverse-text.yaml").read_text())
    served = {f"{crd['spec']['group']}/{v['name']}" for v in crd["spec"]["versions"] if v["served"]}
    assert example["kind"] == "RLRun" and example["apiVersion"] in served
    # Helm installs it from crds/ (before the templates), never from a template.
    assert only(render(), "CustomResourceDefinition") == crd
    assert not list((CHART / "templates").glob("*crd*"))


def test_every_object_carries_the_standard_labels():
    for obj in render(f"watchNamespaces={{{','.join(WATCHED)}}}"):
        if obj["kind"] == "CustomResourceDefinition":
            continue  # generated by `rlrun crd`, not by this release
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "rlrun-operator", obj["kind"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "rlrun-operator-0.1.0"


# --- the Deployment ----------------------------------------------------------------------------------


def test_operator_runs_as_non_root_on_a_read_only_root_with_no_capabilities():
    pod = only(render(), "Deployment")["spec"]["template"]["spec"]
    container = operator_container(render())
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    # A read-only root still leaves Python a writable /tmp.
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_probes_hit_healthz_on_the_health_port_and_metrics_has_its_own_port():
    container = operator_container(render())
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": HEALTH_PORT, "metrics": METRICS_PORT}
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/healthz"
        assert ports.get(get["port"], get["port"]) == HEALTH_PORT, probe
    args = container["args"]
    assert args[args.index("--health-port") + 1] == str(HEALTH_PORT)
    assert args[args.index("--metrics-port") + 1] == str(METRICS_PORT)
    assert args[args.index("--log-level") + 1] == "info"


def test_single_replica_is_replaced_not_rolled():
    spec = only(render(), "Deployment")["spec"]
    # kopf runs standalone: a rolling update would briefly run two operators on the same RLRuns.
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}


def test_operator_watches_all_namespaces_unless_given_a_list():
    assert "--namespace" not in operator_container(render())["args"]
    args = operator_container(render(f"watchNamespaces={{{','.join(WATCHED)}}}"))["args"]
    passed = [args[i + 1] for i, arg in enumerate(args) if arg == "--namespace"]
    assert passed == list(WATCHED)


def test_env_gives_the_operator_its_run_images_tagged_with_the_app_version_by_default():
    env = {e["name"]: e["value"] for e in operator_container(render())["env"]}
    assert env == {
        "RLRUN_OPERATOR_TRAINER_IMAGE": "ghcr.io/rlrun/rlrun-trainer:0.1.0",
        "RLRUN_OPERATOR_ROLLOUT_IMAGE": "ghcr.io/rlrun/rlrun-rollout:0.1.0",
        "RLRUN_OPERATOR_IMAGE_PULL_POLICY": "IfNotPresent",
        "RLRUN_OPERATOR_STATUS_INTERVAL_SECONDS": "5",
        "RLRUN_OPERATOR_FORCE_DELETE_AFTER_SECONDS": "60",
    }  # no RLRUN_OPERATOR_DISRUPTION_TAINTS: the operator's built-in list applies
    objects = render(
        "image.repository=ghcr.io/acme/rlrun-operator",
        "image.tag=sha-1234",
        "runImages.trainer.repository=ghcr.io/acme/rlrun-trainer",
        "runImages.trainer.tag=t1",
        "runImages.rollout.repository=ghcr.io/acme/rlrun-rollout",
        "runImages.pullPolicy=Always",
        "statusIntervalSeconds=30",
    )
    container = operator_container(objects)
    env = {e["name"]: e["value"] for e in container["env"]}
    assert container["image"] == "ghcr.io/acme/rlrun-operator:sha-1234"
    assert env["RLRUN_OPERATOR_TRAINER_IMAGE"] == "ghcr.io/acme/rlrun-trainer:t1"
    assert env["RLRUN_OPERATOR_ROLLOUT_IMAGE"] == "ghcr.io/acme/rlrun-rollout:0.1.0"
    assert env["RLRUN_OPERATOR_IMAGE_PULL_POLICY"] == "Always"
    assert env["RLRUN_OPERATOR_STATUS_INTERVAL_SECONDS"] == "30"


def test_operator_settings_accept_the_environment_the_chart_sets():
    from rlrun_operator.settings import ENV_PREFIX, OperatorSettings

    objects = render(
        "--set-json=statusIntervalSeconds=2.5",
        "runImages.pullSecrets={regcred,mirror}",
        "disruptionTaints={example.com/spot-reclaim,ToBeDeletedByClusterAutoscaler}",
        "forceDeleteAfterSeconds=90",
    )
    env = {e["name"]: e["value"] for e in operator_container(objects)["env"]}
    known = {ENV_PREFIX + field.upper() for field in OperatorSettings.model_fields}
    assert {name for name in env if name.startswith(ENV_PREFIX)} <= known
    settings = OperatorSettings.from_env(env)
    assert settings.trainer_image == env["RLRUN_OPERATOR_TRAINER_IMAGE"]
    assert settings.status_interval_seconds == 2.5
    assert settings.image_pull_secrets == ("regcred", "mirror")
    assert tuple(settings.disruption_taints) == ("example.com/spot-reclaim", "ToBeDeletedByClusterAutoscaler")
    assert settings.force_delete_after_seconds == 90
    defaults = OperatorSettings.from_env({e["name"]: e["value"] for e in operator_container(render())["env"]})
    assert defaults.disruption_taints == OperatorSettings().disruption_taints  # unset: the built-in list


@pytest.mark.parametrize(
    ("values", "taints", "force_delete"),
    [
        ((), None, "60"),
        (("disruptionTaints={karpenter.sh/disrupted}",), "karpenter.sh/disrupted", "60"),
        (("disruptionTaints={a.example.com/x,ToBeDeletedByClusterAutoscaler}", "forceDeleteAfterSeconds=0"),
         "a.example.com/x,ToBeDeletedByClusterAutoscaler", "0"),
        (("--set-json=forceDeleteAfterSeconds=12.5",), None, "12.5"),
        (("forceDeleteAfterSeconds=null",), None, None),
    ],
    ids=["defaults", "one-taint", "taints-and-zero", "fraction", "unset"],
)  # fmt: skip
def test_disruption_settings_map_to_env_only_when_set(values, taints, force_delete):
    env = {e["name"]: e["value"] for e in operator_container(render(*values))["env"]}
    assert env.get("RLRUN_OPERATOR_DISRUPTION_TAINTS") == taints
    assert env.get("RLRUN_OPERATOR_FORCE_DELETE_AFTER_SECONDS") == force_delete


@pytest.mark.parametrize("enabled", [True, False])
def test_metrics_service_exists_only_when_enabled_and_selects_the_operator_pod(enabled):
    objects = render(f"metrics.enabled={str(enabled).lower()}")
    services = of_kind(objects, "Service")
    if not enabled:
        assert services == []
        return
    (service,) = services
    pod_labels = only(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}
    ]


# --- RBAC ------------------------------------------------------------------------------------------


def test_all_namespaces_mode_binds_one_cluster_role_with_every_rule():
    objects = render()
    assert of_kind(objects, "Role") == [] and of_kind(objects, "RoleBinding") == []
    perms = permissions(only(objects, "ClusterRole")["rules"])
    assert ("rlrun.dev", "rlruns", "watch") in perms
    assert ("rlrun.dev", "rlruns/status", "patch") in perms
    assert ("", "pods", "create") in perms
    assert ("apiextensions.k8s.io", "customresourcedefinitions", "watch") in perms
    assert {("", "nodes", "list"), ("", "nodes", "watch")} <= perms
    assert ("", "namespaces", "watch") not in perms  # exact namespace names: kopf needs no namespace discovery


def test_watched_namespaces_get_a_role_each_and_the_cluster_role_keeps_only_cluster_scoped_reads():
    objects = render(f"watchNamespaces={{{','.join(WATCHED)}}}")
    roles, bindings = of_kind(objects, "Role"), of_kind(objects, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(WATCHED)
    assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(WATCHED)
    for binding in bindings:
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": roles[0]["metadata"]["name"],
        }
    cluster_perms = permissions(only(objects, "ClusterRole")["rules"])
    assert cluster_perms == {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        ("", "namespaces", "list"),  # kopf follows the listed namespaces
        ("", "namespaces", "watch"),
        ("", "nodes", "list"),  # the nodes index: kopf watches cluster-scoped resources cluster-wide
        ("", "nodes", "watch"),
    }
    assert only(objects, "ClusterRoleBinding")["roleRef"]["name"] == only(objects, "ClusterRole")["metadata"]["name"]


def test_role_and_cluster_role_grant_the_same_namespaced_rules():
    cluster_wide = permissions(only(render(), "ClusterRole")["rules"])
    for role in of_kind(render(f"watchNamespaces={{{','.join(WATCHED)}}}"), "Role"):
        assert permissions(role["rules"]) == namespaced(cluster_wide), role["metadata"]["namespace"]
    # Nothing cluster-scoped in a Role (it would grant nothing there).
    assert namespaced(cluster_wide) != cluster_wide


def test_the_grants_admission_requires_are_namespaced_and_given_in_both_modes():
    assert namespaced(permissions(only(render(), "ClusterRole")["rules"])) >= ADMISSION_REQUIRED
    for role in of_kind(render(f"watchNamespaces={{{','.join(WATCHED)}}}"), "Role"):
        assert permissions(role["rules"]) >= ADMISSION_REQUIRED, role["metadata"]["namespace"]


@pytest.mark.parametrize(
    "values", [(), ("serviceAccount.create=false", "serviceAccount.name=ops"), (f"watchNamespaces={{{WATCHED[0]}}}",)]
)
def test_every_binding_names_the_service_account_the_pod_runs_as(values):
    objects = render(*values)
    account = only(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    accounts = of_kind(objects, "ServiceAccount")
    if "serviceAccount.create=false" in values:
        assert account == "ops" and accounts == []
    else:
        assert [a["metadata"]["name"] for a in accounts] == [account]
    for binding in of_kind(objects, "ClusterRoleBinding") + of_kind(objects, "RoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]


# --- values.schema.json ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("statusIntervalSeconds=-1", "/statusIntervalSeconds"),
        ("replicaCount=two", "/replicaCount"),
        ("replicaCount=2", "/replicaCount"),
        ("logLevel=verbose", "/logLevel"),
        ("watchNamespaces={Team_A}", "/watchNamespaces/0"),
        ("runImages.pullPolicy=Sometimes", "/runImages/pullPolicy"),
        ("metrics.port=70000", "/metrics/port"),
        ("forceDeleteAfterSeconds=-1", "/forceDeleteAfterSeconds"),
        ("forceDeleteAfterSeconds=soon", "/forceDeleteAfterSeconds"),
        ("disruptionTaints={a,,b}", "/disruptionTaints/1"),
        ("disruptionTaints={bad key}", "/disruptionTaints/0"),
        ("replicas=1", "'replicas' not allowed"),
    ],
)
def test_schema_rejects_a_bad_value_naming_the_field(value, field):
    result = run_helm("template", RELEASE, str(CHART), "--set", value)
    assert result.returncode != 0, f"helm accepted --set {value}"
    assert "values don't meet the specifications of the schema" in result.stderr
    assert field in result.stderr, result.stderr


def test_health_and_metrics_ports_must_differ():
    result = run_helm("template", RELEASE, str(CHART), "--set", "metrics.port=8080")
    assert result.returncode != 0 and "health.port and metrics.port must differ" in result.stderr


def test_notes_tell_how_to_apply_the_example():
    result = run_helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE)
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "kubectl apply -f examples/reverse-text.yaml" in notes
    assert "kubectl get rlrun" in notes
    assert (ROOT / "examples" / "reverse-text.yaml").is_file()
