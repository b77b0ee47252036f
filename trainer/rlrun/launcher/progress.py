"""What ``rlrun local`` shows of a run: metrics lines read as they grow, progress lines, the summary table, and a
wait that shows its time (:class:`Waiting`).

The orchestrator writes one line per shipped step to ``<run_dir>/metrics.jsonl``
(:mod:`rlrun.orchestrator.metrics`), the trainer one per trained step to ``trainer_metrics.jsonl``: the headline
numbers come from both (reward, the groups solved by all / by none, truncation, staleness; the trainer's
mismatch KL, the first sign of a weight-sync bug). The run starts with :func:`model_line` (with LoRA: what trains)
and ends with :func:`print_summary` (the table, the reward gain, what each policy version published, the held-out
evaluation, the trackers, the ledger check) and :func:`done_line`. A **restored batch** — cut from the queue a
resume put back, before its attempt generated anything — has no reward or throughput of its own, and is shown as
restored rather than as zeros.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.filesize import decimal
from rich.table import Table

from rlrun.api.spec import LoraSpec
from rlrun.api.tracking import LoggingSpec
from rlrun.ledger import LedgerReport, check_ledger
from rlrun.rundir import RunDir, read_jsonl
from rlrun.tracking.publisher import read_state


def label_restored(rows: list[dict], generating: set[int]) -> None:
    """Set ``row["restored"]`` on each metrics row, in file order.

    A **restored batch** was cut wholly from the queue a resume put back: shipped before its
    attempt generated anything, so no episode was scored for it (``reward_mean`` null) and no
    token generated (``rollout_tokens_per_s`` 0). Its reward and throughput are not
    measurements, and the launcher shows them as such. ``generating`` holds the attempts seen
    generating so far; it is updated, so rows can be labelled as they arrive.
    """
    for row in rows:
        attempt = row.get("attempt", 0)
        if "restored" in row:  # the orchestrator says (metrics written before it did are inferred)
            if not row["restored"]:
                generating.add(attempt)
            continue
        if row.get("reward_mean") is not None or (row.get("rollout_tokens_per_s") or 0) > 0:
            generating.add(attempt)
        row["restored"] = attempt not in generating


def summary_table(rows: list[dict], max_rows: int = 20, trained: dict[int, dict] | None = None) -> Table:
    """Reward per step, with the groups solved by all / by none, the truncated share, the staleness, tokens/s and
    (from ``trained``: the trainer's metrics line of each step) the mismatch KL; consecutive steps are averaged
    into at most ``max_rows`` rows.

    Restored batches (:func:`label_restored`) count in neither reward nor tokens/s: they
    scored and generated nothing. A row's tokens/s is the tokens generated over the time of
    its other steps (the step's own value for a one-step row), so a step that shipped
    straight from the queue in a few milliseconds cannot drag it down either. A row of
    restored batches only shows "—" for both.
    """
    table = Table(title="reward per step")
    # two-line headers: the table fits 80 columns (a log's width), values never wrapped
    columns = ("steps", "reward", "solved\nall/none", "trun-\ncated", "compl.\nlen", "stale-\nness", "tokens/s")
    for col in (*columns, *(("mismatch\nKL",) if trained else ())):
        table.add_column(col, justify="right", no_wrap=True)
    if not rows:
        return table
    size = max(1, -(-len(rows) // max_rows))
    for i in range(0, len(rows), size):
        chunk = rows[i : i + size]
        measured = [r for r in chunk if not r.get("restored")]

        def mean(key, chunk=chunk):
            vals = [r[key] for r in chunk if r.get(key) is not None]
            return sum(vals) / len(vals) if vals else float("nan")

        def fmt(value: float, spec: str, none: str = "—") -> str:
            return none if value != value else format(value, spec)  # NaN: nothing to average

        steps = f"{chunk[0]['step']}" if len(chunk) == 1 else f"{chunk[0]['step']}–{chunk[-1]['step']}"
        kl = [trained[r["step"]] for r in chunk if r["step"] in (trained or {})]
        table.add_row(
            steps,
            fmt(mean("reward_mean", measured), ".3f", "— (restored)" if not measured else "—"),
            f"{fmt(mean('solved_all', measured), '.2f')}/{fmt(mean('solved_none', measured), '.2f')}",
            fmt(mean("truncated_fraction", measured), ".2f"),
            f"{mean('completion_len_mean'):.1f}",
            f"{mean('staleness_mean'):.2f}",
            fmt(tokens_per_s(measured), ".0f"),
            *((fmt(mean("mismatch_kl", kl), ".4f"),) if trained else ()),
        )
    return table


def tokens_per_s(rows: list[dict]) -> float:
    """Tokens generated over the steps ``rows`` (each ``rollout_tokens_per_s × step_time_s``) per
    second of them; NaN without rows."""
    if not rows:
        return float("nan")
    if all(r.get("step_time_s") for r in rows):
        return sum(r["rollout_tokens_per_s"] * r["step_time_s"] for r in rows) / sum(r["step_time_s"] for r in rows)
    return sum(r.get("rollout_tokens_per_s") or 0 for r in rows) / len(rows)


def reward_gain(rows: list[dict], window: int = 10) -> tuple[float, float] | None:
    """Mean reward of the first and last ``window`` steps (None with fewer than 2·window steps)."""
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    if len(rewards) < 2 * window:
        return None
    return sum(rewards[:window]) / window, sum(rewards[-window:]) / window


def progress_cells(row: dict, max_steps: int, elapsed_s: float, trained: dict | None = None) -> list[str]:
    """The cells of a progress line for metrics ``row`` (``{}`` before the first step) and ``trained``, the
    trainer's metrics line of the row's step, else its newest (its mismatch KL, labelled with its step when that is
    not the row's: the trainer trains step N after the orchestrator ships it; None before one).

    A restored batch (:func:`label_restored`) shows ``reward — (restored batch)`` and
    ``— tok/s``; another step with no episode scored since the one before, ``reward — (none scored)``.
    """
    if row.get("restored"):
        reward, tokens = "reward — (restored batch)", "— tok/s"
    else:
        r = row.get("reward_mean")
        reward = f"reward {r:.3f}" if r is not None else ("reward — (none scored)" if row else "reward —")
        tokens = f"{row.get('rollout_tokens_per_s') or 0:.0f} tok/s"
    solved = (
        [f"solved all/none {row['solved_all']:.2f}/{row['solved_none']:.2f}"]
        if row.get("solved_all") is not None and row.get("solved_none") is not None
        else []
    )
    kl = []
    if trained and trained.get("mismatch_kl") is not None:  # the trainer's step, named when it is not the row's
        other = trained.get("step") is not None and trained.get("step") != row.get("step")
        kl = [f"mismatch KL {trained['mismatch_kl']:.4f}" + (f" (step {trained['step']})" if other else "")]
    wasted = row.get("zero_spread_token_fraction")
    zero_spread = [f"zero-spread {wasted:.0%} of tokens"] if wasted is not None else []
    return [
        f"step {row.get('step', 0)}/{max_steps}",
        reward,
        *solved,
        *zero_spread,
        *kl,
        tokens,
        f"queue {row.get('queue', 0)}",
        f"staleness {row.get('staleness_mean', 0):.2f} (max {row.get('staleness_max', 0)})",
        f"policy v{row.get('policy_version', 0)}",
        f"{elapsed_s:.0f} s",
    ]


def eval_cell(evaluations: list[dict], row: dict | None = None) -> str | None:
    """The progress line's cell for the newest evaluation (``eval.jsonl``,
    :mod:`rlrun.orchestrator.evaluation`), with the rounds this attempt dropped as of metrics ``row``
    (``eval_rounds_dropped``) when there are any."""
    dropped = (row or {}).get("eval_rounds_dropped") or 0
    gone = f"{dropped} eval round(s) dropped" if dropped else None
    if not evaluations:
        return gone
    e = evaluations[-1]
    cell = f"held-out solved {e['greedy_solved']:.3f} (v{e['policy_version']})"
    return f"{cell}, {gone}" if gone else cell


def eval_dropped_line(previous: dict, row: dict) -> str | None:
    """The console's line when metrics ``row`` counts more dropped evaluation rounds than ``previous`` (the
    line before it, of the same attempt): the orchestrator's log says which policy and why."""
    same = previous.get("attempt") == row.get("attempt")
    before = (previous.get("eval_rounds_dropped") or 0) if same else 0
    now = row.get("eval_rounds_dropped") or 0
    if now <= before:
        return None
    return (
        f"held-out evaluation: {now - before} round(s) dropped by step {row.get('step')} "
        f"({now} this attempt; logs/orchestrator.log says which policy and why)"
    )


def eval_report(evaluations: list[dict]) -> list[str]:
    """The summary's lines on held-out evaluation: the first evaluation → the last, each measure with its change
    (nothing without two evaluations). The first is the policy the run started from when it was evaluated at 0."""
    if len(evaluations) < 2:
        return []
    first, last = evaluations[0], evaluations[-1]
    k = last.get("samples_per_task", 1)
    lines = [
        f"held-out evaluation, {last['tasks']} tasks, policy {first['policy_version']} → {last['policy_version']}:"
    ]
    for key, label in (
        ("greedy_solved", "greedy solved (exact match)"),
        ("greedy_reward", "greedy reward"),
        ("sampled_reward", "sampled reward"),
        ("pass_at_k", f"pass@{k}"),
    ):
        a, b = first[key], last[key]
        lines.append(f"  {label:<28} {a:.3f} → {b:.3f} ({b - a:+.3f})")
    return lines


def ledger_line(report: LedgerReport) -> str:
    """The summary's line on the ledger check (:func:`rlrun.ledger.check_ledger`): ok or VIOLATED, and each fate's
    count of finished episodes."""
    untrained = f" (+{report.shipped_untrained} in batches shipped, not trained)" if report.shipped_untrained else ""
    return (
        f"ledger: {'ok' if report.ok else 'VIOLATED'} — {report.finished} finished episodes: {report.trained} trained, "
        f"{report.rejected} rejected, {report.dropped_stale} dropped stale, {report.abandoned} abandoned, "
        f"{report.leftover} left over{untrained}; {report.rolled_back} rolled back"
    )


def tokens_line(report: LedgerReport) -> str | None:
    """The summary's line on what the generated tokens went to (issue 48), from the ledger check: the share trained,
    generated tokens per trained token, and the share spent on groups rejected for zero reward spread, solved by every
    member or not; None for a ledger without token counts (written before them) or with nothing finished."""
    total = report.tokens_finished
    if not total:
        return None
    solved, unsolved = report.tokens_zero_spread_solved, report.tokens_zero_spread_unsolved
    per_trained = f"{total / report.tokens_trained:.2f}" if report.tokens_trained else "—"
    return (
        f"tokens: {total:,} generated, {report.tokens_trained / total:.0%} trained ({per_trained} generated per "
        f"trained token); {(solved + unsolved) / total:.0%} on groups with zero reward spread ({solved / total:.0%} "
        f"solved by every member, {unsolved / total:.0%} not)"
    )


def print_summary(console: Console, run_dir: RunDir, rows: list[dict], lora: LoraSpec | None = None) -> LedgerReport:
    """Print what ``rlrun local`` shows once every process has exited 0: the :func:`summary_table` of ``rows`` (every
    step's last metrics line, in step order) with the trainer's mismatch KL, the :func:`reward_gain`, what each policy
    version published (:func:`published_line`; ``lora``: the run's ``spec.model.lora``), the held-out
    :func:`eval_report`, the :func:`tracker_lines`, and the ledger check (:func:`ledger_line`, :func:`tokens_line`,
    then its first 5 problems). Returns the ledger check's report: the run succeeded only when it is ``ok``."""
    trained = {r["step"]: r for r in read_jsonl(run_dir.trainer_metrics) if "step" in r}  # the last of each
    console.print(summary_table(rows, trained=trained))
    gain = reward_gain(rows)
    if gain:
        console.print(
            f"mean reward, first 10 steps {gain[0]:.3f} → last 10 steps {gain[1]:.3f} ({gain[1] - gain[0]:+.3f})"
        )
    if published := published_line(trained, lora):
        console.print(published, markup=False)
    for line in eval_report(read_jsonl(run_dir.evaluations)) + tracker_lines(run_dir):
        console.print(line, markup=False)
    report = check_ledger(run_dir.ledger)
    console.print(ledger_line(report))
    if tokens := tokens_line(report):
        console.print(tokens, markup=False)
    for problem in report.problems[:5]:
        console.print(f"  [red]{problem}[/red]")
    return report


def model_line(model_path: str, lora: LoraSpec | None) -> str:
    """The launcher's line naming the model, once it is resolved; with ``spec.model.lora``, also what trains (the
    adapter's settings) and how a version reaches the rollout servers (``docs/design.md``, "LoRA")."""
    if lora is None:
        return f"model: {model_path}"
    return (
        f"model: {model_path}, frozen: trains a LoRA adapter of rank {lora.rank}, alpha {lora.alpha:g} on "
        f"{', '.join(lora.target_modules)}; each policy version reaches the rollout servers as an adapter, "
        "with no pause"
    )


def published_line(trained: dict[int, dict], lora: LoraSpec | None) -> str | None:
    """The summary's line on what the trainer published per policy version: the last trained step's
    ``broadcast_bytes`` (``trainer_metrics.jsonl``; kB and MB are 10³ and 10⁶ bytes), the adapter alone with
    ``lora``, every weight without; None when no step recorded it."""
    sizes = [row["broadcast_bytes"] for _, row in sorted(trained.items()) if row.get("broadcast_bytes")]
    if not sizes:
        return None
    return (
        f"published per policy version: {decimal(sizes[-1])} ({'the LoRA adapter alone' if lora else 'every weight'})"
    )


def done_line(steps: int, elapsed_s: float, preemptions: int, run_dir: RunDir) -> str:
    """The launcher's last line: ``steps`` shipped in ``elapsed_s`` seconds, with ``preemptions`` drills."""
    return f"done: {steps} steps in {elapsed_s:.0f} s, {preemptions} preemption(s); run directory {run_dir.root}"


def tracker_lines(run_dir: RunDir) -> list[str]:
    """What the last attempt's experiment trackers did (``tracking.json``: :mod:`rlrun.tracking.publisher`):
    what it decided (a copied run directory's own tracker run), then one line per tracker, its URL or its
    directory and the command that shows or uploads it, or why it could not log; none without trackers."""
    state = read_state(run_dir)
    lines = [f"experiment trackers: {note}" for note in state.get("notes") or [] if isinstance(note, str)]
    lines += [f"experiment tracker: {at}" for at in state.get("locations") or [] if isinstance(at, str)]
    return lines + [f"experiment tracker {error}" for error in state.get("errors") or [] if isinstance(error, str)]


def tracker_plan(spec: LoggingSpec, run_dir: RunDir) -> list[str]:
    """What ``spec.logging`` logs to, as the run starts: each step once a checkpoint holds it."""
    lines = []
    for tracker in spec.trackers:
        if tracker == "wandb" and spec.wandb is not None:
            entity = f"{spec.wandb.entity}/" if spec.wandb.entity else ""
            lines.append(f"W&B ({spec.wandb.mode}): project {entity}{spec.wandb.project}, files in {run_dir.wandb}")
        elif tracker == "tensorboard":
            lines.append(f"TensorBoard: tensorboard --logdir {run_dir.tensorboard}")
    if lines:
        lines[0] = "experiment trackers (each step once its checkpoint is complete): " + lines[0]
    return lines


class Waiting:
    """A wait shown with its seconds: a spinner whose text counts them on a terminal; otherwise a line at the start
    and one every ``every_s`` seconds (a log never goes silent for long). Use as a context manager and call
    :meth:`tick` with the seconds waited (e.g. :func:`rlrun.launcher.processes.wait_http_ok`'s ``tick``).
    """

    def __init__(
        self, console: Console, what: str, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.console = console
        self.what = what
        self.every_s = every_s
        self.clock = clock
        self._status: Any = None
        self._started = self._last = clock()

    def __enter__(self) -> Waiting:
        self._started = self._last = self.clock()
        if self.console.is_terminal:
            self._status = self.console.status(f"{self.what}…")
            self._status.__enter__()
        else:
            self.console.print(f"{self.what}…", markup=False, highlight=False)
        return self

    def tick(self, *_: Any) -> None:
        """Show the wait so far, counted from the start of the whole wait (arguments, such as the seconds a part
        of it took, are ignored)."""
        now = self.clock()
        total = now - self._started
        text = f"{self.what}… {total:.0f} s"
        if self._status is not None:
            self._status.update(text)
        elif now - self._last >= self.every_s:
            self.console.print(text, markup=False, highlight=False)
            self._last = now

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._status is not None:
            self._status.__exit__(kind, exc, tb)
