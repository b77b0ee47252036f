"""The resources the emulator serves: ``ResourceSpec``, the builtin kinds, and the resources a CRD adds.

A ``ResourceSpec`` is one group/version/plural; every served version of a CRD stores its
objects under the CRD's storage version, so they share one store and differ only in
``apiVersion`` (conversion strategy ``None``).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import kmock
import yaml

from .errors import ApiError
from .timestamps import now

#: RBAC verbs of a resource (the subresource ``status`` gets get/patch/update).
RESOURCE_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclasses.dataclass(frozen=True, eq=False)
class ResourceSpec:
    """One served resource (one group/version/plural) and how the emulator treats it.

    Attributes:
        schema: the CRD version's ``openAPIV3Schema``; when set, created and updated objects get
            its defaults, lose unknown fields (pruning) and are validated against it (422 on failure).
        storage_version: the version objects are stored under (for CRDs serving several versions:
            all served versions share one store; only ``apiVersion`` differs, as with conversion
            strategy ``None``). Empty: this version.
    """

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status_subresource: bool = False
    schema: dict[str, Any] | None = None
    storage_version: str = ""
    printer_columns: tuple[dict[str, Any], ...] = ()

    @property
    def api_version(self) -> str:
        """``apiVersion`` of the objects: ``v1`` for the core group, else ``group/version``."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def store(self) -> kmock.resource:
        """The key objects are stored under in ``KubeEmulator.objects`` (group, storage version, plural)."""
        return kmock.resource(self.group, self.storage_version or self.version, self.plural)

    @property
    def qualified(self) -> str:
        """``plural.group`` (``pods`` for the core group), as in API error messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def is_crds(self) -> bool:
        """The ``customresourcedefinitions`` resource: writes to it change what is served."""
        return self.group == "apiextensions.k8s.io" and self.plural == "customresourcedefinitions"

    def present(self, obj: dict[str, Any]) -> dict[str, Any]:
        """A copy of a stored object as served under this version (its ``apiVersion``)."""
        obj = copy.deepcopy(obj)
        obj["apiVersion"] = self.api_version
        return obj


#: Builtin resources an operator of pods, volumes, secrets and events uses; more via ``add_resource``.
BUILTIN_RESOURCES = (
    ResourceSpec("", "v1", "namespaces", "Namespace", False, "namespace", ("ns",), (), True),
    ResourceSpec("", "v1", "nodes", "Node", False, "node", ("no",), (), True),
    ResourceSpec("", "v1", "pods", "Pod", True, "pod", ("po",), ("all",), True),
    ResourceSpec("", "v1", "services", "Service", True, "service", ("svc",), ("all",), True),
    ResourceSpec(
        "", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, "persistentvolumeclaim", ("pvc",), (), True
    ),
    ResourceSpec("", "v1", "secrets", "Secret", True, "secret"),
    ResourceSpec("", "v1", "configmaps", "ConfigMap", True, "configmap", ("cm",)),
    ResourceSpec("", "v1", "serviceaccounts", "ServiceAccount", True, "serviceaccount", ("sa",)),
    ResourceSpec("", "v1", "events", "Event", True, "event", ("ev",)),
    ResourceSpec("events.k8s.io", "v1", "events", "Event", True, "event", ("ev",)),
    ResourceSpec(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        "customresourcedefinition",
        ("crd", "crds"),
        (),
        True,
    ),
)


def crd_resources(crd: dict[str, Any]) -> list[ResourceSpec]:
    """The resources an ``apiextensions.k8s.io/v1`` CRD object serves, one per served version.

    Raises:
        ApiError: 422 when the CRD lacks group/names/versions or its name is not ``plural.group``.
    """
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group, plural, kind = spec.get("group"), names.get("plural"), names.get("kind")
    versions = [v for v in spec.get("versions") or [] if v.get("served", True)]
    name = (crd.get("metadata") or {}).get("name")
    if not (group and plural and kind and versions):
        raise ApiError.invalid(
            "CustomResourceDefinition", name, "spec", "group, names.plural/kind and versions are required"
        )
    if name != f"{plural}.{group}":
        raise ApiError.invalid(
            "CustomResourceDefinition",
            name,
            "metadata.name",
            f"must be spec.names.plural+'.'+spec.group: {plural}.{group}",
        )
    storage = next((v["name"] for v in versions if v.get("storage")), versions[0]["name"])
    return [
        ResourceSpec(
            group=group,
            version=v["name"],
            plural=plural,
            kind=kind,
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            singular=names.get("singular") or kind.lower(),
            short_names=tuple(names.get("shortNames") or ()),
            categories=tuple(names.get("categories") or ()),
            status_subresource="status" in (v.get("subresources") or {}),
            schema=(v.get("schema") or {}).get("openAPIV3Schema"),
            storage_version=storage,
            printer_columns=tuple(v.get("additionalPrinterColumns") or ()),
        )
        for v in versions
    ]


def accept_crd(crd: dict[str, Any], previous: dict[str, Any] | None = None) -> None:
    """Check a CRD can be served and set the status the API server would (names accepted, established).

    Raises:
        ApiError: 422 for a CRD that cannot be served (see :func:`crd_resources`).
    """
    crd_resources(crd)
    names = crd["spec"]["names"]
    since = {c["type"]: c["lastTransitionTime"] for c in ((previous or {}).get("status") or {}).get("conditions", [])}
    conditions = [
        {"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": since.get(t, now())}
        for t, r, m in (
            ("NamesAccepted", "NoConflicts", "no conflicts found"),
            ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
        )
    ]
    storage = [v["name"] for v in crd["spec"]["versions"] if v.get("storage")]
    crd["status"] = {"acceptedNames": names, "conditions": conditions, "storedVersions": storage}


def load_crds(directory: str | Path) -> list[dict[str, Any]]:
    """Every ``CustomResourceDefinition`` document in the ``*.yaml`` files of ``directory`` (sorted by file name)."""
    docs = []
    for path in sorted(Path(directory).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                docs.append(doc)
    return docs
