"""``spec.model.lora``: a LoRA adapter's settings (:class:`LoraSpec`) and the CRD's rule that repeats
their one refusal (:data:`LORA_CEL_RULES`).

Guarantee: an adapter the trainer accepts computes ``log π`` as the rollout servers do — no dropout —
so the importance ratio against the sampler is 1 where the weights are the sampler's (issue 47: with
``dropout: 0.1`` the mean |Δ logp| against a perfect sampler grew 0.013 → 0.51 as the adapter grew,
38 % of tokens clipped). Why refusing rather than computing the ratio with dropout off:
``docs/design.md``, "LoRA".
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from rlrun.api.strict import Strict

#: The modules a LoRA adapter wraps by default: every linear layer of a transformer block in Llama / Qwen /
#: Mistral-style models (attention projections and the MLP), the set vLLM serves adapters for in those models.
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: vLLM's ``--max-lora-rank`` choices (``vllm.config.lora.MaxLoRARanks``, vLLM 0.11–0.32): a server serves an
#: adapter of rank ≤ the one it was started with, and rlrun starts it with the smallest that holds ``rank``.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


#: Why ``spec.model.lora.dropout`` above 0 is refused (pydantic and the CRD's CEL rule say the same).
LORA_DROPOUT_REFUSED = (
    "must be 0: dropout makes the trainer's log π a random draw while the rollout servers sample "
    "without it, so the importance ratio against the sampler and its clipping would be biased"
)


class LoraSpec(Strict):
    """Train a LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on the frozen
    model instead of all its weights, with ``peft``; each policy version reaches the rollout servers as an adapter
    (``docs/design.md``, "LoRA").

    Attributes:
        rank: the adapter's rank r (each wrapped ``W`` gets ``B·A`` with ``A`` r × in, ``B`` out × r); at most 512,
            the largest ``--max-lora-rank`` vLLM serves.
        alpha: the scaling numerator: the update is ``(alpha / rank) · B·A``.
        dropout: must be 0 (the default; kept so manifests and checkpoints that say 0 still read).
            Dropout on the adapter's input makes the trainer's ``log π`` a random draw the rollout servers
            (no dropout) never sample from, so the importance ratio against the sampler is biased:
            measured with 0.1, mean |Δ logp| 0.013 → 0.51 as the adapter grows, 38 % of tokens clipped
            (``docs/design.md``, "LoRA").
        target_modules: names of the modules to wrap (a module is wrapped when its name ends with one): each must
            name a module of the model, checked when the trainer starts.
    """

    rank: int = Field(default=16, ge=1, le=VLLM_LORA_RANKS[-1])
    alpha: float = Field(default=32.0, gt=0)
    dropout: float = Field(default=0.0, ge=0)
    target_modules: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1, max_length=64
    )

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value != 0:
            raise ValueError(LORA_DROPOUT_REFUSED)
        return value

    @property
    def served_max_rank(self) -> int:
        """The ``--max-lora-rank`` a rollout server serving this adapter starts with: the smallest of vLLM's
        choices (:data:`VLLM_LORA_RANKS`) ≥ :attr:`rank`."""
        return next(r for r in VLLM_LORA_RANKS if r >= self.rank)


#: CEL rules on ``spec.model.lora`` (:mod:`rlrun.api.crd`): the dropout's refusal, as pydantic says it.
LORA_CEL_RULES: list[dict[str, str]] = [
    {
        "rule": "!has(self.dropout) || double(self.dropout) == 0.0",
        "message": f"model.lora.dropout {LORA_DROPOUT_REFUSED}",
        "fieldPath": ".dropout",
    },
]
