"""The trainer process: one optimizer step per shipped batch, then publish the new weights.

The policy it trains is assembled in :mod:`rlrun.training.policy` (:meth:`~rlrun.training.policy.Policy.from_spec`:
loading, precision, activation checkpointing, the LoRA wrap, sharding, the KL reference), which also decides, once per
run, whether it publishes and checkpoints full weights or a LoRA adapter; the trainer keeps the attempt, the loop,
publishing, checkpoints and notices.

Step ``s`` reads ``rollouts/step_s/`` (waiting until the orchestrator publishes it), takes one AdamW step (at the
rate of the LR schedule, :mod:`rlrun.training.schedule`, whose state every trainer part keeps) on the loss of
``spec.loss`` (:mod:`rlrun.training.objectives`) over the whole batch, in micro-batches (:mod:`rlrun.training.step`)
in the compute dtype of ``spec.trainer.precision`` (:mod:`rlrun.training.precision`), publishes
``broadcasts/step_s/model.safetensors`` (policy version ``s``, in that dtype; with ``spec.model.lora`` the adapter
alone, ``adapter_config.json`` + ``adapter_model.safetensors``: :meth:`~rlrun.training.policy.Policy.write_weights`)
and, every ``checkpoint.interval`` steps and at the last step, ``checkpoints/step_s/trainer/`` (a fresh run also
checkpoints step 0, so a pause always has a trainer part to pair with). Both are published by an atomic directory
rename, so readers never see a torn file, and both record the attempt number in ``meta.json``
(:func:`rlrun.rundir.write_meta`).

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
resume from (:func:`rlrun.training.parts.wait_for_pairing`), so a notice save is never thrown away.

Data parallel (``dp.world_size`` W > 1, ranks started by ``torchrun``): the model is FSDP2-sharded while the policy
is assembled (:meth:`~rlrun.training.policy.Policy.from_spec`, with :func:`~rlrun.training.distributed.shard_model`),
before the trainer builds the optimizer. Every rank reads the shipped batch file itself and trains its rows
(:func:`~rlrun.training.distributed.rank_slice`, :func:`~rlrun.training.step.accumulate_gradients` in
micro-batches, global :func:`~rlrun.training.distributed.clip_grad_norm_`): the same update as one process. Rank 0
alone decides what to resume from and publishes: broadcasts, ledger, metrics (and, in ``rlrun trainer``, the exit
report); a broadcast's weights come from :meth:`~rlrun.training.policy.Policy.published_state`, which every rank
calls. Trainer parts, in either format and loadable into any number of ranks: :mod:`rlrun.training.parts`.

Agreement between ranks (:meth:`Trainer._agree`): at each step boundary, and at each poll while
waiting for a batch (:mod:`rlrun.training.batches`), the ranks all-reduce (MAX) two flags: "I have
a notice" and "batch not yet visible to me". A notice seen by any rank thus stops every rank at the
same step boundary, and the notice save is a step they take together. In one process the flags are
their own answer: the same code, no collective.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import torch

from rlrun.api.spec import RLRunSpec
from rlrun.batch import read_batch
from rlrun.identity import check_compatible
from rlrun.ledger import Ledger, LedgerEvent, ledger_file
from rlrun.probes import write_probe
from rlrun.rundir import (
    RunDir,
    broadcast_kept,
    end_torn_line,
    fault_point,
    holds_a_run,
    publish_broadcast,
    run_dir_attempt,
    write_meta,
)
from rlrun.training.batches import Noticed, batch_accepted, wait_for_batch
from rlrun.training.distributed import DataParallel, clip_grad_norm_, rank_slice, single_process
from rlrun.training.parts import (
    PAIR_WAIT_S,
    SCHEDULER_KEY,
    choose_checkpoint,
    clear_after,
    republish,
    restore_part,
    write_part,
)
from rlrun.training.policy import Policy
from rlrun.training.probe import probe_logprobs, probe_rows
from rlrun.training.prometheus import TrainerMetrics, serve_from_env
from rlrun.training.schedule import new_optimizer, new_scheduler, restore_scheduler
from rlrun.training.step import StepSettings, accumulate_gradients, on_policy_rows
from rlrun.training.weight_sender import WeightSender, held_copy

log = logging.getLogger(__name__)


class Trainer:
    """Trains ``spec``'s policy from the batches in ``run_dir``.

    Args:
        spec: the run's spec.
        run_dir: shared run directory.
        model_path: initial weights (path or Hugging Face id), see ``rlrun.model.resolve``.
        max_steps: stop after this step (default ``spec.max_steps``; the LR schedule's horizon stays
            ``spec.max_steps``: :mod:`rlrun.training.schedule`).
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
        self.sender: WeightSender | None = None  # rank 0's, with spec.weights.transport collective (weight_sender.py)
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
        self.policy = Policy.from_spec(spec, model_path, self.dp)  # loaded, wrapped, sharded: build the optimizer after
        self.step_settings = StepSettings.from_spec(spec, self.policy.compute_dtype)
        self.probe_rows: list[tuple[list[int], list[bool]]] = []  # the last batch's (rlrun.training.probe)
        self.optimizer = new_optimizer(self.policy.model, spec)
        self.lr_scheduler = new_scheduler(self.optimizer, spec)  # its horizon is spec.max_steps, not max_steps
        restored = resume and self._restore()
        # Batches may already be arriving from this run's orchestrator: only checkpoints count (holds_a_run).
        # With --resume and nothing complete to resume from, they are a dead attempt's: removed below.
        # (Every rank sees the same directory here and raises alike: nothing was written yet.)
        if not restored and not resume and holds_a_run(run_dir, count_batches=False):
            raise RuntimeError(
                f"{run_dir.root} already holds a run; resume it with --resume or choose another --run-dir"
            )
        if self.dp.distributed and not self.dp.is_main:  # rank 0 alone cleans up and writes the ledger
            self.ledger = None
            self.dp.barrier()
            if not restored:
                self.checkpoint(0)
            return
        clear_after(run_dir, self.step, self.attempt)
        if restored:  # the followers load broadcasts only: the resumed step's weights must be one
            republish(run_dir, self.step, self.attempt)
        for path in (ledger_file(run_dir.ledger, self.attempt, "trainer"), run_dir.trainer_metrics):
            end_torn_line(path)
        self.ledger = Ledger(run_dir.ledger, self.attempt, "trainer")
        self.ledger.write(LedgerEvent.STARTED, role="trainer", step=self.step)  # running until its `stopped` line
        self.dp.barrier()  # the other ranks wait for the clean-up above
        if not restored:
            self.checkpoint(0)
        if spec.weights.transport == "collective" and self.policy.adapter is None:
            self.sender = WeightSender(run_dir, spec.weights.timeout_seconds).start()

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

    def _restore(self) -> bool:
        """Load the checkpoint rank 0 chooses (:func:`~rlrun.training.parts.choose_checkpoint`) on every rank;
        False when there is none."""
        # rank 0 chooses (it may wait for the orchestrator); every rank loads the same part
        chosen = choose_checkpoint(self.run_dir, self.attempt, self.pair_wait_s) if self.dp.is_main else None
        ckpt = self._from_main(chosen)
        if ckpt is None:
            log.info("resume: no complete checkpoint in %s; starting from step 0", self.run_dir.root)
            return False
        root = self.run_dir.trainer_checkpoint(ckpt.step)
        base_model = self.policy.identity.get("base_model")
        check_compatible(ckpt.trainer.get("identity"), self.spec, str(root), base_model=base_model)
        restore_part(root, ckpt.step, self.policy, self.optimizer, self.spec, self.dp)
        restore_scheduler(self.lr_scheduler, self.optimizer, ckpt.trainer.get(SCHEDULER_KEY), ckpt.step, str(root))
        self.step = self.checkpointed_step = ckpt.step
        self.shipped_at_restore = int(ckpt.orchestrator.get("shipped", ckpt.step))
        log.info(
            "resume: restored trainer checkpoint step %d from %s (batches up to %d were shipped before it)",
            ckpt.step,
            root,
            self.shipped_at_restore,
        )
        return True

    def _wait_for_batch(self, step: int) -> Path:
        """Batch ``step`` once every rank sees it (:func:`~rlrun.training.batches.wait_for_batch`).

        Raises:
            Noticed: a rank got its notice first.
        """
        path = self.run_dir.rollout_batch(step)
        ready = lambda: batch_accepted(path, step, self.attempt, self.shipped_at_restore)  # noqa: E731
        return wait_for_batch(path, step, ready, self._agree, self.noticed, self.poll_s, self.dp.is_main)

    def train_step(self, step: int) -> dict:
        """Train on batch ``step``: this rank's rows of it (all of them in one process) in micro-batches
        (:func:`~rlrun.training.step.accumulate_gradients`), the loss and its statistics of the whole batch, one
        AdamW step after a global gradient clip, at the rate of the LR schedule (``lr``: the rate this step used,
        :mod:`rlrun.training.schedule`); returns its metrics (loss, grad norm, ``lr``, ratio stats, |Δlogp| and
        ``entropy`` of the whole batch, ``padding_share`` and ``micro_batches``, seconds; ``ranks`` with several).
        ``entropy``: mean over the trained tokens of the policy's next-token entropy under the sampling distribution
        (temperature, top-p: :mod:`rlrun.training.logprobs`, nats/token, before the step): its fall to 0
        is the policy collapsing. ``mismatch_kl``: mean over the trained tokens of
        :func:`~rlrun.training.step.mismatch_kl` (the trainer's logprobs against vLLM's, nats/token), and
        ``mismatch_kl_on_policy`` over the samples of the weights the trainer holds (policy version ``step − 1``;
        None when none): ≈ 0 unless the server's weights or tokens differ from the trainer's.

        Raises:
            Noticed: the notice came while waiting for the batch.
        """
        wait_t0 = time.perf_counter()
        whole = read_batch(self._wait_for_batch(step))
        t0 = time.perf_counter()
        dp, model = self.dp, self.policy.model
        batch = rank_slice(whole, dp.rank, dp.world_size) if dp.distributed else whole
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        rows = on_policy_rows(batch, step)
        stats = accumulate_gradients(model, batch, rows, self.step_settings, dp, reference=self.policy.reference)
        grad_norm = clip_grad_norm_(model.parameters(), self.spec.optimizer.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]  # lr · λ(step − 1): rlrun.training.schedule
        self.optimizer.step()
        self.lr_scheduler.step()
        if dp.is_main:
            self.ledger.write(LedgerEvent.TRAINED, step=step, ids=[t["episode_id"] for t in whole.meta["traces"]])
        self.probe_rows = probe_rows(whole)  # what publish() scores under the new weights (rlrun.probes)
        return {
            "step": step,
            "loss": stats.pop("loss"),
            "grad_norm": grad_norm,
            "lr": lr,
            "samples": whole.num_samples,
            **stats,  # of the whole batch: clip_fraction, ratio_mean/max, tokens, |Δlogp|, entropy, mismatch KL, …
            "wait_s": round(t0 - wait_t0, 4),
            "train_s": round(time.perf_counter() - t0, 4),
            "time": time.time(),
            **({"ranks": dp.world_size} if dp.distributed else {}),
        }

    def publish(self, step: int) -> int:
        """Publish ``broadcasts/step_N/`` (weights after step N, and the attempt that made them), in the dtype
        the trainer computes in, which is the dtype the rollout servers serve
        (:mod:`rlrun.training.precision`); with LoRA the adapter alone
        (:meth:`~rlrun.training.policy.Policy.write_weights`); beside them the step's mismatch probe
        (:mod:`rlrun.training.probe`). One this attempt published already is kept (a retrained step:
        :func:`rlrun.rundir.publish_broadcast`). With ``W > 1`` ranks a collective: every rank gathers, rank 0
        writes. Returns the bytes written (the directory's files; 0 on the other ranks). With a weight sender,
        rank 0 holds what it writes as version N in memory and announces it before the files are written, so
        the servers need not wait for them (:mod:`.weight_sender`), unless the broadcast is kept (a retrained
        step: the files, not these weights, are version N)."""
        probe = probe_logprobs(self.policy.model, self.probe_rows, self.dp, self.step_settings)
        state = self.policy.published_state(self.dp)
        if state is None:  # not rank 0
            return 0
        broadcast = self.run_dir.broadcast(step)
        announced = {}  # the sender named in meta.json: what the orchestrator sent is this broadcast
        if self.sender is not None and not broadcast_kept(broadcast, self.attempt):
            state = held_copy(state, self.policy.compute_dtype)
            self.sender.hold(step, state, self.attempt, probe)
            announced["sender"] = self.sender.id
            fault_point("trainer_announced")  # test-only: a kill between the announcement and the write

        def fill(tmp: Path) -> None:
            self.policy.write_weights(tmp, state)
            write_probe(tmp, probe, step)
            write_meta(tmp, step, self.attempt, **announced)

        published, _ = publish_broadcast(broadcast, fill, self.attempt)
        return sum(f.stat().st_size for f in published.iterdir())

    def checkpoint(self, step: int, reason: str = "periodic") -> Path:
        """Publish ``checkpoints/step_N/trainer/``: weights, optimizer state, progress
        (:func:`~rlrun.training.parts.write_part`; ``reason``, ``periodic`` or ``notice``, in ``progress.json``).
        With ``W > 1`` ranks a collective."""
        path = write_part(
            self.run_dir, step, reason, self.policy, self.optimizer, self.attempt, self.dp, self.lr_scheduler
        )
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

    def record_stop(self, outcome: str, **fields: object) -> None:
        """The ledger's last line, ``stopped`` (``outcome``, the step it has, ``fields``): what a paused orchestrator
        told to stop waits for before it pairs the part saved on notice (rank 0 writes it)."""
        if self.ledger is not None:
            self.ledger.write(LedgerEvent.STOPPED, outcome=outcome, step=self.step, **fields)

    def run(self) -> int:
        """Train until ``max_steps``, or until a :meth:`notice`: then checkpoint the step it has
        (:meth:`save_on_notice`) and stop. Returns the last step trained. Its ledger's last line says how it stopped
        (:meth:`record_stop`), an error included. The weight sender stops with it."""
        done = False
        try:
            step = self._train()
            done = step >= self.max_steps
            return step
        except Exception as exc:
            self.record_stop("error", error=f"{type(exc).__name__}: {exc}"[:500])
            raise
        finally:
            if self.sender is not None:  # the last version's push is on its way: serve it first (bounded)
                self.sender.stop(drain_s=min(30.0, self.spec.weights.timeout_seconds) if done else 0.0)

    def _train(self) -> int:
        log.info("trainer starting at step %d, training to step %d", self.step, self.max_steps)
        interval = self.spec.checkpoint.interval
        gauges = TrainerMetrics() if self.dp.is_main else None  # /metrics on $RLRUN_METRICS_PORT (rank 0)
        server = serve_from_env(gauges) if gauges is not None else None
        while self.step < self.max_steps:
            if self._stop_requested():
                break
            step = self.step + 1
            try:
                metrics = self.train_step(step)
            except Noticed:  # the notice came while waiting for the batch: nothing half-done to finish
                break
            t0 = time.perf_counter()
            written = self.publish(step)
            self.step = step
            checkpoint = step % interval == 0 or step == self.max_steps
            broadcast_s = round(time.perf_counter() - t0, 4)
            metrics.update(
                attempt=self.attempt, broadcast_s=broadcast_s, broadcast_bytes=written, checkpoint=checkpoint
            )
            if self.sender is not None:  # this attempt's sends so far (the servers' side: metrics.jsonl)
                metrics["weight_sends"] = self.sender.totals_now()
            # The line goes before the checkpoint: once a checkpoint holds the step, its line is on disk, and the last
            # line of each step a complete checkpoint holds is final (what rlrun.tracking logs).
            if self.dp.is_main:
                with open(self.run_dir.trainer_metrics, "a") as fh:
                    fh.write(json.dumps(metrics) + "\n")
            if checkpoint:
                t0 = time.perf_counter()
                self.checkpoint(step)
                metrics["checkpoint_s"] = round(time.perf_counter() - t0, 4)
            if not self.dp.is_main:
                continue
            gauges.observe(metrics)  # type: ignore[union-attr]
            kl_ref = f" kl_ref {metrics['kl_ref']:.4f}" if "kl_ref" in metrics else ""
            log.info(
                "step %d loss %.4f grad_norm %.3f lr %.3g clip %.3f |Δlogp| %.4f entropy %.3f%s train %.2fs wait %.2fs",
                step,
                *(metrics[k] for k in ("loss", "grad_norm", "lr", "clip_fraction", "logprob_abs_diff", "entropy")),
                kl_ref,
                metrics["train_s"],
                metrics["wait_s"],
            )
        if server is not None:
            server.shutdown()
        if self._stop_requested():
            self.noticed.set()  # a notice seen by another rank: this rank saves with them
            self.record_stop("interrupted", saved=self.save_on_notice())
            log.info("trainer stopped on notice at step %d", self.step)
            return self.step
        self.record_stop("complete")
        log.info("trainer done at step %d", self.step)
        return self.step
