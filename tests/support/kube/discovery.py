"""Discovery: ``/version``, ``/api``, ``/apis`` and the resource lists kubectl and kopf read before any call.

Built from the served resources alone, so a CRD that is created (or deleted) is in (or out of)
discovery at once: the API server's "Established" without the delay.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .errors import ApiError
from .resources import RESOURCE_VERBS, ResourceSpec

#: The version reported by ``/version`` (kubectl warns when its own is more than one minor apart).
SERVER_VERSION = {"major": "1", "minor": "37", "gitVersion": "v1.37.0-emulator", "platform": "linux/amd64"}
#: Answered ``ok`` (plain text).
HEALTH_PATHS = ("/healthz", "/livez", "/readyz")


def discovery_document(path: str, served: Iterable[ResourceSpec]) -> dict[str, Any]:
    """The JSON document at a discovery ``path`` (no trailing slash) for the ``served`` resources.

    Raises:
        ApiError: 404 for any other path.
    """
    specs = list(served)
    groups: dict[str, list[str]] = {}
    for spec in specs:
        if spec.group and spec.version not in groups.setdefault(spec.group, []):
            groups[spec.group].append(spec.version)

    def group_doc(group: str) -> dict[str, Any]:
        versions = groups[group]
        storage = next((s.storage_version for s in specs if s.group == group and s.storage_version), versions[0])
        preferred = storage if storage in versions else versions[0]
        listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {
            "name": group,
            "versions": listed,
            "preferredVersion": {"groupVersion": f"{group}/{preferred}", "version": preferred},
        }

    def resource_list(group: str, version: str) -> dict[str, Any]:
        resources = []
        for s in specs:
            if (s.group, s.version) != (group, version):
                continue
            entry = {"name": s.plural, "singularName": s.singular, "namespaced": s.namespaced, "kind": s.kind}
            entry |= {"verbs": list(RESOURCE_VERBS), "shortNames": list(s.short_names)}
            if s.categories:
                entry["categories"] = list(s.categories)
            resources.append(entry)
            if s.status_subresource:
                resources.append(
                    {
                        "name": f"{s.plural}/status",
                        "singularName": "",
                        "namespaced": s.namespaced,
                        "kind": s.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        gv = f"{group}/{version}" if group else version
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}

    parts = path.strip("/").split("/")
    if path == "/version":
        return SERVER_VERSION
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
    if path == "/api/v1":
        return resource_list("", "v1")
    if path == "/apis":
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [group_doc(g) for g in groups]}
    if parts[0] == "apis" and len(parts) == 2 and parts[1] in groups:
        return {"kind": "APIGroup", "apiVersion": "v1", **group_doc(parts[1])}
    if parts[0] == "apis" and len(parts) == 3 and parts[2] in groups.get(parts[1], []):
        return resource_list(parts[1], parts[2])
    raise ApiError(404, "NotFound", "the server could not find the requested resource")
