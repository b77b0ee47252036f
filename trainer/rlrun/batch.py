"""The shipped batch: how a step's samples travel from the orchestrator to the trainer.

``rollouts/step_N/`` (published atomically, see :func:`rlrun.rundir.publish_dir`) holds

- ``samples.safetensors``: right-padded tensors for ``B`` samples of up to ``T`` tokens:
  ``input_ids [B, T]`` int64 (prompt then completion, padded with ``pad_id``),
  ``attention_mask [B, T]`` int64, and, aligned with next-token targets
  ``input_ids[:, 1:]``: ``loss_mask [B, T-1]`` bool (True on sampled completion tokens; a multi-turn
  episode's env tokens, whose logprob is NaN (:data:`rlrun.samples.ENV_TOKEN_LOGPROB`), are False),
  ``old_logprobs [B, T-1]`` float32 (the sampling policy's logprobs, 0 off the mask);
  ``advantages [B]`` float32;
- ``meta.json`` (:func:`rlrun.rundir.write_meta`): step, the orchestrator's attempt number,
  sample count, rewards and each sample's trace (:meth:`QueuedTrace.to_dict`).

The sample records come from :mod:`rlrun.samples`, which the orchestrator and the trainer
both import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlrun.rundir import META_FILE, publish_dir, write_meta
from rlrun.samples import TrainingSample, sampled_mask

SAMPLES_FILE = "samples.safetensors"


@dataclass
class TrainBatch:
    """Tensors of one shipped batch (shapes in the module docstring) plus its metadata."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    meta: dict

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def collate(samples: list[TrainingSample], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad ``samples`` into the tensors described in the module docstring."""
    if not samples:
        raise ValueError("cannot collate an empty batch")
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width - 1), dtype=torch.bool)
    old_logprobs = torch.zeros((b, width - 1), dtype=torch.float32)
    for i, s in enumerate(samples):
        ids = [*s.prompt_ids, *s.completion_ids]
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        # target input_ids[:, t + 1] is predicted at position t: completion token j sits at p + j.
        logprobs = torch.tensor(list(s.logprobs), dtype=torch.float32)
        sampled = sampled_mask(logprobs)  # an env token of a multi-turn episode was not sampled: not trained
        loss_mask[i, p - 1 : p - 1 + c] = sampled
        old_logprobs[i, p - 1 : p - 1 + c] = torch.where(sampled, logprobs, 0.0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "old_logprobs": old_logprobs,
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
    }


def write_batch(path: Path, step: int, samples: list[TrainingSample], pad_id: int, attempt: int = 0) -> Path:
    """Publish ``samples`` as batch ``step`` of attempt ``attempt`` at ``path`` (atomic directory rename)."""
    tensors = collate(samples, pad_id)
    rewards = [s.reward for s in samples]
    traces = [s.trace.to_dict() for s in samples]

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / SAMPLES_FILE))
        write_meta(tmp, step, attempt, num_samples=len(samples), rewards=rewards, traces=traces)

    return publish_dir(path, fill)


def read_batch(path: Path) -> TrainBatch:
    """Load a published batch directory.

    Raises:
        FileNotFoundError: the batch is not (yet) published.
    """
    tensors = load_file(str(path / SAMPLES_FILE))
    meta = json.loads((path / META_FILE).read_text())
    return TrainBatch(
        input_ids=tensors["input_ids"],
        attention_mask=tensors["attention_mask"],
        loss_mask=tensors["loss_mask"],
        old_logprobs=tensors["old_logprobs"],
        advantages=tensors["advantages"],
        meta=meta,
    )
