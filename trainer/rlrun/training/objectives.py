"""The policy-gradient loss of ``spec.loss``: each trained token's term and how the terms become the loss.

Every formula here is written out, with its source and its spec field, in ``docs/algorithms.md``; in short, for a
trained token ``t`` of sample ``i`` (``d_t = log π_θ(y_t) − log μ(y_t)``, ``μ`` the sampler whose logprobs vLLM
returned, ``A_i`` the sample's advantage)::

    ratio       ρ_t = exp(d_t)                                    ppo_clip, cispo
                ρ_t = exp(sg[mean_{s∈i} d_s] + log π_θ(y_t) − sg[log π_θ(y_t)])   gspo (value: the sequence's
                                                                  geometric-mean ratio; gradient: GSPO-token's)
    surrogate   s_t = min(ρ_t A_i, clip(ρ_t, 1 − ε_low, 1 + ε_high) A_i)          ppo_clip, gspo
                s_t = max(s_t, c · A_i) where A_i < 0                            with dual_clip c
                s_t = sg[clip(ρ_t, 1 − ε_low, 1 + ε_high)] · A_i · log π_θ(y_t)  cispo
    correction  f_t = min(1, cap / w)  (truncate)  |  1[low ≤ w ≤ high]  (mask)  |  1  (none),
                w = sg[exp(d_t)] (level token) or sg[exp(mean_{s∈i} d_s)] (level sequence)
    KL          k_t = δ | δ²/2 | e^(−δ) − 1 + δ    (k1 | k2 | k3), δ = log π_θ(y_t) − log π_ref(y_t)
    token term  ℓ_t = −f_t · s_t + β · k_t
    loss        L = Σ_t a_t ℓ_t,  a_t = 1/N (token_mean) | 1/(S · n_i) (sequence_mean) | 1/(batch_size · max_tokens)
                (constant)

``sg`` is stop-gradient, ``N`` the batch's trained tokens, ``S`` its samples with a trained token, ``n_i`` sample
``i``'s trained tokens. The correction's weight is read at the step's start — the forward runs on the weights before
the step, so ``sg[π_θ]`` *is* the proximal (old) policy of decoupled PPO, at no extra forward.

Guarantee: :func:`loss_sums` over any partition of a batch into parts that never split a sample (micro-batches,
ranks), each given the whole batch's normaliser (:func:`normaliser`), adds up to the whole batch's loss and gradient:
every quantity above is a token's own or its sample's (a sequence mean, ``n_i``), and the only batch-wide ones,
``N``, ``S`` and the constant, are the normaliser. A masked token stays in ``N`` and its sample in ``S``: the
normaliser is known before any forward, as IcePop's objective and TRL's masked importance sampling keep it.
"""

from __future__ import annotations

from typing import Any

import torch

from rlrun.api.algorithm import LossSpec

#: The detached sums :func:`loss_sums` returns, in this order (summed over parts, then divided by the batch's
#: counts: :mod:`rlrun.training.step`).
SUM_KEYS = ("clipped", "ratio_sum", "dual_clipped", "truncated", "masked", "kl_sum", "policy_loss")


#: Where each of :class:`LossSettings`' plain names is set in :class:`~rlrun.api.algorithm.LossSpec`
#: (the two sides of the clip as ``clip_low``/``clip_high``, the correction's in ``importance_correction``).
_SPEC_PATH = {
    "objective": ("objective",),
    "epsilon_low": ("clip_low",),
    "epsilon_high": ("clip_high",),
    "dual_clip": ("dual_clip",),
    "aggregation": ("aggregation",),
    "kl_coef": ("kl_coef",),
    "kl_estimator": ("kl_estimator",),
    "correction": ("importance_correction", "mode"),
    "correction_level": ("importance_correction", "level"),
    "cap": ("importance_correction", "cap"),
    "low": ("importance_correction", "low"),
    "high": ("importance_correction", "high"),
}


class LossSettings:
    """The loss's settings: ``spec.loss`` (a :class:`~rlrun.api.algorithm.LossSpec`, which holds every
    default and allowed value) and the constant normaliser from the spec, read by plain names.

    ``LossSettings(loss, constant)`` holds a spec's loss; ``LossSettings(constant=…, **values)`` builds
    one from plain names (tests, benchmarks), validated as a manifest's would be. Two settings are equal
    when every plain value and the constant are (``ratio_clip: 0.3`` equals ``epsilon_low = epsilon_high
    = 0.3``).

    Attributes:
        loss: the spec's loss settings.
        constant: ``batch_size × sampling.max_tokens``, the ``constant`` aggregation's normaliser (tokens).
        objective: ``ppo_clip``, ``gspo`` or ``cispo``.
        epsilon_low: ε below 1 (the ratio's clip floor is ``1 − epsilon_low``).
        epsilon_high: ε above 1 (the ceiling ``1 + epsilon_high``).
        dual_clip: ``c > 1`` bounding a negative advantage's surrogate at ``c · A``; None: off.
        aggregation: ``token_mean``, ``sequence_mean`` or ``constant``.
        kl_coef: β of the KL penalty (0: off).
        kl_estimator: ``k1``, ``k2`` or ``k3``.
        correction: ``none``, ``truncate`` or ``mask``.
        correction_level: ``token`` or ``sequence``.
        cap: the truncation's cap.
        low: the mask's lower bound.
        high: the mask's upper bound.

    Raises:
        TypeError: a name that is none of the above, or ``loss`` given with plain values.
        pydantic.ValidationError: a plain value ``spec.loss`` refuses.
    """

    __slots__ = ("constant", "loss")

    def __init__(self, loss: LossSpec | None = None, constant: float = 1.0, **values: Any) -> None:
        if loss is not None and values:
            raise TypeError(f"give a LossSpec or plain values, not both (got {sorted(values)})")
        if unknown := sorted(set(values) - set(_SPEC_PATH)):
            raise TypeError(f"unknown loss settings {unknown}: the names are {list(_SPEC_PATH)}")
        if loss is None:
            nested: dict[str, Any] = {}
            for name, value in values.items():
                *outer, last = _SPEC_PATH[name]
                place = nested
                for key in outer:
                    place = place.setdefault(key, {})
                place[last] = value
            loss = LossSpec.model_validate(nested)
        self.loss = loss
        self.constant = float(constant)

    @classmethod
    def from_spec(cls, spec) -> LossSettings:
        """The settings of an :class:`~rlrun.api.spec.RLRunSpec` (``loss``; ``batch_size`` and
        ``sampling.max_tokens`` for the constant normaliser)."""
        return cls(spec.loss, constant=float(spec.batch_size * spec.sampling.max_tokens))

    @property
    def objective(self) -> str:
        return self.loss.objective

    @property
    def epsilon_low(self) -> float:
        return self.loss.epsilon_low

    @property
    def epsilon_high(self) -> float:
        return self.loss.epsilon_high

    @property
    def dual_clip(self) -> float | None:
        return self.loss.dual_clip

    @property
    def aggregation(self) -> str:
        return self.loss.aggregation

    @property
    def kl_coef(self) -> float:
        return self.loss.kl_coef

    @property
    def kl_estimator(self) -> str:
        return self.loss.kl_estimator

    @property
    def correction(self) -> str:
        return self.loss.importance_correction.mode

    @property
    def correction_level(self) -> str:
        return self.loss.importance_correction.level

    @property
    def cap(self) -> float:
        return self.loss.importance_correction.cap

    @property
    def low(self) -> float:
        return self.loss.importance_correction.low

    @property
    def high(self) -> float:
        return self.loss.importance_correction.high

    @property
    def uses_reference(self) -> bool:
        """Whether the loss has a KL term, hence needs the reference policy's logprobs."""
        return self.kl_coef > 0

    def _values(self) -> tuple:
        return (*(getattr(self, name) for name in _SPEC_PATH), self.constant)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LossSettings) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        values = ", ".join(f"{name}={getattr(self, name)!r}" for name in (*_SPEC_PATH, "constant"))
        return f"LossSettings({values})"


def normaliser(settings: LossSettings, tokens: float, sequences: float) -> float:
    """The whole batch's normaliser: ``tokens`` (``token_mean``: its trained tokens), ``sequences``
    (``sequence_mean``: its samples with a trained token; each token is further divided by its sample's count) or
    ``settings.constant`` (``constant``)."""
    return {"token_mean": tokens, "sequence_mean": sequences, "constant": settings.constant}[settings.aggregation]


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per token, J. Schulman's estimators ("Approximating KL Divergence", 2020) of ``KL(π_θ ‖ π_ref)`` from
    ``δ = log π_θ − log π_ref`` at a sampled token: ``k1 = δ`` (unbiased, can be negative), ``k2 = δ²/2`` (biased,
    low variance), ``k3 = e^(−δ) − 1 + δ`` (unbiased, ≥ 0: GRPO's, DeepSeekMath eq. 4). Shapes ``[N]`` → ``[N]``,
    nats; differentiable in ``logprobs``.

    Raises:
        ValueError: an unknown estimator.
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2 or k3)")


def _per_sample_mean(values: torch.Tensor, samples: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[N]``: at each token, the mean of ``values`` over its sample's tokens (``counts [N]``: their number)."""
    total = torch.zeros(int(samples.max()) + 1 if samples.numel() else 0, dtype=values.dtype, device=values.device)
    return total.index_add_(0, samples, values)[samples] / counts


def loss_sums(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    samples: torch.Tensor,
    settings: LossSettings,
    normaliser: float,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A part's share of the loss (module docstring): ``Σ_t a_t ℓ_t`` over its trained tokens.

    Args:
        logprobs: ``[N]`` under the policy being trained (differentiable), at the part's trained tokens.
        old_logprobs: ``[N]`` under the sampler (vLLM's).
        advantages: ``[N]``, each token's sample's advantage.
        samples: ``[N]`` int64, which sample each token is of (any ids, one per sample); every trained token of a
            sample is in the part.
        settings: :class:`LossSettings`.
        normaliser: the whole batch's (:func:`normaliser`).
        ref_logprobs: ``[N]`` under the reference policy; required when ``settings.kl_coef > 0``.

    Returns:
        ``(loss, sums)``: ``loss`` differentiable; ``sums`` (:data:`SUM_KEYS`, detached scalars): ``clipped``
        (tokens whose clip bound: the clipped term chosen, or for ``cispo`` the weight clipped), ``ratio_sum`` (of
        the token ratio ``exp(d_t)``), ``dual_clipped`` (tokens the dual clip bound), ``truncated`` (tokens whose
        weight was capped), ``masked`` (tokens dropped), ``kl_sum`` (``Σ k_t``, unweighted), ``policy_loss`` (``Σ
        a_t · (−f_t s_t)``); and ``ratio_max`` (−inf when ``N = 0``).

    Raises:
        ValueError: ``kl_coef > 0`` without ``ref_logprobs``.
    """
    log_r = logprobs - old_logprobs
    adv = advantages.to(log_r.dtype)
    counts = torch.bincount(samples)[samples].to(log_r.dtype)  # n_i at each token (empty: empty)
    seq_log_r = _per_sample_mean(log_r.detach(), samples, counts)
    # gspo: Zheng et al. 2025, GSPO-token: its value the sequence's s_i, its gradient s_i ∇log π(y_t)
    gspo = settings.objective == "gspo"
    ratio = torch.exp(seq_log_r + logprobs - logprobs.detach() if gspo else log_r)
    clamped = torch.clamp(ratio, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
    zero = torch.zeros((), dtype=torch.float64, device=log_r.device)
    dual_clipped = zero
    if settings.objective == "cispo":  # MiniMax-M1 (2025), CISPO: the clipped ratio as a stop-gradient weight
        surrogate = clamped.detach() * adv * logprobs
        clipped = clamped.detach() != ratio.detach()
    else:  # PPO (Schulman et al. 2017), eq. 7, with DAPO's two ε
        unclipped, clipped_term = ratio * adv, clamped * adv
        surrogate = torch.minimum(unclipped, clipped_term)
        clipped = clipped_term.detach() < unclipped.detach()
        if settings.dual_clip is not None:  # Ye et al. 2020, dual-clip PPO: a negative advantage's term ≥ c · A
            bound = settings.dual_clip * adv
            binds = (adv < 0) & (surrogate.detach() < bound)
            surrogate = torch.where(binds, bound, surrogate)
            dual_clipped = binds.sum()
    with torch.no_grad():
        weight = torch.exp(seq_log_r if settings.correction_level == "sequence" else log_r.detach())
        factor, truncated, masked = None, zero, zero
        if settings.correction == "truncate":  # TIS (Yao et al. 2025): the gradient's weight min(w, cap)
            factor = torch.clamp(settings.cap / weight, max=1.0)
            truncated = (weight > settings.cap).sum()
        elif settings.correction == "mask":  # masked IS (IcePop, 2025): drop what leaves [low, high]
            keep = (weight >= settings.low) & (weight <= settings.high)
            factor = keep.to(log_r.dtype)
            masked = (~keep).sum()
    policy = surrogate if factor is None else surrogate * factor
    share = 1.0 / normaliser if settings.aggregation != "sequence_mean" else 1.0 / (normaliser * counts)
    policy_loss = -(share * policy).sum()
    loss, kl_sum = policy_loss, zero
    if settings.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("loss.kl_coef > 0 needs the reference policy's logprobs")
        kl = kl_estimate(logprobs, ref_logprobs, settings.kl_estimator)
        loss = loss + settings.kl_coef * (share * kl).sum()
        kl_sum = kl.detach().sum()
    with torch.no_grad():
        token_ratio = torch.exp(log_r.detach())
        sums = {
            "clipped": clipped.sum(),
            "ratio_sum": token_ratio.sum(),
            "dual_clipped": dual_clipped,
            "truncated": truncated,
            "masked": masked,
            "kl_sum": kl_sum,
            "policy_loss": policy_loss.detach(),
            "ratio_max": token_ratio.max() if token_ratio.numel() else torch.tensor(float("-inf"), device=log_r.device),
        }
    return loss, sums
