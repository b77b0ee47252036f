"""Shared fixtures: the builtin model is built once per test session into a temporary cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A model cache for the session (``$RLRUN_TEST_CACHE_DIR`` reuses one across sessions)."""
    if os.environ.get("RLRUN_TEST_CACHE_DIR"):
        return Path(os.environ["RLRUN_TEST_CACHE_DIR"])
    return tmp_path_factory.mktemp("rlrun-cache")


@pytest.fixture(scope="session")
def tiny_model(cache_dir) -> Path:
    """The builtin tiny-reverse model directory (built on first use, ~10 s)."""
    from rlrun.model.resolve import ensure_builtin_model

    return ensure_builtin_model("tiny-reverse", cache_dir)


@pytest.fixture
def rlrun_argv():
    """argv prefix that runs the rlrun CLI with this interpreter."""
    return [sys.executable, "-m", "rlrun"]
