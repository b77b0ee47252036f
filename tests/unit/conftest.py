"""The unit tier runs in this process only: a test that starts a child process fails, naming the tier it needs.

Threads, in-process servers on loopback (aiohttp's ``TestServer``, the fake orchestrators, the control
server) and ``httpx.MockTransport`` fakes are in-process; ``subprocess``, ``os.fork`` (``multiprocessing``,
forked ranks) and ``posix_spawn`` are not. The guard covers a test's fixtures of every scope too: it
wraps the setup, call and teardown of each test of this folder.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest

from tests.support.chat_models import STRIPPING_TEMPLATE, with_template

_REFUSAL = "tests/unit runs in this process only: a test that starts a child process ({}) belongs in tests/processes/"


@contextlib.contextmanager
def _no_child_processes() -> Iterator[None]:
    def refuse(what: str):
        def refused(*args, **kwargs):
            raise AssertionError(_REFUSAL.format(what))

        return refused

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", refuse("subprocess"))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                patch.setattr(os, name, refuse(f"os.{name}"))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with _no_child_processes():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _no_child_processes():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    with _no_child_processes():
        yield


@pytest.fixture
def thinking_model(tmp_path, tiny_model):
    """The tiny model with a chat template that drops past assistant turns' thinking, as Qwen3's does
    (:data:`tests.support.chat_models.STRIPPING_TEMPLATE`); ``<|endoftext|>`` (its EOS) ends each message."""
    return with_template(tiny_model, tmp_path / "thinking-model", STRIPPING_TEMPLATE)


@pytest.fixture
def quick_guard(monkeypatch):
    """The liveness guard's looks in tenths of seconds (its defaults: 2 s, 2 s, 3 s)."""
    from rlrun.orchestrator import liveness

    monkeypatch.setattr(liveness, "CHECK_EVERY_S", 0.1)
    monkeypatch.setattr(liveness, "GRACE_S", 0.2)
    monkeypatch.setattr(liveness, "CONFIRM_S", 0.5)
