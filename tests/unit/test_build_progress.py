"""A model build's progress (:mod:`rlrun.model.build_progress`): a line every few seconds in a log, a bar on a
terminal, each showing the step, the tokens, the loss, the share solved at the last check and an ETA bounded by the
budget; and the waits of ``rlrun local`` (:class:`rlrun.launcher.progress.Waiting`)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rlrun.launcher.progress import Waiting
from rlrun.model.build_progress import BarProgress, LineProgress, build_progress


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_a_line_every_five_seconds_and_one_per_check_and_at_the_end():
    clock, lines = Clock(), []
    progress = LineProgress(lines.append, every_s=5.0, clock=clock)
    progress.start("tiny warm start", steps=1000, tokens_budget=1_000_000)
    for step in range(1, 21):  # 20 steps of 1 s, 2,000 tokens each
        clock.now += 1.0
        progress.advance(step, loss=2.0 - step / 100, tokens=2000 * step)
    assert len(lines) == 1 + 4  # the start, then steps 5, 10, 15, 20
    assert (
        lines[-1] == "tiny warm start: step 20/1000, 40k/1.00M tokens, loss 1.800, 20 s, ETA ≤ 8 min 00 s"
    )  # the tokens end it first
    progress.checking(64)  # 0 s since the last line: a fast check is not announced
    progress.checked(20, {"reasoning-gym": 0.0625})
    assert lines[-1] == "tiny warm start: check at step 20: solved reasoning-gym 0.06"
    clock.now += 5.0
    progress.advance(21, 1.79, 42_000)
    assert lines[-1].endswith("check solved 0.06 (step 20), 25 s, ETA ≤ 9 min 30 s")
    progress.finish("target")
    assert lines[-1] == "tiny warm start: done at step 21 (target), 25 s"


def test_the_eta_counts_the_budget_that_ends_first():
    clock = Clock()
    progress = LineProgress(lambda line: None, clock=clock)
    progress.start("tiny warm start", steps=1000, tokens_budget=1_000_000)
    clock.now += 60.0
    progress.advance(100, 1.0, 500_000)  # 10 % of the steps, half the tokens: the tokens end it
    assert progress.fraction() == 0.5 and progress.eta_s() == pytest.approx(60.0)
    progress = LineProgress(lambda line: None, clock=clock)
    progress.start("tiny-reverse warm start", steps=90)  # no token bound
    clock.now += 10.0
    progress.advance(30, 1.0, 30_000)
    assert progress.eta_s() == pytest.approx(20.0)


def test_a_slow_check_is_announced_once_the_log_has_been_quiet():
    clock, lines = Clock(), []
    progress = LineProgress(lines.append, every_s=5.0, clock=clock)
    progress.start("tiny warm start", steps=100)
    clock.now += 6.0
    progress.checking(64)
    assert lines[-1].endswith("checking (64 tasks, greedy)…")


def test_a_terminal_gets_a_bar_with_the_state_and_the_checks_above_it():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=220)
    progress = build_progress(console)
    assert isinstance(progress, BarProgress)
    progress.start("tiny warm start", steps=500, tokens_budget=1_000_000)
    progress.advance(25, 1.771, 50_000)
    progress.checked(25, {"reasoning-gym": 0.0})
    progress.advance(26, 1.7, 52_000)
    progress.finish("tokens")
    text = out.getvalue()
    assert "tiny warm start" in text and "check at step 25: solved reasoning-gym 0.00" in text
    assert "step 26/500, 52k/1.00M tokens, loss 1.700, check solved 0.00 (step 25)" in text
    assert "done (tokens)" in text


def test_a_log_console_gets_lines():
    out = io.StringIO()
    progress = build_progress(Console(file=out, force_terminal=False, width=220))
    assert isinstance(progress, LineProgress)
    progress.phase("scoring greedy decoding on 64 held-out tasks per env")
    assert out.getvalue() == "scoring greedy decoding on 64 held-out tasks per env…\n"


def test_a_wait_in_a_log_says_it_started_and_counts_its_seconds_every_ten():
    out, clock = io.StringIO(), Clock()
    with Waiting(Console(file=out, force_terminal=False, width=200), "starting 1 rollout server(s)", clock=clock) as w:
        for _ in range(25):
            clock.now += 1.0
            w.tick()
    assert out.getvalue().splitlines() == [
        "starting 1 rollout server(s)…",
        "starting 1 rollout server(s)… 10 s",
        "starting 1 rollout server(s)… 20 s",
    ]
