"""The chunked LM head (``rlrun.training.logprobs``): today's ``token_logprobs`` / ``token_entropy`` values and
gradients without the ``[B, T, V]`` logits, and, under top-p, the distribution vLLM sampled from."""

from __future__ import annotations

import math

import pytest
import torch
from rlrun.training.logprobs import chunked_token_stats, head_returns_token_stats, nucleus_threshold
from rlrun.training.reference_loss import token_entropy, token_logprobs


def _inputs(seed: int = 0, b: int = 3, t: int = 9, h: int = 16, v: int = 50, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g).requires_grad_()
    weight = (0.5 * torch.randn(v, h, generator=g)).requires_grad_()
    b_ = (0.3 * torch.randn(v, generator=g)).requires_grad_() if bias else None
    ids = torch.randint(0, v, (b, t), generator=g)
    return hidden, weight, b_, ids


def _grads(*tensors) -> list[torch.Tensor]:
    out = [t.grad.clone() for t in tensors if t is not None]
    for t in tensors:
        if t is not None:
            t.grad = None
    return out


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_values_and_gradients_equal_todays_full_logits(chunk, bias):
    hidden, weight, b, ids = _inputs(bias=bias)
    temperature = 0.7
    logits = hidden @ weight.T + (b if b is not None else 0)
    lp, ent = token_logprobs(logits, ids, temperature), token_entropy(logits, temperature)
    g = torch.Generator().manual_seed(1)
    up_lp, up_ent = torch.randn(lp.shape, generator=g), torch.randn(ent.shape, generator=g)
    (lp * up_lp + ent * up_ent).sum().backward()
    expected = _grads(hidden, weight, b)

    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # the positions that predict a next token
    lp2, ent2 = chunked_token_stats(h, weight, ids[:, 1:].reshape(-1), temperature, 1.0, chunk, bias=b)
    torch.testing.assert_close(lp2, lp.reshape(-1), rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(ent2, ent.reshape(-1), rtol=1e-5, atol=2e-6)
    (lp2 * up_lp.reshape(-1) + ent2 * up_ent.reshape(-1)).sum().backward()
    for got, want in zip(_grads(hidden, weight, b), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_only_the_logprob_gradient_is_computed_when_the_entropy_is_a_metric():
    hidden, weight, _, ids = _inputs()
    h, targets = hidden[:, :-1].reshape(-1, 16), ids[:, 1:].reshape(-1)
    lp, ent = chunked_token_stats(h, weight, targets, 1.0, 1.0, 5)
    lp.sum().backward()
    got = _grads(hidden, weight)
    token_logprobs(hidden @ weight.T, ids).sum().backward()
    for a, b in zip(got, _grads(hidden, weight), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert torch.isfinite(ent).all()


def test_a_forward_without_the_entropy_gives_the_same_logprobs_and_gradients_and_no_entropy():
    """What the KL term's reference runs (``with_entropy=False``): the logprobs and their gradients of the full pass,
    top-p included; the entropy is NaN (not computed), never a stale value."""
    hidden, weight, _, ids = _inputs()
    h, targets = hidden[:, :-1].reshape(-1, 16), ids[:, 1:].reshape(-1)
    for top_p in (1.0, 0.8):
        lp, _ = chunked_token_stats(h, weight, targets, 0.9, top_p, 5)
        lp.sum().backward()
        want = _grads(hidden, weight)
        lp2, ent2 = chunked_token_stats(h, weight, targets, 0.9, top_p, 5, with_entropy=False)
        assert torch.equal(lp2, lp) and torch.isnan(ent2).all()
        lp2.sum().backward()
        for a, b in zip(_grads(hidden, weight), want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bfloat16_compute_is_the_bf16_matmul_with_float32_softmax_and_a_float32_weight_gradient():
    hidden, weight, _, ids = _inputs()
    h, targets = hidden[:, :-1].reshape(-1, 16), ids[:, 1:].reshape(-1)
    lp, _ = chunked_token_stats(h, weight, targets, 1.0, 1.0, 4, compute_dtype=torch.bfloat16)
    expected = token_logprobs((hidden.bfloat16() @ weight.bfloat16().T).float(), ids).reshape(-1)
    torch.testing.assert_close(lp, expected, rtol=1e-5, atol=1e-5)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.float32


# --- top-p: the distribution vLLM sampled from --------------------------------------------------------------


def _vocab(probs: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden [1, V], weight [V, V])`` whose logits are ``log probs``: the identity head."""
    return torch.tensor([probs]).log(), torch.eye(len(probs))


def test_top_p_keeps_vllms_nucleus_and_renormalises_over_it():
    # vLLM's rule at top_p 0.8: ascending (.03, .07, .15, .25, .5), cumulative (.03, .10, .25, .5, 1);
    # masked where ≤ 1 − 0.8 = 0.2: .03 and .07. Kept mass S = 0.9.
    probs = [0.5, 0.25, 0.15, 0.07, 0.03]
    z, eye = _vocab(probs)
    assert nucleus_threshold(z, 0.8).item() == pytest.approx(math.log(0.15))
    kept = [0.5, 0.25, 0.15]
    s = sum(kept)
    for token, p in enumerate(kept):
        lp, ent = chunked_token_stats(z, eye, torch.tensor([token]), top_p=0.8)
        assert lp.item() == pytest.approx(math.log(p / s), abs=1e-6)
        assert ent.item() == pytest.approx(-sum(q / s * math.log(q / s) for q in kept), abs=1e-6)
    # over the whole vocabulary (today's trainer) the sampled token's logprob is lower by −log S: the ratio of an
    # on-policy token would be S = 0.9, not 1 (huggingface/trl#6789)
    full = token_logprobs(torch.cat([z, z]).unsqueeze(0), torch.tensor([[0, 0]])).item()
    assert full - math.log(0.5 / s) == pytest.approx(math.log(s), abs=1e-6)


def test_a_sampled_token_outside_the_trainers_nucleus_keeps_its_own_probability():
    """A token vLLM sampled at the nucleus's boundary, which the trainer's logits put just outside: it is kept
    (prime-rl PR #2601), never a −inf logprob."""
    probs = [0.5, 0.25, 0.15, 0.07, 0.03]
    z, eye = _vocab(probs)
    lp, ent = chunked_token_stats(z, eye, torch.tensor([3]), top_p=0.8)
    kept = [0.5, 0.25, 0.15, 0.07]
    assert lp.item() == pytest.approx(math.log(0.07 / sum(kept)), abs=1e-6)
    assert math.isfinite(ent.item())


def test_top_p_matches_vllms_rule_on_random_logits_with_gradients_through_the_kept_tokens():
    g = torch.Generator().manual_seed(3)
    n, v = 40, 200
    z = 3 * torch.randn(n, v, generator=g)
    for top_p in (0.3, 0.8, 0.95):
        # vLLM's apply_top_k_top_p_pytorch (top-k off), written out: the reference this module mirrors
        ascending, order = z.sort(dim=-1)
        cut = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        cut[:, -1] = False
        masked = z.clone().scatter_(-1, order, ascending.masked_fill(cut, float("-inf")))
        vllm_logp = masked.log_softmax(-1)
        targets = torch.multinomial(vllm_logp.exp(), 1, generator=g).squeeze(-1)
        hidden = z.clone().requires_grad_()
        lp, ent = chunked_token_stats(hidden, torch.eye(v), targets, 1.0, top_p, chunk_tokens=7)
        torch.testing.assert_close(lp, vllm_logp.gather(-1, targets[:, None]).squeeze(-1), rtol=0, atol=2e-6)
        torch.testing.assert_close(ent, torch.special.entr(vllm_logp.exp()).sum(-1), rtol=0, atol=5e-6)
        # gradient: the masked log-softmax's, the mask a constant
        (lp.sum() + 0.5 * ent.sum()).backward()
        ref = z.clone().requires_grad_()
        ref_logp = ref.masked_fill(masked == float("-inf"), float("-inf")).log_softmax(-1)
        p = ref_logp.exp()
        ref_ent = -(p * ref_logp.masked_fill(p == 0, 0.0)).sum(-1)
        (ref_logp.gather(-1, targets[:, None]).sum() + 0.5 * ref_ent.sum()).backward()
        torch.testing.assert_close(hidden.grad, ref.grad, rtol=1e-4, atol=1e-5)


def test_top_p_of_one_truncates_nothing():
    hidden, weight, _, ids = _inputs()
    h, targets = hidden[:, :-1].reshape(-1, 16), ids[:, 1:].reshape(-1)
    a = chunked_token_stats(h, weight, targets, 0.9, 1.0, 4)
    b = chunked_token_stats(h, weight, targets, 0.9, 1.0 - 1e-9, 4)  # the nucleus is (almost) everything
    torch.testing.assert_close(a[0], b[0])


def test_bad_settings_are_refused():
    hidden, weight, _, ids = _inputs()
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_stats(hidden[0], weight, ids[0], chunk_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        chunked_token_stats(hidden[0], weight, ids[0], top_p=0.0)


# --- inside the model's forward ------------------------------------------------------------------------------


def test_the_models_head_returns_the_stats_of_the_trained_positions_only(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 60, (2, 8), generator=g)
    positions = torch.zeros(2, 8, dtype=torch.bool)
    positions[0, 2:6] = positions[1, 4:7] = True
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    with head_returns_token_stats(model, positions, targets, 0.8, 1.0, 3, torch.float32) as returned:
        out = model(input_ids=ids, use_cache=False)
    assert out.logits is returned[0] and out.logits.shape == (7, 2)
    assert "forward" not in vars(model.lm_head)  # the head is itself again
    full = model(input_ids=ids, use_cache=False).logits
    lp = token_logprobs(full, ids, 0.8)
    torch.testing.assert_close(out.logits[:, 0], lp[positions[:, :-1]], rtol=1e-5, atol=1e-5)
