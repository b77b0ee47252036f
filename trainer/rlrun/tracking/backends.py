"""The experiment trackers: Weights & Biases and TensorBoard, behind one small interface.

Each package is imported only when its tracker is configured (``spec.logging``), so a run without trackers
needs neither installed; one configured but not installed is refused with the manifest (:func:`missing_packages`,
checked by :func:`rlrun.manifest.parse_manifest`), naming the field and the install command.

- **W&B**: one W&B run per rlrun run — its id is given, and each attempt resumes it (``resume="allow"``).
  Steps are logged with an explicit ``step``. Evaluations are logged with the next step's row (W&B's steps only
  grow), their x-axis the ``eval/policy_version`` they evaluated (``define_metric``). The console is not
  captured (the orchestrator's log is its own) and system metrics are off (the orchestrator's pod holds no
  accelerator; vLLM and the trainer report theirs).
- **TensorBoard**: event files under ``<run_dir>/tensorboard/`` (``torch.utils.tensorboard``'s writer). Each
  attempt opens its writer with ``purge_step`` one past the last step logged, so steps a killed attempt logged
  past that point are hidden from TensorBoard (its own rule for restarted jobs); evaluations are written at
  the step they evaluated.
"""

from __future__ import annotations

import logging
from importlib.util import find_spec
from typing import Any, Protocol

from rlrun.api.tracking import LoggingSpec, WandbSpec
from rlrun.rundir import RunDir

log = logging.getLogger(__name__)

INSTALL = "pip install 'rlrun[tracking]'"


class Tracker(Protocol):
    """What the publisher (:mod:`rlrun.tracking.publisher`) logs to."""

    #: ``wandb`` or ``tensorboard``: its key in ``spec.logging`` and in ``tracking.json``
    name: str
    #: where the run can be seen (a URL, or a directory and the command that shows or uploads it)
    location: str
    #: what was logged is durable once :meth:`flush` returns (True), or only once :meth:`close` has (False)
    durable_on_flush: bool

    def log(self, step: int, values: dict[str, float]) -> None:
        """Log ``values`` at ``step`` (steps only grow)."""

    def evaluation(self, step: int, version: int, values: dict[str, float]) -> None:
        """Log an evaluation of policy ``version`` with the row of ``step`` (the last step logged, or the one
        being logged)."""

    def event(self, step: int, text: str) -> None:
        """Note an event (a resume) at ``step``."""

    def flush(self) -> None:
        """Make what was logged durable, where the tracker can (:attr:`durable_on_flush`)."""

    def close(self) -> None:
        """Flush and close."""


def missing_packages(spec: LoggingSpec) -> list[str]:
    """``["spec.logging.wandb: wandb is not installed: pip install …", …]``: each configured tracker whose package
    this environment lacks (empty when all are there)."""
    # each tracker's field, its name and its package's are the same word
    return [f"spec.logging.{t}: {t} is not installed: {INSTALL}" for t in configured(spec) if find_spec(t) is None]


class WandbTracker:
    """A W&B run (``wandb.init(id=run_id, resume="allow")``) in ``spec.mode``, its files under ``<run_dir>/wandb/``.

    Args:
        spec: ``spec.logging.wandb``.
        run_dir: the run directory.
        run_id: the W&B run id (the same for every attempt).
        name: the display name when ``spec.name`` is None.
        config: the run's spec (W&B's ``config``).

    Raises:
        ImportError: wandb is not installed (:func:`missing_packages` says so first).
    """

    name = "wandb"
    durable_on_flush = False

    def __init__(self, spec: WandbSpec, run_dir: RunDir, run_id: str, name: str, config: dict[str, Any]) -> None:
        import wandb

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
        self._pending: dict[str, float] = {}  # an evaluation waiting for the next row
        self._step = 0

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, **self._pending}, step=step)
        self._pending = {}

    def evaluation(self, step: int, version: int, values: dict[str, float]) -> None:
        # with the next row; logged at once only at the end (close): W&B merges a row of the same step
        self._pending.update(values)
        self._step = step

    def event(self, step: int, text: str) -> None:
        log.info("W&B run %s: %s", self.run.id, text)

    def flush(self) -> None:
        pass  # W&B's own process (wandb-core) buffers; only finish() says all is written, so durable at close

    def close(self) -> None:
        if self._pending:
            self.run.log(self._pending, step=self._step)
        self.run.finish()


class TensorBoardTracker:
    """Event files under ``<run_dir>/tensorboard/``, steps past ``logged_step`` purged from earlier attempts' files.

    Raises:
        ImportError: tensorboard is not installed (:func:`missing_packages` says so first).
    """

    name = "tensorboard"
    durable_on_flush = True

    def __init__(self, run_dir: RunDir, logged_step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(str(run_dir.tensorboard), purge_step=logged_step + 1 if logged_step else None)
        self.location = f"{run_dir.tensorboard} (tensorboard --logdir {run_dir.tensorboard})"
        self._summary = Summary

    def log(self, step: int, values: dict[str, float]) -> None:
        # one event of every value (add_scalar makes one each: ~60 µs apiece, the GIL held, beside the run's loop)
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self.writer.file_writer.add_summary(summary, step)

    def evaluation(self, step: int, version: int, values: dict[str, float]) -> None:
        self.log(version, values)

    def event(self, step: int, text: str) -> None:
        self.writer.add_text("run/events", text, step)

    def flush(self) -> None:
        self.writer.flush()  # its own thread writes every 120 s otherwise

    def close(self) -> None:
        self.writer.close()


def configured(spec: LoggingSpec) -> list[str]:
    """The names of the trackers ``spec`` turns on (a disabled W&B is none)."""
    names = ["wandb"] if spec.wandb is not None and spec.wandb.mode != "disabled" else []
    return names + (["tensorboard"] if spec.tensorboard is not None and spec.tensorboard.enabled else [])


def preload(spec: LoggingSpec) -> None:
    """Import the configured trackers' packages (a second or so of imports that hold the GIL: done before the run's
    loop is busy, not in the publisher's thread beside it).

    Raises:
        ImportError: a configured tracker's package is not installed.
    """
    for tracker in configured(spec):
        __import__("wandb" if tracker == "wandb" else "torch.utils.tensorboard")


def open_trackers(
    spec: LoggingSpec, run_dir: RunDir, run_id: str, logged: dict[str, int], name: str, config: dict[str, Any]
) -> list[Tracker]:
    """The trackers ``spec`` turns on (:func:`configured`); ``logged``: the last step each has logged durably.

    Raises:
        ImportError: a configured tracker's package is not installed.
    """
    trackers: list[Tracker] = []
    for tracker in configured(spec):
        if tracker == "wandb":
            trackers.append(WandbTracker(spec.wandb, run_dir, run_id, name, config))  # type: ignore[arg-type]
        else:
            trackers.append(TensorBoardTracker(run_dir, logged.get(tracker, 0)))
    return trackers
