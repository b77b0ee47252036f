"""The reference (test oracle) of the trainer's step: token-level log-probabilities and entropy on full logits, and
the loss over a batch in one piece — what the chunked LM head (:mod:`rlrun.training.logprobs`) and the micro-batched
step (:mod:`rlrun.training.step`) must equal, written the plain way (the loss's formulas are
:mod:`rlrun.training.objectives`).

By default (``spec.loss`` untouched), for every completion token ``t`` of sample ``i`` (``m_{i,t} = 1``)::

    r_{i,t} = exp(log π_θ(y_t | x, y_<t) − log μ(y_t | x, y_<t))
    L = − Σ_{i,t} m_{i,t} · min(r_{i,t} · A_i, clip(r_{i,t}, 1 − ε, 1 + ε) · A_i) / Σ_{i,t} m_{i,t}

``π_θ`` is the policy being trained and ``μ`` the policy that sampled the tokens,
whose logprobs vLLM returned: with asynchronous, off-policy rollouts (up to
``max_off_policy_steps`` old) and with inference/training numerics differing, the
ratio corrects for the mismatch and the clip bounds the update, as in PPO's
clipped surrogate objective (Schulman et al. 2017, "Proximal Policy Optimization
Algorithms", eq. 7) with GRPO's group-relative advantages ``A_i`` (Shao et al. 2024,
DeepSeekMath). Tokens are averaged over the whole batch, not per sequence first
(DAPO, Yu et al. 2025, "token-level policy gradient loss"), so long completions
are not down-weighted. The other objectives, clips, aggregations, the KL term and the mismatch correction of
``spec.loss`` are :mod:`rlrun.training.objectives`; :func:`batch_loss` applies them to a whole batch at once.
"""

from __future__ import annotations

import torch

from rlrun.training.objectives import LossSettings, loss_sums, normaliser


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the next tokens.

    Args:
        logits: ``[B, T, V]`` model outputs.
        input_ids: ``[B, T]``.
        temperature: the sampling temperature (vLLM's processed logprobs are of ``logits / temperature``).

    Returns:
        ``[B, T-1]``: ``log softmax(logits[:, t] / temperature)[input_ids[:, t + 1]]``.
    """
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distributions, nats: ``H = −Σ_v p_v log p_v`` with
    ``p = softmax(logits[:, t] / temperature)``, the distribution :func:`token_logprobs` reads (the
    one the tokens were sampled from). A policy collapsing to one answer shows as H falling to 0.

    Args:
        logits: ``[B, T, V]`` model outputs.
        temperature: the sampling temperature.

    Returns:
        ``[B, T-1]``: the entropy at each position that predicts a next token (``log V`` at most).
    """
    p = torch.softmax(logits[:, :-1].float() / temperature, dim=-1)
    # entr(p) = −p log p with entr(0) = 0: a −inf logit (a masked vocabulary entry) adds 0, not NaN; and
    # one [B, T-1, V] temporary fewer than −(exp(logp) · logp)
    return torch.special.entr(p).sum(-1)


def batch_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    settings: LossSettings | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of ``spec.loss`` (:mod:`rlrun.training.objectives`) over one batch in one piece, each row a sample:
    the reference the micro-batched step (:mod:`rlrun.training.step`) must equal.

    Args:
        logprobs: ``[B, T]`` under the current policy (differentiable).
        old_logprobs: ``[B, T]`` under the sampling policy.
        advantages: ``[B]``, one per sample.
        loss_mask: ``[B, T]`` bool, True where a completion token is scored.
        settings: the loss (default: PPO's clip, ε = 0.2, token mean).
        ref_logprobs: ``[B, T]`` under the reference policy (with ``kl_coef > 0``).

    Returns:
        ``(loss, stats)``; stats: ``clip_fraction`` (share of masked tokens whose clip bound), ``ratio_mean``,
        ``ratio_max``, ``tokens``, and the shares ``dual_clip_fraction``, ``is_truncated_fraction``,
        ``is_masked_fraction`` and the mean ``kl_ref`` (nats/token).

    Raises:
        ValueError: ``loss_mask`` selects no token.
    """
    settings = settings or LossSettings()
    n_tokens = int(loss_mask.sum())
    if n_tokens == 0:
        raise ValueError("loss_mask selects no token")
    rows = torch.arange(loss_mask.shape[0], device=loss_mask.device)[:, None].expand_as(loss_mask)
    adv = advantages[:, None].expand_as(loss_mask)
    sequences = int((loss_mask.sum(dim=1) > 0).sum())
    ref = ref_logprobs[loss_mask] if ref_logprobs is not None else None
    loss, sums = loss_sums(
        logprobs[loss_mask],
        old_logprobs[loss_mask],
        adv[loss_mask],
        rows[loss_mask],
        settings,
        normaliser(settings, n_tokens, sequences),
        ref,
    )
    stats = {
        "clip_fraction": float(sums["clipped"]) / n_tokens,
        "ratio_mean": float(sums["ratio_sum"]) / n_tokens,
        "ratio_max": float(sums["ratio_max"]),
        "tokens": n_tokens,
        "dual_clip_fraction": float(sums["dual_clipped"]) / n_tokens,
        "is_truncated_fraction": float(sums["truncated"]) / n_tokens,
        "is_masked_fraction": float(sums["masked"]) / n_tokens,
        "kl_ref": float(sums["kl_sum"]) / n_tokens,
    }
    return loss, stats
