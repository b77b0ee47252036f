"""The final values of each step, read from the run directory's metrics files: what a tracker logs.

Each process appends its own line per step: ``metrics.jsonl`` (the orchestrator, as it ships the step),
``trainer_metrics.jsonl`` (the trainer's rank 0, before the step's checkpoint), and ``eval.jsonl`` (one line per
evaluated policy version). After an abrupt loss the steps past the newest complete checkpoint are trained again,
and their lines appended again. A step's lines are **final** once a complete checkpoint holds the step: every
later attempt resumes from that checkpoint or a newer one, so none trains the step again, and the last line of
the step in each file is the one of the attempt that made the checkpoint. (The one exception: a newest
checkpoint found corrupt and the one before it resumed from; the steps between were logged already and are not
logged again — a tracker's steps never go backwards.) An evaluation of policy version ``v`` is final by the same
rule once a complete checkpoint holds step ``v``: a resumed attempt evaluates again the versions past its
checkpoint (their weights are trained again: :meth:`rlrun.orchestrator.evaluation.Evaluator.resumed_at`), so
the last line of ``v`` is the one of the weights the run kept; a line older than the attempt that trained step
``v`` for good (the resumed attempt did not evaluate ``v`` again: its weights skipped it, or its round failed)
evaluated weights the run threw away and is never logged.

A step's scalars are named by where they come from: ``rollout/<key>`` (``metrics.jsonl``; its ``reward/<series>``
keys as they are, ``per_env`` as ``rollout/per_env/<env>/<key>``), ``train/<key>`` (``trainer_metrics.jsonl``)
and ``eval/<key>`` (``eval.jsonl``, with ``eval/policy_version``); ``run/attempt`` is the attempt that wrote the
step's lines. Non-numbers (None, booleans, strings, numbers no float holds) are left out, and so is a line that is
no JSON object.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rlrun.rundir import RunDir, read_metrics

#: Keys of each file's lines that are not series: the step itself, wall times, flags.
_SKIP = {
    "rollout": {"step", "attempt", "time", "restored"},
    "train": {"step", "attempt", "time", "checkpoint", "ranks"},
    "eval": {"attempt", "time", "tasks", "samples_per_task"},
}


def scalars(line: dict[str, Any], prefix: str, skip: Iterable[str] = ()) -> dict[str, float]:
    """``line``'s numbers as ``{name: value}``: ``<prefix>/<key>`` (a key holding ``/`` kept as it is), nested
    mappings flattened with ``/``; None, booleans and strings left out."""
    out: dict[str, float] = {}
    for key, value in line.items():
        if key in skip:
            continue
        name = key if "/" in key else f"{prefix}/{key}"
        if isinstance(value, dict):
            out.update(scalars(value, name))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                out[name] = float(value)
            except OverflowError:  # an int past 1.8e308
                continue
    return out


class _Lines:
    """One metrics file read as it grows: the last line of each step (or version) not yet taken."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key
        self.offset = 0
        self.last: dict[int, dict[str, Any]] = {}
        #: the attempt of the last line of every step (version) read, kept or not
        self.attempts: dict[int, int] = {}

    def read(self, keep: Callable[[int], bool]) -> None:
        """Read what was appended, keeping the lines of the steps (versions) ``keep`` accepts."""
        lines, self.offset = read_metrics(self.path, self.offset)
        for line in lines:
            n = line.get(self.key) if isinstance(line, dict) else None
            if not isinstance(n, int) or isinstance(n, bool):
                continue
            if isinstance(line.get("attempt"), int):
                self.attempts[n] = line["attempt"]
            if keep(n):
                self.last[n] = line  # a later line of the same step replaces it: the last one is final


class FinalSteps:
    """The metrics files of ``run_dir``, read incrementally, and each step's and evaluation's scalars once final.

    Args:
        run_dir: the run directory.
        logged_step: steps up to this one were logged already (they are skipped).
        logged_versions: evaluated versions logged already (skipped).
    """

    def __init__(self, run_dir: RunDir, logged_step: int = 0, logged_versions: Iterable[int] = ()) -> None:
        self.orchestrator = _Lines(run_dir.metrics, "step")
        self.trainer = _Lines(run_dir.trainer_metrics, "step")
        self.evaluations = _Lines(run_dir.evaluations, "policy_version")
        self.logged_step, self.logged_versions = logged_step, set(logged_versions)

    def take(self, through: int) -> tuple[list[tuple[int, dict[str, float]]], list[tuple[int, dict[str, float]]]]:
        """Read what was appended; return and forget ``(steps, evaluations)`` final and not yet taken: the steps
        and the evaluated versions up to ``through`` (the newest complete checkpoint), as ``[(step or version,
        scalars)]`` in order."""
        self.orchestrator.read(lambda n: n > self.logged_step)
        self.trainer.read(lambda n: n > self.logged_step)
        self.evaluations.read(lambda n: n not in self.logged_versions)
        steps = []
        for step in sorted(set(self.orchestrator.last) | set(self.trainer.last)):
            if step > through:
                break
            merged = {}
            for source, prefix in ((self.trainer, "train"), (self.orchestrator, "rollout")):
                line = source.last.pop(step, None)
                if line is not None:
                    merged.update(scalars(line, prefix, _SKIP[prefix]))
                    if isinstance(line.get("attempt"), int):  # the orchestrator's, when both say
                        merged["run/attempt"] = float(line["attempt"])
            steps.append((step, merged))
            self.logged_step = step
        evaluations = []
        for version in sorted(v for v in self.evaluations.last if v <= through):
            line = self.evaluations.last.pop(version)
            trained_by, evaluated_by = self.trainer.attempts.get(version), line.get("attempt")
            if isinstance(evaluated_by, int) and trained_by is not None and evaluated_by < trained_by:
                continue  # weights a later attempt trained again: its own evaluation of them, if any, is kept
            evaluations.append((version, scalars(line, "eval", _SKIP["eval"])))
        self.logged_versions.update(version for version, _ in evaluations)
        return steps, evaluations
