"""A rank's rows of a shipped batch cut into micro-batches by a token budget, bucketed by length, packed where the
attention supports it.

Guarantee: every sample of the rank's rows is in exactly one micro-batch, with each of its tokens' target, loss
mask, sampling logprob and advantage at the position that predicts it, so summing the loss over the micro-batches
is summing it over the batch (:mod:`rlrun.training.step` keeps the whole batch's normalisation).

A micro-batch is ``rows × width`` token slots, at most ``budget`` (``spec.trainer.micro_batch_tokens``) unless one
sample is longer than the budget: such a sample forms a micro-batch of its own (it is never cut: a sample's
tokens attend to each other), so a budget below the longest sample costs memory, never correctness. Samples are
taken longest first and a micro-batch's width is its first (longest) sample's length, so samples of like length
share micro-batches (bucketing) and little of a micro-batch is padding.

**Packing** (``pack=True``): several samples share a row, each with its own position ids counting from 0, and the
model is given ``position_ids`` and no ``attention_mask``. transformers (≥ 5, ``masking_utils``) then finds each
row's samples from where the position ids restart (``find_packed_sequence_indices``) and lets a token attend only
within its sample: a block-diagonal causal mask for ``sdpa``, ``eager`` and ``flex_attention``, variable-length
kernels for the ``flash_attention_*`` implementations (:data:`PACKING_ATTENTION`). With a dense mask (``sdpa``,
``eager``, ``flex_attention``) attention costs ``width²`` per row whatever the samples, so a row stays as wide as
the micro-batch's longest sample (rows are filled first-fit, longest first) and costs no more than a padded row of
that width. With a variable-length kernel (:data:`VARLEN_ATTENTION`) attention costs each sample its own length
squared, so a micro-batch is one row as wide as the budget (``wide``): no padding but the end of a row. Without
packing, each row is one sample, right-padded, with an ``attention_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlrun.batch import TrainBatch

#: Attention implementations for which transformers builds a per-sample mask from restarting position ids (its
#: ``masking_utils.AttentionMaskInterface`` mapping, transformers 5.x): packed rows are exact with these.
#: A custom kernel registered under another name may ignore position ids: those rows are padded, not packed.
PACKING_ATTENTION = frozenset(
    {"sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4"}
)


#: Attention implementations whose kernels take packed rows as variable-length sequences (``cu_seqlens`` from the
#: position ids): a sample's attention costs its own length squared, however wide its row.
VARLEN_ATTENTION = frozenset({"flash_attention_2", "flash_attention_3", "flash_attention_4"})


def attention_of(model: torch.nn.Module) -> str | None:
    """``model.config._attn_implementation`` (None when it has none)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def supports_packing(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention implementation (``config._attn_implementation``) takes packed rows
    (:data:`PACKING_ATTENTION`)."""
    return attention_of(model) in PACKING_ATTENTION


@dataclass
class MicroBatch:
    """``rows × width`` token slots, every tensor ``[rows, width]``; the entries at position ``t`` are of the
    token that position ``t`` predicts (``input_ids[:, t + 1]`` of its sample).

    Attributes:
        input_ids: int64, padding 0.
        position_ids: int64 when packed (counting from 0 in each sample, and in the padding at a row's end); else None.
        attention_mask: int64 1 on real tokens when not packed; else None.
        targets: int64, the next token (0 where a position predicts none).
        loss_mask: bool, True where the next token is trained.
        old_logprobs: float32, the sampling policy's logprob of the next token (0 off the mask).
        advantages: float32, the advantage of the position's sample.
        on_policy: bool, the position's sample was sampled by the weights the trainer holds.
        sample_ids: int64, which of the micro-batch's samples the position is of (``0 … samples − 1``; padding: 0,
            never trained): sequence-level terms (GSPO's ratio, a sequence mean) group tokens by it.
        tokens: real (not padding) token slots.
        samples: samples in it.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    targets: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    on_policy: torch.Tensor
    sample_ids: torch.Tensor
    tokens: int
    samples: int

    @property
    def slots(self) -> int:
        """Token slots, padding included: ``rows × width``."""
        return int(self.input_ids.numel())

    @property
    def padding(self) -> int:
        """Slots that hold no token of a sample."""
        return self.slots - self.tokens

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with its tensors on ``device``."""
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return MicroBatch(**moved)


def plan_rows(lengths: list[int], budget: int, pack: bool, wide: bool = False) -> list[list[list[int]]]:
    """The layout: micro-batches, each a list of rows, each a list of sample indices (into ``lengths``).

    Samples go longest first (ties by index, so the plan is deterministic); a micro-batch's width is the length of
    the longest sample not yet placed (``wide``, with ``pack``: the budget, so one row), and it has at most
    ``budget // width`` rows (1 when that sample alone is longer than ``budget``: it is trained alone, never cut).

    - ``pack``: every remaining sample, longest first, goes into the first row with room for it, or a new row
      while there may be one; a sample that fits nowhere waits for the next micro-batch (first-fit decreasing
      over what is left, so a micro-batch's gaps are filled by shorter samples).
    - otherwise: one sample per row, consecutive in length order; a sample shorter than half the width starts the
      next micro-batch (a row is at most half padding, at the cost of at most ``log2(longest / shortest)`` more
      micro-batches).

    Raises:
        ValueError: ``budget < 1`` or a length ``< 1``.
    """
    if budget < 1:
        raise ValueError(f"budget must be ≥ 1 token, got {budget}")
    if any(n < 1 for n in lengths):
        raise ValueError(f"every sample needs at least 1 token, got lengths {lengths}")
    remaining = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan: list[list[list[int]]] = []
    while remaining:
        width = max(budget, lengths[remaining[0]]) if pack and wide else lengths[remaining[0]]
        most_rows = max(1, budget // width)
        rows: list[list[int]] = []
        free: list[int] = []  # room left in each row
        left: list[int] = []
        for k, i in enumerate(remaining):
            n = lengths[i]
            if pack:
                row = next((r for r, room in enumerate(free) if room >= n), None)
                if row is not None:
                    rows[row].append(i)
                    free[row] -= n
                    continue
            elif rows and (len(rows) == most_rows or 2 * n < width):
                left = remaining[k:]  # consecutive: the rest waits for the next micro-batches
                break
            if len(rows) < most_rows:
                rows.append([i])
                free.append(width - n)
            else:
                left.append(i)
        plan.append(rows)
        remaining = left
    return plan


def micro_batches(
    batch: TrainBatch, on_policy_rows: torch.Tensor, budget: int, pack: bool, wide: bool = False
) -> list[MicroBatch]:
    """``batch``'s rows (a rank's slice) as micro-batches of at most ``budget`` token slots (:func:`plan_rows`).

    Args:
        batch: right-padded rows (:mod:`rlrun.batch`): a row's length is its ``attention_mask``'s sum.
        on_policy_rows: ``[b]`` bool, per row: sampled by the weights the trainer holds.
        budget: token slots per micro-batch (padding included).
        pack: several samples per row (:data:`PACKING_ATTENTION`), else one right-padded sample per row.
        wide: with ``pack``, one row per micro-batch (:data:`VARLEN_ATTENTION`).

    Returns:
        The micro-batches, longest samples first.
    """
    lengths = [int(n) for n in batch.attention_mask.sum(dim=1).tolist()]
    out = []
    for rows in plan_rows(lengths, budget, pack, wide):
        width = max(sum(lengths[i] for i in row) for row in rows)  # the fullest row: no padding column
        shape = (len(rows), width)
        mb = MicroBatch(
            input_ids=torch.zeros(shape, dtype=torch.long),
            position_ids=torch.zeros(shape, dtype=torch.long) if pack else None,
            attention_mask=None if pack else torch.zeros(shape, dtype=torch.long),
            targets=torch.zeros(shape, dtype=torch.long),
            loss_mask=torch.zeros(shape, dtype=torch.bool),
            old_logprobs=torch.zeros(shape, dtype=torch.float32),
            advantages=torch.zeros(shape, dtype=torch.float32),
            on_policy=torch.zeros(shape, dtype=torch.bool),
            sample_ids=torch.zeros(shape, dtype=torch.long),
            tokens=sum(lengths[i] for row in rows for i in row),
            samples=sum(len(row) for row in rows),
        )
        k = 0  # the sample's number in the micro-batch
        for r, row in enumerate(rows):
            start = 0
            for i in row:
                n, stop = lengths[i], start + lengths[i]
                mb.input_ids[r, start:stop] = batch.input_ids[i, :n]
                if pack:
                    mb.position_ids[r, start:stop] = torch.arange(n)
                else:
                    mb.attention_mask[r, start:stop] = 1
                # position t predicts token t + 1: the sample's last position predicts nothing
                mb.targets[r, start : stop - 1] = batch.input_ids[i, 1:n]
                mb.loss_mask[r, start : stop - 1] = batch.loss_mask[i, : n - 1]
                mb.old_logprobs[r, start : stop - 1] = batch.old_logprobs[i, : n - 1]
                mb.advantages[r, start:stop] = batch.advantages[i]
                mb.on_policy[r, start:stop] = bool(on_policy_rows[i])
                mb.sample_ids[r, start:stop] = k
                start, k = stop, k + 1
            if pack and start < width:  # the padding at the row's end: a segment of its own, attending to itself
                mb.position_ids[r, start:] = torch.arange(width - start)
        out.append(mb)
    return out


def placeholder(token_id: int, pack: bool) -> MicroBatch:
    """A micro-batch that trains nothing: one token (``token_id``), no position trained, in the layout of ``pack``.
    A rank with fewer micro-batches than another runs these, so that every rank enters FSDP's collectives (the
    all-gathers of the forward, the reduce-scatters of the backward) as many times; its loss and gradient are 0."""
    one = (1, 1)
    return MicroBatch(
        input_ids=torch.full(one, token_id, dtype=torch.long),
        position_ids=torch.zeros(one, dtype=torch.long) if pack else None,
        attention_mask=None if pack else torch.ones(one, dtype=torch.long),
        targets=torch.zeros(one, dtype=torch.long),
        loss_mask=torch.zeros(one, dtype=torch.bool),
        old_logprobs=torch.zeros(one, dtype=torch.float32),
        advantages=torch.zeros(one, dtype=torch.float32),
        on_policy=torch.zeros(one, dtype=torch.bool),
        sample_ids=torch.zeros(one, dtype=torch.long),
        tokens=1,
        samples=0,
    )
