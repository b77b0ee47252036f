"""The pure builders: schema-valid objects, owner references, labels, and commands the real CLI accepts."""

from __future__ import annotations

import base64

import kubernetes_validate
import pytest
import yaml
from rlrun.api.pod_inputs import RESERVED_ENV_NAMES, RESERVED_ENV_PREFIX, RESERVED_MOUNT_PATHS, RESERVED_VOLUME_NAMES
from rlrun.cli import app
from rlrun.manifest import parse_manifest
from rlrun.rollout.server import vllm_command
from rlrun_operator import naming
from rlrun_operator.builders import build_run_objects
from rlrun_operator.pods import build_pods, build_trainer_replacement, command, rollout_shm_size
from rlrun_operator.settings import OperatorSettings
from typer.main import get_command

from tests.support.manifests import manifest

K8S_VERSION = kubernetes_validate.utils.latest_version()
SETTINGS = OperatorSettings(trainer_image="registry.example/trainer:1", rollout_image="registry.example/rollout:1")


def make(**spec_changes):
    doc = manifest("demo", **spec_changes)
    body = {**doc, "metadata": {"name": "demo", "namespace": "team-a", "uid": "1234-uid", "generation": 1}}
    return body, parse_manifest(doc)


def all_objects(body, run, attempt=0):
    return build_run_objects(body, run, SETTINGS, "tok") + build_pods(body, run, SETTINGS, attempt)


def test_every_object_passes_the_kubernetes_schema_strictly():
    body, run = make(
        rollout={"replicas": 2, "gpus": 1, "resources": {"requests": {"cpu": "4", "memory": "32Gi"}}},
        trainer={"gpus": 2, "image": "my/trainer:2", "resources": {"limits": {"memory": "64Gi"}}},
        scheduling={
            "node_selector": {"pool": "gpu"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "spot", "operator": "In", "values": ["1"]}]}
                        ]
                    }
                }
            },
            "priority_class_name": "training",
        },
        storage={"storage_class_name": "fast-rwx", "size": "100Gi"},
    )
    objects = all_objects(body, run, attempt=3)
    kinds = [o["kind"] for o in objects]
    assert kinds == ["PersistentVolumeClaim", "Secret", "ConfigMap", "Service", "Pod", "Pod", "Pod", "Pod"]
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_labels_owner_references_and_attempt():
    body, run = make(rollout={"replicas": 2})
    for obj in all_objects(body, run, attempt=2):
        labels = obj["metadata"]["labels"]
        assert (
            labels[naming.NAME] == "rlrun"
            and labels[naming.INSTANCE] == "demo"
            and labels[naming.MANAGED_BY] == "rlrun-operator"
        )
        if obj["kind"] == "PersistentVolumeClaim":
            assert "ownerReferences" not in obj["metadata"]  # retention policy Retain (the default)
            continue
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "rlrun.dev/v1alpha1",
            "kind": "RLRun",
            "name": "demo",
            "uid": "1234-uid",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        if obj["kind"] == "Pod":
            assert labels[naming.ATTEMPT] == "2" and obj["metadata"]["name"].endswith("-a2")
            assert labels[naming.COMPONENT] in naming.COMPONENTS
    pods = [o for o in all_objects(body, run) if o["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in pods] == [
        "demo-rollout-0-a0",
        "demo-rollout-1-a0",
        "demo-trainer-a0",
        "demo-orchestrator-a0",
    ]


def test_claim_retention_and_existing_claim():
    body, run = make(storage={"retention_policy": "Delete", "access_modes": ["ReadWriteOnce"]})
    claim = all_objects(body, run)[0]
    assert claim["kind"] == "PersistentVolumeClaim" and claim["metadata"]["ownerReferences"][0]["uid"] == "1234-uid"
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "20Gi"}}}
    body, run = make(storage={"existing_claim": "shared-runs"})
    objects = all_objects(body, run)
    assert "PersistentVolumeClaim" not in [o["kind"] for o in objects]
    for pod in (o for o in objects if o["kind"] == "Pod"):
        claims = [
            v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v
        ]
        assert claims == ["shared-runs"]


def test_pods_get_resources_gpus_scheduling_probes_and_grace_period():
    body, run = make(
        rollout={"replicas": 1, "gpus": 1},
        trainer={"gpus": 2, "resources": {"requests": {"cpu": "8"}, "limits": {"memory": "64Gi"}}},
        preemption={"snapshot_timeout_seconds": 30, "termination_grace_period_seconds": 90},
        scheduling={"node_selector": {"pool": "spot"}, "tolerations": [{"key": "spot", "operator": "Exists"}]},
    )
    pods = {p["metadata"]["labels"][naming.COMPONENT]: p for p in build_pods(body, run, SETTINGS, 0)}
    trainer = pods["trainer"]["spec"]["containers"][0]
    assert trainer["resources"] == {
        "requests": {"cpu": "8", "nvidia.com/gpu": "2"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "2"},
    }
    assert trainer["image"] == "registry.example/trainer:1" and "readinessProbe" not in trainer
    rollout = pods["rollout"]["spec"]["containers"][0]
    assert rollout["image"] == "registry.example/rollout:1"
    assert rollout["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert rollout["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    orch = pods["orchestrator"]["spec"]["containers"][0]
    assert orch["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "control"}
    token_env = next(e for e in orch["env"] if e["name"] == "RLRUN_CONTROL_TOKEN")
    assert token_env["valueFrom"]["secretKeyRef"] == {"name": "demo-control", "key": "token"}
    for pod in pods.values():
        spec = pod["spec"]
        assert spec["terminationGracePeriodSeconds"] == 90 and spec["restartPolicy"] == "Never"
        assert spec["nodeSelector"] == {"pool": "spot"} and spec["tolerations"] == [
            {"key": "spot", "operator": "Exists"}
        ]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        ctx = spec["containers"][0]["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"] == {"drop": ["ALL"]}


def test_a_rollout_pod_with_gpus_asks_for_them_gets_dev_shm_for_tensor_parallelism_and_serves_over_them_all():
    body, run = make(model={"name": "Qwen/Qwen3-8B"}, rollout={"replicas": 2, "gpus": 4})
    rollouts = [p for p in build_pods(body, run, SETTINGS, 0) if p["metadata"]["labels"][naming.COMPONENT] == "rollout"]
    assert len(rollouts) == 2
    for pod in rollouts:
        container = pod["spec"]["containers"][0]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "4"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        dshm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
        assert dshm == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "3072Mi"}}  # 1 GiB + 4 × 512 MiB
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    # the pod's rlrun rollout reads the ConfigMap's manifest: vLLM over its 4 GPUs, one tensor-parallel engine
    served = parse_manifest(yaml.safe_load(build_run_objects(body, run, SETTINGS, "tok")[2]["data"]["rlrun.yaml"]))
    argv = vllm_command(served.spec, "Qwen/Qwen3-8B", "0.0.0.0", naming.ROLLOUT_PORT, gpu=True, bf16=True)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"


def test_a_cpu_rollout_pod_asks_for_no_gpu_and_keeps_a_bounded_dev_shm():
    body, run = make()
    (pod,) = [p for p in build_pods(body, run, SETTINGS, 0) if p["metadata"]["labels"][naming.COMPONENT] == "rollout"]
    assert "nvidia.com/gpu" not in pod["spec"]["containers"][0]["resources"]["requests"]
    assert "limits" not in pod["spec"]["containers"][0]["resources"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1024Mi"}} in pod["spec"]["volumes"]
    assert [rollout_shm_size(g) for g in (1, 2, 8)] == ["1536Mi", "2048Mi", "5120Mi"]


def test_secret_and_configmap_contents():
    body, run = make(max_steps=7)
    _, secret, configmap, service = build_run_objects(body, run, SETTINGS, "s3cret")
    assert base64.b64decode(secret["data"]["token"]).decode() == "s3cret"
    manifest = yaml.safe_load(configmap["data"]["rlrun.yaml"])
    assert manifest["metadata"] == {"name": "demo", "namespace": "team-a"}
    assert manifest["spec"]["max_steps"] == 7 and manifest["spec"]["group_size"] == 8  # defaults resolved
    assert parse_manifest(manifest).spec == run.spec
    assert service["metadata"]["name"] == "demo-orchestrator"
    assert (
        service["spec"]["selector"][naming.COMPONENT] == "orchestrator"
        and naming.ATTEMPT not in service["spec"]["selector"]
    )


@pytest.mark.parametrize("component", naming.COMPONENTS)
def test_pod_commands_are_real_rlrun_subcommands(component, tmp_path):
    """Each pod's command parses with the real ``rlrun`` CLI (the manifest path swapped for the ConfigMap's file)."""
    body, run = make()
    configmap = build_run_objects(body, run, SETTINGS, "tok")[2]
    manifest = tmp_path / "rlrun.yaml"
    manifest.write_text(configmap["data"]["rlrun.yaml"])
    pod = next(p for p in build_pods(body, run, SETTINGS, 4) if p["metadata"]["labels"][naming.COMPONENT] == component)
    argv = pod["spec"]["containers"][0]["command"]
    assert argv == command(component, 4, body["metadata"]["uid"]) and argv[0] == "rlrun"
    args = [str(manifest) if a == naming.MANIFEST_PATH else a for a in argv[1:]]
    group = get_command(app)
    ctx = group.make_context("rlrun", list(args), resilient_parsing=False)
    sub = group.get_command(ctx, args[0])
    assert sub is not None, f"rlrun has no subcommand {args[0]!r}"
    sub_ctx = sub.make_context(args[0], list(args[1:]), parent=ctx)  # raises on an unknown option or bad value
    assert sub_ctx.params["manifest"] == manifest
    if component != naming.ROLLOUT:
        assert sub_ctx.params["attempt"] == 4 and sub_ctx.params["resume"] is True
        assert sub_ctx.params["run_uid"] == body["metadata"]["uid"]  # attempts numbered per run directory


def test_a_trainer_replacement_is_the_trainer_of_the_same_attempt_renamed_and_kept_off_lost_nodes():
    body, run = make()
    name = naming.replacement_name("demo", "demo-trainer-a2", 2, 5)
    assert name == "demo-trainer-a2-r5"
    replacement = build_trainer_replacement(body, run, SETTINGS, 2, name, ["node-a"])
    original = next(p for p in build_pods(body, run, SETTINGS, 2) if p["metadata"]["name"] == "demo-trainer-a2")
    assert replacement["metadata"]["name"] == "demo-trainer-a2-r5"
    assert replacement["metadata"]["labels"] == original["metadata"]["labels"]  # trainer, attempt 2
    assert replacement["metadata"]["ownerReferences"] == original["metadata"]["ownerReferences"]
    container = replacement["spec"]["containers"][0]
    assert container == original["spec"]["containers"][0]  # the same command: --attempt 2 --resume, same run uid
    assert (
        container["command"][container["command"].index("--attempt") + 1] == "2" and "--resume" in container["command"]
    )
    terms = replacement["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-a"]}]}
    ]
    kubernetes_validate.validate(replacement, K8S_VERSION, strict=True)


def test_replacement_names_keep_the_attempt_and_never_replace_an_orchestrator_alone():
    assert naming.replacement_name("demo", "demo-trainer-a0-r1", 0, 2) == "demo-trainer-a0-r2"
    assert naming.replacement_name("demo", "demo-rollout-3-a1", 1, 4) == "demo-rollout-3-a1-r4"
    assert naming.component_of("demo-trainer", "demo-trainer-rollout-0-a0") == "rollout"
    assert naming.is_rollout_pod_name("demo-rollout-3-a1-r4") and not naming.is_rollout_pod_name("x-rollout-trainer-a0")
    with pytest.raises(ValueError, match="never replaced alone"):
        naming.replacement_name("demo", "demo-orchestrator-a0", 0, 1)
    with pytest.raises(ValueError, match="not a pod name of run"):
        naming.component_of("demo", "other-trainer-a0")


def test_limits_alone_are_their_own_requests():
    """As Kubernetes does for a container with limits only; a default request above a limit would be refused."""
    body, run = make(orchestrator={"resources": {"limits": {"cpu": "500m", "memory": "1Gi"}}})
    orch = next(
        p for p in build_pods(body, run, SETTINGS, 0) if p["metadata"]["labels"][naming.COMPONENT] == "orchestrator"
    )
    assert orch["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"cpu": "500m", "memory": "1Gi"},
    }


def test_image_pull_secrets_reach_every_pod():
    body, run = make(rollout={"replicas": 2})
    settings = SETTINGS.model_copy(update={"image_pull_secrets": ("regcred",)})
    for pod in build_pods(body, run, settings, 0):
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    assert "imagePullSecrets" not in build_pods(body, run, SETTINGS, 0)[0]["spec"]


def trainer_pods(pods: list[dict]) -> list[dict]:
    return [p for p in pods if p["kind"] == "Pod" and p["metadata"]["labels"][naming.COMPONENT] == naming.TRAINER]


def test_a_two_node_trainer_is_one_pod_per_node_with_stable_dns_names_behind_a_headless_service():
    body, run = make(trainer={"nodes": 2, "processes_per_node": 4, "gpus": 4})
    objects = all_objects(body, run, attempt=3)
    assert [o["kind"] for o in objects] == ["PersistentVolumeClaim", "Secret", "ConfigMap", "Service", "Service"] + [
        "Pod"
    ] * 4
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    service = objects[4]
    assert service["metadata"]["name"] == "demo-trainer"
    assert service["metadata"]["ownerReferences"][0]["uid"] == "1234-uid"
    assert service["spec"] == {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,  # a peer needs node 0's name before anything is ready
        "selector": {naming.INSTANCE: "demo", naming.COMPONENT: "trainer", naming.MANAGED_BY: "rlrun-operator"},
        "ports": [{"name": "rendezvous", "port": 29500, "targetPort": "rendezvous", "protocol": "TCP"}],
    }
    pods = trainer_pods(objects)
    assert [p["metadata"]["name"] for p in pods] == ["demo-trainer-0-a3", "demo-trainer-1-a3"]
    for node, pod in enumerate(pods):
        labels, spec = pod["metadata"]["labels"], pod["spec"]
        assert (labels[naming.TRAINER_NODE], labels[naming.TRAINER_NODES], labels[naming.ATTEMPT]) == (
            str(node),
            "2",
            "3",
        )
        assert service["spec"]["selector"].items() <= labels.items()  # the Service gives it its DNS name
        assert (spec["hostname"], spec["subdomain"]) == (f"trainer-{node}", "demo-trainer")
        container = spec["containers"][0]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "4"}  # gpus per pod, not per group
        assert container["ports"] == [
            {
                "name": "metrics",
                "containerPort": 9400,
                "protocol": "TCP",
            },  # rank 0's /metrics (rlrun.training.prometheus)
            {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"},
        ]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        # torchrun gives its ranks the pod's grace period after a SIGTERM, not its default 30 s
        assert {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": "120"} in container["env"]
        assert container["command"] == [
            "torchrun",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "4",
            "--node-rank",
            str(node),
            "--master-addr",
            "trainer-0.demo-trainer.team-a.svc",
            "--master-port",
            "29500",
            "--rdzv-conf",
            "timeout=1800",
            "--max-restarts",
            "0",
            "--no-python",
            "rlrun",
            "trainer",
            "/etc/rlrun/rlrun.yaml",
            "--run-dir",
            "/var/lib/rlrun/run",
            "--cache-dir",
            "/var/lib/rlrun/cache",
            "--attempt",
            "3",
            "--run-uid",
            "1234-uid",
            "--resume",
        ]
    assert naming.trainer_node_address("demo", "team-a") == "trainer-0.demo-trainer.team-a.svc"


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 4), (3, 1), (1, 2)])
def test_trainer_commands_are_what_torchrun_and_rlrun_accept(nodes, per_node, tmp_path):
    """torchrun's own parser and launch config read each node's command as intended: the group's size, the
    node's rank, node 0's store as the static rendezvous, no restarts of its own; the rest is ``rlrun trainer``."""
    from torch.distributed.run import config_from_args, parse_args

    body, run = make(trainer={"nodes": nodes, "processes_per_node": per_node})
    manifest = tmp_path / "rlrun.yaml"
    manifest.write_text(build_run_objects(body, run, SETTINGS, "tok")[2]["data"]["rlrun.yaml"])
    pods = trainer_pods(build_pods(body, run, SETTINGS, 1))
    assert len(pods) == nodes
    for node, pod in enumerate(pods):
        argv = pod["spec"]["containers"][0]["command"]
        assert argv[0] == "torchrun"
        args = parse_args(argv[1:])
        config, cmd, cmd_args = config_from_args(args)
        assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (nodes, nodes, per_node)
        assert config.max_restarts == 0 and args.no_python and cmd == "rlrun"
        if nodes > 1:
            assert (config.rdzv_backend, config.rdzv_endpoint) == ("static", "trainer-0.demo-trainer.team-a.svc:29500")
            assert config.rdzv_configs == {"timeout": "1800", "rank": node}
        else:
            assert args.standalone  # one node: torchrun's local rendezvous, no Service
            assert "hostname" not in pod["spec"] and pod["metadata"]["name"] == "demo-trainer-a1"
        assert cmd_args == command(naming.TRAINER, 1, "1234-uid")[1:]
        group = get_command(app)
        args = [str(manifest) if a == naming.MANIFEST_PATH else a for a in cmd_args]
        sub = group.get_command(group.make_context("rlrun", list(args)), "trainer")
        params = sub.make_context("trainer", list(args[1:])).params
        assert params["attempt"] == 1 and params["resume"] is True and params["run_uid"] == "1234-uid"


def test_a_one_by_one_trainer_is_todays_single_pod():
    body, run = make()
    objects = all_objects(body, run)
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Service"] == ["demo-orchestrator"]
    (pod,) = trainer_pods(objects)
    assert pod["metadata"]["name"] == "demo-trainer-a0"
    assert (
        naming.TRAINER_NODE not in pod["metadata"]["labels"] and naming.TRAINER_NODES not in pod["metadata"]["labels"]
    )
    assert not {"hostname", "subdomain"} & set(pod["spec"])
    container = pod["spec"]["containers"][0]
    assert container["command"] == command(naming.TRAINER, 0, "1234-uid")
    assert container["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]  # no rendezvous
    assert {"name": "RLRUN_METRICS_PORT", "value": "9400"} in container["env"]
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in {e["name"] for e in container["env"]}
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["data", "config", "tmp"]


def test_a_trainer_sending_weights_in_memory_knows_its_pod_ip_from_the_downward_api():
    """Issue 50: the rollout servers' workers reach rank 0's gloo rendezvous at the trainer pod's IP."""
    pod_ip = {"name": "RLRUN_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    body, run = make(weights={"transport": "collective"})
    (pod,) = trainer_pods(all_objects(body, run))
    assert pod_ip in pod["spec"]["containers"][0]["env"]
    body, run = make()
    (pod,) = trainer_pods(all_objects(body, run))
    assert "RLRUN_POD_IP" not in {e["name"] for e in pod["spec"]["containers"][0]["env"]}


def test_a_trainer_groups_replacement_is_each_node_renamed_with_the_groups_size():
    body, run = make(trainer={"nodes": 2})
    originals = trainer_pods(build_pods(body, run, SETTINGS, 2))
    names = [naming.replacement_name("demo", p["metadata"]["name"], 2, 5) for p in originals]
    assert names == ["demo-trainer-0-a2-r5", "demo-trainer-1-a2-r5"]
    assert [naming.trainer_node_of("demo", n) for n in names] == [0, 1]
    for node, (name, original) in enumerate(zip(names, originals, strict=True)):
        replacement = build_trainer_replacement(body, run, SETTINGS, 2, name, ["node-a"], node, 2)
        assert replacement["metadata"]["name"] == name
        assert replacement["metadata"]["labels"] == original["metadata"]["labels"]
        assert replacement["spec"]["containers"] == original["spec"]["containers"]  # --node-rank, --resume, …
        assert replacement["spec"]["hostname"] == f"trainer-{node}"  # the same DNS name as the pod it replaces
        kubernetes_validate.validate(replacement, K8S_VERSION, strict=True)
    # trainer.nodes changed since: the attempt's group keeps its size until the next attempt
    body, run = make(trainer={"nodes": 3})
    kept = build_trainer_replacement(body, run, SETTINGS, 2, "demo-trainer-1-a2-r5", [], 1, 2)
    argv = kept["spec"]["containers"][0]["command"]
    assert argv[argv.index("--nnodes") + 1] == "2" and kept["metadata"]["labels"][naming.TRAINER_NODES] == "2"
    single = build_trainer_replacement(body, run, SETTINGS, 2, "demo-trainer-a2-r5", [], None, 1)
    assert single["spec"]["containers"][0]["command"][0] == "rlrun" and "hostname" not in single["spec"]


def test_trainer_node_names():
    assert naming.trainer_node_of("demo", "demo-trainer-a0") is None
    assert naming.trainer_node_of("demo", "demo-trainer-a0-r3") is None
    assert naming.trainer_node_of("demo", "demo-trainer-12-a4-r3") == 12
    assert naming.replacement_name("demo", "demo-trainer-1-a0-r1", 0, 2) == "demo-trainer-1-a0-r2"
    with pytest.raises(ValueError, match="not a trainer pod name"):
        naming.trainer_node_of("demo", "demo-trainer-x-a0")


def pods_by_component(pods: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for pod in pods:
        out.setdefault(pod["metadata"]["labels"][naming.COMPONENT], []).append(pod)
    return out


def test_a_roles_volumes_and_env_reach_its_pods_read_only_after_rlruns_own():
    dataset = {"name": "dataset", "mount_path": "/data", "persistent_volume_claim": {"claim_name": "arithmetic"}}
    body, run = make(
        orchestrator={
            "image": "registry.example/my-env:1",
            "volumes": [
                dataset,
                {
                    "name": "conf",
                    "mount_path": "/etc/my-env",
                    "config_map": {"name": "my-env.conf", "items": [{"key": "a", "path": "a.yaml"}]},
                },
                {
                    "name": "scratch",
                    "mount_path": "/scratch",
                    "read_only": False,
                    "persistent_volume_claim": {"claim_name": "scratch"},
                },
                {"name": "creds", "mount_path": "/var/run/creds", "secret": {"secret_name": "creds"}},
            ],
            "env": [
                {"name": "HF_TOKEN", "value_from": {"secret_key_ref": {"name": "hf", "key": "token"}}},
                {"name": "MY_ENV_MODE", "value_from": {"config_map_key_ref": {"name": "my-env.conf", "key": "mode"}}},
                {"name": "OMP_NUM_THREADS", "value": "4"},
            ],
        },
        trainer={"nodes": 2, "volumes": [dataset], "env": [{"name": "OMP_NUM_THREADS", "value": "8"}]},
        rollout={"replicas": 2},
    )
    pods = pods_by_component(build_pods(body, run, SETTINGS, 1))
    (orchestrator,) = pods[naming.ORCHESTRATOR]
    spec, container = orchestrator["spec"], orchestrator["spec"]["containers"][0]
    assert container["image"] == "registry.example/my-env:1"
    assert spec["volumes"][3:] == [
        {"name": "dataset", "persistentVolumeClaim": {"claimName": "arithmetic", "readOnly": True}},
        {"name": "conf", "configMap": {"name": "my-env.conf", "items": [{"key": "a", "path": "a.yaml"}]}},
        {"name": "scratch", "persistentVolumeClaim": {"claimName": "scratch"}},
        {"name": "creds", "secret": {"secretName": "creds"}},
    ]
    assert container["volumeMounts"][3:] == [
        {"name": "dataset", "mountPath": "/data", "readOnly": True},
        {"name": "conf", "mountPath": "/etc/my-env", "readOnly": True},
        {"name": "scratch", "mountPath": "/scratch"},
        {"name": "creds", "mountPath": "/var/run/creds", "readOnly": True},
    ]
    assert container["env"][-3:] == [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        {"name": "MY_ENV_MODE", "valueFrom": {"configMapKeyRef": {"name": "my-env.conf", "key": "mode"}}},
        {"name": "OMP_NUM_THREADS", "value": "4"},
    ]
    assert container["env"][-4]["name"] == "RLRUN_CONTROL_TOKEN"  # rlrun's own come first, all of them
    for pod in pods[naming.TRAINER]:  # every node of the trainer
        container = pod["spec"]["containers"][0]
        assert container["image"] == SETTINGS.trainer_image
        assert pod["spec"]["volumes"][-1] == {
            "name": "dataset",
            "persistentVolumeClaim": {"claimName": "arithmetic", "readOnly": True},
        }
        assert container["volumeMounts"][-1] == {"name": "dataset", "mountPath": "/data", "readOnly": True}
        assert container["env"][-1] == {"name": "OMP_NUM_THREADS", "value": "8"}
    for pod in pods[naming.ROLLOUT]:  # a role without volumes or env gets none of another role's
        container = pod["spec"]["containers"][0]
        assert [v["name"] for v in pod["spec"]["volumes"]] == ["data", "config", "tmp", "dshm"]
        assert not {"HF_TOKEN", "OMP_NUM_THREADS"} & {e["name"] for e in container["env"]}
    replacement = build_trainer_replacement(body, run, SETTINGS, 1, "demo-trainer-0-a1-r1", [], 0, 2)
    assert replacement["spec"]["volumes"] == pods[naming.TRAINER][0]["spec"]["volumes"]
    for pod in [p for role in pods.values() for p in role] + [replacement]:
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_the_spec_reserves_every_name_and_path_rlrun_gives_its_pods():
    """What the spec refuses in a role's ``volumes`` and ``env`` covers all the builders set themselves."""
    body, run = make(trainer={"processes_per_node": 2}, rollout={"replicas": 1})
    for pod in build_pods(body, run, SETTINGS, 0):
        container = pod["spec"]["containers"][0]
        for var in container["env"]:
            assert var["name"] in RESERVED_ENV_NAMES or var["name"].startswith(RESERVED_ENV_PREFIX), var
        paths = [m["mountPath"] for m in container["volumeMounts"]] + [container["terminationMessagePath"]]
        assert set(paths) <= set(RESERVED_MOUNT_PATHS), pod["metadata"]["name"]
        assert {v["name"] for v in pod["spec"]["volumes"]} <= set(RESERVED_VOLUME_NAMES)


def test_the_wandb_api_key_secret_reaches_the_orchestrator_alone():
    logging = {"wandb": {"project": "p", "api_key_secret": {"name": "wandb", "key": "api-key"}}}
    body, run = make(logging=logging)
    pods = pods_by_component(build_pods(body, run, SETTINGS, 0))
    (orchestrator,) = pods[naming.ORCHESTRATOR]
    env = orchestrator["spec"]["containers"][0]["env"]
    assert {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}} in env
    for component in (naming.TRAINER, naming.ROLLOUT):  # only the orchestrator logs to the trackers
        for pod in pods[component]:
            assert all(e["name"] != "WANDB_API_KEY" for e in pod["spec"]["containers"][0]["env"])
