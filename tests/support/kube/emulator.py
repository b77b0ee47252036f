"""``KubeEmulator``: kmock's ``KubernetesEmulator`` answering HTTP as the API server does.

Every request kmock's user reactions do not take is routed here to the store (``KubeStore``),
discovery or a watch, and answered as the API server would: objects, ``Status`` errors,
``Warning`` headers for pruned fields, Tables for kubectl. Every answered request is logged
once, in RBAC terms (a watch when its stream starts).
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import apps, rendering

from .admission import WriteOptions
from .discovery import HEALTH_PATHS, discovery_document
from .errors import ApiError
from .graceful import options_from_query
from .request_log import LOGGED, KubeRequest, Target, kmock_action, parse_target, rbac_verb
from .resources import ResourceSpec
from .selectors import object_matcher
from .store import KubeStore
from .tables import table, wants_table

log = logging.getLogger(__name__)


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> aiohttp.web.Response:
    return aiohttp.web.Response(
        status=status, body=json.dumps(body).encode(), content_type="application/json", headers=headers
    )


class _Direct(Exception):
    """Raised by the emulator's catch-all kmock reaction: serve the request directly (no user reaction matched)."""


@attrs.define(kw_only=True)
class KubeEmulator(KubeStore):
    """kmock's ``KubernetesEmulator`` with the API-server semantics kopf and kubectl rely on.

    Runs inside one event loop (see ``KubeServer``): every write is synchronous code between
    awaits, hence atomic. User reactions (``emulator['get /api/v1/pods'] << 500``) still take
    precedence; every other request is served here (stock kmock's fallbacks are never reached).
    Objects are kept in kmock's ``objects`` (with their history of versions), keyed by
    ``ResourceSpec.store``; ``resources`` mirrors the served resources for kmock's views.

    Attributes:
        history_size: how many past events a watch can resume from; an older ``resourceVersion``
            gets a 410 Gone ``ERROR`` event (as after an etcd compaction).
        garbage_collection: remove objects whose every ``ownerReferences`` owner is gone.
        request_log: every answered request (``KubeRequest``), in order of completion.
    """

    request_log: list[KubeRequest] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # Below user reactions (any priority), above kmock's own K8s fallbacks.
        (self.fallback**1) << self._direct

    @staticmethod
    def _direct(request: rendering.Request) -> None:
        raise _Direct

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        body = await raw.read()
        target = parse_target(raw.path, self._specs)
        verb = rbac_verb(raw, target)
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        request = rendering.Request(
            id=len(self._requests),
            raw_request=raw,
            url=raw.url,
            method=raw.method,
            params=dict(raw.query),
            headers=dict(raw.headers),
            cookies=dict(raw.cookies),
            body=body,
            text=body.decode(errors="replace"),
            data=data,
            action=kmock_action(verb),
            resource=kmock.resource(target.group, target.version, target.plural) if target else None,
            namespace=target.namespace if target else None,
            name=target.name if target else None,
            subresource=target.subresource if target else None,
        )
        self._requests.append(request)
        try:
            response = await self._handle(request)
        except rendering.StreamingError as e:  # a user reaction's stream broke after its headers went out
            response = e.args[0]
            await self._stream_error(e.__cause__ or e, response)
            await response.write_eof()
        except Exception as e:
            log.exception("kube emulator: %s %s failed", raw.method, raw.path_qs)
            if self._errors:
                self._errors[-1].append(e)
            response = await self._render_error(e)
        if not response.get(LOGGED):
            self._log(raw, target, verb, response.status)
        return response

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        # Skip KubernetesEmulator._handle: its writes would bypass everything below.
        try:
            return await apps.RawHandler._handle(self, request)
        except _Direct:
            return await self._serve(request)

    def _log(self, raw: aiohttp.web.BaseRequest, target: Target | None, verb: str, status: int) -> None:
        self.request_log.append(KubeRequest.of(raw.path, target, verb, status, tuple(raw.query.items())))

    async def _serve(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        try:
            if request.resource is not None:
                target = parse_target(raw.path, self._specs)
                assert target is not None
                return await self._serve_resource(raw, target, request.data)
            path = raw.path.rstrip("/") or "/"
            if path in HEALTH_PATHS:
                return aiohttp.web.Response(text="ok")
            return _json(discovery_document(path, self._specs.values()))
        except ApiError as e:
            return _json(e.status(), e.code)

    async def _serve_resource(
        self, raw: aiohttp.web.BaseRequest, target: Target, data: Any
    ) -> aiohttp.web.StreamResponse:
        spec = target.spec
        if spec is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if target.subresource not in (None, "status") or (target.subresource and not spec.status_subresource):
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({target.subresource})")
        ns, name, sub, query = target.namespace, target.name, target.subresource, raw.query
        if ns is not None and not spec.namespaced:
            raise ApiError(404, "NotFound", f"{spec.qualified} is not namespaced")
        opts = WriteOptions("dryRun" in query, query.get("fieldValidation", "Warn"))
        method = raw.method
        # no Content-Type counts as JSON, as kube-apiserver assumes (the python client sends none on create);
        # aiohttp would report it as application/octet-stream
        sent_type = raw.headers.get("Content-Type", "").split(";")[0].strip()
        if method in ("POST", "PUT") and raw.body_exists and sent_type not in ("application/json", ""):
            # kubectl sends protobuf for builtin kinds (create namespace/secret/...): not decoded here.
            message = (
                "the body of the request was in an unknown format - "
                f"accepted media types: application/json ({raw.content_type})"
            )
            raise ApiError(415, "UnsupportedMediaType", message)
        warnings: list[str] = []
        selectors = query.get("labelSelector", ""), query.get("fieldSelector", "")
        if method == "GET" and query.get("watch") in ("true", "1"):
            match = object_matcher(ns, name, *selectors)
            started = functools.partial(self._log, raw, target, "watch", 200)
            return await self._watches.serve(raw, spec, match, self._iter(spec), self._rv, started)
        if method == "GET" and name is None:
            match = object_matcher(ns, None, *selectors)
            items = [spec.present(obj) for obj in self._iter(spec) if match(obj)]
            if wants_table(raw, spec):
                return _json(table(spec, items, str(self._rv)))
            return _json(self._list_doc(spec, items))
        if method == "GET":
            obj = self._current(spec, self._ns(spec, ns), name)
            if obj is None:
                raise ApiError.not_found(spec, name)
            if wants_table(raw, spec):
                return _json(table(spec, [spec.present(obj)], str(self._rv)))
            return _json(spec.present(obj))
        if method == "POST" and name is None:
            obj, warnings = self._create(spec, ns, data, opts=opts)
            return _json(spec.present(obj), 201, self._warning_headers(warnings))
        if method == "PUT" and name is not None:
            obj, warnings = self._replace(spec, self._ns(spec, ns), name, data, sub, opts=opts)
            return _json(spec.present(obj), 200, self._warning_headers(warnings))
        if method == "PATCH" and name is not None:
            obj, warnings = self._patch(spec, self._ns(spec, ns), name, data, raw.content_type, sub, opts=opts)
            return _json(spec.present(obj), 200, self._warning_headers(warnings))
        if method == "DELETE":
            # DeleteOptions: the body when there is one, else the query (?gracePeriodSeconds=), as the API server reads
            # them
            options = data if data else options_from_query(query)
            if name is not None:
                return _json(spec.present(self._delete(spec, self._ns(spec, ns), name, options, opts=opts)))
            match = object_matcher(ns, None, *selectors)
            victims = [obj for obj in self._iter(spec) if match(obj)]
            gone = [
                self._delete(spec, o["metadata"].get("namespace"), o["metadata"]["name"], options, opts=opts)
                for o in victims
            ]
            return _json(self._list_doc(spec, [spec.present(obj) for obj in gone]))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {raw.path}")

    @staticmethod
    def _warning_headers(warnings: list[str]) -> dict[str, str] | None:
        # One header per warning would be right; aiohttp's dict headers take one, so join them.
        return {"Warning": ", ".join(f'299 - "unknown field \\"{w}\\""' for w in warnings)} if warnings else None

    def _list_doc(self, spec: ResourceSpec, items: list[dict[str, Any]]) -> dict[str, Any]:
        metadata = {"resourceVersion": str(self._rv)}
        return {"kind": f"{spec.kind}List", "apiVersion": spec.api_version, "metadata": metadata, "items": items}
