"""One optimizer step's gradient, accumulated over micro-batches with the whole batch's normalisation.

Guarantee: :func:`accumulate_gradients` leaves in the parameters' ``.grad`` the gradient of the loss of
``spec.loss`` (:mod:`rlrun.training.objectives`) over the **whole batch** (all ranks' rows), whatever the micro-batch
budget, the number of ranks or the packing, up to float summation order; and its statistics are the whole batch's.
Peak memory is set by one micro-batch (:mod:`rlrun.training.micro_batches`) and one LM-head chunk
(:mod:`rlrun.training.logprobs`), not by the batch.

The rule that makes it so: the loss is a sum of token terms over the batch divided by a normaliser ``Z`` of the
whole batch — its ``N`` trained tokens (``token_mean``), its ``S`` samples with a trained token (``sequence_mean``)
or a constant — ``L = Σ_m S_m / Z`` with ``S_m`` micro-batch ``m``'s share (:func:`~rlrun.training.objectives.
loss_sums`: a sample is never split, so its sequence terms are whole in one micro-batch). ``N`` and ``S`` are counted
(and, with ``W`` ranks, all-reduced) **before** the first backward, and each micro-batch back-propagates
``S_m · W / Z``: gradients add up across micro-batches in ``.grad``, and FSDP's reduce-scatter averages them over the
ranks (the ``W``: :mod:`rlrun.training.distributed`, rule 2), so the sum is ``∇L``. Back-propagating each
micro-batch's own mean would weight a token by its micro-batch's size.

With a KL term (``loss.kl_coef > 0``) each micro-batch first runs the reference policy (:mod:`rlrun.training.
reference`) forward, without gradient, through the same chunked head: its logprobs at the trained tokens, then the
policy's forward and backward.

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
from rlrun.training.loss import mismatch_kl
from rlrun.training.micro_batches import (
    VARLEN_ATTENTION,
    MicroBatch,
    attention_of,
    micro_batches,
    placeholder,
    supports_packing,
)
from rlrun.training.objectives import SUM_KEYS, LossSettings, loss_sums, normaliser
from rlrun.training.precision import autocast

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepSettings:
    """What a step computes with.

    Attributes:
        temperature: the sampling temperature (the trainer's distribution is vLLM's processed one).
        top_p: the sampling nucleus (1: none).
        loss: the loss (:class:`~rlrun.training.objectives.LossSettings`).
        micro_batch_tokens: token slots per micro-batch (padding included).
        chunk_tokens: positions per LM-head chunk.
        compute_dtype: float32 or bfloat16 (:mod:`rlrun.training.precision`).
    """

    temperature: float
    top_p: float
    loss: LossSettings
    micro_batch_tokens: int
    chunk_tokens: int
    compute_dtype: torch.dtype = torch.float32

    @classmethod
    def from_spec(cls, spec: RLRunSpec, compute_dtype: torch.dtype = torch.float32) -> StepSettings:
        """The settings of ``spec`` (``sampling``, ``loss``, ``trainer``) at ``compute_dtype``."""
        return cls(
            temperature=spec.sampling.temperature,
            top_p=spec.sampling.top_p,
            loss=LossSettings.from_spec(spec),
            micro_batch_tokens=spec.trainer.micro_batch_tokens,
            chunk_tokens=spec.trainer.logprob_chunk_tokens,
            compute_dtype=compute_dtype,
        )


_warned_long_sample = False


def on_policy_rows(batch: TrainBatch, step: int) -> torch.Tensor:
    """``[b]`` bool over ``batch``'s rows (this rank's): sampled by policy version ``step − 1``, the weights
    the trainer holds when it trains ``step`` (``mismatch_kl_on_policy``; with ``max_off_policy_steps ≥ 1``
    seldom any: the probe measures the mismatch then, :mod:`rlrun.probes`)."""
    versions = [t["policy_version"] for t in batch.meta["traces"]]
    start, stop = batch.meta.get("rank_rows", [0, len(versions)])
    rows = [v == step - 1 for v in versions[start:stop]] or [False]  # a rank's placeholder row weighs nothing
    return torch.tensor(rows, dtype=torch.bool)


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
    model: nn.Module, mb: MicroBatch, settings: StepSettings, dp: DataParallel, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)`` ``[N]`` at the micro-batch's trained positions, from one forward of ``model`` (the
    entropy NaN, not computed, unless ``with_entropy``)."""
    with (
        autocast(dp.device, settings.compute_dtype, dp.distributed),
        head_returns_token_stats(
            model, mb.loss_mask, mb.targets, settings.temperature, settings.top_p, settings.chunk_tokens,
            settings.compute_dtype, with_entropy,
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


def _sequences(mb: MicroBatch) -> int:
    """Samples of ``mb`` with a trained token."""
    return int((torch.bincount(mb.sample_ids[mb.loss_mask]) > 0).sum())


def accumulate_gradients(
    model: nn.Module,
    batch: TrainBatch,
    on_policy_rows: torch.Tensor,
    settings: StepSettings,
    dp: DataParallel,
    pack: bool | None = None,
    reference: nn.Module | None = None,
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
        reference: the frozen reference policy (sharded as ``model``), needed when ``settings.loss.kl_coef > 0``.

    Returns:
        The whole batch's statistics: ``loss``, ``clip_fraction`` (share of trained tokens whose clip bound),
        ``ratio_mean``, ``ratio_max`` (of ``π_θ / μ``), ``tokens`` (trained tokens), ``logprob_abs_diff`` (mean
        ``|log π − log μ|``), ``entropy`` (mean, nats/token), ``mismatch_kl`` and ``mismatch_kl_on_policy``
        (nats/token; None without on-policy tokens), ``padding_share`` (padding slots / all slots of the
        micro-batches), ``micro_batches`` (the most any rank ran); with the setting on, ``dual_clip_fraction``,
        ``is_truncated_fraction`` / ``is_masked_fraction`` (shares of trained tokens), ``kl_ref`` (mean of the KL
        estimate, nats/token) and ``policy_loss`` (the loss without its KL term).

    Raises:
        ValueError: no rank has a trained token; a KL term without ``reference``.
    """
    loss_settings = settings.loss
    if loss_settings.uses_reference and reference is None:
        raise ValueError("loss.kl_coef > 0 needs the reference policy")
    pack = supports_packing(model) if pack is None else pack
    plan = _plan(model, batch, on_policy_rows, settings, pack)
    n, sequences, slots, padding = _all_reduce(
        [sum(int(mb.loss_mask.sum()) for mb in plan), sum(_sequences(mb) for mb in plan),
         sum(mb.slots for mb in plan), sum(mb.padding for mb in plan)], dist.ReduceOp.SUM, dp,
    )  # fmt: skip
    (count,) = _all_reduce([len(plan)], dist.ReduceOp.MAX, dp)
    if n == 0:
        raise ValueError("loss_mask selects no token" + (" on any rank" if dp.distributed else ""))
    z = normaliser(loss_settings, n, sequences)
    # loss, |Δlogp|, entropy, KL, KL on policy, on-policy tokens, then SUM_KEYS: summed over micro-batches and ranks
    keys = ("loss", "abs_diff", "entropy", "kl", "kl_on", "on_tokens", *SUM_KEYS)
    sums = torch.zeros(len(keys), dtype=torch.float64)
    ratio_max = float("-inf")
    filler = int(batch.input_ids[0, 0])
    for i in range(int(count)):
        mb = (plan[i] if i < len(plan) else placeholder(filler, pack)).to(dp.device)
        ref = None
        if reference is not None:
            with torch.no_grad():
                ref, _ = _forward_token_stats(reference, mb, settings, dp, with_entropy=False)
        logprobs, entropy = _forward_token_stats(model, mb, settings, dp)
        old, on = mb.old_logprobs[mb.loss_mask], mb.on_policy[mb.loss_mask]
        loss_part, part_sums = loss_sums(
            logprobs, old, mb.advantages[mb.loss_mask], mb.sample_ids[mb.loss_mask], loss_settings, z, ref
        )
        (loss_part * dp.world_size).backward()
        with torch.no_grad():
            d = logprobs.detach() - old
            kl = mismatch_kl(logprobs.detach(), old)
            values = [loss_part.detach(), d.abs().sum(), entropy.sum(), kl.sum(), kl[on].sum(), on.sum()]
            values += [part_sums[k] for k in SUM_KEYS]
            sums += torch.stack([v.to(torch.float64) for v in values]).cpu()  # one copy from the device
            ratio_max = max(ratio_max, float(part_sums["ratio_max"]))
        del logprobs, entropy, loss_part, ref
    total = dict(zip(keys, _all_reduce(sums.tolist(), dist.ReduceOp.SUM, dp), strict=True))
    (ratio_max,) = _all_reduce([ratio_max], dist.ReduceOp.MAX, dp)
    stats = {
        "loss": total["loss"],
        "clip_fraction": total["clipped"] / n,
        "ratio_mean": total["ratio_sum"] / n,
        "ratio_max": ratio_max,
        "tokens": round(n),
        "logprob_abs_diff": total["abs_diff"] / n,
        "entropy": total["entropy"] / n,  # nats/token
        "mismatch_kl": total["kl"] / n,  # nats/token
        "mismatch_kl_on_policy": total["kl_on"] / total["on_tokens"] if total["on_tokens"] else None,
        "padding_share": padding / slots if slots else 0.0,
        "micro_batches": int(count),
    }
    if loss_settings.dual_clip is not None:
        stats["dual_clip_fraction"] = total["dual_clipped"] / n
    if loss_settings.correction == "truncate":
        stats["is_truncated_fraction"] = total["truncated"] / n
    if loss_settings.correction == "mask":
        stats["is_masked_fraction"] = total["masked"] / n
    if loss_settings.uses_reference:
        stats["kl_ref"] = total["kl_sum"] / n  # nats/token
        stats["policy_loss"] = total["policy_loss"]
    return stats
