"""Pure builders of a run's objects: one RLRun in, the Kubernetes objects it needs out (plain dicts, nothing sent).

For a run named ``R`` in attempt ``N``:

| object | name | owned by the RLRun |
|---|---|---|
| PersistentVolumeClaim (run directory + model cache) | ``R-run`` | only with ``retention_policy: Delete`` |
| Secret (orchestrator control token) | ``R-control`` | yes |
| ConfigMap (the resolved manifest every pod reads) | ``R-config`` | yes |
| Service (orchestrator control port) | ``R-orchestrator`` | yes |
| Pod ``rlrun orchestrator`` | ``R-orchestrator-aN`` | yes |
| Pod ``rlrun trainer`` | ``R-trainer-aN`` | yes |
| Pods ``torchrun … rlrun trainer``, one per node of a trainer with ``trainer.nodes`` > 1 | ``R-trainer-I-aN`` | yes |
| headless Service giving those pods stable DNS names (only with ``trainer.nodes`` > 1) | ``R-trainer`` | yes |
| Pods ``rlrun rollout`` (vLLM), ``rollout.replicas`` of them | ``R-rollout-I-aN`` | yes |
| a lost rollout pod's replacement (the attempt goes on) | ``R-rollout-I-aN-rK`` | yes |
| a lost trainer's replacement (the attempt goes on, ``--resume``) | ``R-trainer-aN-rK`` | yes |
| a multi-node trainer's replacement: every node's pod, together | ``R-trainer-I-aN-rK`` | yes |

The pods themselves are built by :mod:`rlrun_operator.pods`.
"""

from __future__ import annotations

import base64
from typing import Any

import yaml
from rlrun.api.spec import API_GROUP, API_VERSION, KIND, RLRun

from rlrun_operator import naming
from rlrun_operator.settings import OperatorSettings


def owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    """An owner reference to the RLRun ``body`` (deleting the RLRun garbage-collects the object)."""
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "name": body["metadata"]["name"],
        "uid": body["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(
    body: dict[str, Any], name: str, component: str | None = None, attempt: int | None = None, owned: bool = True
) -> dict[str, Any]:
    """The ``metadata`` of a run's object ``name``: namespace, labels (:func:`naming.labels`), owner reference unless
    not ``owned``."""
    run = body["metadata"]["name"]
    meta: dict[str, Any] = {
        "name": name,
        "namespace": body["metadata"]["namespace"],
        "labels": naming.labels(run, component, attempt),
    }
    if owned:
        meta["ownerReferences"] = [owner_reference(body)]
    return meta


def resolved_manifest(run: RLRun, namespace: str) -> str:
    """The manifest every pod reads: the spec with every default filled in, as YAML."""
    doc = {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {"name": run.metadata.name, "namespace": namespace},
        "spec": run.spec.model_dump(mode="json"),
    }
    return yaml.safe_dump(doc, sort_keys=False)


def mounted_claim_name(run: RLRun) -> str:
    """The claim a run's pods mount: ``storage.existing_claim``, or the one the operator creates."""
    return run.spec.storage.existing_claim or naming.created_claim_name(run.metadata.name)


def build_claim(body: dict[str, Any], run: RLRun) -> dict[str, Any] | None:
    """The run directory's PersistentVolumeClaim, or None when ``storage.existing_claim`` is used.

    Owned by the RLRun (so deleted with it) only when ``storage.retention_policy`` is ``Delete``.
    """
    storage = run.spec.storage
    if storage.existing_claim:
        return None
    spec: dict[str, Any] = {
        "accessModes": list(storage.access_modes),
        "resources": {"requests": {"storage": storage.size}},
    }
    if storage.storage_class_name:
        spec["storageClassName"] = storage.storage_class_name
    meta = object_meta(body, naming.created_claim_name(run.metadata.name), owned=storage.retention_policy == "Delete")
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def build_secret(body: dict[str, Any], token: str) -> dict[str, Any]:
    """The Secret holding the orchestrator's control-server bearer token."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(body, naming.secret_name(body["metadata"]["name"])),
        "type": "Opaque",
        "data": {naming.TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def build_configmap(body: dict[str, Any], run: RLRun) -> dict[str, Any]:
    """The ConfigMap with the resolved manifest (``rlrun.yaml``) that every role's command reads."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(body, naming.configmap_name(run.metadata.name)),
        "data": {naming.MANIFEST_KEY: resolved_manifest(run, body["metadata"]["namespace"])},
    }


def build_orchestrator_service(body: dict[str, Any]) -> dict[str, Any]:
    """The Service the operator reaches the orchestrator's control server through."""
    run = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(body, naming.orchestrator_service_name(run), naming.ORCHESTRATOR),
        "spec": {
            "type": "ClusterIP",
            "selector": {
                naming.INSTANCE: run,
                naming.COMPONENT: naming.ORCHESTRATOR,
                naming.MANAGED_BY: naming.OPERATOR_NAME,
            },
            "ports": [{"name": "control", "port": naming.CONTROL_PORT, "targetPort": "control", "protocol": "TCP"}],
        },
    }


def build_trainer_service(body: dict[str, Any]) -> dict[str, Any]:
    """The headless Service of a multi-node trainer: the ``subdomain`` of its pods, so node ``I``'s pod is
    ``trainer-I.<run>-trainer.<namespace>.svc`` (:func:`rlrun_operator.naming.trainer_node_address`).

    It selects every trainer pod of the run (any attempt: never two of a node's pods exist at once) and
    publishes them before they are ready (the trainer has no probe; its peers need the name at start).
    """
    run = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(body, naming.trainer_service_name(run), naming.TRAINER),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {
                naming.INSTANCE: run,
                naming.COMPONENT: naming.TRAINER,
                naming.MANAGED_BY: naming.OPERATOR_NAME,
            },
            "ports": [
                {"name": "rendezvous", "port": naming.RENDEZVOUS_PORT, "targetPort": "rendezvous", "protocol": "TCP"}
            ],
        },
    }


def build_run_objects(body: dict[str, Any], run: RLRun, settings: OperatorSettings, token: str) -> list[dict[str, Any]]:
    """Everything a run needs besides its pods, in creation order (claim, Secret, ConfigMap, Service, and the
    trainer's headless Service when ``trainer.nodes`` > 1)."""
    objects = [build_claim(body, run), build_secret(body, token), build_configmap(body, run)]
    objects.append(build_orchestrator_service(body))
    if run.spec.trainer.nodes > 1:
        objects.append(build_trainer_service(body))
    return [o for o in objects if o is not None]
