"""The trainer's checkpoint parts: which one a start resumes from, clearing what dead attempts left,
restoring one (three formats), writing one.

A trainer part (``checkpoints/step_N/trainer/``) is published by an atomic directory rename
(:func:`rlrun.rundir.publish_dir`), so a kill at any instant leaves the previous one whole. Written
by one process it holds ``model.safetensors``, ``optimizer.pt``, ``progress.json`` and ``meta.json``;
by several ranks, their DCP shards (:mod:`rlrun.training.sharded_checkpoint`) plus rank 0's full
``model.safetensors`` and ``progress.json``. Either loads into any number of ranks
(:func:`restore_part`), so a run can change its rank count. ``progress.json`` holds the LR scheduler's
state in both formats (:mod:`rlrun.training.schedule`).

A LoRA run's part (a :class:`~rlrun.training.policy.Policy` with an adapter, ``spec.model.lora``: what
:func:`write_part` and :func:`restore_part` dispatch on) holds the adapter alone: ``adapter_config.json``
and ``adapter_model.safetensors`` (float32, peft's layout), ``optimizer.pt`` (the adapter's AdamW state, keyed by
parameter name: ``get_optimizer_state_dict`` with full tensors), ``progress.json`` and ``meta.json`` — no base weights,
which are never written. Several ranks gather the adapter and its optimizer state (a few MB) and rank 0 writes the part
unsharded; it loads into 1 or W ranks alike (each rank reads the files and keeps its shards).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.optim.lr_scheduler import LRScheduler
from transformers import AutoModelForCausalLM

from rlrun.adapter_format import ADAPTER_FILES, holds_adapter
from rlrun.api.spec import RLRunSpec
from rlrun.checkpoint import (
    TRAINER_PROGRESS_FILE,
    WEIGHTS_FILE,
    CompleteCheckpoint,
    latest_complete_checkpoint,
    part_format,
)
from rlrun.dcp_format import SHARDED_FORMAT
from rlrun.errors import CheckpointError, CheckpointMismatch, WeightsMismatch
from rlrun.rundir import RunDir, fault_point, publish_dir, read_attempt, step_dirs, write_meta, written_by
from rlrun.training.distributed import DataParallel, full_state_dict, tied_weights, untied
from rlrun.training.lora import Adapter, adapter_state, load_adapter, save_adapter
from rlrun.training.policy import Policy
from rlrun.training.schedule import adamw

log = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
#: The key of ``progress.json`` holding the LR scheduler's ``state_dict()`` (:mod:`rlrun.training.schedule`).
SCHEDULER_KEY = "lr_scheduler"

#: Seconds a resuming trainer waits for the live orchestrator to complete a trainer part its
#: predecessor of the same attempt published (a notice save; see :func:`wait_for_pairing`).
#: The orchestrator pairs within its poll interval (50 ms); the margin covers a busy machine.
PAIR_WAIT_S = 30.0


def save_weights(model: torch.nn.Module, path: Path) -> None:
    """Write the model's state dict (Hugging Face names, a tied weight once: :func:`~rlrun.training.distributed.untied`)
    as one safetensors file."""
    state = untied({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, model)
    save_file(state, str(path), metadata={"format": "pt"})


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load ``model.safetensors`` at ``path`` into ``model``: every tensor name must be the model's, and every
    parameter must be there but a tied one whose source is (:func:`~rlrun.training.distributed.tied_weights`: it
    is that tensor).

    Raises:
        WeightsMismatch: missing, unexpected or reshaped tensors (torch names each).
    """
    state = load_file(str(path))
    tied = tied_weights(model)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a shape mismatch: torch names every reshaped tensor
        raise WeightsMismatch(f"{path}: weights do not fit the model: {exc}") from None
    missing = [k for k in missing if not (k in tied and tied[k] in state)]
    if missing or unexpected:
        raise WeightsMismatch(f"{path}: weights do not fit the model: missing {missing}, unexpected {unexpected}")


def clear_after(run_dir: RunDir, step: int, attempt: int) -> None:
    """Remove the broadcasts and trainer parts past ``step`` that a start must not keep.

    They were written by a dead attempt, or by this attempt's previous trainer (a trainer-only
    restart). This attempt's broadcasts stay: the live orchestrator may serve them (the follower's
    version) and catches up a rejoining rollout server from them; the trainer re-publishes them as it
    retrains those steps. Trainer parts past ``step`` were never completed by an orchestrator: they go.
    """
    removed = [
        n for n, p in step_dirs(run_dir.broadcasts).items() if n > step and (attempt == 0 or read_attempt(p) != attempt)
    ]
    for n in removed:
        shutil.rmtree(run_dir.broadcast(n), ignore_errors=True)
    if removed:
        log.info("removed broadcasts %s left by an earlier attempt (past step %d)", sorted(removed), step)
    removed = run_dir.remove_steps_after(run_dir.checkpoints, step)
    if removed:
        log.info("removed trainer parts %s not completed by an orchestrator (past step %d)", removed, step)


def republish(run_dir: RunDir, step: int, attempt: int) -> bool:
    """Publish ``broadcasts/step_N/`` from the trainer part of step ``N`` a start resumed from, unless this attempt's
    is there (idempotent); returns whether it wrote one.

    The weight follower loads broadcasts only, and a trainer that resumes at ``N`` publishes ``N + 1`` only once it
    has a batch for it — which a live orchestrator holding an older policy may never ship (issue 35: weight pushes
    held by an evaluation round, the orchestrator at policy 3, the trainer restarted from checkpoint 4 after
    broadcasts 4 and 5 were removed: the flow budget 0, the trainer waiting for batch 5, the weights on disk only in
    the checkpoint). Every part holds the full ``model.safetensors`` (a sharded one: rank 0's), or a LoRA run's
    adapter files (``adapter_config.json``, ``adapter_model.safetensors``), so rank 0 alone publishes them, no
    collective: hard links where the filesystem allows, else copies. The part's weights are float32 (the master
    weights) where a bf16 trainer's broadcasts are bf16: the follower accepts any floating-point dtype and vLLM casts
    on load (:func:`rlrun.orchestrator.weights.validate_weights_dir`; an adapter to the served model's dtype).
    """
    final = run_dir.broadcast(step)
    if final.is_dir() and written_by(final, attempt):
        return False
    part = run_dir.trainer_checkpoint(step)
    names = ADAPTER_FILES if holds_adapter(part) else (WEIGHTS_FILE,)

    def fill(tmp: Path) -> None:
        for name in names:
            try:
                os.link(part / name, tmp / name)
            except OSError:  # another filesystem, or links not allowed
                shutil.copyfile(part / name, tmp / name)
        write_meta(tmp, step, attempt)

    publish_dir(final, fill)
    log.info("resume: published broadcast %d from its checkpoint (the weights the followers load)", step)
    return True


def wait_for_pairing(run_dir: RunDir, attempt: int, pair_wait_s: float = PAIR_WAIT_S) -> None:
    """Trainer-only restart: wait (up to ``pair_wait_s`` seconds) until the newest trainer part written by
    ``attempt`` is complete, when it is newer than the newest complete checkpoint.

    Only a part of this very attempt can still be completed: its orchestrator is alive (a new
    attempt's orchestrator completes only its own parts). Resuming from an older step instead would
    throw the part away (it is removed as a dead attempt's) and recompute the steps after it.
    """
    if attempt == 0:  # unnumbered: whose part it is cannot be told
        return
    ours = [
        n
        for n, p in step_dirs(run_dir.checkpoints).items()
        if (p / "trainer" / TRAINER_PROGRESS_FILE).is_file() and read_attempt(p / "trainer") == attempt
    ]
    if not ours:
        return
    newest = max(ours)
    deadline = time.monotonic() + pair_wait_s
    logged = False
    while True:
        ckpt = latest_complete_checkpoint(run_dir)
        if ckpt is not None and ckpt.step >= newest:
            return
        if time.monotonic() >= deadline:
            log.warning(
                "resume: trainer part %d of this attempt was not completed by the orchestrator within %.0f s; "
                "resuming from the newest complete checkpoint instead",
                newest,
                pair_wait_s,
            )
            return
        if not logged:
            log.info("resume: waiting for the orchestrator to complete trainer part %d of this attempt", newest)
            logged = True
        time.sleep(0.05)


def choose_checkpoint(run_dir: RunDir, attempt: int, pair_wait_s: float = PAIR_WAIT_S) -> CompleteCheckpoint | None:
    """The complete checkpoint a resuming trainer starts from (after :func:`wait_for_pairing`), or None."""
    wait_for_pairing(run_dir, attempt, pair_wait_s)
    return latest_complete_checkpoint(run_dir)


def restore_part(
    root: Path,
    step: int,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    spec: RLRunSpec,
    dp: DataParallel,
) -> None:
    """Load trainer part ``root`` (of ``step``) into ``policy`` (its adapter with LoRA, else its model's full weights)
    and ``optimizer``, whatever wrote it.

    A sharded part (``meta.json`` ``format: "dcp"``) with :func:`~rlrun.training.sharded_checkpoint.load_sharded`
    on any number of ranks; an unsharded one into one process directly, or into the shards of several
    ranks (:func:`_load_unsharded_into_shards`); a LoRA part into the policy's adapter (:func:`_load_adapter_part`).
    A part of step 0 holds no optimizer state worth loading: the optimizer stays fresh.

    Raises:
        CheckpointMismatch: a LoRA part and a policy without an adapter, or the reverse (the run identity, checked
            first, says so too; this holds for a part written before it recorded LoRA).
        WeightsMismatch: the weights do not fit the model.
        CheckpointError: a torn or foreign sharded part.
    """
    model, adapter = policy.model, policy.adapter
    if holds_adapter(root) != (adapter is not None):
        what = "a LoRA adapter alone" if adapter is None else "the model's full weights, no LoRA adapter"
        want = "a run without spec.model.lora" if adapter is None else "a run with spec.model.lora"
        raise CheckpointMismatch(f"{root} holds {what}, and this trainer is {want}: refusing to resume from it")
    if adapter is not None:
        _load_adapter_part(root, step, adapter, optimizer)
    elif part_format(root) == SHARDED_FORMAT:
        from rlrun.training.sharded_checkpoint import load_sharded

        try:
            load_sharded(root, model, optimizer if step > 0 else None, dp)
        except (RuntimeError, ValueError, KeyError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise WeightsMismatch(f"{root}: sharded state does not fit the model: {exc}") from None
    elif dp.distributed:
        _load_unsharded_into_shards(root, model, optimizer, spec, dp)
    else:
        load_weights(model, root / WEIGHTS_FILE)
        optimizer.load_state_dict(torch.load(root / OPTIMIZER_FILE, weights_only=True))


def _load_adapter_part(root: Path, step: int, adapter: Adapter, optimizer: torch.optim.Optimizer) -> None:
    """A LoRA part into the adapter and its optimizer, on 1 or W ranks alike: each rank reads the files (a few MB)
    and keeps its shards (``set_model_state_dict``, ``set_optimizer_state_dict`` with full tensors)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    load_adapter(adapter, root)
    state = torch.load(root / OPTIMIZER_FILE, weights_only=True)
    if step > 0 and state:  # a step-0 part holds none (a fresh optimizer); keep the fresh one, as one process does
        set_optimizer_state_dict(adapter.model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _load_unsharded_into_shards(
    root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: RLRunSpec, dp: DataParallel
) -> None:
    """Load a part written by one process (``model.safetensors``, ``optimizer.pt``) into the sharded
    model and its optimizer: each rank loads the full state into a plain CPU copy of the model (to
    name the optimizer state by parameter), then keeps its shards of it (``set_state_dict`` with
    ``full_state_dict=True``). Peak memory: one extra full model and optimizer state per rank, for
    the duration of the load.

    Raises:
        WeightsMismatch: the weights do not fit the model.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    load_weights(plain, root / WEIGHTS_FILE)
    plain_opt = adamw(plain.parameters(), spec)
    plain_opt.load_state_dict(torch.load(root / OPTIMIZER_FILE, weights_only=True))
    if not plain_opt.state:  # never stepped (step 0): keep the fresh optimizer, as one process does
        set_model_state_dict(model, plain.state_dict(), options=StateDictOptions(full_state_dict=True))
        log.info("resume: loaded the unsharded part %s (weights only: no optimizer state yet)", root)
        return
    model_state, optim_state = get_state_dict(plain, plain_opt)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=StateDictOptions(full_state_dict=True),
    )
    log.info("resume: loaded the unsharded part %s into %d ranks", root, dp.world_size)


def write_part(
    run_dir: RunDir,
    step: int,
    reason: str,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    attempt: int,
    dp: DataParallel,
    lr_scheduler: LRScheduler | None = None,
) -> Path:
    """Publish ``checkpoints/step_N/trainer/`` (``reason``: ``periodic`` or ``notice``, recorded in
    ``progress.json``); returns its path. With several ranks a collective: every rank writes its DCP
    shard of the model and optimizer (:func:`~rlrun.training.sharded_checkpoint.save_sharded`, ``meta.json``
    ``format: "dcp"``), rank 0 adds the full ``model.safetensors`` (what the orchestrator loads into
    vLLM) and ``progress.json``, and renames the part into place once every shard is written. A policy with an
    adapter (LoRA) writes the adapter's part instead (:func:`_write_adapter_part`). The LR scheduler's state (plain
    JSON) is in ``progress.json`` under ``lr_scheduler``, in every format; the policy's run identity under
    ``identity``."""
    progress = {
        "step": step,
        "policy_version": step,
        "identity": policy.identity,
        "time": time.time(),
        "reason": reason,
    }
    if dp.distributed:
        progress["world_size"] = dp.world_size
    if lr_scheduler is not None:
        progress[SCHEDULER_KEY] = lr_scheduler.state_dict()

    def write_progress(tmp: Path) -> None:
        (tmp / TRAINER_PROGRESS_FILE).write_text(json.dumps(progress))

    if policy.adapter is not None:
        return _write_adapter_part(run_dir, step, reason, policy.adapter, optimizer, attempt, dp, write_progress)
    model = policy.model
    if dp.distributed:
        from rlrun.training.sharded_checkpoint import save_sharded

        state = full_state_dict(model, dp)

        def extra(tmp: Path) -> None:
            save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            write_progress(tmp)
            fault_point(f"trainer_{reason}_save")  # test-only: a kill mid-save (grace period too short)

        if dp.is_main:
            run_dir.checkpoint(step).mkdir(parents=True, exist_ok=True)
        fresh = not optimizer.state
        path = save_sharded(run_dir.trainer_checkpoint(step), model, optimizer, dp, step, attempt, extra=extra)
        if fresh:
            # get_state_dict initialises an empty optimizer's state with a zero-lr step (step count 1,
            # zero moments). Left in place, Adam's bias correction of the first real step would see
            # step 2 and take a ~0.74·lr step where one process takes lr: drop it (a fresh optimizer).
            optimizer.state.clear()
        return path

    def fill(tmp: Path) -> None:
        save_weights(model, tmp / WEIGHTS_FILE)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        write_progress(tmp)
        write_meta(tmp, step, attempt)
        fault_point(f"trainer_{reason}_save")  # test-only: a kill mid-save (grace period too short)

    run_dir.checkpoint(step).mkdir(parents=True, exist_ok=True)
    return publish_dir(run_dir.trainer_checkpoint(step), fill)


def _write_adapter_part(
    run_dir: RunDir,
    step: int,
    reason: str,
    adapter: Adapter,
    optimizer: torch.optim.Optimizer,
    attempt: int,
    dp: DataParallel,
    write_progress,
) -> Path:
    """A LoRA run's part (module docstring): every rank gathers the adapter (float32) and its optimizer state
    (``get_optimizer_state_dict``, full tensors on rank 0), rank 0 writes the part unsharded and renames it into
    place, then tells the others how it went, so every rank returns or raises together. A collective with ranks.

    Raises:
        CheckpointError: on a rank other than 0 when rank 0 failed (its message is included); whatever failed on
            rank 0 (the part is untouched: :func:`rlrun.rundir.publish_dir`).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    weights = adapter_state(adapter, dp)
    fresh = not optimizer.state
    optim = {}
    if not fresh:  # on a fresh optimizer it would take a zero-lr step to create the state (see write_part): none yet
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optim = get_optimizer_state_dict(adapter.model, optimizer, options=options)
    path = run_dir.trainer_checkpoint(step)
    outcome: list[str | None] = [None]
    if dp.is_main:

        def fill(tmp: Path) -> None:
            save_adapter(tmp, weights, adapter)
            torch.save(optim, tmp / OPTIMIZER_FILE)
            write_progress(tmp)
            write_meta(tmp, step, attempt)
            fault_point(f"trainer_{reason}_save")  # test-only: a kill mid-save (grace period too short)

        try:
            run_dir.checkpoint(step).mkdir(parents=True, exist_ok=True)
            publish_dir(path, fill)
            outcome = ["ok"]
        except BaseException as exc:
            if dp.distributed:
                torch.distributed.broadcast_object_list([f"rank 0: {type(exc).__name__}: {exc}"], src=0)
            raise
    if dp.distributed:
        torch.distributed.broadcast_object_list(outcome, src=0)
        if outcome[0] != "ok":
            raise CheckpointError(f"{path}: not published: {outcome[0]}")
    return path
