"""One step's gradient in micro-batches (``rlrun.training.step``): the gradient and statistics of today's single
forward over the whole batch, whatever the budget, the packing, bf16 or activation checkpointing — and whatever the
loss of ``spec.loss`` (every aggregation and objective, the dual clip, the mismatch correction, the KL term to a
reference policy)."""

from __future__ import annotations

import math

import pytest
import torch
from rlrun.batch import TrainBatch, collate
from rlrun.samples import QueuedTrace, TrainingSample
from rlrun.training.distributed import single_process
from rlrun.training.objectives import LossSettings
from rlrun.training.reference_loss import batch_loss, token_entropy, token_logprobs
from rlrun.training.step import StepSettings, accumulate_gradients, mismatch_kl
from transformers import AutoModelForCausalLM

TEMPERATURE = 0.8
LENGTHS = [(4, 6), (7, 3), (3, 9), (5, 2), (6, 7), (2, 20), (9, 1)]
ON_POLICY = torch.tensor([True, False, True, False, True, False, True])


@pytest.fixture(scope="module")
def model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


@pytest.fixture(scope="module")
def batch() -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    samples = []
    for i, (p, c) in enumerate(LENGTHS):
        ids = torch.randint(2, 60, (p + c,), generator=g).tolist()
        lp = (-math.log(64) + 0.6 * (torch.rand(c, generator=g) - 0.5)).tolist()
        adv = [0.5, -0.5, 1.0, -1.0, 0.25, 0.7, -0.3][i]
        samples.append(TrainingSample(ids[:p], ids[p:], lp, adv, 0.5, QueuedTrace("reverse-text", 0, 1, i)))
    return TrainBatch(**collate(samples, pad_id=0), meta={"step": 1})


def _settings(budget: int, dtype: torch.dtype = torch.float32, loss: LossSettings | None = None) -> StepSettings:
    return StepSettings(TEMPERATURE, 1.0, loss or LossSettings(), budget, chunk_tokens=5, compute_dtype=dtype)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _todays_step(model, batch: TrainBatch) -> tuple[dict, dict]:
    """The trainer before micro-batches: one forward, the [B, T, V] logits, the batch's token mean."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logprobs = token_logprobs(logits, batch.input_ids, TEMPERATURE)
    loss, stats = batch_loss(logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask)
    loss.backward()
    with torch.no_grad():
        mask = batch.loss_mask
        kl = mismatch_kl(logprobs, batch.old_logprobs)
        on = mask & ON_POLICY[:, None]
        stats.update(
            loss=loss.item(),
            entropy=float(token_entropy(logits, TEMPERATURE)[mask].mean()),
            logprob_abs_diff=float((logprobs - batch.old_logprobs)[mask].abs().mean()),
            mismatch_kl=float(kl[mask].mean()),
            mismatch_kl_on_policy=float(kl[on].mean()),
        )
    return _grads(model), stats


@pytest.fixture(scope="module")
def today(model, batch) -> tuple[dict, dict]:
    """The reference, computed once: :func:`_todays_step`'s gradients and statistics."""
    return _todays_step(model, batch)


def _assert_same_gradients(got: dict, want: dict) -> None:
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()), msg=name)


@pytest.mark.parametrize(("budget", "pack"), [(10_000, False), (10_000, True), (24, True), (24, False), (5, True)])
def test_micro_batched_step_equals_todays_single_forward(model, batch, today, budget, pack):
    """Several micro-batches (budget 24 → 5; budget 5: each sample alone, longer than the budget; padded rows at
    10,000: 2, by length) or one, packed or padded: the gradient and every whole-batch statistic of one forward over
    the batch."""
    want, stats = today
    got = accumulate_gradients(model, batch, ON_POLICY, _settings(budget), single_process(), pack=pack)
    _assert_same_gradients(_grads(model), want)
    assert got["tokens"] == stats["tokens"] == batch.num_loss_tokens
    assert (
        got["micro_batches"]
        == {(10_000, False): 2, (10_000, True): 1, (24, True): 5, (24, False): 5, (5, True): 7}[budget, pack]
    )
    for key in (
        "loss",
        "clip_fraction",
        "ratio_mean",
        "ratio_max",
        "entropy",
        "logprob_abs_diff",
        "mismatch_kl",
        "mismatch_kl_on_policy",
    ):
        assert got[key] == pytest.approx(stats[key], rel=1e-5, abs=1e-7), key
    assert 0 < stats["clip_fraction"] < 1


def test_padding_share_counts_the_slots_that_hold_no_token(model, batch):
    padded = accumulate_gradients(model, batch, ON_POLICY, _settings(10_000), single_process(), pack=False)
    packed = accumulate_gradients(model, batch, ON_POLICY, _settings(10_000), single_process(), pack=True)
    model.zero_grad(set_to_none=True)
    tokens = sum(p + c for p, c in LENGTHS)  # 84: one padded batch, 7 rows of the longest (22), is 45 % padding
    # by length: rows of 22, 13, 12 (66 slots), then of 10, 10, 10, 7 (40 slots)
    assert padded["padding_share"] == pytest.approx(1 - tokens / (66 + 40))
    assert packed["padding_share"] == pytest.approx(1 - tokens / (4 * 22))  # [22], [13 7], [12 10], [10 10]


def test_bfloat16_compute_keeps_float32_gradients_close_to_the_float32_step(model, batch, today):
    want, _ = today
    accumulate_gradients(model, batch, ON_POLICY, _settings(24, torch.bfloat16), single_process())
    got = _grads(model)
    assert all(g.dtype == torch.float32 for g in got.values())  # master weights' gradients stay float32
    flat = lambda d: torch.cat([v.flatten() for v in d.values()])  # noqa: E731
    rel = float((flat(got) - flat(want)).norm() / flat(want).norm())
    assert 1e-6 < rel < 0.05  # bf16 matmuls: close, not equal (measured ≈ 0.01)


def test_activation_checkpointing_gives_the_same_gradient(tiny_model, batch):
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    fresh.train()
    accumulate_gradients(fresh, batch, ON_POLICY, _settings(24), single_process())
    want = _grads(fresh)
    fresh.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    accumulate_gradients(fresh, batch, ON_POLICY, _settings(24), single_process())
    _assert_same_gradients(_grads(fresh), want)


def test_a_batch_with_no_trained_token_is_refused(model, batch):
    empty = TrainBatch(**{**vars(batch), "loss_mask": torch.zeros_like(batch.loss_mask)})
    with pytest.raises(ValueError, match="selects no token"):
        accumulate_gradients(model, empty, ON_POLICY, _settings(24), single_process())


#: Each loss of ``spec.loss`` that the step's normalisation or its sequence terms touch, every aggregation among them
#: (the formulas themselves: ``test_objectives.py``). Thresholds put some tokens on each side of every bound.
LOSSES = {
    "sequence_mean": LossSettings(aggregation="sequence_mean"),
    "gspo": LossSettings(objective="gspo", aggregation="sequence_mean", epsilon_low=0.1, epsilon_high=0.1),
    "cispo": LossSettings(objective="cispo", epsilon_high=0.1, aggregation="constant", constant=100.0),
    "dual-clip-truncate": LossSettings(epsilon_high=0.28, dual_clip=1.05, correction="truncate", cap=1.2),
    "sequence-mask-kl": LossSettings(
        aggregation="sequence_mean",
        correction="mask",
        correction_level="sequence",
        low=0.85,
        high=1.15,
        kl_coef=0.5,
        kl_estimator="k3",
    ),
}
#: The statistics each loss adds when on (``accumulate_gradients`` leaves out what is off).
EXTRA = {"dual_clip": "dual_clip_fraction", "truncate": "is_truncated_fraction", "mask": "is_masked_fraction"}


@pytest.fixture(scope="module")
def reference(tiny_model):
    """A reference policy apart from the policy: the tiny model with its weights moved (seeded noise)."""
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return ref.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def near_batch(model, batch) -> TrainBatch:
    """``batch`` sampled by a policy near the model: its logprobs ± 0.25 nats (ratios 0.6–1.5, some in and some out
    of every bound below)."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        lp = token_logprobs(
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids, TEMPERATURE
        )
    old = torch.where(batch.loss_mask, lp + 0.25 * torch.randn(lp.shape, generator=g), 0.0)
    return TrainBatch(**{**vars(batch), "old_logprobs": old})


@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_in_micro_batches_equals_its_single_forward(model, reference, near_batch, name):
    """Micro-batches of ≤ 24 tokens (5 of them, samples packed) against one forward over the batch with the whole
    batch's normalisation (``batch_loss``): gradient and statistics. A normaliser taken per micro-batch (its own
    token count, sequence count) would differ; so would a sequence term cut across micro-batches."""
    loss, batch = LOSSES[name], near_batch
    ref_model = reference if loss.uses_reference else None
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    ref_lp = None
    if ref_model is not None:
        with torch.no_grad():
            ref_logits = ref_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            ref_lp = token_logprobs(ref_logits, batch.input_ids, TEMPERATURE)
    lp = token_logprobs(logits, batch.input_ids, TEMPERATURE)
    want_loss, want = batch_loss(lp, batch.old_logprobs, batch.advantages, batch.loss_mask, loss, ref_lp)
    want_loss.backward()
    want_grads = _grads(model)
    got = accumulate_gradients(
        model, batch, ON_POLICY, _settings(24, loss=loss), single_process(), pack=True, reference=ref_model
    )
    _assert_same_gradients(_grads(model), want_grads)
    assert got["micro_batches"] == 5
    assert got["loss"] == pytest.approx(want_loss.item(), rel=1e-5, abs=1e-7)
    keys = ["clip_fraction", "ratio_mean", "ratio_max"]
    keys += [v for k, v in EXTRA.items() if k in (loss.correction, "dual_clip" if loss.dual_clip else None)]
    keys += ["kl_ref"] if loss.uses_reference else []
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        if key != "ratio_max" and key != "ratio_mean":
            assert 0 < got[key] < 1 or (key == "kl_ref" and got[key] > 0), (key, got[key])
    assert set(EXTRA.values()) - set(keys) <= set(EXTRA.values()) - set(got)  # an off setting logs nothing


def test_a_kl_term_without_the_reference_policy_is_refused(model, batch):
    with pytest.raises(ValueError, match="reference"):
        accumulate_gradients(model, batch, ON_POLICY, _settings(24, loss=LOSSES["sequence-mask-kl"]), single_process())
