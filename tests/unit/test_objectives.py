"""Every formula of ``spec.loss`` (``rlrun.training.objectives``) against values worked out by hand on a few tokens,
and the rule the micro-batched step rests on: parts of a batch that never split a sample, given the batch's
normaliser, add up to the whole batch's loss and gradient.

Each token's ratio is set through its logprobs: ``old = 0`` and ``logprobs = log r``, so ``r`` is exactly the ratio
and ``∂ℓ/∂ log π = −A · r · (share)`` wherever a surrogate is not clipped."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from rlrun.training.objectives import LossSettings, kl_estimate, loss_sums, normaliser


def _run(ratios, advantages, samples, settings: LossSettings, ref=None, z: float | None = None):
    """``(loss, grad wrt logprobs, sums)`` of tokens with these ratios (``old = 0``)."""
    logprobs = torch.tensor([math.log(r) for r in ratios], dtype=torch.float32, requires_grad=True)
    samples_t = torch.tensor(samples)
    if z is None:
        z = normaliser(settings, len(ratios), len(set(samples)))
    loss, sums = loss_sums(
        logprobs,
        torch.zeros(len(ratios)),
        torch.tensor(advantages, dtype=torch.float32),
        samples_t,
        settings,
        z,
        None if ref is None else torch.tensor(ref, dtype=torch.float32),
    )
    loss.backward()
    return loss.item(), logprobs.grad.tolist(), {k: float(v) for k, v in sums.items()}


def test_clip_higher_lets_a_positive_advantage_ratio_rise_to_1_plus_clip_high_and_not_past():
    """DAPO's ε_low 0.2, ε_high 0.28. r = 1.25 (A = +1) is inside [0.8, 1.28], so unclipped (symmetric 0.2 would
    clip it at 1.2); r = 1.5 (A = +1) is clipped at 1.28; r = 0.5 (A = −1): min(−0.5, −0.8) = −0.8, clipped; r = 0.9
    (A = −1): −0.9. Loss = −(1.25 + 1.28 − 0.8 − 0.9) / 4 = −0.2075; gradients −A·r/4 where unclipped."""
    settings = LossSettings(epsilon_low=0.2, epsilon_high=0.28)
    loss, grad, sums = _run([1.25, 1.5, 0.5, 0.9], [1, 1, -1, -1], [0, 0, 1, 1], settings)
    assert loss == pytest.approx(-0.2075, abs=1e-6)
    assert grad == pytest.approx([-1.25 / 4, 0.0, 0.0, 0.9 / 4], abs=1e-6)
    assert sums["clipped"] == 2 and sums["ratio_sum"] == pytest.approx(4.15) and sums["ratio_max"] == pytest.approx(1.5)
    symmetric = _run([1.25], [1], [0], LossSettings())  # ε 0.2 both sides: clipped at 1.2, no gradient
    assert symmetric[0] == pytest.approx(-1.2) and symmetric[1] == [0.0]


def test_dual_clip_bounds_a_negative_advantage_term_at_c_times_a():
    """c = 3, A = −1. r = 4: PPO's min(−4, −1.2) = −4, the dual clip's max(−4, −3) = −3: bound, no gradient. r = 2:
    min(−2, −1.2) = −2 > −3, kept: gradient r/N = 1. Without the dual clip the r = 4 token pushes with 4/N."""
    loss, grad, sums = _run([4.0, 2.0], [-1, -1], [0, 1], LossSettings(dual_clip=3.0))
    assert loss == pytest.approx((3 + 2) / 2)
    assert grad == pytest.approx([0.0, 1.0])
    assert sums["dual_clipped"] == 1 and sums["clipped"] == 0
    plain = _run([4.0, 2.0], [-1, -1], [0, 1], LossSettings())
    assert plain[0] == pytest.approx((4 + 2) / 2) and plain[1] == pytest.approx([2.0, 1.0])
    assert _run([4.0], [1], [0], LossSettings(dual_clip=3.0))[0] == pytest.approx(-1.2)  # A > 0: untouched


@pytest.mark.parametrize(
    ("aggregation", "loss", "grad"),
    [
        # one sample of 1 token (A = +1), one of 3 tokens (A = −1), every ratio 1; constant = 2 × 4 = 8
        ("token_mean", -(1 - 3) / 4, [-1 / 4, 1 / 4, 1 / 4, 1 / 4]),  # every token 1/N
        ("sequence_mean", -(1 / 1 - 3 / 3) / 2, [-1 / 2, 1 / 6, 1 / 6, 1 / 6]),  # 1/(S · n_i)
        ("constant", -(1 - 3) / 8, [-1 / 8, 1 / 8, 1 / 8, 1 / 8]),  # 1/(batch_size · max_tokens)
    ],
)
def test_aggregation_weights_tokens_by_the_batch_sequence_or_a_constant(aggregation, loss, grad):
    settings = LossSettings(aggregation=aggregation, constant=8.0)
    got_loss, got_grad, _ = _run([1.0] * 4, [1, -1, -1, -1], [0, 1, 1, 1], settings)
    assert got_loss == pytest.approx(loss, abs=1e-7)
    assert got_grad == pytest.approx(grad)


def test_gspo_clips_a_whole_sequence_by_its_geometric_mean_ratio():
    """Sequence 0: ratios 2 and 1, geometric mean √2 = 1.414 > 1.2 with A = +1: both tokens clipped (PPO would clip
    only the first). Sequence 1: ratios 1.1 and 0.9, s = √0.99 = 0.99499, A = −1: inside, each token's gradient
    −A · s / (S · n_i) = 0.99499 / 4 (GSPO-token: ∂s_{i,t}/∂ log π(y_t) = s). Loss (sequence mean) =
    −½ (1.2 − 0.99499) = −0.102506."""
    settings = LossSettings(objective="gspo", aggregation="sequence_mean")
    s1 = math.sqrt(0.99)
    loss, grad, sums = _run([2.0, 1.0, 1.1, 0.9], [1, 1, -1, -1], [0, 0, 1, 1], settings)
    assert loss == pytest.approx(-0.5 * (1.2 - s1), abs=1e-6)
    assert grad == pytest.approx([0.0, 0.0, s1 / 4, s1 / 4], abs=1e-6)
    assert sums["clipped"] == 2
    ppo = _run([2.0, 1.0, 1.1, 0.9], [1, 1, -1, -1], [0, 0, 1, 1], LossSettings(aggregation="sequence_mean"))
    assert ppo[1] == pytest.approx([0.0, -1 / 4, 1.1 / 4, 0.9 / 4], abs=1e-6)


def test_cispo_keeps_a_clipped_tokens_gradient_with_its_weight_capped():
    """Weights clip(r, 0.8, 1.2) without gradient: r = 1.5 → 1.2, r = 0.5 → 0.8, r = 1.1 → 1.1. The term is
    w · A · log π, so its gradient is −w·A/N, also where PPO's would be 0 (r = 1.5, A = +1)."""
    ratios = [1.5, 0.5, 1.1]
    loss, grad, sums = _run(ratios, [1, 1, -1], [0, 1, 2], LossSettings(objective="cispo"))
    lp = [math.log(r) for r in ratios]
    assert loss == pytest.approx(-(1.2 * lp[0] + 0.8 * lp[1] - 1.1 * lp[2]) / 3, abs=1e-6)
    assert grad == pytest.approx([-1.2 / 3, -0.8 / 3, 1.1 / 3], abs=1e-6)
    assert sums["clipped"] == 2


def test_the_three_kl_estimators_and_their_gradients():
    """δ = log π − log π_ref = ln 2 and ln ½: k1 = δ; k2 = δ²/2; k3 = e^(−δ) − 1 + δ = 0.5 − 1 + ln 2 = 0.19315 and
    2 − 1 − ln 2 = 0.30685. Gradients in log π: 1; δ; 1 − e^(−δ) = 0.5 and −1."""
    ln2 = math.log(2)
    for estimator, values, grads in (
        ("k1", [ln2, -ln2], [1.0, 1.0]),
        ("k2", [ln2**2 / 2, ln2**2 / 2], [ln2, -ln2]),
        ("k3", [0.5 - 1 + ln2, 2 - 1 - ln2], [0.5, -1.0]),
    ):
        lp = torch.tensor([math.log(0.5), math.log(0.25)], requires_grad=True)
        k = kl_estimate(lp, torch.tensor([math.log(0.25), math.log(0.5)]), estimator)
        k.sum().backward()
        assert k.tolist() == pytest.approx(values, abs=1e-6), estimator
        assert lp.grad.tolist() == pytest.approx(grads, abs=1e-6), estimator
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(lp, lp, "k4")


def test_kl_term_adds_beta_times_the_aggregated_estimate_and_needs_the_reference():
    """A = 0 leaves the KL term alone: β · mean(k3) = 0.1 · (0.19315 + 0.30685) / 2 = 0.025."""
    settings = LossSettings(kl_coef=0.1)
    ref = [math.log(0.25), math.log(0.5)]
    loss, grad, sums = _run([0.5, 0.25], [0, 0], [0, 1], settings, ref=ref)
    assert loss == pytest.approx(0.1 * 0.5 / 2, abs=1e-7)
    assert grad == pytest.approx([0.1 * 0.5 / 2, 0.1 * -1.0 / 2], abs=1e-6)
    assert sums["kl_sum"] == pytest.approx(0.5) and sums["policy_loss"] == 0.0
    with pytest.raises(ValueError, match="reference"):
        _run([0.5], [0], [0], settings)


def test_truncation_caps_the_weight_a_tokens_gradient_carries():
    """Token level, cap 2, A = −1: r = 3 has PPO's unclipped term −3 (gradient 3); its factor min(1, 2/3) caps the
    gradient at 2. r = 1.5 is under the cap: untouched. Loss = (2 + 1.5)/2, gradients (2, 1.5)/2."""
    settings = LossSettings(correction="truncate", cap=2.0)
    loss, grad, sums = _run([3.0, 1.5], [-1, -1], [0, 1], settings)
    assert loss == pytest.approx(1.75, abs=1e-6)
    assert grad == pytest.approx([1.0, 0.75], abs=1e-6)
    assert sums["truncated"] == 1


def test_sequence_level_truncation_scales_a_sequence_by_its_geometric_mean_weight():
    """Ratios 4 and 1: geometric mean 2 > cap 1.5, factor 0.75 on both tokens; A = −1: terms −4 and −1 scaled to −3
    and −0.75. Loss (3 + 0.75)/2 = 1.875; gradients 4·0.75/2 = 1.5 and 0.375; 2 tokens truncated."""
    settings = LossSettings(correction="truncate", correction_level="sequence", cap=1.5)
    loss, grad, sums = _run([4.0, 1.0], [-1, -1], [0, 0], settings)
    assert loss == pytest.approx(1.875, abs=1e-6)
    assert grad == pytest.approx([1.5, 0.375], abs=1e-6)
    assert sums["truncated"] == 2


def test_masking_drops_tokens_outside_the_window_but_keeps_them_in_the_normaliser():
    """Window [0.5, 2], A = +1: weights 0.4 and 2.5 leave it (their terms 0.4 and 1.2 dropped), 1.0 stays. The loss
    is −1/3, not −1/1: the batch's 3 tokens still divide."""
    settings = LossSettings(correction="mask", low=0.5, high=2.0)
    loss, grad, sums = _run([0.4, 1.0, 2.5], [1, 1, 1], [0, 1, 2], settings)
    assert loss == pytest.approx(-1 / 3, abs=1e-6)
    assert grad == pytest.approx([0.0, -1 / 3, 0.0], abs=1e-6)
    assert sums["masked"] == 2


def test_sequence_level_masking_judges_a_sequence_by_its_geometric_mean():
    """Sequence 0: weights 0.4 and 2.5, geometric mean 1: kept whole (token level would drop both); sequence 1:
    weight 3: dropped."""
    settings = LossSettings(correction="mask", correction_level="sequence", low=0.5, high=2.0)
    loss, _, sums = _run([0.4, 2.5, 3.0], [1, 1, 1], [0, 0, 1], settings)
    assert sums["masked"] == 1
    assert loss == pytest.approx(-(0.4 + 1.2) / 3, abs=1e-6)


SETTINGS = [
    LossSettings(
        objective=o,
        aggregation=a,
        dual_clip=3.0 if o != "cispo" else None,
        kl_coef=0.05,
        correction=c,
        correction_level=lv,
        constant=40.0,
        cap=1.3,
        low=0.8,
        high=1.25,
    )
    for o, a, c, lv in itertools.product(
        ("ppo_clip", "gspo", "cispo"),
        ("token_mean", "sequence_mean", "constant"),
        ("none", "truncate", "mask"),
        ("token", "sequence"),
    )
]


@pytest.mark.parametrize(
    "settings", SETTINGS, ids=lambda s: f"{s.objective}-{s.aggregation}-{s.correction}-{s.correction_level}"
)
def test_parts_that_never_split_a_sample_add_up_to_the_whole_batch(settings):
    """Five samples of 1–4 tokens with random ratios around 1, cut into parts (as micro-batches and ranks cut them)
    with the batch's normaliser: the parts' losses and gradients add up to the whole batch's."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 4, 2, 3]
    samples = torch.repeat_interleave(torch.arange(5), torch.tensor(lengths))
    n = len(samples)
    logprobs = (-1.0 + 0.4 * torch.randn(n, generator=g)).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(n, generator=g)
    ref = logprobs.detach() + 0.2 * torch.randn(n, generator=g)
    adv = torch.tensor([0.5, -1.0, 1.0, -0.25, 0.75])[samples]
    z = normaliser(settings, n, 5)
    whole, whole_sums = loss_sums(logprobs, old, adv, samples, settings, z, ref)
    (want,) = torch.autograd.grad(whole, logprobs)
    total, grads, clipped = 0.0, torch.zeros(n), 0.0
    for part in ([0, 2], [1], [3, 4]):  # samples by part; ids renumbered inside a part, as a micro-batch does
        at = torch.cat([torch.nonzero(samples == i).flatten() for i in part])
        local = torch.cat([torch.full((lengths[i],), k) for k, i in enumerate(part)])
        loss, sums = loss_sums(logprobs[at], old[at], adv[at], local, settings, z, ref[at])
        (g_part,) = torch.autograd.grad(loss, logprobs)
        total, grads, clipped = total + loss.item(), grads + g_part, clipped + float(sums["clipped"])
    assert total == pytest.approx(whole.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grads, want, rtol=1e-5, atol=1e-7)
    assert clipped == float(whole_sums["clipped"])
