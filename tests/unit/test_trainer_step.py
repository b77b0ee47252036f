"""The trainer's step metrics on the tiny model: ``entropy`` is the mean next-token entropy over the trained
tokens, at the sampling temperature, of the policy before the step."""

from __future__ import annotations

import json
from array import array

import pytest
import torch
from rlrun.batch import read_batch, write_batch
from rlrun.rundir import RunDir
from rlrun.samples import QueuedTrace, TrainingSample
from rlrun.training.trainer import Trainer

from tests.support.manifests import parse


def _sample(member: int, completion: list[int], advantage: float) -> TrainingSample:
    return TrainingSample(
        prompt_ids=array("q", [3, 4, 9]),
        completion_ids=array("q", completion),
        logprobs=array("d", [-1.0] * len(completion)),
        advantage=advantage,
        reward=0.5 + advantage,
        trace=QueuedTrace("reverse-text", 0, 0, member),
    )


def test_train_step_reports_the_mean_entropy_of_the_trained_tokens(tmp_path, tiny_model):
    spec = parse("entropy", max_steps=1, sampling={"temperature": 0.7}).spec
    run_dir = RunDir(tmp_path)
    trainer = Trainer(spec, run_dir, str(tiny_model))
    samples = [_sample(0, [5, 6, 7, 0], 0.5), _sample(1, [5, 0], -0.5)]  # unequal lengths: padding is off the mask
    write_batch(run_dir.rollout_batch(1), 1, samples, pad_id=0)
    batch = read_batch(run_dir.rollout_batch(1))
    with torch.no_grad():  # the expected value, by hand, of the policy before the step
        logits = trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        h = torch.distributions.Categorical(logits=logits[:, :-1].float() / 0.7).entropy()
        expected = float(h[batch.loss_mask].mean())
    metrics = trainer.train_step(1)
    trainer.ledger.close()
    assert metrics["tokens"] == 6
    assert metrics["entropy"] == pytest.approx(expected, rel=1e-5)
    assert 0 < metrics["entropy"] < torch.log(torch.tensor(float(logits.shape[-1]))).item()
    json.dumps(metrics)  # what trainer_metrics.jsonl gets
