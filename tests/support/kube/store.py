"""``KubeStore``: the API server's object semantics on kmock's ``objects``, without HTTP.

Invariant: every write that changes an object gets the next value of one global
``resourceVersion`` counter and reaches the store and the watch hub before control returns to
the event loop; a write that changes nothing gets no new version and no event. Deleting an
object with finalizers only marks it; it is removed when the last finalizer goes, and its
namespace's objects and its ``ownerReferences`` dependents go with it. A scheduled pod is
deleted gracefully (see :mod:`.graceful`): marked for its grace period, removed by the
kubelet's grace-0 delete (``finish_pod_deletion`` / ``expire_pod_deletions`` stand in for the
kubelet). The pure rules are in the sibling modules (admission, schema, patches, selectors,
graceful); this class applies them in order.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import kmock

from . import admission, graceful, schema
from .admission import DEFAULT_WRITE, WriteOptions
from .errors import ApiError
from .patches import JSON_PATCH_TYPE, apply_patch
from .resources import BUILTIN_RESOURCES, RESOURCE_VERBS, ResourceSpec, accept_crd, crd_resources, load_crds
from .selectors import object_matcher
from .timestamps import now, parse
from .watches import WatchHub


@attrs.define(kw_only=True)
class KubeStore(kmock.KubernetesEmulator):
    """The served resources and their objects, written as the API server writes them (see ``KubeEmulator``).

    Call only on the emulator's event loop: every write is synchronous code between awaits, hence atomic.

    Attributes:
        history_size: how many past events a watch can resume from; an older ``resourceVersion``
            gets a 410 Gone ``ERROR`` event (as after an etcd compaction).
        garbage_collection: remove objects whose every ``ownerReferences`` owner is gone.
    """

    history_size: int = 10_000
    garbage_collection: bool = True
    _specs: dict[tuple[str, str, str], ResourceSpec] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _watches: WatchHub = attrs.field(init=False)
    _validators: dict[tuple[str, str, str], Any] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._watches = WatchHub(self.history_size)
        for spec in BUILTIN_RESOURCES:
            self.add_resource(spec)

    # -- resources and objects ---------------------------------------------------------------------

    def add_resource(self, spec: ResourceSpec) -> None:
        """Serve ``spec`` (replacing a resource of the same group/version/plural), discovery included."""
        self._specs[spec.group, spec.version, spec.plural] = spec
        self._validators.pop((spec.group, spec.version, spec.plural), None)
        self.resources[kmock.resource(spec.group, spec.version, spec.plural)] = kmock.ResourceInfo(
            namespaced=spec.namespaced,
            kind=spec.kind,
            singular=spec.singular,
            verbs=RESOURCE_VERBS,
            shortnames=spec.short_names,
            categories=spec.categories,
            subresources={"status"} if spec.status_subresource else set(),
        )

    def remove_resource(self, group: str, version: str, plural: str) -> None:
        """Stop serving a resource (its objects stay in ``objects`` until re-served)."""
        self._specs.pop((group, version, plural), None)
        self.resources.pop(kmock.resource(group, version, plural), None)

    def register_crds(self, directory: str | Path) -> list[ResourceSpec]:
        """Create (or replace) every CRD in ``directory/*.yaml`` and serve its resources.

        Returns:
            The resources served for them, one per served version.

        Raises:
            ApiError: 422 for a CRD that names no group/kind/plural/versions.
        """
        served = []
        crds = self.spec("apiextensions.k8s.io/v1/customresourcedefinitions")
        for crd in load_crds(directory):
            name = crd["metadata"]["name"]
            current = self.get_object(crds, name)
            body = copy.deepcopy(crd)
            if current is not None:
                body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                self.replace_object(crds, name, body)
            else:
                self.create_object(crds, body)
            served += crd_resources(crd)
        return served

    def spec(self, resource: str | ResourceSpec | kmock.resource) -> ResourceSpec:
        """The served resource for ``'v1/pods'``, ``'rlrun.dev/v1alpha1/rlruns'``, ``'pods'``, ``'rlr'``, ``'RLRun'``,
        ``'rlruns.rlrun.dev'``.

        Bare names match plural, singular, short name or kind (the core group wins a tie).

        Raises:
            KeyError: no served resource matches.
        """
        if isinstance(resource, ResourceSpec):
            return resource
        if isinstance(resource, kmock.resource):
            return self._specs[resource.group or "", resource.version or "", resource.plural or ""]
        parts = resource.split("/")
        if len(parts) == 3:
            return self._specs[parts[0], parts[1], parts[2]]
        if len(parts) == 2 and parts[0].startswith("v") and parts[0][1:2].isdigit():
            return self._specs["", parts[0], parts[1]]
        name, _, group = resource.partition(".")
        candidates = [
            s
            for s in self._specs.values()
            if (not group or s.group == group)
            and (name in (s.plural, s.singular, *s.short_names) or name.lower() == s.kind.lower())
        ]
        if not candidates:
            raise KeyError(f"no served resource named {resource!r}")
        return sorted(candidates, key=lambda s: (s.group != "", s.group, s.version != s.storage_version))[0]

    def get_object(
        self, resource: str | ResourceSpec, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """A copy of the stored object, or None."""
        spec = self.spec(resource)
        obj = self._current(spec, self._ns(spec, namespace), name)
        return None if obj is None else spec.present(obj)

    def list_objects(
        self,
        resource: str | ResourceSpec,
        namespace: str | None = None,
        label_selector: str = "",
        field_selector: str = "",
    ) -> list[dict[str, Any]]:
        """Copies of the stored objects (all namespaces when ``namespace`` is None), sorted by namespace/name."""
        spec = self.spec(resource)
        match = object_matcher(namespace, None, label_selector, field_selector)
        return [spec.present(obj) for obj in self._iter(spec) if match(obj)]

    def create_object(
        self,
        resource: str | ResourceSpec,
        body: dict[str, Any],
        namespace: str | None = None,
        *,
        keep_status: bool = False,
    ) -> dict[str, Any]:
        """Create an object as ``POST`` does: uid, timestamps, generation 1, resourceVersion, defaults, validation.

        Args:
            namespace: the URL's namespace; None: the body's (``default`` when it has none).
            keep_status: keep ``status`` even where the status subresource would drop it (test set-up).

        Raises:
            ApiError: 400 for a body that is no object or a namespace mismatch, 409 AlreadyExists,
                422 for a missing/invalid name or a schema violation.
        """
        spec = self.spec(resource)
        return spec.present(self._create(spec, namespace, body, keep_status=keep_status)[0])

    def replace_object(
        self,
        resource: str | ResourceSpec,
        name: str,
        body: dict[str, Any],
        namespace: str | None = None,
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """Replace an object as ``PUT`` does (a stale ``metadata.resourceVersion`` is a 409 Conflict)."""
        spec = self.spec(resource)
        return spec.present(self._replace(spec, self._ns(spec, namespace), name, body, subresource)[0])

    def patch_object(
        self,
        resource: str | ResourceSpec,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        patch_type: str = "merge",
    ) -> dict[str, Any]:
        """Patch an object as ``PATCH`` does; ``patch_type`` is ``merge``, ``strategic`` or ``json``."""
        spec = self.spec(resource)
        content_type = {"json": JSON_PATCH_TYPE}.get(patch_type, "application/merge-patch+json")
        obj = self._patch(spec, self._ns(spec, namespace), name, patch, content_type, subresource)[0]
        return spec.present(obj)

    def delete_object(
        self,
        resource: str | ResourceSpec,
        name: str,
        namespace: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Delete an object as ``DELETE`` does: marked (``deletionTimestamp``) while it has finalizers, else removed.

        A scheduled pod is deleted gracefully (:mod:`.graceful`): ``options`` is the
        ``DeleteOptions`` body (``gracePeriodSeconds``, ``preconditions``).
        """
        spec = self.spec(resource)
        return spec.present(self._delete(spec, self._ns(spec, namespace), name, options or {}))

    def finish_pod_deletion(self, name: str, namespace: str | None = None) -> dict[str, Any]:
        """The kubelet's last word on a terminating pod: its containers stopped, it sends the grace-0 ``DELETE``.

        That is ``DELETE ?gracePeriodSeconds=0`` with a uid precondition: the pod is removed
        (``DELETED``), or, while it still has finalizers, keeps them with
        ``deletionGracePeriodSeconds: 0`` and ``deletionTimestamp`` moved back by the grace period
        (removed when the last finalizer goes). Not a logged request (like every accessor).

        Returns:
            The pod's final state (or its finalizer-held state).

        Raises:
            ApiError: 404 when there is no such pod.
            ValueError: the pod is not being deleted (a kubelet only finishes what was deleted).
        """
        spec = self.spec("v1/pods")
        ns = self._ns(spec, namespace)
        current = self._current(spec, ns, name)
        if current is None:
            raise ApiError.not_found(spec, name)
        meta = current["metadata"]
        if not meta.get("deletionTimestamp"):
            raise ValueError(f"pod {ns}/{name} is not being deleted: no kubelet would finish its deletion")
        options = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
        return spec.present(self._delete(spec, ns, name, options))

    def expire_pod_deletions(self, at: datetime.datetime | str | None = None) -> list[tuple[str, str]]:
        """``finish_pod_deletion`` for every pod whose graceful deletion is due (a kubelet that kills at the deadline).

        Due: ``deletionGracePeriodSeconds`` > 0 and ``deletionTimestamp`` <= ``at``. Nothing
        expires on its own: a test decides when kubelets act (a pod on a lost node stays
        terminating until force-deleted), and may pass a future ``at`` instead of sleeping.

        Args:
            at: the time to compare with (an aware ``datetime`` or an RFC 3339 timestamp); None: now.

        Returns:
            ``(namespace, name)`` of each pod whose deletion it finished, sorted.
        """
        if at is None:
            at = datetime.datetime.now(datetime.timezone.utc)
        elif isinstance(at, str):
            at = parse(at)
        spec = self.spec("v1/pods")
        due = [
            (obj["metadata"]["namespace"], obj["metadata"]["name"])
            for obj in self._iter(spec)
            if (obj["metadata"].get("deletionGracePeriodSeconds") or 0) > 0
            and parse(obj["metadata"]["deletionTimestamp"]) <= at
        ]
        for namespace, name in due:
            self.finish_pod_deletion(name, namespace)
        return due

    @property
    def resource_version(self) -> int:
        """The latest ``resourceVersion`` given out (0 before the first write)."""
        return self._rv

    def close_watches(self) -> None:
        """End every open watch stream (as the API server does on shutdown)."""
        self._watches.close()

    # -- the store ---------------------------------------------------------------------------------

    def _ns(self, spec: ResourceSpec, namespace: str | None) -> str | None:
        return (namespace or "default") if spec.namespaced else None

    def _current(self, spec: ResourceSpec, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (spec.store, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].last.raw

    def _exists(self, spec: ResourceSpec) -> Callable[[str | None, str], bool]:
        return lambda namespace, name: self._current(spec, namespace, name) is not None

    def _iter(self, spec: ResourceSpec) -> Iterator[dict[str, Any]]:
        live = [(key, obj) for key, obj in self.objects.items() if key[0] == spec.store and not obj.deleted]
        for _, obj in sorted(live, key=lambda item: (item[0][1] or "", item[0][2])):
            yield obj.last.raw

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _store(self, spec: ResourceSpec, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        key = (spec.store, meta.get("namespace"), meta["name"])
        if key in self.objects:
            self.objects[key].history.append(copy.deepcopy(obj))
        else:
            self.objects[key] = copy.deepcopy(obj)

    def _admit(self, spec: ResourceSpec, obj: dict[str, Any], opts: WriteOptions) -> list[str]:
        key = (spec.group, spec.version, spec.plural)
        if spec.schema is not None and key not in self._validators:
            self._validators[key] = schema.validator(spec.schema)
        return schema.admit(spec, obj, opts.field_validation, self._validators.get(key))

    # -- writes ------------------------------------------------------------------------------------

    def _create(
        self,
        spec: ResourceSpec,
        namespace: str | None,
        body: Any,
        *,
        keep_status: bool = False,
        opts: WriteOptions = DEFAULT_WRITE,
    ) -> tuple[dict[str, Any], list[str]]:
        obj = admission.new_object(spec, namespace, body, keep_status=keep_status, exists=self._exists(spec))
        unknown = self._admit(spec, obj, opts)
        if spec.is_crds:
            accept_crd(obj)
        if opts.dry_run:
            return obj, unknown
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._store(spec, obj)
        self._watches.emit(spec, "ADDED", None, obj)
        if spec.is_crds:
            self._serve_crd(obj)
        return obj, unknown

    def _replace(
        self,
        spec: ResourceSpec,
        ns: str | None,
        name: str,
        body: Any,
        sub: str | None,
        *,
        opts: WriteOptions = DEFAULT_WRITE,
    ) -> tuple[dict[str, Any], list[str]]:
        current = self._current(spec, ns, name)
        if current is None:
            raise ApiError.not_found(spec, name)
        admission.check_replace(spec, current, name, body)
        return self._update(spec, current, copy.deepcopy(body), sub, opts=opts)

    def _patch(
        self,
        spec: ResourceSpec,
        ns: str | None,
        name: str,
        patch: Any,
        content_type: str,
        sub: str | None,
        *,
        opts: WriteOptions = DEFAULT_WRITE,
    ) -> tuple[dict[str, Any], list[str]]:
        current = self._current(spec, ns, name)
        if current is None:
            raise ApiError.not_found(spec, name)
        return self._update(spec, current, apply_patch(spec, current, patch, content_type), sub, opts=opts)

    def _update(
        self,
        spec: ResourceSpec,
        current: dict[str, Any],
        new: dict[str, Any],
        sub: str | None,
        *,
        opts: WriteOptions = DEFAULT_WRITE,
    ) -> tuple[dict[str, Any], list[str]]:
        new = admission.updated_object(spec, current, new, sub)
        unknown = self._admit(spec, new, opts)
        if spec.is_crds:
            accept_crd(new, current)
        if new == current or opts.dry_run:
            return current if new == current else new, unknown
        meta = new["metadata"]
        if admission.changes_generation(current, new):
            meta["generation"] = current["metadata"].get("generation", 1) + 1
        meta["resourceVersion"] = self._next_rv()
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and not meta.get("deletionGracePeriodSeconds"):
            # the last finalizer is gone: the pending deletion completes (a pod still in its grace
            # period waits for the kubelet's grace-0 delete, as with the API server's ShouldDeleteDuringUpdate)
            self._remove(spec, new)
            return new, unknown
        self._store(spec, new)
        self._watches.emit(spec, "MODIFIED", current, new)
        if spec.is_crds:
            self._serve_crd(new)
        return new, unknown

    def _delete(
        self,
        spec: ResourceSpec,
        ns: str | None,
        name: str,
        options: Any,
        *,
        opts: WriteOptions = DEFAULT_WRITE,
    ) -> dict[str, Any]:
        current = self._current(spec, ns, name)
        if current is None:
            raise ApiError.not_found(spec, name)
        admission.check_preconditions(spec, current, options)
        if spec.group == "" and spec.plural == "pods":
            return self._delete_pod(spec, current, options, opts)
        if opts.dry_run:
            return current
        meta = current["metadata"]
        if meta.get("finalizers"):
            if meta.get("deletionTimestamp"):
                return current  # already pending: nothing changes
            new = copy.deepcopy(current)
            new["metadata"] |= {"deletionTimestamp": now(), "deletionGracePeriodSeconds": 0}
            new["metadata"]["resourceVersion"] = self._next_rv()
            self._store(spec, new)
            self._watches.emit(spec, "MODIFIED", current, new)
            return new
        return self._remove_now(spec, current)

    def _delete_pod(
        self, spec: ResourceSpec, current: dict[str, Any], options: Any, opts: WriteOptions
    ) -> dict[str, Any]:
        """A pod's ``DELETE``: the API server's graceful deletion (see :mod:`.graceful`)."""
        marked = graceful.pod_deletion(current, options, datetime.datetime.now(datetime.timezone.utc))
        if marked is None:  # nothing changes (a deletion is already pending)
            return current
        if not marked["metadata"]["deletionGracePeriodSeconds"] and not marked["metadata"].get("finalizers"):
            # grace 0, no finalizers: removed now, its final state the grace-0 mark. (The API server
            # first writes that mark, a MODIFIED event, then removes it; here only DELETED is emitted.)
            return marked if opts.dry_run else self._remove_now(spec, marked)
        if opts.dry_run:
            return marked
        marked["metadata"]["resourceVersion"] = self._next_rv()
        self._store(spec, marked)
        self._watches.emit(spec, "MODIFIED", current, marked)
        return marked

    def _remove_now(self, spec: ResourceSpec, current: dict[str, Any]) -> dict[str, Any]:
        final = copy.deepcopy(current)
        final["metadata"]["resourceVersion"] = self._next_rv()
        self._remove(spec, final)
        return final

    # -- removal, cascades and garbage collection --------------------------------------------------

    def _remove(self, spec: ResourceSpec, final: dict[str, Any]) -> None:
        """Remove an object for good (its final state carries the new resourceVersion), then its dependents."""
        meta = final["metadata"]
        key = (spec.store, meta.get("namespace"), meta["name"])
        previous = self.objects[key].last.raw
        self.objects[key].delete()
        self._watches.emit(spec, "DELETED", previous, final)
        if spec.is_crds:
            for crd_spec in crd_resources(final):
                self.remove_resource(crd_spec.group, crd_spec.version, crd_spec.plural)
        if spec.group == "" and spec.plural == "namespaces":
            for other in list(self._specs.values()):
                if other.namespaced and other.version == (other.storage_version or other.version):
                    for obj in [o for o in self._iter(other) if o["metadata"].get("namespace") == meta["name"]]:
                        self._delete_quietly(other, obj)
        if self.garbage_collection:
            self._collect_garbage()

    def _delete_quietly(self, spec: ResourceSpec, obj: dict[str, Any]) -> None:
        with contextlib.suppress(ApiError):  # already gone through an earlier cascade
            self._delete(spec, obj["metadata"].get("namespace"), obj["metadata"]["name"], {})

    def _collect_garbage(self) -> None:
        uids = {raw["metadata"].get("uid") for spec in self._store_specs() for raw in self._iter(spec)}
        for spec in self._store_specs():
            for obj in list(self._iter(spec)):
                meta = obj["metadata"]
                owners = [ref.get("uid") for ref in meta.get("ownerReferences") or []]
                if owners and not meta.get("deletionTimestamp") and not any(uid in uids for uid in owners):
                    self._delete_quietly(spec, obj)

    def _store_specs(self) -> list[ResourceSpec]:
        return [s for s in self._specs.values() if s.version == (s.storage_version or s.version)]

    def _serve_crd(self, crd: dict[str, Any]) -> None:
        for spec in crd_resources(crd):
            self.add_resource(spec)
