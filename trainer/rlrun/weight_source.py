"""A vLLM ``WeightSource`` over a state dict: what the trainer's half of a weight-transfer engine sends
(rlrun's gloo engine, :mod:`rlrun.rollout.gloo_transfer`; vLLM's ``nccl`` engine). On the foundation floor so
that the trainer's sender (:mod:`rlrun.training.weight_sender`) and the rollout package's engine share it
without importing each other (``docs/design.md``, "Layers"). Imports vLLM: import it where a weight-transfer
engine runs, not at a process's start.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource


class StateDictSource(WeightSource):
    """A :class:`WeightSource` over a dict of named tensors (Hugging Face names, what a broadcast's
    ``model.safetensors`` holds), in the dict's order: e.g. the trainer's ``published_state``, or a part of
    it."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def metadata(self) -> list[ParamMeta]:
        """Each tensor's name, dtype and shape, in order (what the workers allocate to receive)."""
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.state.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.state.items()
