"""The trainer's optimizer (AdamW of ``spec.optimizer``, :func:`new_optimizer`) and its learning-rate schedule
(``spec.optimizer.lr_schedule``, ``warmup_steps``, ``min_lr_ratio``): a torch ``LambdaLR`` over it, its state in every
trainer checkpoint part.

The factor ``λ(c)`` multiplies ``spec.optimizer.lr`` after ``c`` optimizer steps, so **step s trains with
``lr · λ(s − 1)``** (the scheduler steps once after each optimizer step). With ``W`` = ``warmup_steps``, ``N`` =
``spec.max_steps`` (the horizon) and ``m`` = ``min_lr_ratio``::

    c < W:   λ = c / W                                    (linear warmup from 0; the first step trains at 0)
    c ≥ W:   p = min(1, (c − W) / max(1, N − W))
             constant: λ = 1
             linear:   λ = m + (1 − m) · (1 − p)
             cosine:   λ = m + (1 − m) · ½ (1 + cos π p)

Source: transformers' ``get_constant_schedule_with_warmup``, ``get_linear_schedule_with_warmup`` and
``get_cosine_with_min_lr_schedule_with_warmup`` (``min_lr_rate`` = ``m``; transformers' linear one has no floor:
``m`` enters it the same way), so a recipe from TRL or OpenRLHF (which use them) keeps its curve. One difference:
past ``N`` (only when ``rlrun local --max-steps`` runs past ``spec.max_steps``) ``p`` stays 1, the rate at the
floor, where transformers' cosine would rise again.

The horizon is ``spec.max_steps``, never the ``--max-steps`` a process is started with (that only says where it
stops), so the curve is a function of the spec: a resume cannot change it without changing the spec, which
:func:`rlrun.identity.check_compatible` refuses. Resume (:func:`restore_scheduler`): the saved state when
the part has one (``progress.json``'s ``lr_scheduler``, both part formats), else (a part written before
schedules) the position derived from the step — said in one log line, as the part lacks what every part
written since holds —; either way the rate of the next step is ``lr · λ(step)``.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from rlrun.api.spec import RLRunSpec
from rlrun.errors import CheckpointError

log = logging.getLogger(__name__)


def adamw(params: Iterable[torch.nn.Parameter], spec: RLRunSpec) -> torch.optim.AdamW:
    """AdamW over ``params`` with ``spec.optimizer``'s ``lr``, ``betas``, ``eps`` and ``weight_decay``."""
    opt = spec.optimizer
    return torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)


def new_optimizer(model: torch.nn.Module, spec: RLRunSpec) -> torch.optim.AdamW:
    """The trainer's optimizer: AdamW with the spec's settings over the trainable parameters (every one; with LoRA the
    adapter's alone: the frozen base weights get no optimizer state). Build it after the model is sharded
    (:mod:`rlrun.training.policy`): it holds the parameters the ranks keep."""
    return adamw([p for p in model.parameters() if p.requires_grad], spec)


def lr_factor(count: int, *, schedule: str, warmup_steps: int, horizon: int, min_lr_ratio: float) -> float:
    """``λ(count)``: the share of ``lr`` after ``count`` optimizer steps (the formula in the module docstring).

    Args:
        count: optimizer steps taken (≥ 0); step ``s`` trains with ``λ(s − 1)``.
        schedule: ``constant``, ``linear`` or ``cosine``.
        warmup_steps: ``W``, steps of linear warmup.
        horizon: ``N``, the step the decay ends at (``spec.max_steps``).
        min_lr_ratio: ``m``, the floor of the decay.
    """
    if count < warmup_steps:
        return count / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (count - warmup_steps) / max(1, horizon - warmup_steps))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def schedule_of(spec: RLRunSpec) -> functools.partial[float]:
    """``λ`` of ``spec`` as a one-argument function of the step count (horizon: ``spec.max_steps``)."""
    opt = spec.optimizer
    return functools.partial(
        lr_factor,
        schedule=opt.lr_schedule,
        warmup_steps=opt.warmup_steps,
        horizon=spec.max_steps,
        min_lr_ratio=opt.min_lr_ratio,
    )


def new_scheduler(optimizer: torch.optim.Optimizer, spec: RLRunSpec) -> LambdaLR:
    """The run's scheduler over ``optimizer`` (built with ``lr = spec.optimizer.lr``), at count 0: its groups' rate is
    now ``lr · λ(0)``, the rate of step 1."""
    return LambdaLR(optimizer, schedule_of(spec))


def restore_scheduler(
    scheduler: LambdaLR, optimizer: torch.optim.Optimizer, saved: dict[str, Any] | None, step: int, source: str
) -> None:
    """Put ``scheduler`` at the position of a resumed ``step`` and give ``optimizer``'s groups the rate of step
    ``step + 1``, ``lr · λ(step)`` (whatever rate the loaded optimizer state held).

    Args:
        saved: the part's ``scheduler.state_dict()`` (plain JSON: ``functools.partial`` keeps no state; None: a
            part written before schedules, the position then derived from the step, as the scheduler steps once per
            optimizer step, and said in one INFO line naming the part, the step and the rate).
        step: the resumed step.
        source: the part, for the error.

    Raises:
        CheckpointError: the saved state is at another step than the part (a part that contradicts itself).
    """
    if saved is not None and saved.get("last_epoch") != step:
        raise CheckpointError(f"{source}: its LR scheduler is at step {saved.get('last_epoch')}, the part at {step}")
    rates = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    derived = {**scheduler.state_dict(), "last_epoch": step, "_step_count": step + 1, "_last_lr": rates}
    scheduler.load_state_dict(saved if saved is not None else derived)
    if saved is None:
        log.info(
            "%s holds no LR scheduler state (a part written before schedules): its position is derived from "
            "step %d, the next step trains at lr %.6g",
            *(source, step, rates[0] if rates else float("nan")),
        )
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
