"""Data-parallel training over ``torch.distributed`` with FSDP2: the same update as one process.

Guarantee: ``W`` ranks that each train their slice of a shipped batch (:func:`rank_slice`) with
:func:`rlrun.training.step.accumulate_gradients` and clip with :func:`clip_grad_norm_` take the **same optimizer
step** as one process training the whole batch, up to float summation order. Three rules make it so:

1. **Slicing** — rank ``r`` of ``W`` trains the contiguous rows ``[r·⌊B/W⌋ + min(r, B mod W), …)``
   of the batch (:func:`slice_bounds`, ``torch.tensor_split``'s rule: the first ``B mod W`` ranks
   get one row more). Every row is trained by exactly one rank. A rank left without rows
   (``B < W``) trains a placeholder row whose loss mask is all False: it contributes zero to
   the loss and the gradient but still runs forward and backward, because FSDP's all-gather and
   reduce-scatter are collectives every rank must enter.
2. **Loss normalisation** — the single-process loss (:mod:`rlrun.training.reference_loss`; with the other aggregations
   of ``spec.loss`` its normaliser is another whole-batch count, :mod:`rlrun.training.objectives`) is a mean over
   the ``N = Σ_r N_r`` masked tokens of the whole batch: ``L = Σ_r S_r / N`` with ``S_r`` the
   rank's sum of ``−surrogate`` over its ``N_r`` tokens. FSDP (like DDP) **averages** gradients
   over the data-parallel group: its reduce-scatter divides the summed gradient by ``W``
   (``torch.distributed.fsdp.fully_shard``: gradient divide factor = data-parallel world size;
   DDP documents the same averaging). Each rank therefore back-propagates
   ``ℓ_r = S_r · W / N`` (``N`` from an all-reduce of the token counts), so the reduced gradient
   is ``(1/W) Σ_r ∇ℓ_r = Σ_r ∇S_r / N = ∇L``. Back-propagating each rank's own token mean
   instead would weight a token by ``1 / (W·N_r)``: ranks with fewer completion tokens would
   count more. (:mod:`rlrun.training.step` applies the same rule to micro-batches: each back-propagates its sum
   times ``W / N``.)
3. **Gradient clipping** — the norm is of the **global** gradient: the per-rank shard norms are
   combined across the group (DTensor ``full_tensor``, as torchtitan's ``clip_grad_norm_`` does)
   before the clip coefficient is applied, so every rank scales by the same factor.

World size 1 (no ``WORLD_SIZE`` in the environment, or ``WORLD_SIZE=1``) is today's
single-process path: no process group, no FSDP wrapping, ``W / N = 1 / N``.

Rendezvous is ``torchrun``'s (``env://``, c10d): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``. The backend is ``nccl`` when CUDA is available and ``gloo`` on
CPU (:func:`choose_backend`).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from rlrun.batch import TrainBatch

log = logging.getLogger(__name__)

#: Environment variables of a ``torchrun`` (c10d ``env://``) rendezvous, all required when ``WORLD_SIZE > 1``.
RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

#: Name of the one mesh dimension: data parallel (FSDP shards parameters over it).
DP_MESH_DIM = "dp"

#: Where the stack of transformer blocks lives in common Hugging Face causal LMs (first match wins):
#: Qwen2/3, Llama, Mistral (``model.layers``); GPT-2 (``transformer.h``); GPT-NeoX (``gpt_neox.layers``).
BLOCK_PATHS = ("model.layers", "transformer.h", "gpt_neox.layers")


@dataclass(frozen=True)
class DataParallel:
    """This process's place in the data-parallel group.

    Attributes:
        rank: global rank, ``0 … world_size − 1``.
        world_size: number of ranks (1: no process group).
        local_rank: rank on this node (selects the GPU).
        backend: ``"gloo"`` / ``"nccl"``, or None without a process group.
        device: where the model and the batch live (``cuda:<local_rank>`` or ``cpu``).
        mesh: the 1-D ``DeviceMesh`` named ``"dp"`` FSDP shards over; None without a process group.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: object | None = None  # torch.distributed.device_mesh.DeviceMesh

    @property
    def distributed(self) -> bool:
        """Whether a process group exists (``world_size > 1``)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that publishes weights and renames checkpoints into place."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (no-op in one process)."""
        if self.distributed:
            dist.barrier()


def single_process(device: torch.device | str = "cpu") -> DataParallel:
    """The world-size-1 group: today's trainer, no process group."""
    return DataParallel(device=torch.device(device))


def choose_backend(cuda_available: bool | None = None) -> str:
    """``"nccl"`` when CUDA is available (GPU collectives), else ``"gloo"`` (CPU)."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    return "nccl" if cuda_available else "gloo"


def init_from_env(env: Mapping[str, str] | None = None, timeout_s: float = 600.0) -> DataParallel:
    """Join the data-parallel group that ``torchrun`` (or the operator's pods) describe in the environment.

    Args:
        env: the environment (default ``os.environ``).
        timeout_s: how long collectives (and the rendezvous) may wait for the other ranks, seconds.

    Returns:
        A :class:`DataParallel`. Without ``WORLD_SIZE``, or with ``WORLD_SIZE=1``: world size 1, no
        process group (:func:`single_process`). Otherwise the default process group is
        initialised with ``init_method="env://"`` and a 1-D device mesh is built.

    Raises:
        ValueError: ``WORLD_SIZE > 1`` and a rendezvous variable is missing or not an integer
            where one is needed, or ``RANK`` is outside ``[0, WORLD_SIZE)``; the message names it.
    """
    env = os.environ if env is None else env
    cuda = torch.cuda.is_available()
    world_size = _int_env(env, "WORLD_SIZE") if "WORLD_SIZE" in env else 1
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE={world_size}: must be at least 1")
    if world_size == 1:
        local_rank = _int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        return single_process(torch.device("cuda", local_rank) if cuda else "cpu")
    missing = [k for k in RENDEZVOUS_ENV if not env.get(k)]
    if missing:
        raise ValueError(f"WORLD_SIZE={world_size} but {', '.join(missing)} not set (torchrun sets them)")
    rank, local_rank = _int_env(env, "RANK"), _int_env(env, "LOCAL_RANK")
    _int_env(env, "MASTER_PORT")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")
    backend = choose_backend(cuda)
    if cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # env:// reads MASTER_ADDR/MASTER_PORT from os.environ: mirror a given mapping there.
        for k in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ[k] = env[k]
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=(DP_MESH_DIM,))
    log.info(
        "rank %d of %d (local %d) joined %s:%s with %s on %s",
        rank,
        world_size,
        local_rank,
        env["MASTER_ADDR"],
        env["MASTER_PORT"],
        backend,
        device,
    )
    return DataParallel(rank, world_size, local_rank, backend, device, mesh)


def _int_env(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise ValueError(f"{name}={env.get(name)!r}: expected an integer") from None


def teardown(dp: DataParallel) -> None:
    """Leave the process group (after a last barrier, so no rank exits while others still talk to it)."""
    if dp.distributed and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP wraps one by one: the first of :data:`BLOCK_PATHS` that ``model`` has
    as a ``ModuleList``; ``[]`` when none (then only the root is sharded)."""
    for path in BLOCK_PATHS:
        node: object = model
        for attr in path.split("."):
            node = getattr(node, attr, None)
            if node is None:
                break
        if isinstance(node, nn.ModuleList) and len(node) > 0:
            return list(node)
    return []


def shard_model(
    model: nn.Module, dp: DataParallel, reshard_after_forward: bool = True, mp_policy: object | None = None
) -> nn.Module:
    """Move ``model`` to ``dp.device`` and, with ``world_size > 1``, apply FSDP2 (``fully_shard``)
    to every transformer block (:func:`transformer_blocks`), then to the root, with ``mp_policy`` (a
    ``MixedPrecisionPolicy``: :func:`rlrun.training.precision.mixed_precision_policy`; None: compute in the
    parameters' float32).

    Per-block units let FSDP all-gather one block's parameters at a time (and free them after its
    forward when ``reshard_after_forward``); the root unit holds the rest (embeddings, final norm,
    LM head). Parameters become ``DTensor`` shards along dim 0; build the optimizer **after** this.

    Returns:
        The same module object (``fully_shard`` changes its class in place); unchanged but for the
        device in one process.
    """
    model.to(dp.device)
    if not dp.distributed:
        return model
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": dp.mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    blocks = transformer_blocks(model)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if not blocks:
        log.warning("%s: no transformer blocks found at %s; sharded the root only", type(model).__name__, BLOCK_PATHS)
    return model


def slice_bounds(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a ``num_rows``-row batch that ``rank`` trains (rule 1 of the module).

    The first ``num_rows mod world_size`` ranks get ``⌈num_rows / world_size⌉`` rows, the others
    ``⌊num_rows / world_size⌋`` (``torch.tensor_split``'s split); ``start == stop`` when a rank has none.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)`` or ``num_rows < 0``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if num_rows < 0:
        raise ValueError(f"num_rows {num_rows} < 0")
    base, extra = divmod(num_rows, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def rank_slice(batch: TrainBatch, rank: int, world_size: int) -> TrainBatch:
    """The part of ``batch`` that ``rank`` trains: rows :func:`slice_bounds` of every tensor.

    Shapes: ``input_ids``/``attention_mask`` ``[b, T]``, ``loss_mask``/``old_logprobs``
    ``[b, T−1]``, ``advantages`` ``[b]`` with ``b`` the rank's rows (``T`` is kept: right padding
    does not change a causal model's outputs at the real positions). A rank with no rows gets one
    placeholder row (row 0 with ``loss_mask`` all False; it weighs nothing). ``meta`` is the
    whole batch's, plus ``"rank_rows": [start, stop]`` (the placeholder has ``start == stop``).

    Raises:
        ValueError: as :func:`slice_bounds`, or an empty batch.
    """
    if batch.num_samples == 0:
        raise ValueError("cannot slice an empty batch")
    start, stop = slice_bounds(batch.num_samples, rank, world_size)
    meta = {**batch.meta, "rank_rows": [start, stop]}
    if start == stop:
        return replace(
            batch,
            input_ids=batch.input_ids[:1].clone(),
            attention_mask=batch.attention_mask[:1].clone(),
            loss_mask=torch.zeros_like(batch.loss_mask[:1]),
            old_logprobs=batch.old_logprobs[:1].clone(),
            advantages=batch.advantages[:1].clone(),
            meta=meta,
        )
    rows = slice(start, stop)
    return replace(
        batch,
        input_ids=batch.input_ids[rows],
        attention_mask=batch.attention_mask[rows],
        loss_mask=batch.loss_mask[rows],
        old_logprobs=batch.old_logprobs[rows],
        advantages=batch.advantages[rows],
        meta=meta,
    )


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip gradients to a total 2-norm of ``max_norm``; returns the norm before clipping (rule 3).

    Same semantics as ``torch.nn.utils.clip_grad_norm_`` (coefficient
    ``min(1, max_norm / (norm + 1e-6))``); with FSDP's ``DTensor`` gradient shards the norm is
    made a full (global) tensor first, as torchtitan does, so every rank clips by the same factor.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    full = getattr(total, "full_tensor", None)
    if full is not None:
        total = full()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def full_state_dict(model: nn.Module, dp: DataParallel) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict (Hugging Face names, CPU tensors) on rank 0, for publishing weights.

    A collective with ``world_size > 1``: every rank must call it.
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with
    ``full_state_dict=True, cpu_offload=True`` all-gathers each shard and keeps the result on
    rank 0 only, so the other ranks hold no full copy.

    A tied weight (``model.all_tied_weights_keys``: Qwen3-0.6B's ``lm_head.weight``, the embedding itself) is left
    out, as ``save_pretrained`` leaves it out: safetensors refuses two names for one tensor, and the model's own
    checkpoint, vLLM's loader and :func:`rlrun.training.parts.load_weights` know it by its source's name.

    Returns:
        ``{name: tensor}`` on rank 0 (new tensors, not views of the parameters), None on the other ranks.
    """
    if not dp.distributed:  # a copy: the caller may keep it while training goes on
        return untied({k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}, model)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dp.is_main:
        return None
    return untied({k: v.contiguous() for k, v in state.items()}, model)


def tied_weights(model: nn.Module) -> dict[str, str]:
    """``{tied name: the name of the tensor it is}`` (transformers' ``all_tied_weights_keys``; ``{}`` for a model
    without tied weights or not from transformers)."""
    return dict(getattr(model, "all_tied_weights_keys", None) or {})


def untied(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``state`` without the names of tied weights (:func:`tied_weights`) whose source it holds."""
    tied = tied_weights(model)
    return {k: v for k, v in state.items() if not (k in tied and tied[k] in state)}
