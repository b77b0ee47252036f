"""Fixtures for the emulator's tests: a small CRD of our own, a running emulator, clients of it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.binaries import kubectl
from tests.support.kube import KubeServer

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


@pytest.fixture
def crd_dir(tmp_path: Path) -> Path:
    """A directory with the two CRDs above (one per file) and a non-CRD document that is skipped."""
    directory = tmp_path / "crds"
    directory.mkdir()
    (directory / "example.com_widgets.yaml").write_text(yaml.safe_dump(WIDGET_CRD))
    (directory / "example.com_gadgets.yaml").write_text(yaml.safe_dump(GADGET_CRD))
    (directory / "README.yaml").write_text(yaml.safe_dump({"kind": "ConfigMap", "metadata": {"name": "x"}}))
    return directory


@pytest.fixture
def kube(crd_dir: Path) -> Iterator[KubeServer]:
    with KubeServer(crds=crd_dir) as server:
        yield server


@pytest.fixture
def http(kube: KubeServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=kube.url, timeout=5) as client:
        yield client


@pytest.fixture
def api(kube: KubeServer):
    """A sync ``kubernetes`` ApiClient of the emulator."""
    with kube.api_client() as client:
        yield client


@pytest.fixture
def run_kubectl(kube: KubeServer, tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the real kubectl against the emulator (own kubeconfig, cache and HOME; ``$KUBECONFIG`` ignored)."""
    config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    env = dict(os.environ, HOME=str(tmp_path), KUBECONFIG=str(config))

    def run(*args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        argv = [str(kubectl()), "--kubeconfig", str(config), "--cache-dir", str(tmp_path / "cache"), *args]
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env, timeout=30, check=False)
        if check:
            assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result

    run.argv = lambda *args: [
        str(kubectl()),
        "--kubeconfig",
        str(config),
        "--cache-dir",
        str(tmp_path / "cache"),
        *args,
    ]  # type: ignore[attr-defined]
    run.env = env  # type: ignore[attr-defined]
    return run
