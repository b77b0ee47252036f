"""The images ``make images`` builds, and their containers run the way a kubelet runs them, with buildah.

:func:`start_build` starts ``images/build.py operator cpu`` (what ``make images`` runs) in the background;
``tests/images/conftest.py`` starts it when the session collects the images tier, so the build overlaps the
cheaper tiers, and the tier's first test waits for it (:class:`Build`). A :class:`Container` is ``buildah from``
the image and ``buildah run`` in it (chroot isolation, the host's network: a server on the host's loopback is
reached as it is from a pod's sidecar; volumes are bind mounts, as a kubelet's). :func:`run_read_only` runs a
command with the image's root file system mounted read-only, as ``readOnlyRootFilesystem: true`` does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def load_build_script():
    """``images/build.py`` as a module (a script of the standard library only, not in a package)."""
    spec = importlib.util.spec_from_file_location("rlrun_images_build", ROOT / "images" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


image_build = load_build_script()

REGISTRY, TAG = image_build.chart_defaults()
#: The images the tier runs: the chart's default names and tags (what ``make images`` tags).
OPERATOR_IMAGE = f"{REGISTRY}/rlrun-operator:{TAG}"
CPU_IMAGE = f"{REGISTRY}/rlrun-trainer:{TAG}-cpu"
CPU_ROLLOUT_IMAGE = f"{REGISTRY}/rlrun-rollout:{TAG}-cpu"
#: buildah's isolation: chroot works inside an unprivileged container (this machine and CI are one).
ENV = {**os.environ, "BUILDAH_ISOLATION": "chroot"}


@dataclass
class Build:
    """The background build of the tier's images: its process, its log and the JSON it writes."""

    process: subprocess.Popen
    log: Path
    summary: Path
    started: float

    def stop(self) -> None:
        """SIGTERM to the build and the buildah it runs (its process group), if it still runs."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(30)

    def wait(self) -> list[dict]:
        """Wait for the build; its per-image ``tags``, ``seconds`` and ``bytes``. Raises ``RuntimeError`` with
        the log's last lines if it failed (a missing tool is one line: ``images/build.py``'s message)."""
        status = self.process.wait()
        if status != 0:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"images/build.py operator cpu exited with {status}; last lines of {self.log}:\n{tail}")
        return json.loads(self.summary.read_text())


def start_build(out_dir: Path) -> Build:
    """Start ``images/build.py operator cpu`` (``make images``) in the background, its output in ``out_dir``."""
    log, summary = out_dir / "build.log", out_dir / "build.json"
    argv = [sys.executable, str(ROOT / "images" / "build.py"), "operator", "cpu", "--json", str(summary)]
    with log.open("w") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT, start_new_session=True
        )
    return Build(process, log, summary, time.monotonic())


def buildah(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """One buildah command, its output captured; ``CalledProcessError`` (with its stderr) unless ``check=False``."""
    done = subprocess.run(["buildah", *args], capture_output=True, text=True, env=ENV)
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, ["buildah", *args], done.stdout, done.stderr)
    return done


def image_config(image: str) -> dict:
    """The image's OCI config (``User``, ``Env``, ``Entrypoint``, ``WorkingDir``, ``ExposedPorts``)."""
    return json.loads(buildah("inspect", "--type", "image", image).stdout)["OCIv1"]["config"]


class Container:
    """A working container of ``image`` (``buildah from``), removed on exit. Commands run in it as the image's
    user unless told otherwise, with the image's environment and working directory."""

    def __init__(self, image: str):
        self.image = image
        self.name = ""

    def __enter__(self) -> Container:
        self.name = buildah("from", "--quiet", "--pull-never", self.image).stdout.strip()
        return self

    def __exit__(self, *exc) -> None:
        buildah("rm", self.name, check=False)

    def argv(self, command: list[str], *, env: dict[str, str] | None = None, volumes=(), user: str | None = None):
        """``buildah run`` of ``command``: host network, ``volumes`` as ``(host, inside[, "ro"])``."""
        argv = ["buildah", "run", "--network", "host"]
        if user is not None:
            argv += ["--user", user]
        for key, value in (env or {}).items():
            argv += ["--env", f"{key}={value}"]
        for volume in volumes:
            argv += ["--volume", ":".join(str(part) for part in volume)]
        return [*argv, self.name, "--", *command]

    def run(self, command: list[str], *, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        """Run ``command`` to its end; stdout and stderr together in ``stdout``."""
        return subprocess.run(
            self.argv(command, **kwargs),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            env=ENV,
        )

    def start(self, command: list[str], *, log: Path, **kwargs) -> subprocess.Popen:
        """Start ``command`` in the background (its own process group: :func:`stop` ends all of it)."""
        with log.open("w") as out:
            return subprocess.Popen(
                self.argv(command, **kwargs), stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
            )


def stop(process: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM to the container's command, as a kubelet stops a container, and its exit status (``buildah run``
    exits with it); SIGKILL to the whole group if it outlives ``timeout`` seconds.

    The signal goes to the command itself: buildah's chroot isolation runs it, in no PID namespace of its own, as
    the child of ``buildah-chroot-exec``, and on a SIGTERM of its own buildah 1.28 kills it rather than passing it on.
    """
    commands = [
        p
        for p in psutil.Process(process.pid).children(recursive=True)
        if (parent := p.parent()) is not None and parent.cmdline()[:1] == ["buildah-chroot-exec"]
    ]
    for command in commands or [psutil.Process(process.pid)]:
        command.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait(10)


def run_read_only(image: str, command: list[str], *, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``command`` as the image's user with its root file system read-only, its ``Env`` and ``WorkingDir``
    (a kubelet with ``readOnlyRootFilesystem: true``): the image's layers mounted by buildah, bound read-only
    over themselves in a mount namespace of this command's own, ``/proc`` and ``/dev`` from the host."""
    config = image_config(image)
    user = config.get("User") or "0:0"
    user = user if ":" in user else f"{user}:{user}"
    with Container(image) as container:
        rootfs = buildah("mount", container.name).stdout.strip()
        env = ["env", "-i", *config.get("Env", [])]
        inside = shlex.join(
            [
                "chroot",
                f"--userspec={user}",
                rootfs,
                *env,
                "sh",
                "-c",
                'cd "$0" && exec "$@"',
                config.get("WorkingDir") or "/",
                *command,
            ]
        )
        script = (
            f"mount --bind {rootfs} {rootfs} && mount -o remount,bind,ro {rootfs} {rootfs}"
            f" && mount -t proc proc {rootfs}/proc && mount --rbind /dev {rootfs}/dev && exec {inside}"
        )
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
        try:
            return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        finally:
            buildah("umount", container.name, check=False)
