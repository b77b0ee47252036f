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

Save on notice (:meth:`Trainer.notice`, which ``rlrun trainer`` calls on SIGTERM): the trainer
finishes the step it is computing (or abandons waiting for the next batch), publishes that
step's broadcast, and writes ``checkpoints/step_S/trainer/`` for the step ``S`` it has (unless
that part is already there), then stops; the orchestrator pairs it (its periodic path, or its
pause snapshot when paused: see :mod:`rlrun.orchestrator.checkpointing`), so the next start
recomputes no step. The part is published by rename: a kill during the save (a grace period
too short) leaves the previous complete checkpoint, and the next start retrains the steps after
it from the kept batch files, as without a notice.

Trainer-only restart: a trainer that replaces one of the **same attempt** (same ``--attempt``
and ``--run-uid``; the orchestrator and rollout servers kept running) uses ``--resume``. Its
batches past the checkpoint's ``shipped`` carry the same attempt number, so they are accepted;
and when its predecessor published a trainer part the live orchestrator has not completed yet,
it waits up to ``pair_wait_s`` for the orchestrator to complete it before choosing the step to
resume from (:meth:`Trainer._wait_for_pairing`), so a notice save is never thrown away.

Data parallel (``dp.world_size`` W > 1, ranks started by ``torchrun``): the model is FSDP2-sharded
(:func:`~rlrun.training.distributed.shard_model`) before the optimizer is built. Every rank reads
the shipped batch file itself and trains its rows (:func:`~rlrun.training.distributed.rank_slice`,
:func:`~rlrun.training.distributed.data_parallel_policy_loss`, global
:func:`~rlrun.training.distributed.clip_grad_norm_`): the same update as one process. Rank 0
alone decides what to resume from and publishes: broadcasts, ledger, metrics (and, in
``rlrun trainer``, the exit report); a broadcast's weights come from
:func:`~rlrun.training.distributed.full_state_dict`, which every rank calls. A trainer part is
written by every rank (:func:`~rlrun.training.sharded_checkpoint.save_sharded`, ``meta.json``
``format: "dcp"``) with rank 0's full ``model.safetensors`` and ``progress.json`` beside the
shards, so the orchestrator's resume is unchanged and the part loads into any number of ranks.
Resume loads a sharded part with ``load_sharded`` and an unsharded one (written by one process)
by setting its full state into the sharded model and optimizer, so a run can change its rank count.

Agreement between ranks (:meth:`Trainer._agree`): at each step boundary, and at each poll while
waiting for a batch, the ranks all-reduce (MAX) two flags: "I have a notice" and "batch not yet
visible to me". A notice seen by any rank thus stops every rank at the same step boundary, and
the notice save is a step they take together; a batch is read only once every rank sees it. The
poll is a short collective every ``poll_s``, so no rank sits in one collective for longer than
that (a long wait for a batch never hits the process group's timeout).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rlrun.api.spec import RLRunSpec
from rlrun.batch import read_batch
from rlrun.checkpoint import (
    SHARDED_TRAINER_FORMAT,
    TRAINER_PROGRESS_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    check_compatible,
    latest_complete_checkpoint,
    part_format,
    run_identity,
)
from rlrun.errors import WeightsMismatch
from rlrun.ledger import Ledger, LedgerEvent
from rlrun.rundir import (
    RunDir,
    fault_point,
    publish_dir,
    read_attempt,
    run_dir_attempt,
    step_dirs,
    write_meta,
)
from rlrun.training.distributed import (
    DataParallel,
    clip_grad_norm_,
    data_parallel_policy_loss,
    full_state_dict,
    rank_slice,
    shard_model,
    single_process,
)
from rlrun.training.loss import clipped_policy_loss, token_logprobs

log = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"

#: Seconds a resuming trainer waits for the live orchestrator to complete a trainer part its
#: predecessor of the same attempt published (a notice save; see :meth:`Trainer._wait_for_pairing`).
#: The orchestrator pairs within its poll interval (50 ms); the margin covers a busy machine.
PAIR_WAIT_S = 30.0


class Noticed(Exception):
    """Raised inside :meth:`Trainer.run` to abandon waiting for a batch once a notice came."""


def end_torn_line(path: Path) -> None:
    """Terminate a last line cut short by a kill, so the next writer's first line is not glued to it
    (a trainer restarted within its attempt appends to its predecessor's ledger and metrics)."""
    try:
        with open(path, "rb+") as fh:
            if fh.seek(0, os.SEEK_END) == 0:
                return
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")
    except FileNotFoundError:
        pass


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
        pair_wait_s: with ``resume``, most seconds to wait for the orchestrator to complete a trainer
            part this attempt's previous trainer published (:meth:`_wait_for_pairing`).
        dp: the data-parallel group (:func:`rlrun.training.distributed.init_from_env`); None: one
            process on the CPU, today's path. Every rank constructs its ``Trainer`` with the same arguments.

    Attributes:
        attempt: the run-directory attempt (:func:`rlrun.rundir.run_dir_attempt`) that stamps
            what it publishes, names its ledger and checks batches.
        step: the last step trained.
        checkpointed_step: the step of the newest trainer part this process published or restored.
        saved_on_notice: the step :meth:`run` checkpointed because of a notice (None: no notice, or
            the step's part was already written).

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
        pair_wait_s: float = PAIR_WAIT_S,
        dp: DataParallel | None = None,
    ) -> None:
        self.spec = spec
        self.shipped_at_restore = 0
        self.step = 0
        self.checkpointed_step = -1
        self.saved_on_notice: int | None = None
        self.noticed = threading.Event()
        self.pair_wait_s = pair_wait_s
        self.dp = dp if dp is not None else single_process()
        self.run_dir = run_dir.ensure()
        if self.dp.distributed:  # rank 0 numbers the attempt (it may write attempt_offsets.json)
            number = run_dir_attempt(self.run_dir, run_uid, attempt) if self.dp.is_main else None
            self.attempt = int(self._from_main(number))
        else:
            self.attempt = run_dir_attempt(self.run_dir, run_uid, attempt)
        self.max_steps = max_steps or spec.max_steps
        self.poll_s = poll_s
        torch.manual_seed(spec.seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        if self.dp.distributed:
            shard_model(self.model, self.dp)
        opt = spec.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
        restored = resume and self._restore()
        # Batches may already be arriving from this run's orchestrator; checkpoints past 0 cannot be ours.
        # With --resume and nothing complete to resume from, they are a dead attempt's: removed below.
        # (Every rank sees the same directory here and raises alike: nothing was written yet.)
        if not restored and not resume and [n for n in step_dirs(run_dir.checkpoints) if n > 0]:
            raise RuntimeError(
                f"{run_dir.root} already holds a run; resume it with --resume or choose another --run-dir"
            )
        if self.dp.distributed and not self.dp.is_main:  # rank 0 alone cleans up and writes the ledger
            self.ledger = None
            self.dp.barrier()
            if not restored:
                self.checkpoint(0)
            return
        # Broadcasts and trainer parts past the restored step were written by a dead attempt, or by this
        # attempt's previous trainer (a trainer-only restart). Its broadcasts stay: the live orchestrator
        # may serve them (the follower's version) and catches up a rejoining rollout server from them;
        # this trainer re-publishes them as it retrains those steps.
        removed = [
            n
            for n, p in step_dirs(run_dir.broadcasts).items()
            if n > self.step and (self.attempt == 0 or read_attempt(p) != self.attempt)
        ]
        for n in removed:
            shutil.rmtree(run_dir.broadcast(n), ignore_errors=True)
        if removed:
            log.info("removed broadcasts %s left by an earlier attempt (past step %d)", sorted(removed), self.step)
        removed = run_dir.remove_steps_after(run_dir.checkpoints, self.step)
        if removed:
            log.info("removed trainer parts %s not completed by an orchestrator (past step %d)", removed, self.step)
        ledger_root = run_dir.root / "ledger"
        for path in (ledger_root / f"attempt-{self.attempt}.trainer.jsonl", run_dir.trainer_metrics):
            end_torn_line(path)
        self.ledger = Ledger(ledger_root, self.attempt, "trainer")
        self.dp.barrier()  # the other ranks wait for the clean-up above
        if not restored:
            self.checkpoint(0)

    def _from_main(self, value: object) -> object:
        """Rank 0's ``value`` on every rank (``broadcast_object_list``; plain data only); ``value`` in one process."""
        if not self.dp.distributed:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def _agree(self, noticed: bool, waiting: bool = False) -> tuple[bool, bool]:
        """``(any rank noticed, any rank still waiting)``: an all-reduce (MAX) of the two flags, a
        collective every rank calls at the same point; the flags themselves in one process."""
        if not self.dp.distributed:
            return noticed, waiting
        flags = torch.tensor([float(noticed), float(waiting)], dtype=torch.float64)
        if self.dp.device.type != "cpu":  # nccl reduces device tensors only
            flags = flags.to(self.dp.device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        any_noticed, any_waiting = (bool(v) for v in flags.tolist())
        return any_noticed, any_waiting

    def _stop_requested(self) -> bool:
        """Whether any rank has a notice (:meth:`_agree`); every rank gets the same answer."""
        return self._agree(self.noticed.is_set())[0]

    def _wait_for_pairing(self) -> None:
        """Trainer-only restart: wait (up to :attr:`pair_wait_s`) until the newest trainer part
        written by this attempt is complete, when it is newer than the newest complete checkpoint.

        Only a part of this very attempt can still be completed: its orchestrator is alive (a
        new attempt's orchestrator completes only its own parts). Resuming from an older step
        instead would throw the part away (it is removed as a dead attempt's) and recompute the
        steps after it.
        """
        if self.attempt == 0:  # unnumbered: whose part it is cannot be told
            return
        ours = [
            n
            for n, p in step_dirs(self.run_dir.checkpoints).items()
            if (p / "trainer" / TRAINER_PROGRESS_FILE).is_file() and read_attempt(p / "trainer") == self.attempt
        ]
        if not ours:
            return
        newest = max(ours)
        deadline = time.monotonic() + self.pair_wait_s
        logged = False
        while True:
            ckpt = latest_complete_checkpoint(self.run_dir)
            if ckpt is not None and ckpt.step >= newest:
                return
            if time.monotonic() >= deadline:
                log.warning(
                    "resume: trainer part %d of this attempt was not completed by the orchestrator within %.0f s; "
                    "resuming from the newest complete checkpoint instead", newest, self.pair_wait_s,
                )  # fmt: skip
                return
            if not logged:
                log.info("resume: waiting for the orchestrator to complete trainer part %d of this attempt", newest)
                logged = True
            time.sleep(0.05)

    def _choose_checkpoint(self):
        """Rank 0 (or the one process): the complete checkpoint to resume from, or None."""
        self._wait_for_pairing()
        return latest_complete_checkpoint(self.run_dir)

    def _restore(self) -> bool:
        if self.dp.distributed:  # rank 0 chooses; every rank loads the same part
            chosen = self._choose_checkpoint() if self.dp.is_main else None
            ckpt = self._from_main(chosen)
        else:
            ckpt = self._choose_checkpoint()
        if ckpt is None:
            log.info("resume: no complete checkpoint in %s; starting from step 0", self.run_dir.root)
            return False
        root = self.run_dir.trainer_checkpoint(ckpt.step)
        check_compatible(ckpt.trainer.get("identity"), self.spec, str(root))
        if part_format(root) == SHARDED_TRAINER_FORMAT:
            from rlrun.training.sharded_checkpoint import load_sharded

            # A part of step 0 holds no optimizer state worth loading (see _checkpoint_sharded): a fresh
            # optimizer, as one process restores from its empty optimizer.pt.
            optimizer = self.optimizer if ckpt.step > 0 else None
            try:
                load_sharded(root, self.model, optimizer, self.dp)
            except (RuntimeError, ValueError, KeyError) as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise WeightsMismatch(f"{root}: sharded state does not fit the model: {exc}") from None
        elif self.dp.distributed:
            self._load_unsharded_into_shards(root)
        else:
            try:
                self.model.load_state_dict(load_file(str(root / WEIGHTS_FILE)))
            except RuntimeError as exc:  # torch names every missing, unexpected and reshaped tensor
                raise WeightsMismatch(f"{root / WEIGHTS_FILE}: weights do not fit the model: {exc}") from None
            self.optimizer.load_state_dict(torch.load(root / OPTIMIZER_FILE, weights_only=True))
        self.step = self.checkpointed_step = ckpt.step
        self.shipped_at_restore = int(ckpt.orchestrator.get("shipped", ckpt.step))
        log.info(
            "resume: restored trainer checkpoint step %d from %s (batches up to %d were shipped before it)",
            ckpt.step, root, self.shipped_at_restore,
        )  # fmt: skip
        return True

    def _load_unsharded_into_shards(self, root: Path) -> None:
        """Load a part written by one process (``model.safetensors``, ``optimizer.pt``) into the
        sharded model and its optimizer: each rank loads the full state into a plain CPU copy of the
        model (to name the optimizer state by parameter), then keeps its shards of it
        (``set_state_dict`` with ``full_state_dict=True``). Peak memory: one extra full model and
        optimizer state per rank, for the duration of the load.

        Raises:
            WeightsMismatch: the weights do not fit the model.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        plain = AutoModelForCausalLM.from_config(self.model.config, dtype=torch.float32)
        try:
            plain.load_state_dict(load_file(str(root / WEIGHTS_FILE)))
        except RuntimeError as exc:
            raise WeightsMismatch(f"{root / WEIGHTS_FILE}: weights do not fit the model: {exc}") from None
        opt = self.spec.optimizer
        plain_opt = torch.optim.AdamW(
            plain.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
        plain_opt.load_state_dict(torch.load(root / OPTIMIZER_FILE, weights_only=True))
        if not plain_opt.state:  # never stepped (step 0): keep the fresh optimizer, as one process does
            set_model_state_dict(self.model, plain.state_dict(), options=StateDictOptions(full_state_dict=True))
            log.info("resume: loaded the unsharded part %s (weights only: no optimizer state yet)", root)
            return
        model_state, optim_state = get_state_dict(plain, plain_opt)
        set_state_dict(
            self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
            options=StateDictOptions(full_state_dict=True),
        )  # fmt: skip
        log.info("resume: loaded the unsharded part %s into %d ranks", root, self.dp.world_size)

    def _batch_ready(self, path: Path, step: int) -> bool:
        return batch_accepted(path, step, self.attempt, self.shipped_at_restore)

    def _wait_for_batch(self, step: int) -> Path:
        path = self.run_dir.rollout_batch(step)
        t0 = time.monotonic()
        next_note = 30.0
        if self.dp.distributed:
            return self._wait_for_batch_together(path, step)
        while not self._batch_ready(path, step):
            if self.noticed.is_set():
                raise Noticed
            time.sleep(self.poll_s)
            waited = time.monotonic() - t0
            if waited > next_note:
                log.info("still waiting for batch %d after %.0f s", step, waited)
                next_note *= 2
        return path

    def _wait_for_batch_together(self, path: Path, step: int) -> Path:
        """Every rank polls the batch; it is taken once every rank sees it, and abandoned as soon
        as any rank has a notice (:meth:`_agree` at each poll)."""
        t0 = time.monotonic()
        next_note = 30.0
        while True:
            noticed, waiting = self._agree(self.noticed.is_set(), not self._batch_ready(path, step))
            if noticed:
                raise Noticed
            if not waiting:
                return path
            time.sleep(self.poll_s)
            waited = time.monotonic() - t0
            if waited > next_note and self.dp.is_main:
                log.info("still waiting for batch %d after %.0f s", step, waited)
                next_note *= 2

    def _train_step_distributed(self, step: int) -> dict:
        """:meth:`train_step` on ``W`` ranks: this rank's rows of the batch, whole-batch metrics."""
        wait_t0 = time.perf_counter()
        whole = read_batch(self._wait_for_batch(step))
        t0 = time.perf_counter()
        batch = rank_slice(whole, self.dp.rank, self.dp.world_size)
        dev = self.dp.device
        input_ids, attention_mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)
        old_logprobs, advantages = batch.old_logprobs.to(dev), batch.advantages.to(dev)
        mask = batch.loss_mask.to(dev)
        self.model.train()
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        logprobs = token_logprobs(logits, input_ids, self.spec.sampling.temperature)
        loss, stats = data_parallel_policy_loss(
            logprobs, old_logprobs, advantages, mask, self.spec.loss.ratio_clip, self.dp
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = clip_grad_norm_(self.model.parameters(), self.spec.optimizer.max_grad_norm)
        self.optimizer.step()
        with torch.no_grad():  # whole-batch mean |Δlogp| over the masked tokens
            diff = torch.tensor(
                [float((logprobs.detach() - old_logprobs)[mask].abs().sum()), float(mask.sum())], dtype=torch.float64
            )
            if dev.type != "cpu":
                diff = diff.to(dev)
            torch.distributed.all_reduce(diff)
            diff_sum, tokens = diff.tolist()
        if self.dp.is_main:
            self.ledger.write(LedgerEvent.TRAINED, step=step, ids=[t["episode_id"] for t in whole.meta["traces"]])
        return {
            "step": step,
            "loss": stats.pop("loss"),
            "grad_norm": grad_norm,
            "samples": whole.num_samples,
            **stats,  # clip_fraction, ratio_mean, ratio_max, tokens: of the whole batch
            "logprob_abs_diff": diff_sum / max(tokens, 1.0),
            "wait_s": round(t0 - wait_t0, 4),
            "train_s": round(time.perf_counter() - t0, 4),
            "time": time.time(),
            "ranks": self.dp.world_size,
        }

    def train_step(self, step: int) -> dict:
        """Train on batch ``step``; returns its metrics (loss, grad norm, ratio stats, seconds)."""
        if self.dp.distributed:
            return self._train_step_distributed(step)
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

        if self.dp.distributed:  # a collective: every rank gathers, rank 0 writes
            state = full_state_dict(self.model, self.dp)
            if not self.dp.is_main:
                return

            def fill(tmp: Path) -> None:
                save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
                write_meta(tmp, step, self.attempt)

        else:

            def fill(tmp: Path) -> None:
                save_weights(self.model, tmp / WEIGHTS_FILE)
                write_meta(tmp, step, self.attempt)

        publish_dir(self.run_dir.broadcast(step), fill)

    def checkpoint(self, step: int, reason: str = "periodic") -> Path:
        """Publish ``checkpoints/step_N/trainer/``: weights, optimizer state, progress.

        ``reason`` (``periodic`` or ``notice``) is recorded in ``progress.json``. With ``W > 1``
        ranks a collective (:meth:`_checkpoint_sharded`).
        """
        if self.dp.distributed:
            return self._checkpoint_sharded(step, reason)

        def fill(tmp: Path) -> None:
            save_weights(self.model, tmp / WEIGHTS_FILE)
            torch.save(self.optimizer.state_dict(), tmp / OPTIMIZER_FILE)
            progress = {
                "step": step, "policy_version": step, "identity": run_identity(self.spec), "time": time.time(),
                "reason": reason,
            }  # fmt: skip
            (tmp / TRAINER_PROGRESS_FILE).write_text(json.dumps(progress))
            write_meta(tmp, step, self.attempt)
            fault_point(f"trainer_{reason}_save")  # test-only: a kill mid-save (grace period too short)

        self.run_dir.checkpoint(step).mkdir(parents=True, exist_ok=True)
        path = publish_dir(self.run_dir.trainer_checkpoint(step), fill)
        self.checkpointed_step = step
        return path

    def _checkpoint_sharded(self, step: int, reason: str) -> Path:
        """Every rank writes its DCP shard of the model and optimizer
        (:func:`~rlrun.training.sharded_checkpoint.save_sharded`, ``meta.json`` ``format: "dcp"``);
        rank 0 adds the full ``model.safetensors`` (what the orchestrator loads into vLLM) and
        ``progress.json``, and renames the part into place once every shard is written."""
        from rlrun.training.sharded_checkpoint import save_sharded

        state = full_state_dict(self.model, self.dp)

        def extra(tmp: Path) -> None:
            save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            progress = {
                "step": step, "policy_version": step, "identity": run_identity(self.spec), "time": time.time(),
                "reason": reason, "world_size": self.dp.world_size,
            }  # fmt: skip
            (tmp / TRAINER_PROGRESS_FILE).write_text(json.dumps(progress))
            fault_point(f"trainer_{reason}_save")  # test-only: a kill mid-save (grace period too short)

        if self.dp.is_main:
            self.run_dir.checkpoint(step).mkdir(parents=True, exist_ok=True)
        fresh = not self.optimizer.state
        path = save_sharded(
            self.run_dir.trainer_checkpoint(step), self.model, self.optimizer, self.dp, step, self.attempt, extra=extra
        )
        if fresh:
            # get_state_dict initialises an empty optimizer's state with a zero-lr step (step count 1,
            # zero moments). Left in place, Adam's bias correction of the first real step would see
            # step 2 and take a ~0.74·lr step where one process takes lr: drop it (a fresh optimizer).
            self.optimizer.state.clear()
        self.checkpointed_step = step
        return path

    def notice(self) -> None:
        """Ask :meth:`run` to stop after the step it is computing and checkpoint the step it has
        (``rlrun trainer`` calls it on SIGTERM; safe from a signal handler or another thread)."""
        self.noticed.set()

    def save_on_notice(self) -> int | None:
        """Checkpoint the step the trainer has, unless that part is already written (idempotent).

        Returns the step saved, or None when nothing had to be written.
        """
        if self.checkpointed_step == self.step:
            log.info("notice: trainer part of step %d is already written", self.step)
            return None
        t0 = time.perf_counter()
        self.checkpoint(self.step, "notice")
        log.info("notice: saved trainer checkpoint step %d in %.2f s", self.step, time.perf_counter() - t0)
        self.saved_on_notice = self.step
        return self.step

    def run(self) -> int:
        """Train until ``max_steps``, or until a :meth:`notice`: then checkpoint the step it has
        (:meth:`save_on_notice`) and stop. Returns the last step trained."""
        log.info("trainer starting at step %d, training to step %d", self.step, self.max_steps)
        interval = self.spec.checkpoint.interval
        while self.step < self.max_steps:
            if self._stop_requested():
                break
            step = self.step + 1
            try:
                metrics = self.train_step(step)
            except Noticed:  # the notice came while waiting for the batch: nothing half-done to finish
                break
            self.publish(step)
            self.step = step
            if step % interval == 0 or step == self.max_steps:
                self.checkpoint(step)
                metrics["checkpoint"] = True
            if not self.dp.is_main:
                continue
            with open(self.run_dir.trainer_metrics, "a") as fh:
                fh.write(json.dumps(metrics) + "\n")
            log.info(
                "step %d loss %.4f grad_norm %.3f clip %.3f |Δlogp| %.4f train %.2fs wait %.2fs",
                step, metrics["loss"], metrics["grad_norm"], metrics["clip_fraction"],
                metrics["logprob_abs_diff"], metrics["train_s"], metrics["wait_s"],
            )  # fmt: skip
        if self._stop_requested():
            self.noticed.set()  # a notice seen by another rank: this rank saves with them
            self.save_on_notice()
            log.info("trainer stopped on notice at step %d", self.step)
            return self.step
        log.info("trainer done at step %d", self.step)
        return self.step
