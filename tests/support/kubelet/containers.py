"""One pod's container as a real process: its command, its env, its volumes at their ``mountPath``s.

The process runs in a private mount namespace (``unshare --mount --propagation private``)
where a small shell prologue bind-mounts each volume's host directory at the container's
``mountPath`` (staged through a tmpfs on ``/mnt``, then parents before children;
``readOnly`` mounts remounted read-only) and the pod's termination-message file at
``terminationMessagePath``, then ``exec``s the command.
The mounts live exactly as long as the namespace, i.e. the process tree: none outlives it.

Like a container runtime, :meth:`ContainerProcess.signal` (the stop signal) reaches the main
process only; :meth:`ContainerProcess.kill` reaches every process of the tree.

Differences from a container runtime, on purpose: the process runs as root in the host's
filesystem, network and PID namespaces (``securityContext`` and ``resources`` are not
applied); the "image" is this test session's virtual environment and repository
(``IMAGE_PATHS``, first on ``PATH`` and mounted at their own paths over the pod's volumes); and a
``--host``/``--control-host`` argument of ``0.0.0.0`` is rewritten to the pod's IP, because every pod shares the host's
network namespace and two pods binding ``0.0.0.0`` on the same port would collide (a real pod has a network namespace of
its own). What binds all interfaces by itself still takes the host's port: a multi-node trainer's rendezvous store
(``torchrun``'s TCPStore on 29500) does, which works because only trainer node 0 hosts it and a
group's replacements start only once every old pod is gone.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlrun.launcher.processes import Child

#: Arguments whose value ``0.0.0.0`` becomes the pod IP (see the module docstring).
BIND_OPTIONS = ("--host", "--control-host")
#: The kubelet keeps at most this much of a termination message (bytes), and of a log fallback 80 lines.
MAX_MESSAGE_BYTES = 4096
FALLBACK_LINES = 80
FALLBACK_BYTES = 2048
#: Where the mount prologue stages volume sources (a tmpfs private to the pod's mount namespace).
STAGING = "/mnt"
#: The "image": this test session's virtual environment and the repository (``rlrun`` is installed
#: editable). Mounted at their own paths in every pod, after the pod's volumes, so that a volume at
#: an ancestor of theirs (the emptyDir at ``/tmp`` when the checkout is under ``/tmp``) hides neither.
IMAGE_PATHS = (Path(sys.prefix), Path(__file__).resolve().parents[3])


def pod_argv(container: dict[str, Any], pod_ip: str) -> list[str]:
    """The container's ``command`` + ``args`` as written, with ``0.0.0.0`` binds moved to ``pod_ip``."""
    argv = [*container.get("command", []), *container.get("args", [])]
    return [
        pod_ip if value == "0.0.0.0" and i > 0 and argv[i - 1] in BIND_OPTIONS else value
        for i, value in enumerate(argv)
    ]


def pod_env(
    container: dict[str, Any], read_secret: Callable[[str], dict[str, Any] | None], pod_ip: str, pod: dict[str, Any]
) -> dict[str, str]:
    """The container's environment: the "image" ``PATH`` plus its ``env`` (values, Secret and field refs).

    Raises:
        KeyError: a referenced Secret or key that does not exist (the kubelet's
            ``CreateContainerConfigError``).
    """
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        ref = var.get("valueFrom", {})
        if "secretKeyRef" in ref:
            secret = read_secret(ref["secretKeyRef"]["name"])
            if secret is None or ref["secretKeyRef"]["key"] not in secret.get("data", {}):
                raise KeyError(f"secret {ref['secretKeyRef']['name']}/{ref['secretKeyRef']['key']} not found")
            env[var["name"]] = base64.b64decode(secret["data"][ref["secretKeyRef"]["key"]]).decode()
        elif "fieldRef" in ref:
            path = ref["fieldRef"]["fieldPath"]
            values = {"status.podIP": pod_ip, "metadata.name": pod["metadata"]["name"]}
            values["metadata.namespace"] = pod["metadata"]["namespace"]
            values["spec.nodeName"] = pod["spec"].get("nodeName", "")
            env[var["name"]] = values[path]
    return env


def exit_code(returncode: int) -> int:
    """A container's exit code as the kubelet reports it: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Mount:
    """A host path shown at ``target`` inside the container."""

    source: Path
    target: str
    read_only: bool = False


@dataclass
class ContainerProcess:
    """The running container of one pod (a ``Child``: its own session and process group).

    Attributes:
        log_path: stdout and stderr of the container (what ``kubectl logs`` would show).
        message_path: the host file behind the container's ``terminationMessagePath``.
    """

    name: str
    argv: list[str]
    env: dict[str, str]
    mounts: list[Mount]
    workdir: Path
    log_path: Path
    message_path: Path
    child: Child | None = field(default=None, init=False)

    def start(self) -> int:
        """Write the mount prologue, start the process; returns its pid."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Every source is first bind-mounted into a private tmpfs on STAGING, then moved to its
        # target, parents first: a source under another mount's target (a volume directory in
        # /tmp while /tmp is an emptyDir) stays reachable whatever the order.
        lines = ["set -e", f"mount -t tmpfs rlrun-stage {STAGING}"]
        ordered = sorted(self.mounts, key=lambda m: m.target.count("/"))
        for i, m in enumerate(ordered):
            stage = f"{STAGING}/{i}"
            lines.append(f"mkdir {stage}" if m.source.is_dir() else f"touch {stage}")
            lines.append(f"mount --bind {shlex.quote(str(m.source))} {stage}")
        for i, m in enumerate(ordered):
            target = shlex.quote(m.target)
            # a target inside an earlier mount (the image under an emptyDir's /tmp) is created there
            make = f"mkdir -p {target}" if m.source.is_dir() else f"touch {target}"
            lines.append(f"[ -e {target} ] || {make}")
            lines.append(f"mount --move {STAGING}/{i} {target}")
            if m.read_only:
                lines.append(f"mount -o remount,bind,ro {shlex.quote(m.target)}")
        lines += ["cd /", 'exec "$@"']
        script = self.workdir / "entrypoint.sh"
        script.write_text("\n".join(lines) + "\n")
        argv = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", str(script), *self.argv]
        self.child = Child(self.name, argv, self.log_path, env=self.env)
        return self.child.pid

    @property
    def pid(self) -> int:
        """pid of the container's main process (the leader of its process group)."""
        assert self.child is not None
        return self.child.pid

    def poll(self) -> int | None:
        """The container's exit code once it exited (128 + N if killed by signal N), else None."""
        assert self.child is not None
        code = self.child.poll()
        return None if code is None else exit_code(code)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the container's main process only, as a container runtime sends its stop signal
        to PID 1: what that process started (torchrun's ranks, vLLM's engine core) hears of it from the
        process, once. Signalling the whole tree would hand each torchrun rank SIGTERM twice (from here
        and forwarded by torchrun), which a real runtime does not do.
        :meth:`kill` still SIGKILLs the whole tree (the runtime kills the container's cgroup)."""
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole tree and reap the process."""
        if self.child is not None:
            self.child.kill()

    def alive_tree(self) -> list[int]:
        """pids of the tree still alive (the process, its descendants, its process group)."""
        return [p.pid for p in self.child.tree()] if self.child is not None else []

    def termination_message(self, code: int, policy: str) -> str:
        """What the kubelet puts in the terminated state's ``message``: the termination-message file, or
        with ``FallbackToLogsOnError`` and a non-zero exit and an empty file, the log's last lines."""
        with contextlib.suppress(OSError):
            text = self.message_path.read_bytes()[:MAX_MESSAGE_BYTES].decode(errors="replace")
            if text:
                return text
        if policy == "FallbackToLogsOnError" and code != 0:
            with contextlib.suppress(OSError):
                tail = self.log_path.read_bytes().splitlines()[-FALLBACK_LINES:]
                return b"\n".join(tail)[-FALLBACK_BYTES:].decode(errors="replace")
        return ""
