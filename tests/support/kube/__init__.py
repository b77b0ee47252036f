"""A Kubernetes API server emulator for tests: kmock's ``KubernetesEmulator`` made strict enough for kopf and kubectl.

Invariant: every write that changes an object gets the next value of one global
``resourceVersion`` counter, and every watcher sees exactly the changes after the version it
asked for, in that order, each once. kopf relies on it to list-then-watch without handling an
object twice and to test-and-patch its finalizers; kubectl relies on it for ``get -w`` and
``delete --wait``. Everything else here (uids, generations, the status subresource, selectors,
discovery, finalizers, schema validation, the request log) follows the real API server closely
enough that an operator tested against it behaves the same against a cluster.

Known differences from a real API server: strategic-merge patches are plain merge patches
(lists are replaced, not merged by key); server-side apply is not served (415); CEL rules
(``x-kubernetes-validations``) are not evaluated; builtin kinds are not validated; namespaces
need not exist. There is no kubelet or scheduler: a scheduled pod deleted with a grace period
stays terminating until a test plays the kubelet (``KubeServer.finish_pod_deletion``,
``expire_pod_deletions``; the rules are in ``graceful``), and a pod's grace-0 removal emits
only ``DELETED`` (the API server writes a grace-0 mark, a ``MODIFIED``, first). Garbage
collection of ``ownerReferences`` runs synchronously with the owner's removal and deletes
dependents as background propagation does (no grace period of its own: a scheduled pod gets
its ``terminationGracePeriodSeconds``). For kubectl: there is no ``/openapi`` (use
``--validate=false``), server-side printing only for kinds with printer columns (``get`` shows
NAME and AGE for the others), and protobuf bodies (``kubectl create
namespace|secret|configmap``) get 415 (use ``apply -f``).

``KubeServer`` runs one emulator on 127.0.0.1 in its own thread and event loop, so tests,
operators in other threads, kubectl subprocesses and the sync ``kubernetes`` client can all
reach it; ``KopfThread`` runs a kopf operator against it in a thread of its own.

Modules, one job each: ``resources`` (what is served), ``errors`` (``Status`` answers),
``request_log`` (requests in RBAC terms), ``selectors``, ``patches``, ``schema`` (defaults,
pruning, validation; OpenAPI → JSON Schema is ``tests/support/crd_validation``'s), ``admission``
(server-set fields of a write), ``graceful`` (pods' graceful deletion), ``tables`` (server-side
printing), ``discovery``, ``watches``, ``store`` (the write semantics), ``emulator`` (HTTP),
``server``, ``kopf_thread``.
"""

from .discovery import SERVER_VERSION
from .emulator import KubeEmulator
from .errors import ApiError
from .kopf_thread import KopfThread
from .patches import PatchError, json_patch, merge_patch
from .request_log import KubeRequest
from .resources import BUILTIN_RESOURCES, RESOURCE_VERBS, ResourceSpec, crd_resources, load_crds
from .schema import apply_schema
from .selectors import field_matcher, label_matcher
from .server import KubeServer
from .tables import table

__all__ = [
    "BUILTIN_RESOURCES",
    "RESOURCE_VERBS",
    "SERVER_VERSION",
    "ApiError",
    "KopfThread",
    "KubeEmulator",
    "KubeRequest",
    "KubeServer",
    "PatchError",
    "ResourceSpec",
    "apply_schema",
    "crd_resources",
    "field_matcher",
    "json_patch",
    "label_matcher",
    "load_crds",
    "merge_patch",
    "table",
]
