"""What tests ask of processes they did not start themselves: which are still alive, which a process started (and
which it started while a test watched it: :func:`watch`); and
data-parallel ranks forked from the test process (:func:`run_forked_ranks`).

(A free port comes from :func:`rlrun.launcher.processes.free_port`, the launcher's own.)
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable

import psutil
import pytest


def alive(pids: int | Iterable[int]) -> list[str]:
    """``"pid cmdline"`` of each of ``pids`` (one pid or several) still running; zombies count as gone.

    Empty, hence falsy, when none is: ``assert not alive(pid)``, ``assert alive(tree) == []``.
    """
    out = []
    for pid in [pids] if isinstance(pids, int) else pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            pass
    return out


def descendants(pid: int) -> set[int]:
    """pids of every live descendant of ``pid`` (none once it is gone)."""
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def watch(proc: subprocess.Popen, timeout_s: float, until: Callable[[], object] | None = None) -> set[int]:
    """Wait for ``proc`` to exit (or ``until()`` to be truthy), at most ``timeout_s`` seconds, collecting every
    descendant pid seen (every 0.2 s); returns the pids (for :func:`alive` once it is over)."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= descendants(proc.pid)
        if until is not None and until():
            return seen
        time.sleep(0.2)
    return seen


def run_forked_ranks(fn: Callable, args: tuple, ranks: int, timeout_s: float) -> None:
    """Run ``fn(rank, *args)`` on ``ranks`` forked processes (``torch.multiprocessing.start_processes``); fail the test
    (and kill the ranks) after ``timeout_s`` seconds.

    Forked, the ranks inherit the imported torch and transformers (spawned ranks spent ~35 of 45 s importing them on
    2 busy cores). Safe as long as the test process runs torch with no process group: each rank builds its own group
    and models after the fork.
    """
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=ranks, join=False, start_method="fork")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{ranks}-rank job did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
