"""Token-level, importance-weighted, clipped policy-gradient loss.

For every completion token ``t`` of sample ``i`` (``m_{i,t} = 1``)::

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
are not down-weighted.
"""

from __future__ import annotations

import torch


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


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    ratio_clip: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss in the module docstring.

    Args:
        logprobs: ``[B, T]`` under the current policy (differentiable).
        old_logprobs: ``[B, T]`` under the sampling policy.
        advantages: ``[B]``, one per sample.
        loss_mask: ``[B, T]`` bool, True where a completion token is scored.
        ratio_clip: ε.

    Returns:
        ``(loss, stats)``; stats: ``clip_fraction`` (share of masked tokens where the clipped
        term was chosen), ``ratio_mean``, ``ratio_max``, ``tokens``.

    Raises:
        ValueError: ``loss_mask`` selects no token.
    """
    mask = loss_mask.to(logprobs.dtype)
    n_tokens = mask.sum()
    if n_tokens.item() == 0:
        raise ValueError("loss_mask selects no token")
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None].to(logprobs.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - ratio_clip, 1 + ratio_clip) * adv
    surrogate = torch.minimum(unclipped, clipped)
    loss = -(surrogate * mask).sum() / n_tokens
    with torch.no_grad():
        sel = loss_mask
        stats = {
            "clip_fraction": float(((clipped < unclipped) & sel).sum() / n_tokens),
            "ratio_mean": float(ratio[sel].mean()),
            "ratio_max": float(ratio[sel].max()),
            "tokens": int(n_tokens.item()),
        }
    return loss, stats
