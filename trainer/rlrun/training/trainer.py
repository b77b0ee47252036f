"""The trainer process: one optimizer step per shipped batch, then publish the new weights.

Step ``s`` reads ``rollouts/step_s/`` (waiting until the orchestrator publishes it),
takes one AdamW step on :func:`rlrun.training.loss.clipped_policy_loss`, publishes
``broadcasts/step_s/model.safetensors`` (policy version ``s``) and, every
``checkpoint.interval`` steps and at the last step, ``checkpoints/step_s/trainer/``
(a fresh run also checkpoints step 0, so a pause always has a trainer part to pair
with). Both are published by an atomic directory rename, so readers never see a torn
file, and both record the attempt number in ``meta.json`` (:func:`rlrun.rundir.write_meta`).

Resume from step ``N``: the checkpoint's orchestrator part says ``M`` batches were
shipped when it was taken. Batches ``N+1 … M`` on disk are trained as they are; a
batch past ``M`` is trained only when it carries this attempt's number or a later one
(:func:`batch_accepted`) — one left by a dead attempt holds samples the restored snapshot
has queued again. Attempt numbers are run-directory attempts (``--run-uid``,
:func:`rlrun.rundir.run_dir_attempt`), so a run re-created over the same directory never
shares a number with the run before it, and cannot take that run's stale batch for its own.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rlrun.api.spec import RLRunSpec
from rlrun.batch import read_batch
from rlrun.checkpoint import (
    TRAINER_PROGRESS_FILE,
    WEIGHTS_FILE,
    check_compatible,
    latest_complete_checkpoint,
    run_identity,
)
from rlrun.ledger import Ledger, LedgerEvent
from rlrun.orchestrator.weights import WeightsMismatch
from rlrun.rundir import RunDir, publish_dir, read_attempt, run_dir_attempt, step_dirs, write_meta
from rlrun.training.loss import clipped_policy_loss, token_logprobs

log = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"


def save_weights(model: torch.nn.Module, path: Path) -> None:
    """Write the model's state dict (Hugging Face names) as one safetensors file."""
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt"})


def batch_accepted(path: Path, step: int, attempt: int, shipped_at_restore: int) -> bool:
    """Whether the published batch directory ``path`` is batch ``step`` for the trainer of ``attempt``.

    Args:
        path: ``rollouts/step_<step>/``.
        step: the step to train.
        attempt: this attempt's run-directory number (0: unnumbered, every batch counts).
        shipped_at_restore: batches shipped when the checkpoint resumed from was taken: those
            (written by an earlier attempt) are trained as they are.

    Returns:
        False while it is not published; True for a batch the checkpoint counts as shipped;
        else True only when its ``meta.json`` carries ``attempt`` or a later number.
    """
    if not path.is_dir():
        return False
    if step <= shipped_at_restore or attempt == 0:
        return True
    written = read_attempt(path)
    return written is not None and written >= attempt


class Trainer:
    """Trains ``spec``'s policy from the batches in ``run_dir``.

    Args:
        spec: the run's spec.
        run_dir: shared run directory.
        model_path: initial weights (path or Hugging Face id), see ``rlrun.model.resolve``.
        max_steps: stop after this step (default ``spec.max_steps``).
        resume: start from the newest complete checkpoint, if any.
        attempt: this attempt's number as the launcher or operator counts it (0 = unnumbered).
        poll_s: how often to look for the next batch, seconds.
        run_uid: the run's uid (``--run-uid``): attempts are then numbered per run directory.

    Attributes:
        attempt: the run-directory attempt (:func:`rlrun.rundir.run_dir_attempt`) that stamps
            what it publishes, names its ledger and checks batches.
        step: the last step trained.

    Raises:
        RuntimeError: a fresh start in a run directory that holds a run.
        CheckpointMismatch: the checkpoint resumed from belongs to a run with other settings.
        WeightsMismatch: the checkpoint's weights do not fit the model.
    """

    def __init__(
        self,
        spec: RLRunSpec,
        run_dir: RunDir,
        model_path: str,
        max_steps: int | None = None,
        resume: bool = False,
        attempt: int = 0,
        poll_s: float = 0.02,
        run_uid: str | None = None,
    ) -> None:
        self.spec = spec
        self.shipped_at_restore = 0
        self.step = 0
        self.run_dir = run_dir.ensure()
        self.attempt = run_dir_attempt(self.run_dir, run_uid, attempt)
        self.max_steps = max_steps or spec.max_steps
        self.poll_s = poll_s
        torch.manual_seed(spec.seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        opt = spec.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
        restored = resume and self._restore()
        # Batches may already be arriving from this run's orchestrator; checkpoints past 0 cannot be ours.
        # With --resume and nothing complete to resume from, they are a dead attempt's: removed below.
        if not restored and not resume and [n for n in step_dirs(run_dir.checkpoints) if n > 0]:
            raise RuntimeError(
                f"{run_dir.root} already holds a run; resume it with --resume or choose another --run-dir"
            )
        # Broadcasts and trainer parts past the restored step were written by a dead attempt.
        for parent in (run_dir.broadcasts, run_dir.checkpoints):
            removed = run_dir.remove_steps_after(parent, self.step)
            if removed:
                log.info("removed %s %s left by an earlier attempt (past step %d)", parent.name, removed, self.step)
        self.ledger = Ledger(run_dir.root / "ledger", self.attempt, "trainer")
        if not restored:
            self.checkpoint(0)

    def _restore(self) -> bool:
        ckpt = latest_complete_checkpoint(self.run_dir)
        if ckpt is None:
            log.info("resume: no complete checkpoint in %s; starting from step 0", self.run_dir.root)
            return False
        root = self.run_dir.trainer_checkpoint(ckpt.step)
        check_compatible(ckpt.trainer.get("identity"), self.spec, str(root))
        try:
            self.model.load_state_dict(load_file(str(root / WEIGHTS_FILE)))
        except RuntimeError as exc:  # torch names every missing, unexpected and reshaped tensor
            raise WeightsMismatch(f"{root / WEIGHTS_FILE}: weights do not fit the model: {exc}") from None
        self.optimizer.load_state_dict(torch.load(root / OPTIMIZER_FILE, weights_only=True))
        self.step = ckpt.step
        self.shipped_at_restore = int(ckpt.orchestrator.get("shipped", ckpt.step))
        log.info(
            "resume: restored trainer checkpoint step %d from %s (batches up to %d were shipped before it)",
            ckpt.step, root, self.shipped_at_restore,
        )  # fmt: skip
        return True

    def _batch_ready(self, path: Path, step: int) -> bool:
        return batch_accepted(path, step, self.attempt, self.shipped_at_restore)

    def _wait_for_batch(self, step: int) -> Path:
        path = self.run_dir.rollout_batch(step)
        t0 = time.monotonic()
        next_note = 30.0
        while not self._batch_ready(path, step):
            time.sleep(self.poll_s)
            waited = time.monotonic() - t0
            if waited > next_note:
                log.info("still waiting for batch %d after %.0f s", step, waited)
                next_note *= 2
        return path

    def train_step(self, step: int) -> dict:
        """Train on batch ``step``; returns its metrics (loss, grad norm, ratio stats, seconds)."""
        wait_t0 = time.perf_counter()
        batch = read_batch(self._wait_for_batch(step))
        t0 = time.perf_counter()
        self.model.train()
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logprobs = token_logprobs(logits, batch.input_ids, self.spec.sampling.temperature)
        loss, stats = clipped_policy_loss(
            logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask, self.spec.loss.ratio_clip
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.optimizer.max_grad_norm)
        self.optimizer.step()
        with torch.no_grad():
            mask = batch.loss_mask
            mismatch = (logprobs.detach() - batch.old_logprobs)[mask].abs().mean()
        self.ledger.write(LedgerEvent.TRAINED, step=step, ids=[t["episode_id"] for t in batch.meta["traces"]])
        return {
            "step": step,
            "loss": loss.item(),
            "grad_norm": float(grad_norm),
            "samples": batch.num_samples,
            **stats,
            "logprob_abs_diff": float(mismatch),
            "wait_s": round(t0 - wait_t0, 4),
            "train_s": round(time.perf_counter() - t0, 4),
            "time": time.time(),
        }

    def publish(self, step: int) -> None:
        """Publish ``broadcasts/step_N/`` (weights after step N, and the attempt that made them)."""

        def fill(tmp: Path) -> None:
            save_weights(self.model, tmp / WEIGHTS_FILE)
            write_meta(tmp, step, self.attempt)

        publish_dir(self.run_dir.broadcast(step), fill)

    def checkpoint(self, step: int) -> Path:
        """Publish ``checkpoints/step_N/trainer/``: weights, optimizer state, progress."""

        def fill(tmp: Path) -> None:
            save_weights(self.model, tmp / WEIGHTS_FILE)
            torch.save(self.optimizer.state_dict(), tmp / OPTIMIZER_FILE)
            progress = {"step": step, "policy_version": step, "identity": run_identity(self.spec), "time": time.time()}
            (tmp / TRAINER_PROGRESS_FILE).write_text(json.dumps(progress))
            write_meta(tmp, step, self.attempt)

        self.run_dir.checkpoint(step).mkdir(parents=True, exist_ok=True)
        return publish_dir(self.run_dir.trainer_checkpoint(step), fill)

    def run(self) -> int:
        """Train until ``max_steps``; returns the last step trained."""
        log.info("trainer starting at step %d, training to step %d", self.step, self.max_steps)
        interval = self.spec.checkpoint.interval
        while self.step < self.max_steps:
            step = self.step + 1
            metrics = self.train_step(step)
            self.publish(step)
            self.step = step
            if step % interval == 0 or step == self.max_steps:
                self.checkpoint(step)
                metrics["checkpoint"] = True
            with open(self.run_dir.trainer_metrics, "a") as fh:
                fh.write(json.dumps(metrics) + "\n")
            log.info(
                "step %d loss %.4f grad_norm %.3f clip %.3f |Δlogp| %.4f train %.2fs wait %.2fs",
                step, metrics["loss"], metrics["grad_norm"], metrics["clip_fraction"],
                metrics["logprob_abs_diff"], metrics["train_s"], metrics["wait_s"],
            )  # fmt: skip
        log.info("trainer done at step %d", self.step)
        return self.step
