"""What tests ask of processes they did not start themselves: which are still alive, which a process started.

(A free port comes from :func:`rlrun.launcher.processes.free_port`, the launcher's own.)
"""

from __future__ import annotations

from collections.abc import Iterable

import psutil


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
