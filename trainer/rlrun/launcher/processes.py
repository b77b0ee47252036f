"""Child processes of the local launcher: start in their own session, log to a file, stop whole trees,
and read how they exited.

Each child leads its own process group (``start_new_session``), so stopping it
signals everything it spawned too (vLLM's engine core, for one). On Linux the
child also gets ``PR_SET_PDEATHSIG``: if the launcher is killed outright, the
kernel sends the child SIGTERM, so no orphan keeps a port or a CPU.

A role's exit status is read as ``rlrun`` gives it (:func:`role_exit_code`: torchrun's own status
replaced by what rank 0 reported, :mod:`rlrun.role_exit`). A child told where to write its exit report
(``Child.exit_report``) that dies of a permanent error (exit 78: a setting or the data to change) is said
as that error's message alone (:func:`death_report`), not as a traceback or its log's last lines.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from rich.text import Text

from rlrun.api.control import TERMINATION_LOG_ENV, ExitReport

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Child:
    """One named child process whose stdout and stderr go to ``log_path``.

    ``exit_report``: tell the child to write its exit report there (``$RLRUN_TERMINATION_LOG``, :mod:`rlrun.role_exit`),
    cleared first so a report found there is this process's.

    Attributes:
        exit_report: where the child writes its exit report: ``exit_report``, else what its ``env`` names (None:
            nowhere).
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        exit_report: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if exit_report is not None:
            exit_report.unlink(missing_ok=True)
            env = {**(os.environ if env is None else env), TERMINATION_LOG_ENV: str(exit_report)}
        named = (env or {}).get(TERMINATION_LOG_ENV)
        self.exit_report = exit_report if exit_report is not None else Path(named) if named else None
        self._log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        """Exit code, or None while running."""
        return self.proc.poll()

    def tree(self) -> list[psutil.Process]:
        """The child, its descendants, and any other member of its process group, still alive.

        Group members count too: when the child itself died first (SIGKILL), what it spawned
        is no longer its descendant but still sits in its process group.
        """
        procs: dict[int, psutil.Process] = {}
        try:
            root = psutil.Process(self.pid)
            for p in [root, *root.children(recursive=True)]:
                procs[p.pid] = p
        except psutil.NoSuchProcess:
            pass
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if p.pid not in procs and os.getpgid(p.pid) == self.pid:
                    procs[p.pid] = p
        return [p for p in procs.values() if _alive(p)]

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` once to every process of the tree: the process group at once, then each
        descendant that left it. Once matters: a second SIGTERM tells the orchestrator to skip
        its snapshot and exit now."""
        procs = self.tree()
        try:
            os.killpg(self.pid, sig)
            grouped = True
        except (ProcessLookupError, PermissionError):
            grouped = False
        for p in procs:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if grouped and os.getpgid(p.pid) == self.pid:
                    continue  # the killpg above reached it
                p.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the whole tree at once (a simulated node loss) and reap the child."""
        procs = self.tree()
        self.signal_group(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._log.close()

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the tree, then SIGKILL whatever is left after ``timeout_s``; reap the child."""
        procs = self.tree()
        if procs:
            self.signal_group(signal.SIGTERM)
            _, alive = psutil.wait_procs(procs, timeout=timeout_s)
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(alive, timeout=5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._log.close()

    def tail(self, lines: int = 20) -> list[str]:
        """The last ``lines`` lines of the child's log."""
        try:
            with open(self.log_path, errors="replace") as fh:
                return [line.rstrip("\n") for line in deque(fh, maxlen=lines)]
        except OSError:
            return []


def stop_together(children: list[Child], timeout_s: float = 15.0) -> None:
    """SIGTERM every child's tree at once, as deleting an attempt's pods signals every container, wait up to
    ``timeout_s`` for all of them, then SIGKILL whatever is left and reap each child.

    Together matters: a paused orchestrator told to stop waits for the trainer's save on notice to pair it
    (:meth:`rlrun.orchestrator.checkpointing.CheckpointManager.pair_notice_save`); stopped one after the other, it
    would wait for a trainer not yet told.
    """
    trees = [child.tree() for child in children]
    for child, procs in zip(children, trees, strict=True):
        if procs:
            child.signal_group(signal.SIGTERM)
    psutil.wait_procs([p for procs in trees for p in procs], timeout=timeout_s)
    for child in children:
        child.kill()  # SIGKILLs what is left of its tree (nothing, usually), reaps it, closes its log


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_http_ok(url: str, child: Child, timeout_s: float, tick: Callable[[float], Any] | None = None) -> float:
    """Poll ``url`` until it answers 200; returns seconds waited. ``tick`` is called with the seconds waited so far
    after each poll that did not answer (every ~0.5 s: what shows the wait).

    Raises:
        ChildDied: ``child`` exited first.
        TimeoutError: no 200 within ``timeout_s``.
    """
    import httpx

    t0 = time.monotonic()
    while True:
        code = child.poll()
        if code is not None:
            raise ChildDied(child, code)
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{child.name}: {url} did not answer within {timeout_s:.0f} s")
        if tick is not None:
            tick(time.monotonic() - t0)
        time.sleep(0.5)


class ChildDied(RuntimeError):
    """A child process exited when it should not have."""

    def __init__(self, child: Child, code: int) -> None:
        self.child = child
        self.code = code
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        super().__init__(f"{child.name} (pid {child.pid}) {how}")


def role_exit_code(code: int | None, report_path: Path, under_torchrun: bool) -> int | None:
    """A role process's exit status as ``rlrun trainer`` gives it (:mod:`rlrun.role_exit`), given the status
    the launcher saw (None: killed) and the exit report the role wrote at ``report_path``.

    Under torchrun the status is torchrun's own, and torchrun exits 1 whenever it got SIGTERM (its
    ``SignalException``), after its ranks saved on notice and exited 143 as well; so there the outcome
    rank 0 reported decides: ``interrupted`` is 143 (saved on notice), ``complete`` 0. One process: a
    role that reported ``complete`` and was then killed by a stop signal (status −15: it landed before
    the role could ignore SIGTERM to exit, :func:`rlrun.role_exit.exiting`) finished, so that is 0 too.
    None (killed) and a status without a report stay as they are. The report must be this process's:
    the caller clears ``report_path`` before starting it.
    """
    if code in (None, 0):
        return code
    try:
        report = ExitReport.model_validate_json(report_path.read_text())
    except (OSError, ValueError):
        return code
    if report.outcome == "complete":
        return 0
    if report.outcome == "interrupted" and under_torchrun:
        return 128 + signal.SIGTERM
    return code


def permanent_error(report_path: Path | None) -> str | None:
    """The message of the permanent error a role reported at ``report_path`` (:mod:`rlrun.role_exit`: exit 78),
    or None: no report, one that does not read, or no permanent error."""
    try:
        report = ExitReport.model_validate_json(report_path.read_text()) if report_path is not None else None
    except (OSError, ValueError):
        return None
    return report.message if report is not None and report.outcome == "error" and report.permanent else None


def death_report(exc: ChildDied) -> list[Text]:
    """What to say of a child that died, line by line: a role's permanent error as its message alone (what to
    change is in it; a traceback or the log's tail would add nothing), else the exit and the log's last 20 lines."""
    child = exc.child
    message = permanent_error(child.exit_report)
    if message is not None:
        return [
            Text.assemble(("error:", "red"), f" {child.name} stopped: {message}"),
            Text(f"(exit {exc.code}: retrying cannot heal it; its log: {child.log_path})"),
        ]
    return [Text.assemble(("error:", "red"), f" {exc}; last lines of {child.log_path}:")] + [
        Text(f"  {line}") for line in child.tail(20)
    ]


def exits_cleanly(child: Child, within_s: float) -> bool:
    """True once ``child`` has exited 0, waiting up to ``within_s`` seconds; False while it runs on.

    Raises:
        ChildDied: it exited with another code.
    """
    deadline = time.monotonic() + within_s
    while True:
        code = child.poll()
        if code == 0:
            return True
        if code is not None:
            raise ChildDied(child, code)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
