"""What the Kubernetes API emulator's own tests (``tests/kube/test_emulator_*.py``) share: their two small CRDs
(namespaced widgets with a status subresource and a schema; cluster-scoped gadgets), objects of them and of pods, and
raw-HTTP helpers (the first events of a watch, a merge patch, an object's resource version as a number)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

#: A namespaced CRD with a status subresource, a short name, a schema with defaults and bounds.
WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.com"},
    "spec": {
        "group": "example.com",
        "scope": "Namespaced",
        "names": {
            "kind": "Widget",
            "listKind": "WidgetList",
            "plural": "widgets",
            "singular": "widget",
            "shortNames": ["wd"],
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["size"],
                                "properties": {
                                    "size": {"type": "integer", "minimum": 0, "exclusiveMinimum": True},
                                    "color": {"type": "string", "enum": ["red", "blue"], "default": "red"},
                                    "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                                },
                            },
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}

#: A cluster-scoped CRD without a status subresource or schema.
GADGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "gadgets.example.com"},
    "spec": {
        "group": "example.com",
        "scope": "Cluster",
        "names": {"kind": "Gadget", "plural": "gadgets"},
        "versions": [{"name": "v1", "served": True, "storage": True}],
    },
}

#: the repository
ROOT = Path(__file__).resolve().parents[2]
#: the widgets of namespace ``ns``, and its pods
WIDGETS = "/apis/example.com/v1/namespaces/ns/widgets"
PODS = "/api/v1/namespaces/ns/pods"


def widget(name: str, size: int = 1, **metadata) -> dict:
    return {
        "apiVersion": "example.com/v1",
        "kind": "Widget",
        "metadata": {"name": name, **metadata},
        "spec": {"size": size},
    }


def pod(name: str, **metadata) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **metadata}, "spec": {"containers": []}}


def watch(http: httpx.Client, path: str, count: int, **params) -> tuple[list[dict], httpx.Headers]:
    """The first ``count`` events of a watch (2 s server timeout as a safety net), and the response headers."""
    params = {"watch": "true", "timeoutSeconds": "2", **params}
    events = []
    with http.stream("GET", path, params=params) as response:
        for line in response.iter_lines():
            if line:
                events.append(json.loads(line))
            if len(events) >= count:
                break
    return events, response.headers


def rv(obj: dict) -> int:
    return int(obj["metadata"]["resourceVersion"])


def merge(http: httpx.Client, path: str, patch: dict) -> httpx.Response:
    return http.patch(path, json=patch, headers={"Content-Type": "application/merge-patch+json"})
