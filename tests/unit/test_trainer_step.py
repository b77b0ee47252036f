"""The trainer's step metrics on the tiny model: ``entropy`` is the mean next-token entropy over the trained
tokens, at the sampling temperature, of the policy before the step."""

from __future__ import annotations

import json
import math
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
        logits = trainer.policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        h = torch.distributions.Categorical(logits=logits[:, :-1].float() / 0.7).entropy()
        expected = float(h[batch.loss_mask].mean())
    metrics = trainer.train_step(1)
    trainer.ledger.close()
    assert metrics["tokens"] == 6
    assert metrics["micro_batches"] == 1 and metrics["padding_share"] == pytest.approx(2 / 14)  # rows of 7 and 5
    assert metrics["entropy"] == pytest.approx(expected, rel=1e-5)
    assert 0 < metrics["entropy"] < torch.log(torch.tensor(float(logits.shape[-1]))).item()
    json.dumps(metrics)  # what trainer_metrics.jsonl gets


def test_mismatch_kl_is_zero_for_the_trainers_own_logprobs_and_moves_when_the_server_had_other_weights(
    tmp_path, tiny_model
):
    """The server's logprobs are the trainer's own when both hold the same weights (a correct sync): mismatch KL
    ≈ 0. The same batch sampled by other weights (a sync that did not happen): it moves, on-policy samples too."""
    from rlrun.training.reference_loss import token_logprobs

    spec = parse("kl", max_steps=2, sampling={"temperature": 1.0}).spec
    run_dir = RunDir(tmp_path)
    trainer = Trainer(spec, run_dir, str(tiny_model))
    completions = [[5, 6, 7, 0], [5, 9, 0], [12, 0]]
    probe = [_sample(m, c, 0.5 - 0.5 * m) for m, c in enumerate(completions)]
    write_batch(run_dir.rollout_batch(1), 1, probe, pad_id=0)
    probe_batch = read_batch(run_dir.rollout_batch(1))

    def server_logprobs(model) -> list[list[float]]:  # what a server holding `model`'s weights would return
        with torch.no_grad():
            logits = model(input_ids=probe_batch.input_ids, attention_mask=probe_batch.attention_mask).logits
            lp = token_logprobs(logits, probe_batch.input_ids, 1.0)
        return [lp[i][probe_batch.loss_mask[i]].tolist() for i in range(len(completions))]

    def batch(step: int, logprobs: list[list[float]], version: int) -> None:
        samples = [
            TrainingSample(
                array("q", [3, 4, 9]),
                array("q", c),
                array("d", lp),
                0.5 - 0.5 * m,
                0.5,
                QueuedTrace("reverse-text", version, 0, m),
            )
            for m, (c, lp) in enumerate(zip(completions, logprobs, strict=True))
        ]
        write_batch(run_dir.rollout_batch(step), step, samples, pad_id=0)

    batch(1, server_logprobs(trainer.policy.model), version=0)  # the server holds the trainer's weights (version 0)
    same = trainer.train_step(1)
    assert same["mismatch_kl"] < 1e-6 and same["mismatch_kl_on_policy"] == pytest.approx(same["mismatch_kl"])
    other = Trainer(spec, RunDir(tmp_path / "other"), str(tiny_model))
    with torch.no_grad():
        for p in other.policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # weights the trainer does not hold
    batch(2, server_logprobs(other.policy.model), version=1)  # labelled as the weights the trainer holds at step 2
    moved = trainer.train_step(2)
    trainer.ledger.close()
    other.ledger.close()
    assert moved["mismatch_kl"] > 100 * max(same["mismatch_kl"], 1e-6) and moved["mismatch_kl_on_policy"] > 0.01


def _vllm_processed_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """``[n, V]``: what vLLM returns with ``--logprobs-mode processed_logprobs`` (``Sampler.sample``): float32 logits
    / temperature, ``apply_top_k_top_p_pytorch``'s top-p mask (ascending sort, cumulative softmax, masked where
    ≤ 1 − top_p, never the largest), log-softmax over what is kept."""
    z = logits.float() / temperature
    ascending, order = z.sort(dim=-1)
    cut = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
    cut[:, -1] = False
    return z.scatter(-1, order, ascending.masked_fill(cut, float("-inf"))).log_softmax(-1)


def test_on_policy_ratio_is_one_under_top_p(tmp_path, tiny_model):
    """Issue 35 item 6: with ``top_p < 1`` vLLM's logprobs are renormalised over the nucleus it sampled from; the
    trainer's must be too, or an on-policy token's ratio is the nucleus's kept mass (0.893 measured at top_p 0.8).
    Completions sampled here as vLLM samples (temperature, then the top-p nucleus) from the trainer's own weights,
    labelled with those logprobs: step 1 is on policy, so the ratio is 1 and the mismatch KL 0."""
    temperature, top_p = 0.9, 0.8
    spec = parse("topp", max_steps=1, sampling={"temperature": temperature, "top_p": top_p}).spec
    run_dir = RunDir(tmp_path)
    trainer = Trainer(spec, run_dir, str(tiny_model))
    g = torch.Generator().manual_seed(0)
    samples, kept_mass = [], []
    with torch.no_grad():
        for member in range(4):
            ids, logprobs = [3, 4, 9], []
            for _ in range(8):
                logits = trainer.policy.model(input_ids=torch.tensor([ids])).logits[0, -1:]
                processed = _vllm_processed_logprobs(logits, temperature, top_p)
                token = int(torch.multinomial(processed.exp(), 1, generator=g))
                kept_mass.append(float(torch.softmax(logits / temperature, -1)[0][processed[0] > -math.inf].sum()))
                ids.append(token)
                logprobs.append(float(processed[0, token]))
            samples.append(
                TrainingSample(
                    array("q", ids[:3]),
                    array("q", ids[3:]),
                    array("d", logprobs),
                    0.5 - 0.25 * member,
                    0.5,
                    QueuedTrace("reverse-text", 0, 0, member),
                )
            )
    assert sum(kept_mass) / len(kept_mass) < 0.97  # the nucleus truncates: over the whole vocabulary, ratio ≈ S
    write_batch(run_dir.rollout_batch(1), 1, samples, pad_id=0)
    metrics = trainer.train_step(1)
    trainer.ledger.close()
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["mismatch_kl_on_policy"] < 1e-9 and metrics["clip_fraction"] == 0.0
