"""The trainer's compute dtype (``spec.trainer.precision``) and what follows from it.

Guarantee: the master weights and the optimizer state stay float32 whatever the precision; ``bfloat16`` changes
only the dtype the forward and backward compute in, and the dtype of the weights published to the rollout
servers, which serve that same dtype (vLLM ``--dtype bfloat16`` when the trainer computes in bf16, ``float32``
when it computes in float32: ``docs/design.md``, "Precision"). A requested precision is never dropped silently:
``bfloat16`` on hardware without it computes in float32 after one warning.

- One process: ``torch.autocast(dtype=bfloat16)`` around the forward (:func:`autocast`); parameters and their
  gradients stay float32.
- Ranks: FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (:func:`mixed_precision_policy`):
  the all-gathered parameters are cast to bf16 for compute, gradients are reduce-scattered in float32 into the
  float32 shards the optimizer steps.
"""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 natively: a CUDA device that says so
    (``torch.cuda.is_bf16_supported``: compute capability ≥ 8.0), or a CPU with AVX512-BF16 or AMX-BF16
    instructions (without them PyTorch emulates bf16 matmuls, slower than float32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False


def resolve_precision(requested: str, device: torch.device, warn: bool = True) -> torch.dtype:
    """The compute dtype for ``spec.trainer.precision`` on ``device``.

    ``auto``: bfloat16 on a GPU that has it, float32 otherwise (a CPU trains in float32 unless asked).
    ``bfloat16``: bfloat16 where :func:`bf16_supported`, else float32 with one warning (``warn``: this process
    logs it; ranks other than 0 pass False). ``float32``: float32.

    Raises:
        ValueError: an unknown ``requested``.
    """
    if requested == "float32":
        return torch.float32
    if requested not in ("auto", "bfloat16"):
        raise ValueError(f"spec.trainer.precision: unknown precision {requested!r} (auto, float32, bfloat16)")
    has = bf16_supported(device)
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" and has else torch.float32
    if has:
        return torch.bfloat16
    if warn:
        log.warning(
            "spec.trainer.precision: bfloat16 requested but %s has no native bfloat16; training in float32 "
            "(and publishing float32 weights)",
            "this CPU" if device.type == "cpu" else device,
        )
    return torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` / ``"bfloat16"``: the name the spec, vLLM's ``--dtype`` and the metrics use."""
    return str(dtype).removeprefix("torch.")


def autocast(device: torch.device, dtype: torch.dtype, distributed: bool) -> contextlib.AbstractContextManager:
    """The context of a forward in one process: bf16 autocast when ``dtype`` is bfloat16; nothing otherwise, nor
    with ranks (FSDP2's mixed-precision policy casts the parameters there)."""
    if dtype == torch.float32 or distributed:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def mixed_precision_policy(dtype: torch.dtype):  # -> torch.distributed.fsdp.MixedPrecisionPolicy | None
    """FSDP2's policy for ``dtype``: None for float32; for bfloat16 bf16 parameters in compute and float32 gradient
    reduction (summing the ranks' gradients in bf16 would lose their low bits)."""
    if dtype == torch.float32:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def cast_floating(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` with its floating-point tensors in ``dtype`` (the published weights; integer buffers untouched)."""
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
