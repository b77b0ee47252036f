"""What a builtin model's build shows while it runs: the warm start's step, loss, the share of check tasks solved so
far and an ETA; the build's other phases by name.

A build can take minutes (the ``tiny`` warm start of a slow env; a CPU shared with other work makes it several times
slower), and whoever waits must see it move. The builds (:mod:`rlrun.model.tiny`, :mod:`rlrun.model.tiny_envs`) call
a :class:`BuildProgress`; two draw it: :class:`LineProgress` writes a line every few seconds (a log, CI, a pod: the
default) and :class:`BarProgress` a rich progress bar (a terminal: ``rlrun local``, ``rlrun model init``). The ETA is
an upper bound: the budget's end (steps or tokens, whichever comes first); a warm start may stop sooner at its target.
Progress never changes what is built (nothing here feeds back into the build).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def _tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


class BuildProgress:
    """What a build reports, and the state shown from it; this base class shows nothing.

    The warm start calls :meth:`start`, :meth:`advance` after each step, :meth:`checking` and :meth:`checked` around
    each check, :meth:`finish` at its end; :meth:`phase` names any other phase longer than a moment.

    Attributes:
        title: what is being built (``"tiny warm start"``).
        steps: the most steps of the warm start; tokens_budget: the most tokens (None: no token bound).
        step, tokens, loss: the last step's number, the tokens trained so far (padding included), its loss
            (nats per completion token).
        solved: the last check's share of check tasks solved, averaged over the envs, and the step it was at.
        clock: seconds, monotonic (a test passes its own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.title = ""
        self.steps = 0
        self.tokens_budget: int | None = None
        self.step = self.tokens = 0
        self.loss: float | None = None
        self.solved: tuple[int, float] | None = None
        self.started = clock()

    # -- what the build calls ---------------------------------------------------------------------------------

    def phase(self, text: str) -> None:
        """A phase of the build other than the warm start's steps begins (``"scoring held-out tasks"``)."""

    def start(self, title: str, steps: int, tokens_budget: int | None = None) -> None:
        """The warm start begins: at most ``steps`` steps and ``tokens_budget`` tokens."""
        self.title, self.steps, self.tokens_budget = title, steps, tokens_budget
        self.started = self.clock()
        self._show()

    def advance(self, step: int, loss: float, tokens: int) -> None:
        """Step ``step`` (from 1) is done: its ``loss``, ``tokens`` trained so far."""
        self.step, self.loss, self.tokens = step, loss, tokens
        self._show()

    def checking(self, tasks: int) -> None:
        """A check begins: greedy decoding of ``tasks`` check tasks."""

    def checked(self, step: int, solved: dict[str, float]) -> None:
        """The check at ``step`` solved ``solved`` (per env name, the share of its check tasks)."""
        self.solved = (step, sum(solved.values()) / max(len(solved), 1))
        self._show()

    def finish(self, stopped: str) -> None:
        """The warm start ended, for ``stopped`` (``target``, ``tokens``, ``steps``)."""

    # -- what is shown -----------------------------------------------------------------------------------------

    def fraction(self) -> float:
        """Share of the budget used: steps or tokens, whichever is further along, in [0, 1]."""
        done = self.step / self.steps if self.steps else 0.0
        if self.tokens_budget:
            done = max(done, self.tokens / self.tokens_budget)
        return min(done, 1.0)

    def elapsed_s(self) -> float:
        """Seconds since :meth:`start`."""
        return self.clock() - self.started

    def eta_s(self) -> float | None:
        """Seconds left at the rate so far until the budget's end (None before the first step)."""
        done = self.fraction()
        return self.elapsed_s() * (1 - done) / done if done > 0 else None

    def cells(self) -> list[str]:
        """The state as the parts of one line: step, tokens, loss, solved so far."""
        cells = [f"step {self.step}/{self.steps}"]
        if self.tokens_budget:
            cells.append(f"{_tokens(self.tokens)}/{_tokens(self.tokens_budget)} tokens")
        cells.append(f"loss {self.loss:.3f}" if self.loss is not None else "loss —")
        if self.solved is not None:
            cells.append(f"check solved {self.solved[1]:.2f} (step {self.solved[0]})")
        return cells

    def _show(self) -> None:
        pass


class LineProgress(BuildProgress):
    """One line every ``every_s`` seconds at most, through ``write`` (default: this module's logger), and one at the
    start, at each phase, check and the end: what a log or a pod's output shows."""

    def __init__(
        self,
        write: Callable[[str], Any] | None = None,
        every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(clock)
        self.write = write or log.info
        self.every_s = every_s
        self._last = -float("inf")

    def phase(self, text: str) -> None:
        self.write(f"{text}…")

    def checking(self, tasks: int) -> None:
        if self.clock() - self._last >= self.every_s:  # a slow check (multi-turn envs) is worth a line of its own
            self.write(f"{self.title}: {', '.join(self.cells())}; checking ({tasks} tasks, greedy)…")
            self._last = self.clock()

    def checked(self, step: int, solved: dict[str, float]) -> None:
        self.solved = (step, sum(solved.values()) / max(len(solved), 1))
        per_env = ", ".join(f"{name} {share:.2f}" for name, share in solved.items())
        self.write(f"{self.title}: check at step {step}: solved {per_env}")
        self._last = self.clock()

    def finish(self, stopped: str) -> None:
        self.write(f"{self.title}: done at step {self.step} ({stopped}), {_duration(self.elapsed_s())}")

    def _show(self) -> None:
        now = self.clock()
        if now - self._last < self.every_s:
            return
        self._last = now
        eta = self.eta_s()
        when = f"{_duration(self.elapsed_s())}" + (f", ETA ≤ {_duration(eta)}" if eta is not None else "")
        self.write(f"{self.title}: {', '.join(self.cells())}, {when}")


class BarProgress(BuildProgress):
    """A rich progress bar on ``console`` (a terminal): the budget used, elapsed time and ETA, with the state's cells
    on the line below, redrawn 4 times a second; checks and phases printed above it."""

    def __init__(self, console: Any, clock: Callable[[], float] = time.monotonic) -> None:
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
        from rich.text import Text

        class TwoLines(Progress):
            """The bar, then the state on a line of its own (it would not fit beside the bar in 80 columns)."""

            def get_renderables(self):  # rich's documented hook
                yield self.make_tasks_table(self.tasks)
                for task in self.tasks:
                    yield Text(f"  {task.fields.get('state', '')}")

        super().__init__(clock)
        self.console = console
        self._bar = TwoLines(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            TaskProgressColumn(),
            TimeElapsedColumn(),  # ticks on its own, through a slow check too
            TextColumn("{task.fields[eta]}"),
            console=console,
            refresh_per_second=4,
        )
        self._task: Any = None

    def phase(self, text: str) -> None:
        self.console.print(f"{text}…", markup=False, highlight=False)

    def start(self, title: str, steps: int, tokens_budget: int | None = None) -> None:
        self._task = self._bar.add_task(title, total=1.0, state="starting", eta="")
        self._bar.start()
        super().start(title, steps, tokens_budget)

    def checking(self, tasks: int) -> None:
        self._update(f"checking ({tasks} tasks, greedy)…")

    def checked(self, step: int, solved: dict[str, float]) -> None:
        super().checked(step, solved)
        per_env = ", ".join(f"{name} {share:.2f}" for name, share in solved.items())
        self._bar.console.print(f"  check at step {step}: solved {per_env}", markup=False, highlight=False)

    def finish(self, stopped: str) -> None:
        self._update(f"done ({stopped})", done=True)
        self._bar.stop()

    def _update(self, tail: str, done: bool = False) -> None:
        if self._task is None:
            return
        eta = None if done else self.eta_s()
        self._bar.update(
            self._task,
            completed=self.fraction(),
            eta=f"ETA ≤ {_duration(eta)}" if eta is not None else "",
            state=", ".join(self.cells()) + (f"  {tail}" if tail else ""),
        )

    def _show(self) -> None:
        self._update("")


def build_progress(console: Any) -> BuildProgress:
    """The progress of a build shown on ``console`` (a rich ``Console``): a bar on a terminal, else a line every 5 s."""
    if console.is_terminal:
        return BarProgress(console)
    return LineProgress(lambda line: console.print(line, markup=False, highlight=False))
