"""The reference policy of the KL term (``spec.loss.kl_coef > 0``): the run's starting weights, frozen, on the trainer.

Guarantee: the reference is the weights at the run's model path — the ones step 0 started from — on every attempt.
It is never trained nor checkpointed: a resumed or replaced trainer loads it again from the same path (a builtin
model's recipe builds the same bytes; a named model is pinned by ``model.revision``), so a resume costs no
checkpoint space for it and reads nothing a checkpoint could have torn. It is sharded as the policy (FSDP2 over the
same ranks and units, :func:`~rlrun.training.distributed.shard_model`), has no gradient, no optimizer state, and is
held in the compute dtype (``spec.trainer.precision``): a bf16 trainer's reference takes 2 bytes a parameter, half
its float32 master copy (on ranks FSDP2's mixed precision computes the policy in bf16 too, so both run the same
arithmetic; in one process autocast computes the policy's matmuls in bf16 from float32 weights and the reference's
norms and embeddings from their bf16 rounding: a difference of bf16 noise).

With LoRA (``spec.model.lora``) none of this is loaded: the reference is the policy with its adapter disabled
(:class:`rlrun.training.lora.AdapterOff`), which is the base model — the run's starting weights, since the adapter's
``B`` starts at zero — frozen and never written, at no memory cost (and no room check).

Room (:func:`room_problem`): the reference costs what it holds, ``P / W`` parameters per rank in the compute dtype.
Whether a model fits twice is known only where the trainer runs — a named model's size is read from its files, the
memory from the device — so it is checked there, before the first step: after the policy is loaded, the reference
and what the policy's first step will still allocate (float32 gradients and AdamW's two moments, 12 bytes a
parameter) must fit in the device's free memory, else the trainer refuses the setting by its field (a permanent
error, exit 78). Activations (set by ``trainer.micro_batch_tokens``) are not counted: it is a floor, refusing only
what cannot fit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import psutil
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from rlrun.manifest import ManifestError
from rlrun.training.distributed import DataParallel, shard_model
from rlrun.training.precision import mixed_precision_policy

GIB = 1024**3
#: Bytes a parameter's training state still takes after the policy is loaded: its float32 gradient (4) and AdamW's
#: two float32 moments (8), allocated by the first step.
TRAINING_STATE_BYTES = 12
#: cgroup v2's memory limit and usage of this process's container (Kubernetes nodes run cgroup v2).
CGROUP_MAX, CGROUP_CURRENT = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")


def load_reference(
    model_path: str,
    dp: DataParallel,
    dtype: torch.dtype,
    mp_policy: object | None,
    pretrained: Mapping[str, str] | None = None,
) -> nn.Module:
    """The starting weights at ``model_path`` in ``dtype``, frozen (``eval``, no gradient), on ``dp.device`` and
    sharded as the policy (``mp_policy``: :func:`~rlrun.training.precision.mixed_precision_policy`). ``pretrained``:
    the model's ``from_pretrained`` arguments (:func:`rlrun.model.resolve.pretrained_kwargs`: its revision), the
    policy's."""
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **(pretrained or {}))
    reference.eval()
    reference.requires_grad_(False)
    return shard_model(reference, dp, mp_policy=mp_policy)


def parameter_count(model: nn.Module) -> int:
    """The model's parameters, all ranks' together (a sharded ``DTensor``'s ``numel`` is its global size)."""
    return sum(p.numel() for p in model.parameters())


def free_bytes(device: torch.device) -> tuple[int, str]:
    """``(bytes free, what)`` on ``device``: a GPU's free memory (``torch.cuda.mem_get_info``); on a CPU the memory
    available (``psutil``), bounded by the cgroup v2 limit less its usage where one is set (a pod's limit)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]), f"GPU {device}"
    free = int(psutil.virtual_memory().available)
    try:
        limit = CGROUP_MAX.read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(CGROUP_CURRENT.read_text()))
    except (OSError, ValueError):
        pass
    return free, "CPU memory"


def room_problem(
    parameters: int, world_size: int, bytes_per_parameter: int, free: int, where: str = "device", sharing: int = 1
) -> str | None:
    """Why the reference policy cannot be held (module docstring, "Room"), or None.

    Args:
        parameters: the model's parameters (all ranks').
        world_size: ranks the model is sharded over.
        bytes_per_parameter: of the reference (its dtype: 4 float32, 2 bf16).
        free: bytes free where this rank holds it, after the policy is loaded.
        where: what ``free`` is of, for the message.
        sharing: ranks holding theirs in the same ``free`` (CPU ranks of one machine; 1 on GPUs).

    Returns:
        A message naming ``spec.loss.kl_coef``, the bytes needed and free, and what to change.
    """
    per_rank = parameters / world_size * sharing
    reference, state = per_rank * bytes_per_parameter, per_rank * TRAINING_STATE_BYTES
    if reference + state <= free:
        return None
    return (
        f"spec.loss.kl_coef: the reference policy (the starting weights, frozen) needs {reference / GIB:.2f} GiB "
        f"beside the {state / GIB:.2f} GiB the policy's gradients and AdamW state will take, and the {where} has "
        f"{free / GIB:.2f} GiB free: set loss.kl_coef to 0, or shard the trainer over more ranks "
        "(trainer.processes_per_node, trainer.nodes), or train in bfloat16 (trainer.precision: a bf16 reference "
        "takes half)"
    )


def check_room(model: nn.Module, dp: DataParallel, dtype: torch.dtype) -> str | None:
    """:func:`room_problem` for ``model`` (the policy, loaded and sharded) on this rank's device."""
    free, where = free_bytes(dp.device)
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if dp.device.type == "cpu" and dp.distributed else 1
    size = torch.empty((), dtype=dtype).element_size()
    return room_problem(parameter_count(model), dp.world_size, size, free, where, sharing)


def reference_policy(
    policy: nn.Module,
    model_path: str,
    dp: DataParallel,
    dtype: torch.dtype,
    pretrained: Mapping[str, str] | None = None,
) -> nn.Module:
    """The reference policy for ``policy`` (loaded and sharded): :func:`check_room`, then :func:`load_reference` in
    ``dtype`` with ``pretrained`` (the policy's ``from_pretrained`` arguments). With ranks a collective: every rank
    refuses, or none (a rank that went on would wait in the next collective for the others).

    Raises:
        ManifestError: it does not fit beside the policy on some rank (names ``spec.loss.kl_coef``; permanent).
    """
    problem = check_room(policy, dp, dtype)
    if dp.distributed:
        flag = torch.tensor([float(problem is not None)], device=dp.device if dp.device.type != "cpu" else None)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item() and problem is None:
            problem = "spec.loss.kl_coef: the reference policy does not fit beside the policy on another rank"
    if problem is not None:
        raise ManifestError("(checked by the trainer with its model loaded)", [problem])
    return load_reference(model_path, dp, dtype, mixed_precision_policy(dtype), pretrained)
