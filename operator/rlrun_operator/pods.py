"""Pure builders of a run's pods: the pods of one attempt and the replacements of lost ones (plain dicts).

The pods' names are in :mod:`rlrun_operator.builders`' table. Every pod mounts the claim at
``/var/lib/rlrun`` (run directory ``run/``, model cache ``cache/``) and the ConfigMap at ``/etc/rlrun``, then
the role's own ``volumes`` (read-only unless the spec says otherwise) with its ``env`` after rlrun's variables
(:func:`user_volumes`, :func:`user_env`); runs as a non-root user with no capabilities; gets
``terminationGracePeriodSeconds`` from ``spec.preemption`` (the orchestrator writes its snapshot on SIGTERM
within ``snapshot_timeout_seconds``).
Pods have ``restartPolicy: Never``: a restart is a new attempt, which the operator
numbers (and which resumes from the newest complete checkpoint: every role gets
``--resume``, which starts fresh on an empty run directory). The orchestrator and trainer
also get ``--run-uid`` (the RLRun's uid), so attempts are numbered per run directory: a run
re-created over a retained claim continues the numbering. Every container writes its exit
report (:class:`~rlrun.api.control.ExitReport`) to ``/dev/termination-log``, which the
kubelet hands back as the terminated state's ``message`` (how the operator tells a complete
run from one that paused on a SIGTERM). After a recovery the pods avoid the nodes that were
lost: ``NotIn`` the failed nodes is merged into every ``nodeSelectorTerm`` (:func:`avoid_nodes`).

A trainer of ``nodes × processes_per_node`` > 1 ranks runs ``rlrun trainer`` under ``torchrun``
(:func:`trainer_command`). Several nodes use torchrun's *static* rendezvous: node ``I``'s pod has
``--node-rank I``, ``hostname: trainer-I`` and ``subdomain: R-trainer`` (the headless Service, which
publishes not-ready pods, so a pod's DNS name exists as soon as it has an IP), and every node's
``--master-addr`` is node 0's name ``trainer-0.R-trainer.<namespace>.svc``. Node 0 hosts the store
because of its rank, not because a DNS lookup matched its own address (c10d's heuristic), and the
operator always restarts the whole group, so a fixed membership with fixed node ranks is all the
rendezvous needs; ``--max-restarts 0`` leaves every restart to the operator.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from rlrun import roles
from rlrun.api.control import TERMINATION_LOG_ENV
from rlrun.api.pod_inputs import KeyToPathSpec
from rlrun.api.role_specs import RoleSpec, TrainerSpec
from rlrun.api.spec import RLRun

from rlrun_operator import naming
from rlrun_operator.builders import mounted_claim_name, object_meta
from rlrun_operator.settings import OperatorSettings

#: Non-root user and group of every container (the images create this user).
RUN_AS_USER = 1000
GPU_RESOURCE = "nvidia.com/gpu"
#: Where the kubelet reads a container's termination message (Kubernetes' default path).
TERMINATION_LOG = "/dev/termination-log"
#: The node label ``NotIn`` matches against to keep pods off lost nodes.
HOSTNAME_LABEL = "kubernetes.io/hostname"
#: Seconds a multi-node trainer's node waits for the others at its start (torchrun's static rendezvous
#: ``timeout``): trainer pods may be scheduled minutes apart (new GPU nodes, image pulls).
RENDEZVOUS_TIMEOUT_SECONDS = 1800
#: Default requests of roles that give none: enough to schedule the tiny example.
DEFAULT_REQUESTS = {
    naming.ORCHESTRATOR: {"cpu": "1", "memory": "2Gi"},
    naming.TRAINER: {"cpu": "1", "memory": "4Gi"},
    naming.ROLLOUT: {"cpu": "1", "memory": "4Gi"},
}


def trainer_command(
    trainer: TrainerSpec, run: str, namespace: str, attempt: int, run_uid: str = "", node: int = 0,
    nodes: int | None = None,
) -> list[str]:  # fmt: skip
    """The command of trainer node ``node``'s container: :func:`command`'s ``rlrun trainer …`` as it is
    (``1 × 1``), else under torchrun (:func:`rlrun.roles.torchrun_command`): one node of several
    processes standalone; several nodes with a static rendezvous at trainer node 0's address
    (``trainer-0.<run>-trainer.<namespace>.svc``, port :data:`naming.RENDEZVOUS_PORT`,
    :data:`RENDEZVOUS_TIMEOUT_SECONDS`; see the module docstring).

    Args:
        trainer: the spec's trainer (``nodes``, ``processes_per_node``).
        nodes: the group's size when it is not ``trainer.nodes`` (a replacement keeps its attempt's group).
    """
    nodes = trainer.nodes if nodes is None else nodes
    rlrun = command(naming.TRAINER, attempt, run_uid)
    if nodes == 1 and trainer.processes_per_node == 1:
        return rlrun
    if nodes == 1:
        return roles.torchrun_command(rlrun, trainer.processes_per_node)
    return roles.torchrun_command(
        rlrun, trainer.processes_per_node, nodes, node, naming.trainer_node_address(run, namespace, 0),
        naming.RENDEZVOUS_PORT, RENDEZVOUS_TIMEOUT_SECONDS,
    )  # fmt: skip


def rollout_shm_size(gpus: int) -> str:
    """The ``sizeLimit`` of a rollout pod's ``/dev/shm`` (a memory-backed emptyDir) for a server over ``gpus`` GPUs:
    1 GiB, plus 512 MiB per GPU.

    What vLLM puts there with tensor parallelism over N GPUs (vLLM 0.32, ``distributed/device_communicators/
    shm_broadcast.py``, ``v1/executor/multiproc_executor.py``): the scheduler's broadcast ring to the workers
    (10 chunks of ``VLLM_MQ_MAX_CHUNK_BYTES_MB`` = 16 MiB: 160 MiB), each worker's response ring (10 × 24 MiB:
    240 MiB per GPU) and the tensor-parallel group's broadcaster (24 MiB), ≈ 0.2 GiB + 0.24 GiB per GPU; NCCL's
    shared-memory transport and proxy segments (GPUs without peer-to-peer access) take the rest of the margin.
    Pages count against the pod's memory only once written, and a writer past the limit gets the pod evicted
    rather than the node's memory exhausted (without a limit the volume may grow to the node's allocatable
    memory). One GPU or a CPU server (no worker processes) needs little of it.
    """
    return f"{1024 + 512 * gpus}Mi"


def _resources(role: RoleSpec, component: str) -> dict[str, Any]:
    limits = dict(role.resources.limits)
    # No requests given: the defaults, except that a limit is its own request (what Kubernetes does
    # for a container that sets only limits, and a request above its limit would be refused).
    requests = dict(role.resources.requests) or {**DEFAULT_REQUESTS[component], **limits}
    if role.gpus:
        requests[GPU_RESOURCE] = str(role.gpus)
        limits[GPU_RESOURCE] = str(role.gpus)
    out: dict[str, Any] = {"requests": requests}
    if limits:
        out["limits"] = limits
    return out


def _items(items: list[KeyToPathSpec]) -> dict[str, Any]:
    return {"items": [{"key": i.key, "path": i.path} for i in items]} if items else {}


def user_volumes(role: RoleSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the container's mounts for ``role.volumes``, in Kubernetes' shapes, after rlrun's
    own (the spec keeps names and paths apart from theirs). A read-only claim is read-only in the volume too,
    so the kubelet never walks a dataset to apply the pod's ``fsGroup``.

    Returns:
        ``(volumes, mounts)``, in the spec's order.
    """
    volumes, mounts = [], []
    for v in role.volumes:
        mount: dict[str, Any] = {"name": v.name, "mountPath": v.mount_path}
        if v.read_only:
            mount["readOnly"] = True
        mounts.append(mount)
        if v.persistent_volume_claim is not None:
            claim: dict[str, Any] = {"claimName": v.persistent_volume_claim.claim_name}
            if v.read_only:
                claim["readOnly"] = True
            volumes.append({"name": v.name, "persistentVolumeClaim": claim})
        elif v.config_map is not None:
            volumes.append({"name": v.name, "configMap": {"name": v.config_map.name, **_items(v.config_map.items)}})
        elif v.secret is not None:
            secret = {"secretName": v.secret.secret_name, **_items(v.secret.items)}
            volumes.append({"name": v.name, "secret": secret})
    return volumes, mounts


def user_env(role: RoleSpec) -> list[dict[str, Any]]:
    """The container's variables for ``role.env``, in Kubernetes' ``EnvVar`` shape (after rlrun's own, whose
    names the spec refuses)."""
    out: list[dict[str, Any]] = []
    for e in role.env:
        if e.value_from is None:
            out.append({"name": e.name, "value": e.value})
        elif e.value_from.secret_key_ref is not None:
            ref = e.value_from.secret_key_ref
            out.append({"name": e.name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
        elif e.value_from.config_map_key_ref is not None:
            ref = e.value_from.config_map_key_ref
            out.append({"name": e.name, "valueFrom": {"configMapKeyRef": {"name": ref.name, "key": ref.key}}})
    return out


def command(component: str, attempt: int, run_uid: str = "") -> list[str]:
    """The ``rlrun`` command a role's container runs (:mod:`rlrun.roles`, with the pod's paths and ports;
    tests parse it with the real CLI). Every attempt's orchestrator and trainer pass ``--resume``: a fresh
    run directory resumes nothing.

    Args:
        run_uid: the RLRun's uid (``--run-uid``: attempts are numbered per run directory); "" leaves it out.

    Raises:
        ValueError: ``component`` is not one of :data:`rlrun_operator.naming.COMPONENTS`.
    """
    manifest, run_dir, cache = naming.MANIFEST_PATH, naming.RUN_DIR, naming.CACHE_DIR
    if component == naming.ORCHESTRATOR:
        return roles.orchestrator_command(
            manifest, run_dir, cache, attempt, resume=True, run_uid=run_uid,
            control_host="0.0.0.0", control_port=naming.CONTROL_PORT,
        )  # fmt: skip
    if component == naming.TRAINER:
        return roles.trainer_command(manifest, run_dir, cache, attempt, resume=True, run_uid=run_uid)
    if component == naming.ROLLOUT:
        return roles.rollout_command(manifest, cache, "0.0.0.0", naming.ROLLOUT_PORT)
    raise ValueError(f"unknown component {component!r}")


def _pod(
    body: dict[str, Any],
    run: RLRun,
    settings: OperatorSettings,
    component: str,
    attempt: int,
    index: int | None = None,
    avoid: Sequence[str] = (),
    name: str | None = None,
    node: int = 0,
    nodes: int | None = None,
) -> dict[str, Any]:
    spec = run.spec
    namespace = body["metadata"]["namespace"]
    # a trainer's group: its size (a replacement keeps its attempt's), and whether it runs several ranks
    group = (spec.trainer.nodes if nodes is None else nodes) if component == naming.TRAINER else 1
    ranks = group * spec.trainer.processes_per_node if component == naming.TRAINER else 1
    role: RoleSpec = {
        naming.ORCHESTRATOR: spec.orchestrator,
        naming.TRAINER: spec.trainer,
        naming.ROLLOUT: spec.rollout,
    }[component]
    default_image = settings.rollout_image if component == naming.ROLLOUT else settings.trainer_image
    env = [
        {"name": "RLRUN_CACHE_DIR", "value": naming.CACHE_DIR},
        {"name": "HF_HOME", "value": f"{naming.CACHE_DIR}/hf"},
        {"name": "HOME", "value": "/tmp"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": TERMINATION_LOG_ENV, "value": TERMINATION_LOG},
    ]
    mounts = [
        {"name": "data", "mountPath": naming.DATA_DIR},
        {"name": "config", "mountPath": naming.CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "data", "persistentVolumeClaim": {"claimName": mounted_claim_name(run)}},
        {"name": "config", "configMap": {"name": naming.configmap_name(run.metadata.name)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    container: dict[str, Any] = {
        "name": component,
        "image": role.image or default_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": (
            trainer_command(
                spec.trainer, run.metadata.name, namespace, attempt, body["metadata"].get("uid", ""), node, group
            )
            if component == naming.TRAINER
            else command(component, attempt, body["metadata"].get("uid", ""))
        ),
        "env": env,
        "resources": _resources(role, component),
        "volumeMounts": mounts,
        "terminationMessagePath": TERMINATION_LOG,
        # a crash that wrote no exit report still says something: the last lines of its log
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
        },
    }
    if component == naming.ORCHESTRATOR:
        env.append(
            {
                "name": roles.CONTROL_TOKEN_ENV,
                "valueFrom": {"secretKeyRef": {"name": naming.secret_name(run.metadata.name), "key": naming.TOKEN_KEY}},
            }
        )
        wandb = spec.logging.wandb  # the orchestrator is the one process that logs to the trackers
        if wandb is not None and wandb.api_key_secret is not None:
            ref = {"name": wandb.api_key_secret.name, "key": wandb.api_key_secret.key}
            env.append({"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": ref}})
        container["ports"] = [{"name": "control", "containerPort": naming.CONTROL_PORT, "protocol": "TCP"}]
        container["readinessProbe"] = {
            "httpGet": {"path": "/healthz", "port": "control"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        }
    elif component == naming.TRAINER:  # rank 0 serves /metrics and /healthz (rlrun.training.prometheus)
        env.append({"name": roles.METRICS_PORT_ENV, "value": str(naming.TRAINER_METRICS_PORT)})
        container["ports"] = [{"name": "metrics", "containerPort": naming.TRAINER_METRICS_PORT, "protocol": "TCP"}]
        if group > 1:  # node 0 hosts the rendezvous store on this port
            container["ports"].append(
                {"name": "rendezvous", "containerPort": naming.RENDEZVOUS_PORT, "protocol": "TCP"}
            )
    if component == naming.TRAINER and ranks > 1:
        # torchrun forwards SIGTERM to its ranks and SIGKILLs them 30 s later by default: give them the pod's
        # grace period instead, so only the kubelet's SIGKILL bounds the save on notice (rlrun.roles). With the
        # trainer image's torch 2.8, which ignores it, a save on notice under torchrun must fit in 30 s (a cut
        # save only costs the steps since the previous checkpoint).
        grace = spec.preemption.termination_grace_period_seconds
        env += [{"name": k, "value": v} for k, v in roles.trainer_env(ranks, grace).items()]
        # ranks on one node exchange through /dev/shm (NCCL's SHM transport, gloo); 64 MiB is too small
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    elif component == naming.ROLLOUT:
        # vLLM's worker processes share tensors through /dev/shm; the container default (64 MiB) is too small.
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": rollout_shm_size(role.gpus)}})
        container["ports"] = [{"name": "http", "containerPort": naming.ROLLOUT_PORT, "protocol": "TCP"}]
        probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5}
        # loading a model can take minutes: the startup probe allows 20 of them before liveness applies
        container["startupProbe"] = {**probe, "periodSeconds": 10, "failureThreshold": 120}
        container["readinessProbe"] = {**probe, "failureThreshold": 2}
        container["livenessProbe"] = {**probe, "periodSeconds": 15, "failureThreshold": 4}
    # The trainer serves nothing, so it has no probe: its progress is the orchestrator's step.
    extra_volumes, extra_mounts = user_volumes(role)
    volumes += extra_volumes
    mounts += extra_mounts
    env += user_env(role)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": spec.preemption.termination_grace_period_seconds,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    if settings.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in settings.image_pull_secrets]
    scheduling = spec.scheduling
    if scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in scheduling.tolerations]
    affinity = avoid_nodes(scheduling.affinity, avoid)
    if affinity:
        pod_spec["affinity"] = affinity
    if scheduling.priority_class_name:
        pod_spec["priorityClassName"] = scheduling.priority_class_name
    if group > 1:  # a stable DNS name per node: trainer-I.<run>-trainer.<namespace>.svc
        pod_spec["hostname"] = naming.trainer_hostname(node)
        pod_spec["subdomain"] = naming.trainer_service_name(run.metadata.name)
    pod_name = name or naming.pod_name(run.metadata.name, component, attempt, node if group > 1 else index)
    meta = object_meta(body, pod_name, component, attempt)
    if index is not None:
        meta["labels"][naming.ROLLOUT_INDEX] = str(index)
    if group > 1:
        meta["labels"][naming.TRAINER_NODE] = str(node)
        meta["labels"][naming.TRAINER_NODES] = str(group)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def avoid_nodes(affinity: dict[str, Any] | None, nodes: Sequence[str]) -> dict[str, Any] | None:
    """``affinity`` with ``kubernetes.io/hostname NotIn nodes`` required in every ``nodeSelectorTerm``.

    Node selector terms are ORed, so an added term of its own would do nothing when the user's
    affinity has terms: the expression is merged into each of them (ANDed there). Without
    required node affinity, one term with the expression is added. ``affinity`` is not changed.

    Args:
        affinity: the user's ``scheduling.affinity`` (Kubernetes' shape), or None.
        nodes: node names to keep off; empty: ``affinity`` as it is.
    """
    if not nodes:
        return copy.deepcopy(affinity) if affinity else None
    out = copy.deepcopy(affinity) if affinity else {}
    rule = {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": sorted(set(nodes))}
    node_affinity = out.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        term["matchExpressions"] = [*term.get("matchExpressions", []), rule]
    required["nodeSelectorTerms"] = terms
    return out


def build_pods(
    body: dict[str, Any], run: RLRun, settings: OperatorSettings, attempt: int, avoid: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """The pods of one attempt: rollout servers first (they take longest), trainer (one pod per node), orchestrator.

    Args:
        body: the RLRun object (``metadata.name``, ``namespace`` and ``uid`` are read).
        run: its spec, parsed (the model's defaults filled in).
        avoid: nodes the pods must not be scheduled on (lost in earlier attempts).
    """
    pods = [_pod(body, run, settings, naming.ROLLOUT, attempt, i, avoid) for i in range(run.spec.rollout.replicas)]
    pods += [
        _pod(body, run, settings, naming.TRAINER, attempt, avoid=avoid, node=i) for i in range(run.spec.trainer.nodes)
    ]
    pods.append(_pod(body, run, settings, naming.ORCHESTRATOR, attempt, avoid=avoid))
    return pods


def build_rollout_replacement(
    body: dict[str, Any], run: RLRun, settings: OperatorSettings, attempt: int, index: int, name: str,
    avoid: Sequence[str] = (),
) -> dict[str, Any]:  # fmt: skip
    """The replacement of attempt ``attempt``'s lost rollout pod ``index``, named ``name``
    (``naming.replacement_pod_name``): the same pod, a new name, the same attempt."""
    return _pod(body, run, settings, naming.ROLLOUT, attempt, index, avoid, name=name)


def build_trainer_replacement(
    body: dict[str, Any], run: RLRun, settings: OperatorSettings, attempt: int, name: str, avoid: Sequence[str] = (),
    node: int | None = None, nodes: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """The replacement of attempt ``attempt``'s lost trainer, named ``name`` (``naming.replacement_name``):
    the trainer pod of :func:`build_pods` with a new name and the same attempt, so its command is the same
    ``rlrun trainer … --attempt <attempt> --run-uid <uid> --resume`` (it restores the newest complete checkpoint
    and trains the batches the orchestrator of that attempt shipped after it), kept off ``avoid``.

    Args:
        node: the node index of a multi-node trainer's pod (None: a single-node trainer).
        nodes: the size of the group being replaced (every node's pod is replaced together; the attempt's
            group size holds even if ``trainer.nodes`` changed since, like ``rollout.replicas``).
    """
    return _pod(body, run, settings, naming.TRAINER, attempt, avoid=avoid, name=name, node=node or 0, nodes=nodes)
