"""The experiment trackers: Weights & Biases and TensorBoard, behind one small interface.

Each package is imported only when its tracker is configured (``spec.logging``), so a run without trackers
needs neither installed; one configured but not installed is refused with the manifest (:func:`missing_packages`,
checked by :func:`rlrun.manifest.parse_manifest`), naming the field and the install command.

Each tracker knows what it has logged (:class:`Cursor`: the last step, the evaluated versions) and whether that is
durable yet: the publisher records it in ``tracking.json`` only then, so the next attempt logs again whatever a
killed one had not made durable.

- **W&B**: one W&B run per rlrun run — its id is given, and each attempt resumes it (``resume="allow"``).
  Steps are logged with an explicit ``step``; W&B ignores a row whose step is less than its run's current one.
  What it is given is durable only once ``finish()`` returns (W&B's own process, ``wandb-core``, buffers it and
  dies with ours), so after an attempt that did not close, the next logs its rows again, and W&B keeps one of
  each. An evaluation joins a following step's row (one per row), its x-axis the ``eval/policy_version`` it
  evaluated (``define_metric``), and only a row past every step W&B was ever given, which W&B cannot ignore; the
  evaluations left when the run ends get rows of their own after the last step. The console is not captured (the
  orchestrator's log is its own) and system metrics are off (the orchestrator's pod holds no accelerator; vLLM and the
  trainer report theirs).
- **TensorBoard**: event files under ``<run_dir>/tensorboard/<tracker run id>/`` (``torch.utils.tensorboard``'s
  writer), one event per step. Each attempt opens its writer with ``purge_step`` one past the last step
  recorded, so what a killed attempt wrote past that point is hidden (TensorBoard's own rule for restarted
  jobs); evaluations are written at the step they evaluated. Durable once flushed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any, Protocol

from rlrun.api.tracking import LoggingSpec, WandbSpec
from rlrun.rundir import RunDir

log = logging.getLogger(__name__)

INSTALL = "pip install 'rlrun[tracking]'"


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


@dataclass
class Cursor:
    """What a tracker has logged: steps up to ``step`` and the evaluations of ``versions`` (durably, in
    ``tracking.json``); ``given``: the highest step it was ever given, durable or not (W&B: a row at or below it
    may be one W&B ignores)."""

    step: int = 0
    versions: set[int] = field(default_factory=set)
    given: int = 0

    def copy(self) -> Cursor:
        """A cursor of its own to update (the versions not shared)."""
        return Cursor(self.step, set(self.versions), self.given)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "versions": sorted(self.versions), "given": max(self.given, self.step)}

    @classmethod
    def from_json(cls, data: Any) -> Cursor:
        """A cursor from ``tracking.json`` (a malformed entry reads as nothing logged)."""
        if not isinstance(data, dict):
            return cls()
        versions = data.get("versions") if isinstance(data.get("versions"), list) else []
        step = _count(data.get("step"))
        versions = {v for v in versions if isinstance(v, int) and not isinstance(v, bool)}
        return cls(step, versions, max(step, _count(data.get("given"))))


class Tracker(Protocol):
    """What the publisher (:mod:`rlrun.tracking.publisher`) logs to."""

    #: ``wandb`` or ``tensorboard``: its key in ``spec.logging`` and in ``tracking.json``
    name: str
    #: where the run can be seen (a URL, or a directory and the command that shows or uploads it)
    location: str
    #: what it was given (updated as it logs)
    logged: Cursor
    #: what was logged is durable once :meth:`flush` returns (True), or only once :meth:`close` has (False)
    durable_on_flush: bool

    def log(self, step: int, values: dict[str, float]) -> None:
        """Log ``values`` at ``step`` (steps only grow)."""

    def evaluation(self, version: int, values: dict[str, float]) -> None:
        """Log the evaluation of policy ``version`` (now, or with the next step: :attr:`logged` says when)."""

    def event(self, step: int, text: str) -> None:
        """Note an event (a resume) at ``step``."""

    def flush(self) -> None:
        """Make what was logged durable, where the tracker can (:attr:`durable_on_flush`)."""

    def close(self, finished: bool) -> None:
        """Flush and close; ``finished``: the run is complete (no attempt comes after this one)."""


class WandbTracker:
    """A W&B run (``wandb.init(id=run_id, resume="allow")``) in ``spec.mode``, its files under ``<run_dir>/wandb/``.

    Args:
        spec: ``spec.logging.wandb``.
        run_dir: the run directory.
        run_id: the W&B run id (the same for every attempt).
        name: the display name when ``spec.name`` is None.
        config: the run's spec (W&B's ``config``).
        logged: what earlier attempts logged durably.

    Raises:
        ImportError: wandb is not installed (:func:`missing_packages` says so first).
        Exception: whatever ``wandb.init`` raises (no API key, an unknown entity, no network).
    """

    name = "wandb"
    durable_on_flush = False

    def __init__(
        self, spec: WandbSpec, run_dir: RunDir, run_id: str, name: str, config: dict[str, Any], logged: Cursor
    ) -> None:
        import wandb

        # This process's own wandb-core, never one named by an inherited WANDB_SERVICE (a notebook's, a shell's
        # detached service, the test runner's): a shared service outlives a killed attempt and keeps holding the
        # run's id, so the next attempt's resume is refused ("run ID ... is in use"). Ours dies with us.
        os.environ.pop("WANDB_SERVICE", None)
        self.run = wandb.init(
            project=spec.project,
            entity=spec.entity,
            name=spec.name or name,
            tags=spec.tags or None,
            id=run_id,
            resume="allow",
            mode=spec.mode,
            dir=str(run_dir.root),
            config=config,
            reinit="create_new",  # tests run several orchestrators in one process
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.run.define_metric("eval/policy_version")
        self.run.define_metric("eval/*", step_metric="eval/policy_version")
        offline = f"{self.run.settings.sync_dir} (upload: wandb sync {run_dir.wandb}/offline-run-*-{run_id})"
        self.location = offline if spec.mode == "offline" else self.run.url
        self.logged = logged.copy()
        self._floor = logged.given  # rows up to it may be ignored: no evaluation rides on them
        self._pending: list[tuple[int, dict[str, float]]] = []  # evaluations waiting for a row, oldest first

    def log(self, step: int, values: dict[str, float]) -> None:
        row = dict(values)
        if self._pending and step > self._floor:
            version, evaluation = self._pending.pop(0)
            row.update(evaluation)
            self.logged.versions.add(version)
        self.run.log(row, step=step)
        self.logged.step, self.logged.given = step, max(self.logged.given, step)

    def evaluation(self, version: int, values: dict[str, float]) -> None:
        self._pending.append((version, values))

    def event(self, step: int, text: str) -> None:
        log.info("W&B run %s: %s", self.run.id, text)

    def flush(self) -> None:
        pass  # wandb-core buffers; only finish() says all is written

    def close(self, finished: bool) -> None:
        # the run's last evaluations (the final one comes after the last checkpoint) get rows after its last step;
        # otherwise what is pending is left to the next attempt's rows
        while finished and self._pending:
            version, evaluation = self._pending.pop(0)
            self.logged.given += 1
            self.run.log(evaluation, step=self.logged.given)
            self.logged.versions.add(version)
        self.run.finish()


class TensorBoardTracker:
    """Event files under ``<run_dir>/tensorboard/<run_id>/``; steps past ``logged.step`` purged from earlier
    attempts' files.

    Raises:
        ImportError: tensorboard is not installed (:func:`missing_packages` says so first).
    """

    name = "tensorboard"
    durable_on_flush = True

    def __init__(self, run_dir: RunDir, run_id: str, logged: Cursor) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        # one directory per tracker run: a new run over a retained volume does not write over the old one's steps.
        # Everything past what was recorded is hidden (an evaluation of version 0 is at step 0)
        purge = logged.step + 1 if logged.step or 0 in logged.versions else 0
        self.writer = SummaryWriter(str(run_dir.tensorboard / run_id), purge_step=purge)
        self.location = f"{run_dir.tensorboard / run_id} (tensorboard --logdir {run_dir.tensorboard})"
        self.logged = logged.copy()
        self._summary = Summary

    def _write(self, step: int, values: dict[str, float]) -> None:
        # one event of every value (add_scalar makes one each: ~60 µs apiece, the GIL held, beside the run's loop)
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self.writer.file_writer.add_summary(summary, step)

    def log(self, step: int, values: dict[str, float]) -> None:
        self._write(step, values)
        self.logged.step = self.logged.given = step

    def evaluation(self, version: int, values: dict[str, float]) -> None:
        self._write(version, values)
        self.logged.versions.add(version)

    def event(self, step: int, text: str) -> None:
        self.writer.add_text("run/events", text, step)

    def flush(self) -> None:
        self.writer.flush()  # its own thread writes every 120 s otherwise

    def close(self, finished: bool) -> None:
        self.writer.close()


def missing_packages(spec: LoggingSpec) -> list[str]:
    """``["spec.logging.wandb: wandb is not installed: pip install …", …]``: each configured tracker whose package
    this environment lacks (empty when all are there)."""
    return [f"spec.logging.{t}: {t} is not installed: {INSTALL}" for t in spec.trackers if find_spec(t) is None]


def preload(spec: LoggingSpec) -> None:
    """Import the configured trackers' packages (a second or so of imports that hold the GIL: done before the run's
    loop is busy, not in the publisher's thread beside it).

    Raises:
        ImportError: a configured tracker's package is not installed.
    """
    for tracker in spec.trackers:
        __import__("wandb" if tracker == "wandb" else "torch.utils.tensorboard")


def open_tracker(
    tracker: str, spec: LoggingSpec, run_dir: RunDir, run_id: str, logged: Cursor, name: str, config: dict[str, Any]
) -> Tracker:
    """Open ``tracker`` (a name of :attr:`LoggingSpec.trackers`); ``logged``: what earlier attempts logged to it
    durably.

    Raises:
        ImportError: its package is not installed.
        Exception: whatever the tracker raises when it cannot start.
    """
    if tracker == "wandb":
        assert spec.wandb is not None
        return WandbTracker(spec.wandb, run_dir, run_id, name, config, logged)
    return TensorBoardTracker(run_dir, run_id, logged)
