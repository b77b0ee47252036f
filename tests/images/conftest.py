"""The images tier: rlrun run inside the images ``make images`` builds (``tests/README.md``).

The build (``images/build.py operator cpu``: the operator image and the CPU image of every role, on one base,
with buildah's layer cache) starts in the background as soon as the session has collected a test of this tier,
so it overlaps the cheaper tiers that run first; :func:`images` waits for it. A failed build fails every test
of the tier with the build's last lines.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest

from tests.support.images import Build, start_build

_build: Build | None = None


def pytest_collection_finish(session: pytest.Session) -> None:
    global _build
    if any(item.get_closest_marker("images") for item in session.items):
        _build = start_build(Path(tempfile.mkdtemp(prefix="rlrun-images-build-")))


@pytest.fixture(scope="session")
def images() -> list[dict]:
    """The built images (``tags``, ``seconds``, ``bytes`` each), once the background build has ended."""
    assert _build is not None, "the images tier's build was not started (pytest_collection_finish)"
    waited = time.monotonic()
    try:
        built = _build.wait()
    except RuntimeError as error:
        pytest.fail(str(error), pytrace=False)
    print(
        f"images built in {time.monotonic() - _build.started:.0f} s "
        f"(the tier waited {time.monotonic() - waited:.0f} s of it): "
        + ", ".join(f"{b['target']} {b['seconds']:.0f} s {b['bytes'] / 1e9:.2f} GB" for b in built)
    )
    return built


def pytest_unconfigure(config: pytest.Config) -> None:
    """A session that ends before the tier's tests (interrupted, ``-x``) stops the build it started."""
    if _build is not None:
        _build.stop()
