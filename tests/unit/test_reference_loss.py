import math

import pytest
import torch
from rlrun.training.reference_loss import batch_loss, token_entropy, token_logprobs


def _two_tokens(advantage: float):
    logprobs = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    old = torch.tensor([[math.log(0.4), math.log(0.25)]])
    mask = torch.tensor([[True, True]])
    return logprobs, old, torch.tensor([advantage]), mask


def test_two_token_loss_positive_advantage_is_clipped_on_the_first_token():
    # token 1: ratio 0.5/0.4 = 1.25 > 1 + 0.2 → min(1.25·1, 1.2·1) = 1.2; token 2: ratio 1 → 1.
    logprobs, old, adv, mask = _two_tokens(1.0)
    loss, stats = batch_loss(logprobs, old, adv, mask)
    assert loss.item() == pytest.approx(-(1.2 + 1.0) / 2)
    loss.backward()
    # the clipped token gets no gradient; the other gets -A·ratio / n_tokens = -0.5
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -0.5])
    assert stats["clip_fraction"] == pytest.approx(0.5)
    assert stats["tokens"] == 2
    assert stats["ratio_max"] == pytest.approx(1.25)


def test_two_token_loss_negative_advantage_keeps_the_unclipped_term():
    # A = -1: min(-1.25, -1.2) = -1.25 (pessimistic bound), min(-1, -1) = -1.
    logprobs, old, adv, mask = _two_tokens(-1.0)
    loss, stats = batch_loss(logprobs, old, adv, mask)
    assert loss.item() == pytest.approx((1.25 + 1.0) / 2)
    loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([1.25 / 2, 0.5])
    assert stats["clip_fraction"] == 0.0


def test_loss_averages_over_tokens_not_sequences():
    # sequence 0 has 1 token with advantage +1, sequence 1 has 3 tokens with advantage -1, all ratios 1.
    logprobs = torch.zeros(2, 3)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    loss, _ = batch_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask)
    assert loss.item() == pytest.approx(-(1 - 3) / 4)


def test_loss_rejects_empty_mask():
    with pytest.raises(ValueError, match="no token"):
        batch_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.zeros(1, 2, dtype=torch.bool))


def test_token_logprobs_align_with_next_tokens_and_temperature():
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(3.0), 0.0], [0.0, 0.0]]])
    ids = torch.tensor([[0, 1, 0]])
    lp = token_logprobs(logits, ids)
    assert lp.shape == (1, 2)
    assert lp[0].tolist() == pytest.approx([math.log(0.75), math.log(0.75)])
    lp_t = token_logprobs(logits, ids, temperature=2.0)
    p = math.sqrt(3) / (1 + math.sqrt(3))
    assert lp_t[0].tolist() == pytest.approx([math.log(p), math.log(p)])


def test_token_entropy_of_uniform_and_peaked_distributions():
    v = 7
    uniform = token_entropy(torch.zeros(2, 4, v))
    assert uniform.shape == (2, 3)  # one per position that predicts a next token
    assert uniform.flatten().tolist() == pytest.approx([math.log(v)] * 6)
    peaked = torch.full((1, 3, v), -1e4)
    peaked[..., 2] = 1e4
    assert token_entropy(peaked).flatten().tolist() == pytest.approx([0.0, 0.0], abs=1e-6)
    masked = torch.tensor([[[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0]]])  # p = 0 adds nothing, not NaN
    assert token_entropy(masked).item() == pytest.approx(math.log(2))


def test_token_entropy_is_of_the_distribution_at_the_sampling_temperature():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    for temperature in (0.5, 1.0, 2.0):
        expected = torch.distributions.Categorical(logits=logits[:, :-1] / temperature).entropy()
        assert torch.allclose(token_entropy(logits, temperature), expected, atol=1e-5)
    # a higher temperature flattens the distribution: the entropy grows toward log V
    cold, warm = token_entropy(logits, 0.5), token_entropy(logits, 2.0)
    assert (cold < token_entropy(logits)).all() and (token_entropy(logits) < warm).all()
    assert (warm < math.log(11)).all()
    # two tokens with logits (0, log 3): p = (1/4, 3/4) at T = 1, (1, √3)/(1 + √3) at T = 2
    two = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])
    h = lambda p: -(p * math.log(p) + (1 - p) * math.log(1 - p))  # noqa: E731
    assert token_entropy(two).item() == pytest.approx(h(0.25))
    assert token_entropy(two, 2.0).item() == pytest.approx(h(1 / (1 + math.sqrt(3))))
