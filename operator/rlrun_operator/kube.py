"""The Kubernetes API calls the operator makes (``kubernetes`` client), retried on transient errors.

Every call here maps to one RBAC rule of the Helm chart's ClusterRole; the test suite
records the calls the operator makes against the API emulator and checks the role grants
exactly those. Creation is idempotent: an object that already exists (409) counts as
created, so a handler retried after a partial failure finishes the job.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from typing import Any

import kubernetes
import urllib3
from kubernetes.client import ApiClient, ApiextensionsV1Api, CoreV1Api, CustomObjectsApi
from kubernetes.client.exceptions import ApiException
from rlrun.api.crd import CRD_NAME, PLURAL, SCHEMA_HASH_ANNOTATION
from rlrun.api.spec import API_GROUP, API_VERSION
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from rlrun_operator import naming
from rlrun_operator.kueue import GROUP as KUEUE_GROUP
from rlrun_operator.kueue import VERSION as KUEUE_VERSION
from rlrun_operator.kueue import WORKLOADS

log = logging.getLogger(__name__)

#: HTTP statuses worth retrying: throttling and server-side trouble.
TRANSIENT_STATUSES = {429, 500, 502, 503, 504}


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in TRANSIENT_STATUSES or exc.status == 0
    return isinstance(exc, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError))


_retry = retry(
    retry=retry_if_exception(_transient),
    stop=stop_after_attempt(5),
    wait=wait_exponential(multiplier=0.2, max=5),
    reraise=True,
)


def load_api_client() -> ApiClient:
    """An API client from the in-cluster service account, else ``$KUBECONFIG`` (read now, not at import)."""
    cfg = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=cfg)
    cfg.connection_pool_maxsize = 32  # handlers of many runs call at once from kopf's thread pool
    return ApiClient(cfg)


class Kube:
    """The operator's view of the API: read RLRuns and write their status, create run objects, list and
    delete pods, read the control token; with Kueue, read and patch the runs' Workloads and read ResourceFlavors
    and WorkloadPriorityClasses."""

    def __init__(self, api: ApiClient) -> None:
        self.core = CoreV1Api(api)
        self.custom = CustomObjectsApi(api)
        self.extensions = ApiextensionsV1Api(api)
        self._create = {
            "Pod": self.core.create_namespaced_pod,
            "Service": self.core.create_namespaced_service,
            "Secret": self.core.create_namespaced_secret,
            "ConfigMap": self.core.create_namespaced_config_map,
            "PersistentVolumeClaim": self.core.create_namespaced_persistent_volume_claim,
            "Workload": lambda namespace, body, **kw: self.custom.create_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOADS, body, **kw
            ),
        }

    @_retry
    def create(self, obj: dict[str, Any]) -> bool:
        """Create ``obj`` in its namespace; False when it already exists.

        Raises:
            ApiException: a non-transient refusal (403, 422, …) or one that outlasted the retries.
        """
        try:
            # the generated client sets no Content-Type for bodies it did not build itself; the answer is not
            # read, so it is not deserialized into the client's models either (see delete_pod)
            self._create[obj["kind"]](
                obj["metadata"]["namespace"], obj, _content_type="application/json", _preload_content=False
            )
            return True
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise

    @_retry
    def get_run(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The RLRun as the API server has it now (None when it is gone).

        Raises:
            ApiException: a refusal other than 404, or a transient error that outlasted the retries.
        """
        try:
            return self.custom.get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    @_retry
    def patch_run_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any] | None:
        """Merge ``status`` into the RLRun's status subresource (a key set to None is removed); None when gone.

        Raises:
            ApiException: a refusal other than 404, or a transient error that outlasted the retries.
        """
        try:
            return self.custom.patch_namespaced_custom_object_status(
                API_GROUP,
                API_VERSION,
                namespace,
                PLURAL,
                name,
                {"status": status},
                _content_type="application/merge-patch+json",
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    @_retry
    def list_pods(self, namespace: str, run: str) -> list[dict[str, Any]]:
        """The pods carrying run ``run``'s labels, as the API server has them now (plain dicts).

        Raises:
            ApiException: a refusal, or a transient error that outlasted the retries.
        """
        selector = ",".join(f"{k}={v}" for k, v in naming.labels(run).items())
        resp = self.core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False)
        return json.loads(resp.data)["items"]  # as the server wrote them: no model round trip

    @_retry
    def delete_pod(self, namespace: str, name: str, grace_period_s: int | None = None) -> None:
        """Delete a pod (SIGTERM, then SIGKILL after its grace period: the one it was created with, or
        ``grace_period_s``); a missing pod is fine.

        Raises:
            ApiException: a refusal other than 404, or a transient error that outlasted the retries.
        """
        grace = {} if grace_period_s is None else {"grace_period_seconds": grace_period_s}
        try:
            # The answer (the pod, being deleted) is not read: with the client's model round trip, a
            # container status the model finds incomplete would fail a delete the server had done.
            self.core.delete_namespaced_pod(name, namespace, _preload_content=False, **grace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    @_retry
    def crd_schema_hash(self) -> str | None:
        """The installed ``RLRun`` CRD's schema-hash annotation (None: it has none).

        Raises:
            ApiException: the CRD cannot be read (403: no grant; 404: not installed).
        """
        resp = self.extensions.read_custom_resource_definition(CRD_NAME, _preload_content=False)
        return ((json.loads(resp.data).get("metadata") or {}).get("annotations") or {}).get(SCHEMA_HASH_ANNOTATION)

    @_retry
    def read_token(self, namespace: str, run: str) -> str:
        """The run's control-server bearer token from its Secret.

        Raises:
            ApiException: 404 when the Secret is gone.
        """
        secret = self.core.read_namespaced_secret(naming.secret_name(run), namespace)
        return base64.b64decode(secret.data[naming.TOKEN_KEY]).decode()

    @_retry
    def apply_configmap(self, obj: dict[str, Any]) -> None:
        """Replace the keys of ConfigMap ``obj``'s ``data`` (creating it if it is gone).

        Raises:
            ApiException: a refusal other than 404, or a transient error that outlasted the retries.
        """
        meta = obj["metadata"]
        try:
            self.core.patch_namespaced_config_map(
                meta["name"], meta["namespace"], {"data": obj["data"]}, _content_type="application/merge-patch+json"
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.create(obj)

    # -- Kueue (kueue.x-k8s.io/v1beta1) ---------------------------------------------------------------

    @_retry
    def get_workload(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Workload ``name`` as the API server has it now (None when it is gone).

        Raises:
            ApiException: a refusal other than 404, or a transient error that outlasted the retries.
        """
        try:
            resp = self.custom.get_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOADS, name, _preload_content=False
            )
            return json.loads(resp.data)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    @_retry
    def patch_workload(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """Merge ``patch`` into the Workload (``spec.active``, ``spec.podSets``); a missing Workload is fine.

        Raises:
            ApiException: a refusal other than 404, or a transient error that outlasted the retries.
        """
        try:
            self.custom.patch_namespaced_custom_object(
                KUEUE_GROUP,
                KUEUE_VERSION,
                namespace,
                WORKLOADS,
                name,
                patch,
                _content_type="application/merge-patch+json",
                _preload_content=False,
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    @_retry
    def delete_workload(self, namespace: str, name: str) -> None:
        """Delete the Workload ``name`` (its run left Kueue); a missing Workload is fine.

        Raises:
            ApiException: a refusal other than 404, or a transient error that outlasted the retries.
        """
        try:
            self.custom.delete_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOADS, name, _preload_content=False
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    @_retry
    def patch_workload_status(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> bool:
        """Apply the JSON patch ``ops`` (:func:`rlrun_operator.kueue.status_ops`: guarded by a ``resourceVersion``
        test) to the Workload's status subresource; False when it is gone or changed since it was read (404, 409,
        422: the caller reads it again at its next look).

        Raises:
            ApiException: another refusal, or a transient error that outlasted the retries.
        """
        try:
            self.custom.patch_namespaced_custom_object_status(
                KUEUE_GROUP,
                KUEUE_VERSION,
                namespace,
                WORKLOADS,
                name,
                ops,
                _content_type="application/json-patch+json",
                _preload_content=False,
            )
            return True
        except ApiException as exc:
            if exc.status in (404, 409, 422):
                log.info(
                    "Workload %s/%s changed or gone before its status was written (%s)", namespace, name, exc.status
                )
                return False
            raise

    @_retry
    def get_kueue_object(self, plural: str, name: str) -> dict[str, Any] | None:
        """A cluster-scoped Kueue object: a ResourceFlavor (``resourceflavors``) or a WorkloadPriorityClass
        (``workloadpriorityclasses``); None when it does not exist.

        Raises:
            ApiException: a refusal other than 404, or a transient error that outlasted the retries.
        """
        try:
            resp = self.custom.get_cluster_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, plural, name, _preload_content=False
            )
            return json.loads(resp.data)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
