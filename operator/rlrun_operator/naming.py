"""Names and labels of the objects the operator creates for one RLRun.

Pods carry the attempt in their name and the ``rlrun.dev/attempt`` label: a new attempt's
pods can be created while the previous attempt's are still terminating. A lost trainer or rollout
pod replaced within its attempt gets ``-r<K>`` after the attempt (:func:`replacement_name`). A
multi-node trainer has one pod per node, ``<run>-trainer-<I>-a<N>``, each reachable at the stable DNS
name :func:`trainer_node_address` through the headless Service :func:`trainer_service_name`.
Services select by run and component only, so they follow the run across attempts.
"""

from __future__ import annotations

import re

from rlrun.api.spec import API_GROUP

OPERATOR_NAME = "rlrun-operator"
APP_NAME = "rlrun"

NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = "app.kubernetes.io/managed-by"
ATTEMPT = f"{API_GROUP}/attempt"
ROLLOUT_INDEX = f"{API_GROUP}/rollout-index"
#: A multi-node trainer's pods: the node's index (its ``torchrun --node-rank``) and the group's size.
TRAINER_NODE = f"{API_GROUP}/trainer-node"
TRAINER_NODES = f"{API_GROUP}/trainer-nodes"

#: Kueue's labels on an RLRun: the LocalQueue that admits it, and its WorkloadPriorityClass (``kueue.py``).
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"

ORCHESTRATOR = "orchestrator"
TRAINER = "trainer"
ROLLOUT = "rollout"
COMPONENTS = (ORCHESTRATOR, TRAINER, ROLLOUT)

#: Ports: the orchestrator's control server and vLLM's HTTP server.
CONTROL_PORT = 8080
ROLLOUT_PORT = 8000
#: A multi-node trainer's rendezvous: the TCP store of ``torchrun``'s static rendezvous on trainer node 0.
RENDEZVOUS_PORT = 29500
#: The trainer's /metrics and /healthz (rank 0; rlrun.training.prometheus).
TRAINER_METRICS_PORT = 9400
#: Paths inside the pods.
CONFIG_DIR = "/etc/rlrun"
MANIFEST_PATH = f"{CONFIG_DIR}/rlrun.yaml"
DATA_DIR = "/var/lib/rlrun"
RUN_DIR = f"{DATA_DIR}/run"
CACHE_DIR = f"{DATA_DIR}/cache"
#: Key of the control token in the run's Secret, and of the manifest in its ConfigMap.
TOKEN_KEY = "token"
MANIFEST_KEY = "rlrun.yaml"


def labels(run: str, component: str | None = None, attempt: int | None = None) -> dict[str, str]:
    """The labels of a run's objects (``component`` and ``attempt`` where they apply)."""
    out = {NAME: APP_NAME, INSTANCE: run, MANAGED_BY: OPERATOR_NAME}
    if component is not None:
        out[COMPONENT] = component
    if attempt is not None:
        out[ATTEMPT] = str(attempt)
    return out


def created_claim_name(run: str) -> str:
    """The PersistentVolumeClaim the operator creates for the run directory: ``<run>-run``.

    Not always the one the pods mount: ``storage.existing_claim`` replaces it
    (``builders.mounted_claim_name``).
    """
    return f"{run}-run"


def workload_name(run: str) -> str:
    """The Kueue Workload of a run labelled ``kueue.x-k8s.io/queue-name``: ``rlrun-<run>`` (≤ 56 characters, a
    DNS-1123 subdomain: run names are ≤ 50 characters)."""
    return f"rlrun-{run}"


def secret_name(run: str) -> str:
    """The Secret holding the orchestrator's control token: ``<run>-control``."""
    return f"{run}-control"


def configmap_name(run: str) -> str:
    """The ConfigMap holding the resolved manifest: ``<run>-config``."""
    return f"{run}-config"


def orchestrator_service_name(run: str) -> str:
    """The Service of the orchestrator's control port: ``<run>-orchestrator``."""
    return f"{run}-orchestrator"


def trainer_service_name(run: str) -> str:
    """The headless Service of a multi-node trainer: ``<run>-trainer`` (the trainer pods' ``subdomain``)."""
    return f"{run}-trainer"


def trainer_hostname(node: int) -> str:
    """The ``hostname`` of trainer node ``node``'s pod: ``trainer-<node>`` (stable across replacements)."""
    return f"trainer-{node}"


def trainer_node_address(run: str, namespace: str, node: int = 0) -> str:
    """The DNS name of trainer node ``node`` of a multi-node trainer: ``trainer-<node>.<run>-trainer.<namespace>.svc``.

    The pod's ``hostname`` under the ``subdomain`` of the headless Service :func:`trainer_service_name`;
    it resolves through the pods' DNS search path whatever the cluster domain is, and names every
    replacement of that node too (only one exists at a time).
    """
    return f"{trainer_hostname(node)}.{trainer_service_name(run)}.{namespace}.svc"


def pod_name(run: str, component: str, attempt: int, index: int | None = None) -> str:
    """``<run>-orchestrator-a0``, ``<run>-trainer-a0``, ``<run>-rollout-1-a0``; with ``index`` a rollout pod's
    or a multi-node trainer's node: ``<run>-trainer-1-a0``."""
    middle = component if index is None else f"{component}-{index}"
    return f"{run}-{middle}-a{attempt}"


def replacement_pod_name(run: str, index: int, attempt: int, recovery: int) -> str:
    """``<run>-rollout-<index>-a<attempt>-r<recovery>``: a lost rollout pod's replacement (same attempt),
    ``recovery`` being the run's count of recoveries so far (unique per run, so idempotent by name)."""
    return f"{pod_name(run, ROLLOUT, attempt, index)}-r{recovery}"


def component_of(run: str, pod: str) -> str:
    """The component in the name of run ``run``'s pod ``pod`` (``<run>-<component>-…``).

    Raises:
        ValueError: ``pod`` is not a pod name of ``run``.
    """
    for component in COMPONENTS:
        if pod.startswith(f"{run}-{component}-"):
            return component
    raise ValueError(f"{pod!r} is not a pod name of run {run!r}")


def replacement_name(run: str, pod: str, attempt: int, recovery: int) -> str:
    """The name of the replacement of run ``run``'s lost pod ``pod`` in the same attempt ``attempt``:
    ``<run>-trainer-a<attempt>-r<recovery>`` (a multi-node trainer's node ``I``:
    ``<run>-trainer-<I>-a<attempt>-r<recovery>``) or ``<run>-rollout-<index>-a<attempt>-r<recovery>``
    (``recovery``: the run's count of recoveries so far, so a replacement's replacement gets a new name).

    Raises:
        ValueError: ``pod`` is not a trainer or rollout pod name of ``run`` (an orchestrator is never
            replaced alone: its loss restarts the attempt).
    """
    component = component_of(run, pod)
    if component == TRAINER:
        return f"{pod_name(run, TRAINER, attempt, trainer_node_of(run, pod))}-r{recovery}"
    if component == ROLLOUT:
        return replacement_pod_name(run, rollout_index_of(run, pod), attempt, recovery)
    raise ValueError(f"{pod!r} is an orchestrator: it is never replaced alone")


def is_rollout_pod_name(pod: str) -> bool:
    """Whether ``pod`` is named as a rollout pod is (``…-rollout-<index>-a<attempt>``, maybe ``-r<K>``)."""
    return re.search(r"-rollout-\d+-a\d+(-r\d+)?$", pod) is not None


def rollout_index_of(run: str, pod: str) -> int:
    """The rollout index in the name of run ``run``'s rollout pod ``pod`` (``<run>-rollout-<index>-a…``).

    Raises:
        ValueError: ``pod`` is not a rollout pod name of ``run``.
    """
    prefix = f"{run}-{ROLLOUT}-"
    index = pod[len(prefix) :].split("-", 1)[0] if pod.startswith(prefix) else ""
    if not index.isdigit():
        raise ValueError(f"{pod!r} is not a rollout pod name of run {run!r}")
    return int(index)


def trainer_node_of(run: str, pod: str) -> int | None:
    """The node index in the name of run ``run``'s trainer pod ``pod``: ``<run>-trainer-<I>-a…`` → ``I``, and
    None for a single-node trainer's ``<run>-trainer-a…``.

    Raises:
        ValueError: ``pod`` is not a trainer pod name of ``run``.
    """
    prefix = f"{run}-{TRAINER}-"
    rest = pod[len(prefix) :] if pod.startswith(prefix) else ""
    if re.fullmatch(r"a\d+(-r\d+)?", rest):
        return None
    found = re.fullmatch(r"(\d+)-a\d+(-r\d+)?", rest)
    if found is None:
        raise ValueError(f"{pod!r} is not a trainer pod name of run {run!r}")
    return int(found.group(1))
