"""One optimizer step's gradient, accumulated over micro-batches with the whole batch's normalisation.

Guarantee: :func:`accumulate_gradients` leaves in the parameters' ``.grad`` the gradient of the loss of
:mod:`rlrun.training.loss` over the **whole batch** (all ranks' rows), whatever the micro-batch budget, the number of
ranks or the packing, up to float summation order; and its statistics are the whole batch's. Peak memory is set by
one micro-batch (:mod:`rlrun.training.micro_batches`) and one LM-head chunk (:mod:`rlrun.training.logprobs`), not
by the batch.

The rule that makes it so: the loss is a mean over the batch's ``N`` trained tokens, ``L = Σ_m S_m / N`` with
``S_m`` the sum of ``−surrogate`` over micro-batch ``m``'s tokens (:func:`~rlrun.training.loss.policy_loss_sums`).
``N`` is counted (and, with ``W`` ranks, all-reduced) **before** the first backward, and each micro-batch
back-propagates ``S_m · W / N``: gradients add up across micro-batches in ``.grad``, and FSDP's reduce-scatter
averages them over the ranks (the ``W``: :mod:`rlrun.training.distributed`, rule 2), so the sum is ``∇L``.
Back-propagating each micro-batch's own token mean would weight a token by its micro-batch's size.

Every rank runs as many micro-batches as the rank with the most (:func:`~rlrun.training.micro_batches.placeholder`
ones weigh nothing): each forward and backward enters FSDP's collectives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rlrun.api.spec import RLRunSpec
from rlrun.batch import TrainBatch
from rlrun.training.distributed import DataParallel
from rlrun.training.logprobs import head_returns_token_stats
from rlrun.training.loss import mismatch_kl, policy_loss_sums
from rlrun.training.micro_batches import (
    VARLEN_ATTENTION,
    MicroBatch,
    attention_of,
    micro_batches,
    placeholder,
    supports_packing,
)
from rlrun.training.precision import autocast

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepSettings:
    """What a step computes with.

    Attributes:
        temperature: the sampling temperature (the trainer's distribution is vLLM's processed one).
        top_p: the sampling nucleus (1: none).
        ratio_clip: ε of the clipped ratio.
        micro_batch_tokens: token slots per micro-batch (padding included).
        chunk_tokens: positions per LM-head chunk.
        compute_dtype: float32 or bfloat16 (:mod:`rlrun.training.precision`).
    """

    temperature: float
    top_p: float
    ratio_clip: float
    micro_batch_tokens: int
    chunk_tokens: int
    compute_dtype: torch.dtype = torch.float32

    @classmethod
    def from_spec(cls, spec: RLRunSpec, compute_dtype: torch.dtype = torch.float32) -> StepSettings:
        """The settings of ``spec`` (``sampling``, ``loss``, ``trainer``) at ``compute_dtype``."""
        return cls(
            temperature=spec.sampling.temperature,
            top_p=spec.sampling.top_p,
            ratio_clip=spec.loss.ratio_clip,
            micro_batch_tokens=spec.trainer.micro_batch_tokens,
            chunk_tokens=spec.trainer.logprob_chunk_tokens,
            compute_dtype=compute_dtype,
        )


_warned_long_sample = False


def _plan(
    model: nn.Module, batch: TrainBatch, on_policy_rows: torch.Tensor, settings: StepSettings, pack: bool
) -> list[MicroBatch]:
    """This rank's micro-batches; none for a rank whose slice is the weightless placeholder row."""
    start, stop = batch.meta.get("rank_rows", [0, batch.num_samples])
    if start == stop:
        return []
    wide = pack and attention_of(model) in VARLEN_ATTENTION
    plan = micro_batches(batch, on_policy_rows, settings.micro_batch_tokens, pack, wide)
    global _warned_long_sample
    longest = max(mb.input_ids.shape[1] for mb in plan)
    if longest > settings.micro_batch_tokens and not _warned_long_sample:
        _warned_long_sample = True
        log.warning(
            "a sample of %d tokens is longer than spec.trainer.micro_batch_tokens (%d): it is trained in a "
            "micro-batch of its own, whose memory it sets (logged once)", longest, settings.micro_batch_tokens,
        )  # fmt: skip
    return plan


def _all_reduce(values: list[float], op, dp: DataParallel) -> list[float]:
    """``values`` reduced over the ranks with ``op`` (float64; in place on the device for nccl); as is in one process."""
    if not dp.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=dp.device if dp.device.type != "cpu" else None)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _forward_token_stats(
    model: nn.Module, mb: MicroBatch, settings: StepSettings, dp: DataParallel
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)`` ``[N]`` at the micro-batch's trained positions, from one forward of ``model``."""
    with (
        autocast(dp.device, settings.compute_dtype, dp.distributed),
        head_returns_token_stats(
            model, mb.loss_mask, mb.targets, settings.temperature, settings.top_p, settings.chunk_tokens,
            settings.compute_dtype,
        ) as returned,
    ):  # fmt: skip
        out = model(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False
        )
    if not returned or out.logits is not returned[0]:
        raise RuntimeError(
            f"{type(model).__name__} transforms its LM head's output before returning it (a logit soft-cap or "
            "scale): the trainer's chunked logprobs do not support such a model"
        )
    stats = out.logits
    return stats[:, 0], stats[:, 1]


def accumulate_gradients(
    model: nn.Module,
    batch: TrainBatch,
    on_policy_rows: torch.Tensor,
    settings: StepSettings,
    dp: DataParallel,
    pack: bool | None = None,
) -> dict:
    """Add this rank's share of the whole batch's loss gradient to the parameters' ``.grad`` (module docstring).
    A collective with ``W > 1`` ranks. The caller zeroes the gradients before and clips and steps after.

    Args:
        model: the policy (a Hugging Face causal LM; FSDP2-sharded with ranks), in train mode.
        batch: this rank's rows (:func:`~rlrun.training.distributed.rank_slice`; the batch in one process).
        on_policy_rows: ``[b]`` bool per row: sampled by the weights the trainer holds.
        settings: :class:`StepSettings`.
        dp: the data-parallel group.
        pack: several samples per row; default where the model's attention supports it
            (:func:`~rlrun.training.micro_batches.supports_packing`), in one budget-wide row per micro-batch for a
            variable-length kernel (``VARLEN_ATTENTION``).

    Returns:
        The whole batch's statistics: ``loss`` (the mean over trained tokens), ``clip_fraction``, ``ratio_mean``,
        ``ratio_max``, ``tokens`` (trained tokens), ``logprob_abs_diff`` (mean ``|log π − log μ|``), ``entropy``
        (mean, nats/token), ``mismatch_kl`` and ``mismatch_kl_on_policy`` (nats/token; None without on-policy
        tokens), ``padding_share`` (padding slots / all slots of the micro-batches), ``micro_batches`` (the most
        any rank ran).

    Raises:
        ValueError: no rank has a trained token.
    """
    pack = supports_packing(model) if pack is None else pack
    plan = _plan(model, batch, on_policy_rows, settings, pack)
    n_local = sum(int(mb.loss_mask.sum()) for mb in plan)
    n, slots, padding = _all_reduce(
        [n_local, sum(mb.slots for mb in plan), sum(mb.padding for mb in plan)], dist.ReduceOp.SUM, dp
    )
    (count,) = _all_reduce([len(plan)], dist.ReduceOp.MAX, dp)
    if n == 0:
        raise ValueError("loss_mask selects no token" + (" on any rank" if dp.distributed else ""))
    scale = dp.world_size / n
    # loss, clipped, ratio, |Δlogp|, entropy, KL, KL on policy, on-policy tokens: summed over micro-batches and ranks
    sums = torch.zeros(8, dtype=torch.float64)
    ratio_max = float("-inf")
    filler = int(batch.input_ids[0, 0])
    for i in range(int(count)):
        mb = (plan[i] if i < len(plan) else placeholder(filler, pack)).to(dp.device)
        logprobs, entropy = _forward_token_stats(model, mb, settings, dp)
        old, on = mb.old_logprobs[mb.loss_mask], mb.on_policy[mb.loss_mask]
        loss_sum, loss_sums = policy_loss_sums(logprobs, old, mb.advantages[mb.loss_mask], settings.ratio_clip)
        (loss_sum * scale).backward()
        with torch.no_grad():
            d = logprobs.detach() - old
            kl = mismatch_kl(logprobs.detach(), old)
            sums += torch.stack(
                [loss_sum.detach(), loss_sums["clipped"], loss_sums["ratio_sum"], d.abs().sum(), entropy.sum(),
                 kl.sum(), kl[on].sum(), on.sum()]
            ).to(device="cpu", dtype=torch.float64)  # fmt: skip
            ratio_max = max(ratio_max, float(loss_sums["ratio_max"]))
        del logprobs, entropy, loss_sum
    loss, clipped, ratio, abs_diff, entropy_sum, kl_sum, kl_on, on_tokens = _all_reduce(
        sums.tolist(), dist.ReduceOp.SUM, dp
    )
    (ratio_max,) = _all_reduce([ratio_max], dist.ReduceOp.MAX, dp)
    return {
        "loss": loss / n,
        "clip_fraction": clipped / n,
        "ratio_mean": ratio / n,
        "ratio_max": ratio_max,
        "tokens": round(n),
        "logprob_abs_diff": abs_diff / n,
        "entropy": entropy_sum / n,  # nats/token
        "mismatch_kl": kl_sum / n,  # nats/token
        "mismatch_kl_on_policy": kl_on / on_tokens if on_tokens else None,
        "padding_share": padding / slots if slots else 0.0,
        "micro_batches": int(count),
    }
