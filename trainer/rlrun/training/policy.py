"""The policy the trainer trains, assembled once from the spec: the model, its compute dtype, its LoRA adapter or none,
the KL term's reference, and the run identity its checkpoints carry.

Guarantee: "full weights or adapter" is decided here, once per run (``spec.model.lora``), and everything that
depends on it dispatches on the :class:`Policy`: what a broadcast publishes (:meth:`Policy.published_state`,
:meth:`Policy.write_weights`), what a trainer part holds (:mod:`rlrun.training.parts`), what the KL term compares
with, and the identity a resume is checked against. :meth:`Policy.from_spec` builds it in one order, top to bottom:

1. **seed** — torch's RNG from ``spec.seed``: a LoRA adapter's ``A`` is drawn from it, the same on every rank;
2. **load** — float32 master weights (:mod:`rlrun.training.precision`) at ``spec.model.revision``
   (:func:`rlrun.model.resolve.pretrained_kwargs`, the revision vLLM serves);
3. **precision** — the compute dtype of ``spec.trainer.precision`` on this rank's device;
4. **activation checkpointing** — before sharding: FSDP2 wraps the checkpointed blocks;
5. **LoRA** — injected before sharding (FSDP2 shards each block with its adapter), the base frozen
   (:mod:`rlrun.training.lora`), so the optimizer built after it holds the adapter alone;
6. **identity** — :func:`rlrun.identity.run_identity`, with a LoRA run's base model;
7. **sharding** — to the device (a GPU in one process too), FSDP2-sharded over the ranks with the mixed-precision
   policy of the compute dtype (:func:`~rlrun.training.distributed.shard_model`): after every change to the
   module tree, before the optimizer (the trainer's: :func:`rlrun.training.schedule.new_optimizer`);
8. **reference** — the KL term's (``spec.loss.kl_coef > 0``): with LoRA the adapter off (no copy), else the
   starting weights loaded again and sharded as the policy (:mod:`rlrun.training.reference`), after the policy so
   its room check sees the policy's memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM

from rlrun.api.spec import LoraSpec, RLRunSpec
from rlrun.checkpoint import WEIGHTS_FILE
from rlrun.identity import run_identity
from rlrun.model.resolve import pretrained_kwargs
from rlrun.training.distributed import DataParallel, full_state_dict, shard_model, untied
from rlrun.training.lora import Adapter, AdapterOff, adapter_state, base_model_identity, save_adapter, wrap
from rlrun.training.precision import cast_floating, dtype_name, mixed_precision_policy, resolve_precision
from rlrun.training.reference import reference_policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    """The trainer's policy (:meth:`from_spec`).

    Attributes:
        model: the Hugging Face model the trainer trains and calls: float32 master weights on ``dp.device``,
            FSDP2-sharded with ranks; with LoRA the adapter injected in place, the base frozen.
        compute_dtype: the dtype the forward and backward compute in, and the broadcasts' dtype.
        identity: the run identity (:func:`rlrun.identity.run_identity`) its trainer parts record and a resume checks.
        adapter: the LoRA adapter (``spec.model.lora``); None: every weight trains.
        reference: the KL term's reference policy (called as the model is); None when ``spec.loss.kl_coef`` is 0.
    """

    model: nn.Module
    compute_dtype: torch.dtype
    identity: dict
    adapter: Adapter | None = None
    reference: nn.Module | AdapterOff | None = None

    @classmethod
    def from_spec(cls, spec: RLRunSpec, model_path: str, dp: DataParallel) -> Policy:
        """``spec``'s policy from the weights at ``model_path`` (path or Hugging Face id), for this rank of ``dp``, in
        the order of the module docstring; rank 0 logs what it computes in and trains. With ranks a collective (the
        sharding, the reference's room check).

        Raises:
            ManifestError: a LoRA target module the model lacks, or a reference that does not fit beside the policy
                (permanent: the message names the ``spec`` field).
        """
        torch.manual_seed(spec.seed)
        load = pretrained_kwargs(spec.model)  # the revision vLLM serves, for the policy and the KL reference
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **load)
        compute_dtype = resolve_precision(spec.trainer.precision, dp.device, warn=dp.is_main)
        if spec.trainer.activation_checkpointing:  # before sharding: FSDP2 wraps the checkpointed blocks
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lora = spec.model.lora  # before sharding: FSDP2 shards each block with its adapter
        adapter = wrap(model, lora) if lora is not None else None
        identity = run_identity(
            spec, base_model=base_model_identity(spec.model, model_path) if adapter is not None else None
        )
        shard_model(model, dp, mp_policy=mixed_precision_policy(compute_dtype))
        # the starting weights on every start; with LoRA the base: the adapter off, no copy
        if not spec.loss.kl_coef:
            reference = None
        elif adapter is not None:
            reference = AdapterOff(adapter)
        else:
            reference = reference_policy(model, model_path, dp, compute_dtype, load)
        if dp.is_main:
            log.info(
                "trainer: computes in %s (spec.trainer.precision %s), micro-batches of ≤ %d tokens, LM head in chunks "
                "of %d positions, activation checkpointing %s, trains %s",
                dtype_name(compute_dtype),
                spec.trainer.precision,
                spec.trainer.micro_batch_tokens,
                spec.trainer.logprob_chunk_tokens,
                "on" if spec.trainer.activation_checkpointing else "off",
                _what_trains(model, lora),
            )
        return cls(model, compute_dtype, identity, adapter, reference)

    def published_state(self, dp: DataParallel) -> dict[str, torch.Tensor] | None:
        """What a broadcast publishes, on rank 0 (None on the other ranks; with ranks a collective: every rank
        gathers): the adapter in peft's saved layout, in the compute dtype, on the CPU
        (:func:`~rlrun.training.lora.adapter_state`); or the full state dict (Hugging Face names, a tied weight once),
        in one process the live tensors, no copy (:meth:`write_weights` writes them before the next step)."""
        if self.adapter is not None:
            return adapter_state(self.adapter, dp, self.compute_dtype)
        if dp.distributed:
            return full_state_dict(self.model, dp)
        return untied({k: v.detach() for k, v in self.model.state_dict().items()}, self.model)

    def write_weights(self, directory: Path, state: dict[str, torch.Tensor]) -> None:
        """Write :meth:`published_state`'s ``state`` into a broadcast's ``directory``: the adapter directory
        (:func:`~rlrun.training.lora.save_adapter`), or ``model.safetensors`` with the floating-point tensors in the
        compute dtype (the dtype the rollout servers serve)."""
        if self.adapter is not None:
            save_adapter(directory, state, self.adapter)
            return
        cast = {k: v.cpu() for k, v in cast_floating(state, self.compute_dtype).items()}
        save_file(cast, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})


def _what_trains(model: nn.Module, lora: LoraSpec | None) -> str:
    """The startup line's end: the adapter or every weight, and the trainable parameters (all ranks')."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if lora is None:
        return f"every weight ({trainable:,} parameters)"
    return f"a LoRA adapter of rank {lora.rank} on {', '.join(lora.target_modules)} ({trainable:,} parameters)"
