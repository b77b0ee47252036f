"""An instant stand-in for the trainer, for tests and benchmarks of the orchestrator.

:func:`fake_trainer` does what the trainer does to the run directory, without training:
for each batch ``rollouts/step_N/`` that appears it records ``trained`` in its own ledger
(``attempt-<K>.trainer.jsonl``), publishes ``broadcasts/step_N/`` with the initial weights,
and every ``interval`` steps (and at the last) a trainer checkpoint part. So the real
orchestrator can run to ``max_steps`` against fake rollout endpoints
(:mod:`rlrun.rollout.fake`) and the ledger check applies to the result. Like the trainer it writes ``started``
and, once done, ``stopped`` in its ledger; given a ``notice`` it saves a part of the step it has (after
``notice_s``, the rest of a step) and stops as the trainer's save on notice does; ``stop`` ends it as a kill
would (no more lines).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

from rlrun.checkpoint import TRAINER_PROGRESS_FILE, WEIGHTS_FILE
from rlrun.ledger import Ledger, LedgerEvent
from rlrun.rundir import META_FILE, RunDir, publish_broadcast, publish_dir, write_meta


def fake_trainer(
    run_dir: RunDir,
    model_dir: Path,
    steps: int,
    interval: int,
    stop: threading.Event,
    attempt: int = 0,
    first_step: int = 0,
    notice: threading.Event | None = None,
    notice_s: float = 0.0,
) -> None:
    """Publish broadcasts and trainer checkpoints for batches ``first_step + 1 … steps`` as they appear.

    Args:
        run_dir: the run directory.
        model_dir: a model directory whose ``model.safetensors`` every broadcast and part copies.
        steps: the last step.
        interval: checkpoint every this many steps (``checkpoint.interval``).
        stop: set it to make the function return early.
        attempt: stamped into what it publishes and names its ledger file.
        first_step: the step it starts after (a resumed run's checkpoint step).
        notice: set it to have it save the step it has (a part, unless there is one) after ``notice_s`` seconds
            and stop, writing ``stopped`` (the trainer's save on notice).
    """
    weights = model_dir / WEIGHTS_FILE
    ledger = Ledger(run_dir.ledger, attempt, "trainer")
    ledger.write(LedgerEvent.STARTED, role="trainer", step=first_step)
    step = first_step
    try:
        while step < steps and not stop.is_set():
            if notice is not None and notice.is_set():
                time.sleep(notice_s)
                saved = None if run_dir.trainer_checkpoint(step).is_dir() else step
                if saved is not None:
                    _publish(run_dir, weights, step, attempt, part=True)
                ledger.write(LedgerEvent.STOPPED, outcome="interrupted", step=step, saved=saved)
                return
            if not run_dir.rollout_batch(step + 1).is_dir():
                time.sleep(0.002)
                continue
            step += 1
            traces = json.loads((run_dir.rollout_batch(step) / META_FILE).read_text())["traces"]
            ledger.write(LedgerEvent.TRAINED, step=step, ids=[t["episode_id"] for t in traces])
            _publish(run_dir, weights, step, attempt, part=False)
            if step % interval == 0 or step == steps:
                _publish(run_dir, weights, step, attempt, part=True)
        if step >= steps:
            ledger.write(LedgerEvent.STOPPED, outcome="complete", step=step)
    finally:
        ledger.close()


def _publish(run_dir: RunDir, weights: Path, step: int, attempt: int, part: bool) -> None:
    """``broadcasts/step_N/`` (``part``: ``checkpoints/step_N/trainer/``) with the initial weights."""

    def fill(tmp: Path) -> None:
        shutil.copy(weights, tmp / WEIGHTS_FILE)
        write_meta(tmp, step, attempt)
        if part:
            (tmp / TRAINER_PROGRESS_FILE).write_text(json.dumps({"step": step}))

    if part:
        run_dir.checkpoint(step).mkdir(parents=True, exist_ok=True)
    if part:
        publish_dir(run_dir.trainer_checkpoint(step), fill)
    else:
        publish_broadcast(run_dir.broadcast(step), fill, attempt)


def start_fake_trainer(run_dir: RunDir, model_dir: Path, steps: int, interval: int, **kwargs) -> threading.Event:
    """Run :func:`fake_trainer` in a daemon thread; returns the event that stops it."""
    stop = threading.Event()
    args = (run_dir, model_dir, steps, interval, stop)
    threading.Thread(target=fake_trainer, args=args, kwargs=kwargs, daemon=True, name="fake-trainer").start()
    return stop
