"""Pure builders of a run's pods: the pods of one attempt and the replacements of lost ones (plain dicts).

Every role runs in the same pod (:func:`_pod`); what a role adds — its command, variables, ports and probes,
``/dev/shm`` — is its own function's (:func:`orchestrator_parts`, :func:`trainer_parts`, :func:`rollout_parts`), and
what its command is, :mod:`rlrun.roles` decides for this launcher and ``rlrun local`` alike.

The pods' names are in :mod:`rlrun_operator.builders`' table. Every pod mounts the claim at
``/var/lib/rlrun`` (run directory ``run/``, model cache ``cache/``) and the ConfigMap at ``/etc/rlrun``, then
the role's own ``volumes`` (read-only unless the spec says otherwise) with its ``env`` after rlrun's variables
(:func:`~rlrun_operator.role_inputs.user_volumes`, :func:`~rlrun_operator.role_inputs.user_env`); runs as a non-root
user with no capabilities; gets ``terminationGracePeriodSeconds`` from ``spec.preemption`` (the orchestrator writes its
snapshot on SIGTERM within ``snapshot_timeout_seconds``).
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
(:func:`trainer_command`, :func:`rlrun.roles.trainer_argv`). Several nodes use torchrun's *static* rendezvous: node
``I``'s pod has ``--node-rank I``, ``hostname: trainer-I`` and ``subdomain: R-trainer`` (the headless Service, which
publishes not-ready pods, so a pod's DNS name exists as soon as it has an IP), and every node's
``--master-addr`` is node 0's name ``trainer-0.R-trainer.<namespace>.svc``. Node 0 hosts the store
because of its rank, not because a DNS lookup matched its own address (c10d's heuristic), and the
operator always restarts the whole group, so a fixed membership with fixed node ranks is all the
rendezvous needs; ``--max-restarts 0`` leaves every restart to the operator.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlrun import roles
from rlrun.api.control import TERMINATION_LOG_ENV
from rlrun.api.role_specs import RoleSpec, TrainerSpec
from rlrun.api.spec import RLRun

from rlrun_operator import naming
from rlrun_operator.builders import mounted_claim_name, object_meta
from rlrun_operator.role_inputs import resources, user_env, user_volumes
from rlrun_operator.settings import OperatorSettings

#: Non-root user and group of every container (the images create this user).
RUN_AS_USER = 1000
#: Where the kubelet reads a container's termination message (Kubernetes' default path).
TERMINATION_LOG = "/dev/termination-log"
#: The node label ``NotIn`` matches against to keep pods off lost nodes.
HOSTNAME_LABEL = "kubernetes.io/hostname"
#: Seconds a multi-node trainer's node waits for the others at its start (torchrun's static rendezvous
#: ``timeout``): trainer pods may be scheduled minutes apart (new GPU nodes, image pulls).
RENDEZVOUS_TIMEOUT_SECONDS = 1800


def trainer_command(
    trainer: TrainerSpec,
    run: str,
    namespace: str,
    attempt: int,
    run_uid: str = "",
    node: int = 0,
    nodes: int | None = None,
) -> list[str]:
    """The command of trainer node ``node``'s container: :func:`command`'s ``rlrun trainer …``, as
    :func:`rlrun.roles.trainer_argv` runs it: as it is for one rank, else under torchrun — one node standalone;
    several with a static rendezvous at trainer node 0's address (``trainer-0.<run>-trainer.<namespace>.svc``, port
    :data:`naming.RENDEZVOUS_PORT`, :data:`RENDEZVOUS_TIMEOUT_SECONDS`; see the module docstring).

    Args:
        trainer: the spec's trainer (``nodes``, ``processes_per_node``).
        nodes: the group's size when it is not ``trainer.nodes`` (a replacement keeps its attempt's group).
    """
    nodes = trainer.nodes if nodes is None else nodes
    rlrun = command(naming.TRAINER, attempt, run_uid)
    if nodes == 1:
        return roles.trainer_argv(rlrun, trainer.processes_per_node)
    master = naming.trainer_node_address(run, namespace, 0)
    rendezvous = (master, naming.RENDEZVOUS_PORT, RENDEZVOUS_TIMEOUT_SECONDS)
    return roles.trainer_argv(rlrun, trainer.processes_per_node, nodes, node, *rendezvous)


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
            manifest,
            run_dir,
            cache,
            attempt,
            resume=True,
            run_uid=run_uid,
            control_host="0.0.0.0",
            control_port=naming.CONTROL_PORT,
        )
    if component == naming.TRAINER:
        return roles.trainer_command(manifest, run_dir, cache, attempt, resume=True, run_uid=run_uid)
    if component == naming.ROLLOUT:
        return roles.rollout_command(manifest, cache, "0.0.0.0", naming.ROLLOUT_PORT)
    raise ValueError(f"unknown component {component!r}")


@dataclass
class RoleParts:
    """What a role's container adds to every pod's (:func:`_pod`), each list after rlrun's common entries and before
    the role's own ``env`` and ``volumes`` from the spec.

    Attributes:
        command: the container's command.
        env: its variables.
        container: more of its fields (``ports``, probes).
        mounts, volumes: its mounts and the pod's volumes.
    """

    command: list[str]
    env: list[dict[str, Any]] = field(default_factory=list)
    container: dict[str, Any] = field(default_factory=dict)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    volumes: list[dict[str, Any]] = field(default_factory=list)


def _uid(body: dict[str, Any]) -> str:
    return body["metadata"].get("uid", "")


def orchestrator_parts(body: dict[str, Any], run: RLRun, attempt: int) -> RoleParts:
    """The orchestrator's: its control server's port with a readiness probe on ``/healthz``, the bearer token from
    the run's Secret, and W&B's API key (the orchestrator is the one process that logs to the trackers)."""
    secret = {"secretKeyRef": {"name": naming.secret_name(run.metadata.name), "key": naming.TOKEN_KEY}}
    env: list[dict[str, Any]] = [{"name": roles.CONTROL_TOKEN_ENV, "valueFrom": secret}]
    wandb = run.spec.logging.wandb
    if wandb is not None and wandb.api_key_secret is not None:
        ref = {"name": wandb.api_key_secret.name, "key": wandb.api_key_secret.key}
        env.append({"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": ref}})
    container = {
        "ports": [{"name": "control", "containerPort": naming.CONTROL_PORT, "protocol": "TCP"}],
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": "control"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
    }
    return RoleParts(command(naming.ORCHESTRATOR, attempt, _uid(body)), env, container)


def trainer_parts(body: dict[str, Any], run: RLRun, attempt: int, node: int, group: int) -> RoleParts:
    """Trainer node ``node`` of a group of ``group``'s: rank 0 serves ``/metrics`` and ``/healthz``
    (:mod:`rlrun.training.prometheus`), node 0 of several hosts the rendezvous store; with ``spec.weights.transport:
    collective`` its pod IP is ``$RLRUN_POD_IP`` (the downward API: where the rollout servers' workers reach rank 0's
    weight sender, :mod:`rlrun.training.weight_sender`); under torchrun
    (:func:`rlrun.roles.under_torchrun`) :func:`rlrun.roles.trainer_env` and a memory-backed ``/dev/shm``. It serves
    nothing a probe could ask, so it has none: its progress is the orchestrator's step."""
    spec = run.spec
    namespace = body["metadata"]["namespace"]
    argv = trainer_command(spec.trainer, run.metadata.name, namespace, attempt, _uid(body), node, group)
    ports = [{"name": "metrics", "containerPort": naming.TRAINER_METRICS_PORT, "protocol": "TCP"}]
    if group > 1:  # node 0 hosts the rendezvous store on this port
        ports.append({"name": "rendezvous", "containerPort": naming.RENDEZVOUS_PORT, "protocol": "TCP"})
    parts = RoleParts(argv, [{"name": roles.METRICS_PORT_ENV, "value": str(naming.TRAINER_METRICS_PORT)}])
    if spec.weights.transport == "collective":  # rank 0's rendezvous address for the rollout servers' workers
        parts.env.append({"name": roles.POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    parts.container["ports"] = ports
    if roles.under_torchrun(spec.trainer.processes_per_node, group):
        # torchrun forwards SIGTERM to its ranks and SIGKILLs them 30 s later by default: give them the pod's
        # grace period instead, so only the kubelet's SIGKILL bounds the save on notice (rlrun.roles). With the
        # trainer image's torch 2.8, which ignores it, a save on notice under torchrun must fit in 30 s (a cut
        # save only costs the steps since the previous checkpoint).
        grace = spec.preemption.termination_grace_period_seconds
        env = roles.trainer_env(spec.trainer.processes_per_node, grace, group)
        parts.env += [{"name": k, "value": v} for k, v in env.items()]
        # ranks on one node exchange through /dev/shm (NCCL's SHM transport, gloo); 64 MiB is too small
        parts.mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        parts.volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    return parts


def rollout_parts(run: RLRun) -> RoleParts:
    """A rollout server's: its HTTP port with startup, readiness and liveness probes on ``/health``, and a
    memory-backed ``/dev/shm`` (:func:`rollout_shm_size`: vLLM's worker processes share tensors there; the
    container default, 64 MiB, is too small)."""
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5}
    container = {
        "ports": [{"name": "http", "containerPort": naming.ROLLOUT_PORT, "protocol": "TCP"}],
        # loading a model can take minutes: the startup probe allows 20 of them before liveness applies
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 120},
        "readinessProbe": {**probe, "failureThreshold": 2},
        "livenessProbe": {**probe, "periodSeconds": 15, "failureThreshold": 4},
    }
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": rollout_shm_size(run.spec.rollout.gpus)}}
    return RoleParts(
        command(naming.ROLLOUT, attempt=0), [], container, [{"name": "dshm", "mountPath": "/dev/shm"}], [shm]
    )


def _pod(
    body: dict[str, Any],
    run: RLRun,
    settings: OperatorSettings,
    component: str,
    parts: RoleParts,
    pod_name: str,
    attempt: int,
    avoid: Sequence[str] = (),
) -> dict[str, Any]:
    """The pod every role runs in (the module docstring), with the role's ``parts``, named ``pod_name``."""
    spec = run.spec
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
        *parts.env,
        *user_env(role),
    ]
    extra_volumes, extra_mounts = user_volumes(role)
    mounts = [
        {"name": "data", "mountPath": naming.DATA_DIR},
        {"name": "config", "mountPath": naming.CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        *parts.mounts,
        *extra_mounts,
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "data", "persistentVolumeClaim": {"claimName": mounted_claim_name(run)}},
        {"name": "config", "configMap": {"name": naming.configmap_name(run.metadata.name)}},
        {"name": "tmp", "emptyDir": {}},
        *parts.volumes,
        *extra_volumes,
    ]
    container: dict[str, Any] = {
        "name": component,
        "image": role.image or default_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": parts.command,
        "env": env,
        "resources": resources(role, component),
        "volumeMounts": mounts,
        "terminationMessagePath": TERMINATION_LOG,
        # a crash that wrote no exit report still says something: the last lines of its log
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
        },
        **parts.container,
    }
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
    meta = object_meta(body, pod_name, component, attempt)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def _rollout_pod(
    body: dict[str, Any],
    run: RLRun,
    settings: OperatorSettings,
    attempt: int,
    index: int,
    avoid: Sequence[str],
    name: str | None = None,
) -> dict[str, Any]:
    pod_name = name or naming.pod_name(run.metadata.name, naming.ROLLOUT, attempt, index)
    pod = _pod(body, run, settings, naming.ROLLOUT, rollout_parts(run), pod_name, attempt, avoid)
    pod["metadata"]["labels"][naming.ROLLOUT_INDEX] = str(index)
    return pod


def _trainer_pod(
    body: dict[str, Any],
    run: RLRun,
    settings: OperatorSettings,
    attempt: int,
    avoid: Sequence[str],
    node: int = 0,
    nodes: int | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """Trainer node ``node``'s pod of a group of ``nodes`` (None: ``trainer.nodes``; a replacement keeps its
    attempt's group): several have a stable DNS name each, ``trainer-I.<run>-trainer.<namespace>.svc``."""
    group = run.spec.trainer.nodes if nodes is None else nodes
    pod_name = name or naming.pod_name(run.metadata.name, naming.TRAINER, attempt, node if group > 1 else None)
    parts = trainer_parts(body, run, attempt, node, group)
    pod = _pod(body, run, settings, naming.TRAINER, parts, pod_name, attempt, avoid)
    if group > 1:
        pod["spec"]["hostname"] = naming.trainer_hostname(node)
        pod["spec"]["subdomain"] = naming.trainer_service_name(run.metadata.name)
        pod["metadata"]["labels"][naming.TRAINER_NODE] = str(node)
        pod["metadata"]["labels"][naming.TRAINER_NODES] = str(group)
    return pod


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
    pods = [_rollout_pod(body, run, settings, attempt, i, avoid) for i in range(run.spec.rollout.replicas)]
    pods += [_trainer_pod(body, run, settings, attempt, avoid, node=i) for i in range(run.spec.trainer.nodes)]
    orchestrator = naming.pod_name(run.metadata.name, naming.ORCHESTRATOR, attempt, None)
    pods.append(
        _pod(
            body,
            run,
            settings,
            naming.ORCHESTRATOR,
            orchestrator_parts(body, run, attempt),
            orchestrator,
            attempt,
            avoid,
        )
    )
    return pods


def build_rollout_replacement(
    body: dict[str, Any],
    run: RLRun,
    settings: OperatorSettings,
    attempt: int,
    index: int,
    name: str,
    avoid: Sequence[str] = (),
) -> dict[str, Any]:
    """The replacement of attempt ``attempt``'s lost rollout pod ``index``, named ``name``
    (``naming.replacement_pod_name``): the same pod, a new name, the same attempt."""
    return _rollout_pod(body, run, settings, attempt, index, avoid, name)


def build_trainer_replacement(
    body: dict[str, Any],
    run: RLRun,
    settings: OperatorSettings,
    attempt: int,
    name: str,
    avoid: Sequence[str] = (),
    node: int | None = None,
    nodes: int = 1,
) -> dict[str, Any]:
    """The replacement of attempt ``attempt``'s lost trainer, named ``name`` (``naming.replacement_name``):
    the trainer pod of :func:`build_pods` with a new name and the same attempt, so its command is the same
    ``rlrun trainer … --attempt <attempt> --run-uid <uid> --resume`` (it restores the newest complete checkpoint
    and trains the batches the orchestrator of that attempt shipped after it), kept off ``avoid``.

    Args:
        node: the node index of a multi-node trainer's pod (None: a single-node trainer).
        nodes: the size of the group being replaced (every node's pod is replaced together; the attempt's
            group size holds even if ``trainer.nodes`` changed since, like ``rollout.replicas``).
    """
    return _trainer_pod(body, run, settings, attempt, avoid, node or 0, nodes, name)
