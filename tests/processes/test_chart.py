"""The rlrun-operator Helm chart, linted and rendered by the real helm binary.

What holds: every object the chart renders (the CRD included) is valid against the Kubernetes
schemas of the newest version kubernetes-validate carries; the operator runs as non-root with its
probes on the health port; it is granted the same namespaced rules whether it watches all
namespaces (ClusterRole) or a list of them (a Role in each, plus a ClusterRole for the
cluster-scoped reads only); and values.schema.json turns a bad value into a helm error naming it. With
monitoring on (it is off by default), the PodMonitors scrape the operator and every run's orchestrator and
trainer pod as the operator builds them, and the Grafana dashboard queries only metrics that rlrun exposes.
"""

from __future__ import annotations

import json
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry
from rlrun.manifest import parse_manifest
from rlrun.orchestrator.prometheus import METRICS as ORCHESTRATOR_METRICS
from rlrun.training.prometheus import METRICS as TRAINER_METRICS
from rlrun_operator import naming
from rlrun_operator.metrics import OperatorMetrics
from rlrun_operator.pods import build_pods
from rlrun_operator.settings import OperatorSettings

from tests.support.chart import (
    ADMISSION_REQUIRED,
    CHART,
    CRD_FILE,
    DASHBOARD_FILE,
    HEALTH_PORT,
    K8S_VERSION,
    METRICS_PORT,
    NAMESPACE,
    POD_MONITOR_SCHEMA,
    RELEASE,
    ROOT,
    WATCHED,
    namespaced,
    of_kind,
    only,
    operator_container,
    permissions,
    render,
    require_crd,
    run_helm,
    scrape_targets,
    set_args,
)
from tests.support.manifests import manifest

#: Both monitoring objects on (vLLM's metrics too).
MONITORING = (
    "monitoring.podMonitor.enabled=true",
    "monitoring.podMonitor.rolloutServers=true",
    "monitoring.dashboard.enabled=true",
)

# --- helm lint -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [(), (f"watchNamespaces={{{','.join(WATCHED)}}}",), MONITORING],
    ids=["all-ns", "watched-ns", "monitoring"],
)
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
    "kueue": ("kueue.enabled=true",),
    "scheduling": (
        "nodeSelector.pool=system",
        "tolerations[0].key=dedicated",
        "tolerations[0].operator=Exists",
        "priorityClassName=system-cluster-critical",
        "imagePullSecrets[0].name=regcred",
        "podAnnotations.team=ml",
        "podLabels.team=ml",
    ),
    "monitoring": (
        *MONITORING,
        "monitoring.podMonitor.labels.release=prometheus",
        "monitoring.dashboard.namespace=grafana",
    ),
}


@pytest.mark.parametrize("values", list(RENDER_CASES.values()), ids=list(RENDER_CASES))
def test_every_rendered_object_is_valid_against_the_kubernetes_schemas(values):
    require_crd()
    objects = render(*values)
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole"} <= {o["kind"] for o in objects}
    for obj in objects:
        if obj["kind"] == "PodMonitor":  # a CRD's kind, which kubernetes-validate does not know
            jsonschema.validate(obj, POD_MONITOR_SCHEMA)
            continue
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
    for obj in render(f"watchNamespaces={{{','.join(WATCHED)}}}", *MONITORING):
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


def test_kueue_enabled_sets_its_variable_and_grants_only_then():
    assert "RLRUN_OPERATOR_KUEUE_ENABLED" not in {e["name"] for e in operator_container(render())["env"]}
    assert not [r for r in only(render(), "ClusterRole")["rules"] if "kueue.x-k8s.io" in r["apiGroups"]]
    objects = render("kueue.enabled=true")
    env = {e["name"]: e["value"] for e in operator_container(objects)["env"]}
    assert env["RLRUN_OPERATOR_KUEUE_ENABLED"] == "true"
    # the exact grants are proven against the calls in tests/kube/test_rbac.py
    assert {p[1] for p in permissions(only(objects, "ClusterRole")["rules"]) if p[0] == "kueue.x-k8s.io"} == {
        "workloads",
        "workloads/status",
        "resourceflavors",
        "workloadpriorityclasses",
    }


def test_operator_settings_accept_the_environment_the_chart_sets():
    from rlrun_operator.settings import ENV_PREFIX, OperatorSettings

    objects = render(
        "--set-json=statusIntervalSeconds=2.5",
        "runImages.pullSecrets={regcred,mirror}",
        "disruptionTaints={example.com/spot-reclaim,ToBeDeletedByClusterAutoscaler}",
        "forceDeleteAfterSeconds=90",
        "kueue.enabled=true",
    )
    env = {e["name"]: e["value"] for e in operator_container(objects)["env"]}
    known = {ENV_PREFIX + field.upper() for field in OperatorSettings.model_fields}
    assert {name for name in env if name.startswith(ENV_PREFIX)} <= known
    settings = OperatorSettings.from_env(env)
    assert settings.trainer_image == env["RLRUN_OPERATOR_TRAINER_IMAGE"]
    assert settings.status_interval_seconds == 2.5
    assert settings.image_pull_secrets == ("regcred", "mirror")
    assert tuple(settings.disruption_taints) == ("example.com/spot-reclaim", "ToBeDeletedByClusterAutoscaler")
    assert settings.force_delete_after_seconds == 90 and settings.kueue_enabled is True
    defaults = OperatorSettings.from_env({e["name"]: e["value"] for e in operator_container(render())["env"]})
    assert defaults.disruption_taints == OperatorSettings().disruption_taints  # unset: the built-in list


@pytest.mark.parametrize(
    ("values", "taints", "force_delete"),
    [
        ((), None, "60"),
        (("disruptionTaints={karpenter.sh/disrupted}",), "karpenter.sh/disrupted", "60"),
        (
            ("disruptionTaints={a.example.com/x,ToBeDeletedByClusterAutoscaler}", "forceDeleteAfterSeconds=0"),
            "a.example.com/x,ToBeDeletedByClusterAutoscaler",
            "0",
        ),
        (("--set-json=forceDeleteAfterSeconds=12.5",), None, "12.5"),
        (("forceDeleteAfterSeconds=null",), None, None),
    ],
    ids=["defaults", "one-taint", "taints-and-zero", "fraction", "unset"],
)
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
        ("apiextensions.k8s.io", "customresourcedefinitions", "get"),  # the CRD drift check, its own CRD only
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


# --- monitoring: PodMonitors and the Grafana dashboard ---------------------------------------------

RUN_NAMESPACE = WATCHED[0]


def run_pods(nodes: int = 2) -> list[dict]:
    """An attempt's pods as the operator builds them: two rollout servers, a trainer of ``nodes`` nodes, the
    orchestrator."""
    doc = manifest("demo", rollout={"replicas": 2}, trainer={"nodes": nodes, "processes_per_node": 2, "gpus": 2})
    body = {**doc, "metadata": {"name": "demo", "namespace": RUN_NAMESPACE, "uid": "1234-uid", "generation": 1}}
    return build_pods(body, parse_manifest(doc), OperatorSettings(), attempt=3)


def pod_monitor(objects, suffix: str) -> dict:
    (found,) = [o for o in of_kind(objects, "PodMonitor") if o["metadata"]["name"].endswith(f"-{suffix}")]
    return found


def dashboard_config_map(objects) -> dict:
    (found,) = [o for o in of_kind(objects, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]
    return found


def test_monitoring_objects_are_off_by_default():
    objects = render()
    assert of_kind(objects, "PodMonitor") == []
    assert of_kind(objects, "ConfigMap") == []


def test_the_runs_pod_monitor_scrapes_each_orchestrator_and_the_trainers_rank_0_labelled_by_run():
    monitor = pod_monitor(
        render(f"watchNamespaces={{{','.join(WATCHED)}}}", "monitoring.podMonitor.enabled=true"), "runs"
    )
    targets = {pod["metadata"]["name"]: scrape_targets(monitor, pod, RUN_NAMESPACE) for pod in run_pods(nodes=2)}
    labels = {"run": "demo", "namespace": RUN_NAMESPACE, "attempt": "3", "path": "/metrics"}
    assert targets == {
        "demo-orchestrator-a3": [
            {
                **labels,
                "component": "orchestrator",
                "container": "orchestrator",
                "port": "control",
                "number": str(naming.CONTROL_PORT),
            },
        ],
        "demo-trainer-0-a3": [
            {
                **labels,
                "component": "trainer",
                "container": "trainer",
                "port": "metrics",
                "number": str(naming.TRAINER_METRICS_PORT),
            },
        ],
        "demo-trainer-1-a3": [],  # only rank 0 serves; node 1's declared port would be a target always down
        "demo-rollout-0-a3": [],  # vLLM's metrics only with rolloutServers
        "demo-rollout-1-a3": [],
    }
    # what the selector reads is what naming.labels puts on every run's pods
    assert monitor["spec"]["selector"]["matchLabels"].items() <= naming.labels("any-run").items()
    # no credentials: the orchestrator's /metrics is the one route of its control server without a token
    assert all(set(e) <= {"port", "path", "interval", "relabelings"} for e in monitor["spec"]["podMetricsEndpoints"])


def test_a_single_node_trainer_is_scraped_and_vllm_only_when_asked():
    monitor = pod_monitor(
        render("monitoring.podMonitor.enabled=true", "monitoring.podMonitor.rolloutServers=true"), "runs"
    )
    scraped = {
        pod["metadata"]["name"]: [t["port"] for t in scrape_targets(monitor, pod, "anywhere")]
        for pod in run_pods(nodes=1)
    }
    assert scraped == {
        "demo-orchestrator-a3": ["control"],
        "demo-trainer-a3": ["metrics"],
        "demo-rollout-0-a3": ["http"],
        "demo-rollout-1-a3": ["http"],
    }


def test_the_operator_pod_monitor_scrapes_this_releases_operator_on_its_metrics_port_only():
    objects = render("monitoring.podMonitor.enabled=true", "metrics.port=9191")
    template = only(objects, "Deployment")["spec"]["template"]
    operator, runs = pod_monitor(objects, "operator"), pod_monitor(objects, "runs")
    [target] = scrape_targets(operator, template, NAMESPACE)
    assert (target["port"], target["number"], target["path"]) == ("metrics", "9191", "/metrics")
    assert scrape_targets(operator, template, "elsewhere") == []
    assert scrape_targets(runs, template, NAMESPACE) == []
    assert all(scrape_targets(operator, pod, NAMESPACE) == [] for pod in run_pods())


@pytest.mark.parametrize(
    ("values", "selector"),
    [
        ((), {"any": True}),
        ((f"watchNamespaces={{{','.join(WATCHED)}}}",), {"matchNames": list(WATCHED)}),
        (
            (f"watchNamespaces={{{','.join(WATCHED)}}}", "monitoring.podMonitor.namespaceSelector.any=true"),
            {"any": True},
        ),
        (("monitoring.podMonitor.namespaceSelector.matchNames={ml}",), {"matchNames": ["ml"]}),
    ],
    ids=["all-ns", "watched-ns", "override-any", "override-names"],
)
def test_run_pods_are_looked_for_where_the_operator_reconciles_runs_unless_told(values, selector):
    objects = render("monitoring.podMonitor.enabled=true", *values)
    assert pod_monitor(objects, "runs")["spec"]["namespaceSelector"] == selector
    assert pod_monitor(objects, "operator")["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def test_pod_monitors_carry_the_labels_a_prometheus_selects_by_and_the_scrape_interval():
    objects = render(
        "monitoring.podMonitor.enabled=true",
        "monitoring.podMonitor.labels.release=prometheus",
        "monitoring.podMonitor.interval=1m",
        "monitoring.podMonitor.scrapeTimeout=20s",
    )
    for monitor in of_kind(objects, "PodMonitor"):
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        assert monitor["metadata"]["namespace"] == NAMESPACE
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("1m", "20s")
    unset = render("monitoring.podMonitor.enabled=true", "monitoring.podMonitor.interval=")
    for monitor in of_kind(unset, "PodMonitor"):  # empty: the Prometheus' own interval
        assert all("interval" not in e for e in monitor["spec"]["podMetricsEndpoints"])


def test_the_dashboard_config_map_is_labelled_for_the_grafana_sidecar_and_holds_the_charts_dashboard():
    config_map = dashboard_config_map(render("monitoring.dashboard.enabled=true"))
    assert config_map["metadata"]["namespace"] == NAMESPACE
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = config_map["data"].values()
    assert json.loads(text) == json.loads(DASHBOARD_FILE.read_text())
    custom = dashboard_config_map(
        render(
            "monitoring.dashboard.enabled=true",
            "monitoring.dashboard.namespace=grafana",
            "monitoring.dashboard.label=dashboards.example.com/load",
            "monitoring.dashboard.labelValue=yes",
            "monitoring.dashboard.annotations.grafana_folder=RL",
        )
    )
    assert custom["metadata"]["namespace"] == "grafana"
    assert custom["metadata"]["labels"]["dashboards.example.com/load"] == "yes"
    assert custom["metadata"]["annotations"] == {"grafana_folder": "RL"}


def exposed_series() -> set[str]:
    """Every series name rlrun serves: the orchestrator's and trainer's METRICS (counters with ``_total``) and the
    operator's metrics (histograms as their ``_bucket``, ``_sum`` and ``_count``)."""
    names = {
        f"{name}_total" if spec[0] == "counter" else name
        for metrics in (ORCHESTRATOR_METRICS, TRAINER_METRICS)
        for name, spec in metrics.items()
    }
    registry = CollectorRegistry()
    OperatorMetrics(registry)
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    return names | {family.name + s for family in registry.collect() for s in suffixes[family.type]}


def dashboard_queries(dashboard: dict) -> list[str]:
    """The PromQL of every panel (rows' nested panels too) and every query variable."""
    panels = [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    return exprs + [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def test_every_metric_the_dashboard_queries_is_one_rlrun_serves():
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    used = {name for expr in dashboard_queries(dashboard) for name in re.findall(r"\brlrun_\w+", expr)}
    assert used - exposed_series() == set()
    # the headline numbers of a run, each on a panel
    assert {
        "rlrun_step",
        "rlrun_max_steps",
        "rlrun_reward_mean",
        "rlrun_reward_std",
        "rlrun_groups_solved_all_ratio",
        "rlrun_groups_solved_none_ratio",
        "rlrun_staleness_mean_steps",
        "rlrun_queue_samples",
        "rlrun_open_groups",
        "rlrun_inflight_completions",
        "rlrun_rollout_tokens_per_second",
        "rlrun_step_duration_seconds",
        "rlrun_trainer_loss",
        "rlrun_trainer_grad_norm",
        "rlrun_trainer_entropy_nats",
        "rlrun_trainer_mismatch_kl_nats",
        "rlrun_trainer_clip_ratio",
        "rlrun_trainer_tokens_per_second",
        "rlrun_trainer_batch_wait_seconds",
        "rlrun_checkpoint_write_seconds",
        "rlrun_pause_seconds",
        "rlrun_samples_dropped_stale_total",
        "rlrun_groups_abandoned_total",
        "rlrun_journal_fsyncs_total",
    } <= used


def test_dashboard_queries_pick_runs_by_the_labels_the_pod_monitor_sets():
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "run"} <= set(variables)
    run_labels = {
        t["run"]
        for pod in run_pods()
        for t in scrape_targets(pod_monitor(render("monitoring.podMonitor.enabled=true"), "runs"), pod, RUN_NAMESPACE)
    }
    assert run_labels == {"demo"}  # the label the variables and the queries below filter on
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            if not re.search(r"\brlrun_operator_", target["expr"]):  # the operator's pod belongs to no run
                assert 'namespace=~"$namespace", run=~"$run"' in target["expr"], panel["title"]


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
        ("monitoring.podMonitor.enabled=yes", "/monitoring/podMonitor/enabled"),
        ("monitoring.podMonitor.interval=30 seconds", "/monitoring/podMonitor/interval"),
        (
            "monitoring.podMonitor.namespaceSelector.matchNames={Team_A}",
            "/monitoring/podMonitor/namespaceSelector/matchNames/0",
        ),
        ("monitoring.podMonitor.namespaceSelector.all=true", "'all' not allowed"),
        ("monitoring.dashboard.namespace=Grafana", "/monitoring/dashboard/namespace"),
        ("monitoring.dashboard.label=bad key", "/monitoring/dashboard/label"),
        ("monitoring.dashboard.labelValue=1", "/monitoring/dashboard/labelValue"),  # --set makes it a number
        ("kueue.enabled=yes", "/kueue/enabled"),
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


def test_the_cluster_role_reads_only_the_rlrun_crd_by_name():
    [rule] = [
        r
        for r in only(render(), "ClusterRole")["rules"]
        if "customresourcedefinitions" in r["resources"] and "get" in r["verbs"]
    ]
    assert rule["resourceNames"] == ["rlruns.rlrun.dev"] and rule["verbs"] == ["get"]
