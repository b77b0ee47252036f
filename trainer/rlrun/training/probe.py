"""The trainer's half of the mismatch probe (:mod:`rlrun.probes`): the log-probabilities its new weights give
a few sampled sequences, written beside the weights it publishes.

Guarantee: a probe's logprobs are those of exactly the weights of the broadcast it is written in — computed
after the optimizer step, before the next — at temperature 1 over the whole vocabulary (what vLLM's prompt
logprobs are), by the trainer's own forward (its chunked LM head, :mod:`rlrun.training.logprobs`; the compute
dtype's autocast) in eval mode without gradient, so LoRA dropout, if any, is off as on the server. With ``W``
ranks every rank runs the same forwards (FSDP2 gathers the weights in them), rank 0 writes.
"""

from __future__ import annotations

import torch
from torch import nn

from rlrun.batch import TrainBatch
from rlrun.probes import PROBE_SEQUENCES, ProbeSequence
from rlrun.training.distributed import DataParallel
from rlrun.training.logprobs import head_returns_token_stats
from rlrun.training.precision import autocast
from rlrun.training.step import StepSettings


def probe_rows(batch: TrainBatch, count: int = PROBE_SEQUENCES) -> list[tuple[list[int], list[bool]]]:
    """The first ``count`` samples of ``batch`` (the whole batch, every rank's rows): each ``(ids, sampled)``,
    its token ids (prompt and completion, no padding) and per token whether it was sampled (trained; position
    0 never)."""
    rows = []
    for i in range(min(count, batch.num_samples)):
        length = int(batch.attention_mask[i].sum())
        ids = batch.input_ids[i, :length].tolist()
        # target j is predicted at position j − 1
        sampled = [False, *batch.loss_mask[i, : length - 1].tolist()]
        rows.append((ids, sampled))
    return rows


@torch.no_grad()
def probe_logprobs(
    model: nn.Module,
    rows: list[tuple[list[int], list[bool]]],
    dp: DataParallel,
    settings: StepSettings,
) -> list[ProbeSequence]:
    """The probe of ``model``'s weights on ``rows`` (:func:`probe_rows`): each sampled token's log-probability
    (nats, temperature 1, whatever ``settings``' sampling; its compute dtype and LM-head chunk), one forward
    per row. A collective with ranks: every rank calls it with the same rows."""
    compute_dtype, chunk_tokens = settings.compute_dtype, settings.chunk_tokens
    was_training = model.training
    model.eval()
    out = []
    try:
        for ids, sampled in rows:
            input_ids = torch.tensor([ids], device=dp.device)
            # position t predicts token t + 1
            positions = torch.tensor([[*sampled[1:], False]], device=dp.device)
            targets = torch.tensor([[*ids[1:], 0]], device=dp.device)
            with (
                autocast(dp.device, compute_dtype, dp.distributed),
                head_returns_token_stats(
                    model, positions, targets, 1.0, 1.0, chunk_tokens, compute_dtype, False
                ) as got,
            ):
                position_ids = torch.arange(len(ids), device=dp.device)[None]
                model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
            values = iter(got[0][:, 0].float().tolist())
            out.append(ProbeSequence(ids, [next(values) if s else None for s in sampled]))
    finally:
        model.train(was_training)
    return out
