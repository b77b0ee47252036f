"""Shared fixtures, and the tiers: each test is marked with the tier folder it sits in (``tests/README.md``).

The builtin model is built once per test session into a temporary cache.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
#: The tier folders, cheapest first (the order ``pytest`` runs them in: ``testpaths``); each is also a marker.
TIERS = ("unit", "processes", "kube", "integration", "cluster", "images")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its tier folder, so ``-m`` selects tiers; refuse a test outside them.

    (A ``pytestmark`` in a folder's ``conftest.py`` would not do it: pytest reads ``pytestmark`` only
    from test modules.)
    """
    for item in items:
        path = Path(str(item.path)).resolve()
        tier = path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else None
        if tier not in TIERS:
            raise pytest.UsageError(
                f"{item.nodeid}: every test lives in a tier folder, one of tests/{{{','.join(TIERS)}}}/ "
                "(tests/README.md says which)"
            )
        item.add_marker(tier)


#: Seconds spent per tier in this session (setup + call + teardown of its tests), and its tests run.
_TIER_SECONDS: dict[str, float] = defaultdict(float)
_TIER_TESTS: dict[str, int] = defaultdict(int)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = report.nodeid.split("/", 2)[1] if report.nodeid.startswith("tests/") else None
    if tier in TIERS:
        _TIER_SECONDS[tier] += report.duration
        _TIER_TESTS[tier] += report.when == "call"


def pytest_terminal_summary(terminalreporter) -> None:
    """One line per tier that ran: its tests and seconds (what ``docs/measurements.md`` keeps a table of)."""
    ran = [t for t in TIERS if _TIER_TESTS[t]]
    if ran:
        terminalreporter.section("time per tier")
        for tier in ran:
            terminalreporter.write_line(f"{tier:<12} {_TIER_TESTS[tier]:>4} tests {_TIER_SECONDS[tier]:8.1f} s")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A model cache for the session (``$RLRUN_TEST_CACHE_DIR`` reuses one across sessions)."""
    if os.environ.get("RLRUN_TEST_CACHE_DIR"):
        return Path(os.environ["RLRUN_TEST_CACHE_DIR"])
    return tmp_path_factory.mktemp("rlrun-cache")


@pytest.fixture(scope="session")
def tiny_model(cache_dir) -> Path:
    """The builtin tiny-reverse model directory (built on first use, ~15 s on 2 idle cores)."""
    from rlrun.model.resolve import ensure_builtin_model

    return ensure_builtin_model("tiny-reverse", cache_dir)
