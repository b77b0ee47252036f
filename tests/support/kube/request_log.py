"""Requests in RBAC terms: the resource a URL addresses, the verb a method means, the log entry.

The log is what proves an operator's ClusterRole least privilege: every answered request
becomes one ``KubeRequest`` naming the (apiGroup, resource[/subresource], verb) a rule must grant.
"""

from __future__ import annotations

import dataclasses

import aiohttp.web
import kmock

from .resources import ResourceSpec

#: Set on a response that logged itself (a watch logs once its stream starts, not when it ends).
LOGGED = aiohttp.web.ResponseKey("kube_logged", bool)


@dataclasses.dataclass(frozen=True)
class KubeRequest:
    """One request the emulator answered, in RBAC terms.

    Attributes:
        verb: the RBAC verb (get, list, watch, create, update, patch, delete, deletecollection);
            ``get`` for non-resource URLs (discovery, ``/version``).
        group: API group ('' for core); None for non-resource URLs.
        resource: the plural; None for non-resource URLs.
        status: the HTTP status (for a watch: 200 once it started streaming).
        path: the URL path (for non-resource URLs, what RBAC's ``nonResourceURLs`` name).
        query: the query parameters, in order (``gracePeriodSeconds``, ``dryRun``, selectors…); see :meth:`param`.
    """

    verb: str
    group: str | None
    version: str | None
    resource: str | None
    subresource: str | None
    namespace: str | None
    name: str | None
    status: int
    path: str
    query: tuple[tuple[str, str], ...] = ()

    def param(self, name: str) -> str | None:
        """The query parameter ``name`` (its last value), or None when the request had none."""
        return next((value for key, value in reversed(self.query) if key == name), None)

    @property
    def rbac(self) -> tuple[str, str, str] | None:
        """``(apiGroup, resource[/subresource], verb)`` as a ClusterRole rule names it; None for non-resource URLs."""
        if self.resource is None or self.group is None:
            return None
        resource = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return self.group, resource, self.verb

    @classmethod
    def of(
        cls, path: str, target: Target | None, verb: str, status: int, query: tuple[tuple[str, str], ...] = ()
    ) -> KubeRequest:
        """The entry for a request to ``path`` (``target`` None: a non-resource URL) with ``query`` parameters."""
        if target is None:
            return cls(verb, None, None, None, None, None, None, status, path, query)
        return cls(
            verb,
            target.group,
            target.version,
            target.plural,
            target.subresource,
            target.namespace,
            target.name,
            status,
            path,
            query,
        )


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed resource URL (syntax only; ``spec`` is None for unknown resources)."""

    group: str
    version: str
    plural: str
    namespace: str | None
    name: str | None
    subresource: str | None
    spec: ResourceSpec | None


def parse_target(path: str, specs: dict[tuple[str, str, str], ResourceSpec]) -> Target | None:
    """The resource a URL path addresses; None for non-resource URLs (discovery, ``/version``)."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        inner = specs.get((group, version, rest[2]))
        if inner is None or inner.namespaced:  # else /api/v1/namespaces/{name}/{subresource}
            namespace, rest = rest[1], rest[2:]
    spec = specs.get((group, version, rest[0]))
    name = rest[1] if len(rest) > 1 else None
    subresource = "/".join(rest[2:]) or None
    return Target(group, version, rest[0], namespace, name, subresource, spec)


def rbac_verb(raw: aiohttp.web.BaseRequest, target: Target | None) -> str:
    """The RBAC verb of a request (the lowercased method for non-resource URLs)."""
    if target is None:
        return raw.method.lower()
    named = target.name is not None
    if raw.method == "GET":
        return "watch" if raw.query.get("watch") in ("true", "1") else "get" if named else "list"
    verbs = {"POST": "create", "PUT": "update", "PATCH": "patch"}
    if raw.method == "DELETE":
        return "delete" if named else "deletecollection"
    return verbs.get(raw.method, raw.method.lower())


def kmock_action(verb: str) -> kmock.action | None:
    """The kmock action of an RBAC verb (what kmock's request filters match on)."""
    actions = {"get": "FETCH", "list": "LIST", "watch": "WATCH", "create": "CREATE", "update": "UPDATE"}
    actions |= {"patch": "UPDATE", "delete": "DELETE"}
    return kmock.action(actions[verb]) if verb in actions else None
