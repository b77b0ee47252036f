"""A role's own inputs from the spec — resources, volumes, variables — in Kubernetes' shapes, for its container
(:mod:`rlrun_operator.pods`). The spec's side (names and paths kept apart from rlrun's own) is
:mod:`rlrun.api.pod_inputs`.
"""

from __future__ import annotations

from typing import Any

from rlrun.api.pod_inputs import KeyToPathSpec
from rlrun.api.role_specs import RoleSpec

from rlrun_operator import naming

GPU_RESOURCE = "nvidia.com/gpu"
#: Default requests of roles that give none: enough to schedule the tiny example.
DEFAULT_REQUESTS = {
    naming.ORCHESTRATOR: {"cpu": "1", "memory": "2Gi"},
    naming.TRAINER: {"cpu": "1", "memory": "4Gi"},
    naming.ROLLOUT: {"cpu": "1", "memory": "4Gi"},
}


def resources(role: RoleSpec, component: str) -> dict[str, Any]:
    """The container's ``resources`` for ``role`` (a :data:`rlrun_operator.naming.COMPONENTS` ``component``): its
    requests and limits, ``role.gpus`` as :data:`GPU_RESOURCE` in both; without requests, the component's
    :data:`DEFAULT_REQUESTS` (with the limits as requests)."""
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
