"""Data-parallel training (FSDP2 over gloo, 2 real ranks) takes the single-process step, and sharded
(DCP) checkpoints reshard 2 → 1 and 1 → 2 and continue training as if never resharded.

One module fixture runs everything once (the 2-rank job is most of this file's ~25 s):

- in this process (world size 1, no environment: the plain path) steps A, B, C from the same
  initial weights, each batch in one micro-batch, saving a sharded part after A;
- in 2 forked ranks (``torch.multiprocessing``, gloo on localhost, a free port) the same steps
  with ``rank_slice`` + ``accumulate_gradients`` in micro-batches of at most 16 tokens (rank 0 runs 3
  of batch A's, rank 1 two and a placeholder), saving a 2-rank part after A, and a second
  model that loads the 1-rank part and takes step B;
- back here, a third model loads the 2-rank part and takes step B;
- bf16 and activation checkpointing: step A on 2 ranks with FSDP2's mixed precision (bf16 compute, float32
  reduction) and checkpointed blocks, and here with bf16 autocast: both within bf16's error of the float32
  gradient;
- the other losses of ``spec.loss`` (:data:`LOSSES`: the sequence-mean and constant aggregations, GSPO, the dual
  clip, the mismatch correction, the KL term to a reference policy sharded as the policy): step A from the initial
  weights on both sides, gradients and statistics compared as for the default loss.

Batch A has 5 rows of unequal lengths (ranks get 3 and 2 rows: 18 and 9 loss tokens), batch C
has 1 row (rank 1 trains a placeholder row); the gradient clip is active (norm 3.7 > 1).

Tolerances (float32 but for the bf16 scenario):

- Gradients: each element within ``1e-4 · |g| + 5e-4 · max |g|`` of the single process's, ``max |g|``
  the largest element of its tensor (:func:`grad_mismatches`). The two runs add the same products in
  another order (micro-batches of 1–2 rows, the LM head in chunks, then a gloo sum): a few float32 ulps
  (~1e-7 relative) per sum — relative to the magnitudes summed, not to the sum, so an element near 0 whose
  terms cancel carries an error of its tensor's scale. Hence the absolute part follows the tensor (issue
  47: an absolute ``1e-7`` held where it was tuned and failed on another 2-core machine: 30 of 16,384
  ``embed_tokens`` elements of step C off by up to 1.2e-6, 1.7e-5 of that tensor's ``max |g|`` 0.07).
  Measured here (2026-12-06): at most 1.5e-5 of ``max |g|`` (step C, ``down_proj``), 1.7e-6 for step A;
  the bound is 30× the worst seen on either machine and 1/1000 of the wrong normalisation's 54 %.
- Weights ``atol = 0.05 · lr`` = 1.5e-5 (measured: 4.1e-6 after three steps). AdamW moves each
  element by ``lr · m̂ / (√v̂ + ε)``, ≈ ``lr`` for any gradient well above ε, so a gradient's float
  error changes its update by a tiny fraction of ``lr``; only an element whose gradient is itself
  float noise could move differently (by up to ``2 · lr``).
- The negative control: each rank's own token mean (the wrong normalisation) gives gradients off
  by 54 % of a tensor's largest element, and the same :func:`grad_mismatches` refuses them, so the checks
  above can fail.
- Loading is exact: a part loaded on any number of ranks equals what was saved, bit for bit.
- bf16: the relative norm of the gradient's difference from float32's, ``< 0.05`` (measured 0.009 in one
  process, 0.011 on 2 ranks): bf16 keeps 8 bits of mantissa; a wrong normalisation or a lost micro-batch is
  far larger (the negative control's 54 %).
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rlrun.api.spec import OptimizerSpec
from rlrun.batch import TrainBatch, collate
from rlrun.checkpoint import CheckpointError
from rlrun.dcp_format import METADATA_FILE, SHARDED_DIR, read_metadata, verify_sharded
from rlrun.model.tiny import TinyModelRecipe, build_config, build_tokenizer
from rlrun.net import free_port
from rlrun.samples import QueuedTrace, TrainingSample
from rlrun.training.distributed import (
    DataParallel,
    choose_backend,
    clip_grad_norm_,
    full_state_dict,
    init_from_env,
    rank_slice,
    shard_model,
    slice_bounds,
    teardown,
    transformer_blocks,
)
from rlrun.training.objectives import LossSettings
from rlrun.training.precision import mixed_precision_policy
from rlrun.training.reference import load_reference
from rlrun.training.reference_loss import batch_loss, token_logprobs
from rlrun.training.sharded_checkpoint import load_sharded, save_sharded
from rlrun.training.step import StepSettings, accumulate_gradients
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from transformers import Qwen3ForCausalLM

from tests.support.processes import run_forked_ranks

WORLD = 2
OPT = OptimizerSpec()  # the trainer's defaults: lr 3e-4, betas (0.9, 0.99), eps 1e-8, clip 1.0
LOSS = LossSettings()  # the spec's default: PPO's clip, ε = 0.2, token mean
#: Gradients: an element's tolerance, relative to itself and to its tensor's largest element (docstring)
GRAD_RTOL, GRAD_SCALE_TOL = 1e-4, 5e-4
WEIGHT_ATOL = 0.05 * OPT.lr
SPAWN_TIMEOUT_S = 240
WHOLE, SMALL = 100_000, 16  # micro-batch budgets: the batch in one; a sample or two each (lengths 7–13)
#: bf16 against float32: the relative norm of the gradient's difference (measured: 0.009 and 0.011)
BF16_REL = 0.05
#: Losses whose normaliser is not the token count, or with sequence terms, or a reference policy: each must give the
#: single-process step on 2 ranks in micro-batches (batch A's ratios are 0.7–1.4: some tokens inside every bound).
LOSSES = {
    "sequence_gspo_kl": LossSettings(
        objective="gspo",
        epsilon_low=0.05,
        epsilon_high=0.05,
        aggregation="sequence_mean",
        kl_coef=0.5,
        correction="mask",
        correction_level="sequence",
        low=0.9,
        high=1.1,
    ),
    "constant_dual_truncate": LossSettings(
        aggregation="constant",
        constant=5 * 24.0,
        epsilon_high=0.28,
        dual_clip=1.1,
        correction="truncate",
        cap=1.1,
        kl_coef=0.2,
        kl_estimator="k2",
    ),
}


# --- small real inputs -----------------------------------------------------------------------------


def _samples(seed: int, lengths: list[tuple[int, int]], advantages: list[float]) -> list[TrainingSample]:
    """Samples with prompt/completion lengths ``lengths`` and sampling logprobs near the untrained model's
    (``−ln 128 ± 0.3``, so some importance ratios leave ``[1 − ε, 1 + ε]`` and are clipped)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, ((p, c), adv) in enumerate(zip(lengths, advantages, strict=True)):
        ids = torch.randint(2, 97, (p + c,), generator=g).tolist()
        lp = (-math.log(128) + 0.6 * (torch.rand(c, generator=g) - 0.5)).tolist()
        out.append(TrainingSample(ids[:p], ids[p:], lp, adv, 0.5, QueuedTrace("reverse-text", 0, seed, i)))
    return out


def _batch(samples: list[TrainingSample]) -> TrainBatch:
    return TrainBatch(**collate(samples, pad_id=0), meta={"step": 1, "attempt": 0})


BATCH_A = lambda: _batch(_samples(1, [(4, 6), (7, 3), (3, 9), (5, 2), (6, 7)], [0.5, -0.5, 1.0, -1.0, 0.25]))  # noqa: E731
BATCH_B = lambda: _batch(_samples(2, [(5, 5), (3, 8), (8, 2), (4, 4)], [-0.75, 0.75, 0.5, -0.5]))  # noqa: E731
BATCH_C = lambda: _batch(_samples(3, [(5, 6)], [1.0]))  # noqa: E731  (1 row: rank 1 gets a placeholder)


def _new_model(
    init: Path, dp: DataParallel, dtype: torch.dtype = torch.float32, checkpointing: bool = False
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = Qwen3ForCausalLM(build_config(TinyModelRecipe(), build_tokenizer()))
    model.load_state_dict(load_file(str(init)))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    shard_model(model, dp, mp_policy=mixed_precision_policy(dtype) if dp.distributed else None)
    opt = torch.optim.AdamW(model.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay)
    return model, opt


def _step(
    model,
    opt,
    batch: TrainBatch,
    dp: DataParallel,
    budget: int,
    local_mean: bool = False,
    dtype=torch.float32,
    loss: LossSettings = LOSS,
    reference: torch.nn.Module | None = None,
) -> tuple[dict, dict]:
    """One trainer step on this rank's slice in micro-batches of ``budget`` tokens; returns ``(stats, full
    gradients after clipping)``.

    ``local_mean``: the wrong normalisation (each rank's own token mean, in one forward), for the negative control.
    """
    part = rank_slice(batch, dp.rank, dp.world_size)
    model.train()
    opt.zero_grad(set_to_none=True)
    if local_mean:
        logits = model(input_ids=part.input_ids, attention_mask=part.attention_mask).logits
        loss, stats = batch_loss(
            token_logprobs(logits, part.input_ids), part.old_logprobs, part.advantages, part.loss_mask, LOSS
        )
        loss.backward()
    else:
        settings = StepSettings(1.0, 1.0, loss, budget, chunk_tokens=8, compute_dtype=dtype)
        on_policy = torch.ones(part.num_samples, dtype=torch.bool)
        stats = accumulate_gradients(model, part, on_policy, settings, dp, reference=reference)
    stats["grad_norm"] = clip_grad_norm_(model.parameters(), OPT.max_grad_norm)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    opt.step()
    return stats, grads


def _full_optim(model, opt, dp: DataParallel) -> dict:
    """A copy of the whole optimizer state (in one process the state dict holds the live tensors)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return copy.deepcopy(get_optimizer_state_dict(model, opt, options=options))


# --- the 2-rank job --------------------------------------------------------------------------------


def _train_a_save_b_c(model, opt, dp, part: Path, budget: int) -> dict:
    """Steps A, B, C with a sharded save after A (both sides of every scenario); what each left."""
    out: dict = {}
    out["stats_a"], out["grads_a"] = _step(model, opt, BATCH_A(), dp, budget)
    out["weights_a"] = full_state_dict(model, dp)
    out["optim_a"] = _full_optim(model, opt, dp)
    save_sharded(part, model, opt, dp, step=1, attempt=3)
    out["stats_b"], _ = _step(model, opt, BATCH_B(), dp, budget)
    out["weights_b"] = full_state_dict(model, dp)
    out["stats_c"], out["grads_c"] = _step(model, opt, BATCH_C(), dp, budget)
    out["weights_c"] = full_state_dict(model, dp)
    return out


def _other_losses(work: Path, dp: DataParallel, budget: int) -> dict:
    """Step A from the initial weights under each of :data:`LOSSES` (the reference: ``work/ref``, loaded and sharded
    as the trainer does); ``{"stats_<name>", "grads_<name>"}``."""
    out: dict = {}
    for name, loss in LOSSES.items():
        model, opt = _new_model(work / "init.safetensors", dp)
        reference = load_reference(str(work / "ref"), dp, torch.float32, None) if loss.uses_reference else None
        out[f"stats_{name}"], out[f"grads_{name}"] = _step(
            model, opt, BATCH_A(), dp, budget, loss=loss, reference=reference
        )
    return out


def _rank_main(rank: int, port: int, work: str) -> None:
    """One rank of the forked group: the 2-rank side of every scenario (results written by rank 0)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    work_dir = Path(work)
    dp = init_from_env(timeout_s=120)
    assert dp.distributed and dp.backend == "gloo" and dp.world_size == WORLD and dist.get_rank() == rank
    out: dict = {}
    model, opt = _new_model(work_dir / "init.safetensors", dp)
    out["sharded"] = all(hasattr(p, "full_tensor") for p in model.parameters())
    out.update(_train_a_save_b_c(model, opt, dp, work_dir / "two" / "trainer", SMALL))

    # 1 → 2: load the part this test's process wrote alone, then continue with step B.
    model2, opt2 = _new_model(work_dir / "init.safetensors", dp)
    info = load_sharded(work_dir / "one" / "trainer", model2, opt2, dp)
    out["info_one"] = {"world_size": info.world_size, "shards": sorted(info.shards)}
    out["loaded_one"] = full_state_dict(model2, dp)
    out["loaded_one_optim"] = _full_optim(model2, opt2, dp)
    _step(model2, opt2, BATCH_B(), dp, SMALL)
    out["one_to_two_b"] = full_state_dict(model2, dp)

    # rank 0 fails inside the publish (after every rank wrote its shard): nobody publishes, all raise.
    def fail(tmp: Path) -> None:
        raise OSError("disk full")

    try:
        save_sharded(work_dir / "failed" / "trainer", model2, opt2, dp, step=2, attempt=3, extra=fail)
        out["failed_save"] = "returned"
    except (OSError, CheckpointError) as exc:
        out["failed_save"] = f"{type(exc).__name__}: {exc}"
    failed = [None] * WORLD if dp.is_main else None
    dist.gather_object(out["failed_save"], failed, dst=0)
    out["failed_save"] = failed

    # negative control: each rank's own token mean instead of the global normalisation.
    model3, opt3 = _new_model(work_dir / "init.safetensors", dp)
    _, out["grads_local_mean"] = _step(model3, opt3, BATCH_A(), dp, WHOLE, local_mean=True)

    # bf16 (FSDP2 mixed precision) with activation checkpointing
    model4, opt4 = _new_model(work_dir / "init.safetensors", dp, torch.bfloat16, checkpointing=True)
    out["stats_bf16"], out["grads_bf16"] = _step(model4, opt4, BATCH_A(), dp, SMALL, dtype=torch.bfloat16)
    out.update(_other_losses(work_dir, dp, SMALL))
    if dp.is_main:
        torch.save(out, work_dir / "two_ranks.pt")
    teardown(dp)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every scenario's results: ``{"one": …, "two": …, "two_to_one": …, "work": Path, "seconds": …}``."""
    t0 = time.perf_counter()
    work = tmp_path_factory.mktemp("dp")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(7)
        init = Qwen3ForCausalLM(build_config(TinyModelRecipe(), build_tokenizer()))
        save_file({k: v.contiguous() for k, v in init.state_dict().items()}, str(work / "init.safetensors"))
        Qwen3ForCausalLM(build_config(TinyModelRecipe(), build_tokenizer())).save_pretrained(
            work / "ref"
        )  # seed 7's next

        dp = init_from_env(env={})
        one: dict = {}
        model, opt = _new_model(work / "init.safetensors", dp)
        one.update(_train_a_save_b_c(model, opt, dp, work / "one" / "trainer", WHOLE))
        model_bf16, opt_bf16 = _new_model(work / "init.safetensors", dp, checkpointing=True)
        one["stats_bf16"], one["grads_bf16"] = _step(model_bf16, opt_bf16, BATCH_A(), dp, WHOLE, dtype=torch.bfloat16)
        one.update(_other_losses(work, dp, WHOLE))

        run_forked_ranks(_rank_main, (free_port(), str(work)), WORLD, SPAWN_TIMEOUT_S)
        two = torch.load(work / "two_ranks.pt", weights_only=True)

        # 2 → 1: load the 2-rank part in this single process and continue with step B.
        model1, opt1 = _new_model(work / "init.safetensors", dp)
        two_to_one = {"info": load_sharded(work / "two" / "trainer", model1, opt1, dp)}
        two_to_one["loaded"] = full_state_dict(model1, dp)
        two_to_one["loaded_optim"] = _full_optim(model1, opt1, dp)
        _step(model1, opt1, BATCH_B(), dp, WHOLE)
        two_to_one["weights_b"] = full_state_dict(model1, dp)
    finally:
        torch.set_num_threads(threads)
    return {"one": one, "two": two, "two_to_one": two_to_one, "work": work, "seconds": time.perf_counter() - t0}


def grad_mismatches(got: dict, want: dict) -> list[str]:
    """One line per tensor of ``got`` (gradients by parameter name) with an element off ``want``'s by
    more than ``GRAD_RTOL · |g| + GRAD_SCALE_TOL · max |g|`` (``g``: ``want``'s tensor); empty when
    every tensor matches."""
    assert got.keys() == want.keys()
    lines = []
    for name, g in want.items():
        diff, scale = (got[name].float() - g.float()).abs(), float(g.abs().max())
        over = diff > GRAD_RTOL * g.abs() + GRAD_SCALE_TOL * scale
        if over.any():
            worst = f"max |Δ| {float(diff.max()):.3g}, max |g| {scale:.3g}"
            lines.append(f"{name}: {int(over.sum())} of {g.numel()} off, {worst}")
    return lines


def _max_abs_diff(a: dict, b: dict) -> float:
    return _worst(a, b)[0]


def _worst(a: dict, b: dict) -> tuple[float, str, tuple[int, ...]]:
    """``(max |a − b|, tensor name, index)`` over every tensor of two state dicts with the same keys."""
    assert a.keys() == b.keys()
    worst = (0.0, "", ())
    for k in a:
        d = (a[k].float() - b[k].float()).abs()
        if d.numel() and float(d.max()) > worst[0]:
            worst = (float(d.max()), k, tuple(int(i) for i in torch.unravel_index(d.argmax(), d.shape)))
    return worst


def _assert_same_state(a: dict, b: dict) -> None:
    """Bit-for-bit equality of two nested state dicts (tensors, numbers, lists)."""
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_same_state(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


# --- (1) 2 ranks take the single-process step ----------------------------------------------------------


def test_two_ranks_shard_every_parameter_and_split_rows_3_and_2(runs):
    assert runs["two"]["sharded"]
    assert [slice_bounds(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    part0, part1 = rank_slice(BATCH_A(), 0, 2), rank_slice(BATCH_A(), 1, 2)
    assert part0.num_loss_tokens + part1.num_loss_tokens == BATCH_A().num_loss_tokens == 27
    assert part0.num_loss_tokens != part1.num_loss_tokens  # the normalisation is exercised


def test_two_rank_gradients_equal_the_single_process_gradients(runs):
    one, two = runs["one"], runs["two"]
    for step in ("a", "c"):
        assert grad_mismatches(two[f"grads_{step}"], one[f"grads_{step}"]) == [], step
    # the clip was active (norm > 1), so the global norm mattered
    assert one["stats_a"]["grad_norm"] > OPT.max_grad_norm
    assert two["stats_a"]["grad_norm"] == pytest.approx(one["stats_a"]["grad_norm"], rel=1e-5)


def test_the_ranks_ran_several_micro_batches_and_one_process_one(runs):
    """Batch A's rows (10, 10, 12 | 7, 13 tokens) in micro-batches of ≤ 16 tokens: rank 0 runs 3, rank 1 runs 2 and
    one placeholder (FSDP's collectives need as many on every rank); one process runs the batch in one."""
    assert runs["two"]["stats_a"]["micro_batches"] == 3 and runs["one"]["stats_a"]["micro_batches"] == 1


def test_two_ranks_in_bf16_with_checkpointed_blocks_stay_within_bf16_error_of_float32(runs):
    """FSDP2's mixed precision (bf16 compute, float32 reduction and master weights) and activation checkpointing
    on 2 ranks, and bf16 autocast in one process: both gradients within bf16's error of the float32 one."""
    flat = lambda d: torch.cat([d[k].float().flatten() for k in sorted(d)])  # noqa: E731
    want = flat(runs["one"]["grads_a"])
    for side in ("one", "two"):
        got = runs[side]["grads_bf16"]
        assert all(g.dtype == torch.float32 for g in got.values())
        rel = float((flat(got) - want).norm() / want.norm())
        assert 1e-6 < rel < BF16_REL, (side, rel)
    assert runs["two"]["stats_bf16"]["tokens"] == runs["one"]["stats_a"]["tokens"]


@pytest.mark.parametrize("name", LOSSES)
def test_two_ranks_take_the_single_process_step_under_every_loss(runs, name):
    """Sequence-mean and constant normalisers, GSPO's sequence ratio, the dual clip, the mismatch correction and the
    KL term to a reference sharded as the policy: 2 ranks in micro-batches give the gradient and statistics of one
    process in one micro-batch (the normaliser is all-reduced before the first backward)."""
    one, two = runs["one"], runs["two"]
    assert grad_mismatches(two[f"grads_{name}"], one[f"grads_{name}"]) == []
    a, b = one[f"stats_{name}"], two[f"stats_{name}"]
    assert b["micro_batches"] > a["micro_batches"] == 1
    shares = [
        k for k in ("clip_fraction", "dual_clip_fraction", "is_truncated_fraction", "is_masked_fraction") if k in a
    ]
    for key in ("loss", "kl_ref", "policy_loss", *shares):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert all(0 < a[k] < 1 for k in shares), {k: a[k] for k in shares}  # every bound acts on some tokens
    assert a["kl_ref"] > 0  # the reference differs from the policy


def test_two_rank_loss_stats_are_the_whole_batch_stats(runs):
    one, two = runs["one"], runs["two"]
    for step in ("a", "b", "c"):
        a, b = one[f"stats_{step}"], two[f"stats_{step}"]
        assert b["tokens"] == a["tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["clip_fraction"] == pytest.approx(a["clip_fraction"], abs=1e-6)
        assert b["ratio_mean"] == pytest.approx(a["ratio_mean"], rel=1e-5)
        assert b["ratio_max"] == pytest.approx(a["ratio_max"], rel=1e-5)
    assert 0 < one["stats_a"]["clip_fraction"] < 1


def test_two_rank_weights_equal_the_single_process_weights_after_each_step(runs):
    one, two = runs["one"], runs["two"]
    init = load_file(str(runs["work"] / "init.safetensors"))
    assert _max_abs_diff(one["weights_a"], init) > 0.5 * OPT.lr  # the step moved the weights
    for step in ("a", "b", "c"):
        diff, name, index = _worst(two[f"weights_{step}"], one[f"weights_{step}"])
        detail = f"step {step}: {name}{list(index)} differs by {diff:.3g}" + (
            f"; grads {float(one[f'grads_{step}'][name][index]):.3g} / {float(two[f'grads_{step}'][name][index]):.3g}"
            if f"grads_{step}" in one
            else ""
        )
        assert diff <= WEIGHT_ATOL, detail


def test_each_rank_averaging_its_own_tokens_would_not_equal_the_single_process_gradient(runs):
    """The negative control: the tests above can fail, with the tolerance they use."""
    one, wrong = runs["one"]["grads_a"], runs["two"]["grads_local_mean"]
    worst = max(float(((wrong[k] - g).abs() / (g.abs().max() + 1e-12)).max()) for k, g in one.items())
    assert worst > 0.1  # measured: 0.54 of a tensor's largest gradient element
    assert len(grad_mismatches(wrong, one)) == len(one)  # every tensor is refused


def test_the_gradient_tolerance_follows_each_tensors_scale(runs):
    """Issue 47: on another 2-core machine 30 of 16,384 ``embed_tokens`` gradient elements of step C
    were off by up to 1.2e-6 (max |g| 0.07: 1.7e-5 of the scale), outside the absolute 1e-7 this test
    was tuned to. Such an error on the tensor's smallest elements passes; one 100 times larger does not."""
    want, name = runs["one"]["grads_c"], "model.embed_tokens.weight"
    g = want[name]
    smallest, scale = g.abs().flatten().argsort()[:30], float(g.abs().max())

    def off_by(delta: float) -> dict:
        flat = g.clone().flatten()
        flat[smallest] += delta
        return {**want, name: flat.view_as(g)}

    assert grad_mismatches(off_by(1.7e-5 * scale), want) == []
    (line,) = grad_mismatches(off_by(1.7e-3 * scale), want)
    assert line.startswith(f"{name}: 30 of {g.numel()} off")


# --- (2) resharding 2 → 1 and 1 → 2 --------------------------------------------------------------------


def test_two_rank_part_loads_into_one_process_exactly_and_continues_identically(runs):
    two, resumed = runs["two"], runs["two_to_one"]
    assert resumed["info"].world_size == 2 and resumed["info"].step == 1 and resumed["info"].attempt == 3
    assert sorted(resumed["info"].shards) == ["__0_0.distcp", "__1_0.distcp"]
    _assert_same_state(resumed["loaded"], two["weights_a"])
    _assert_same_state(resumed["loaded_optim"], two["optim_a"])
    # same continuation as the 2 ranks that never resharded (and as the single process)
    assert _max_abs_diff(resumed["weights_b"], two["weights_b"]) <= WEIGHT_ATOL
    assert _max_abs_diff(resumed["weights_b"], runs["one"]["weights_b"]) <= WEIGHT_ATOL


def test_one_process_part_loads_into_two_ranks_exactly_and_continues_identically(runs):
    one, two = runs["one"], runs["two"]
    assert two["info_one"] == {"world_size": 1, "shards": ["__0_0.distcp"]}
    _assert_same_state(two["loaded_one"], one["weights_a"])
    _assert_same_state(two["loaded_one_optim"], one["optim_a"])
    assert _max_abs_diff(two["one_to_two_b"], one["weights_b"]) <= WEIGHT_ATOL


def test_a_rank_0_failure_during_a_two_rank_save_raises_on_every_rank_and_publishes_nothing(runs):
    rank0, rank1 = runs["two"]["failed_save"]
    assert rank0 == "OSError: disk full"
    assert rank1.startswith("CheckpointError: ") and rank1.endswith("not published: rank 0: OSError: disk full")
    parent = runs["work"] / "failed"
    assert not parent.exists() or list(parent.iterdir()) == []


def test_sharded_part_layout(runs):
    part = runs["work"] / "two" / "trainer"
    names = sorted(p.name for p in (part / SHARDED_DIR).iterdir())
    assert names == [METADATA_FILE, "__0_0.distcp", "__1_0.distcp"]
    info = verify_sharded(part, deep=True)
    assert info.entries > 2 * len(runs["one"]["weights_a"])  # model chunks + optimizer moments
    assert not [p for p in part.parent.iterdir() if p.name.startswith(".")]  # no temporary left


# --- (3) a torn or missing shard is detected --------------------------------------------------------


@pytest.fixture
def part(runs, tmp_path) -> Path:
    dst = tmp_path / "trainer"
    shutil.copytree(runs["work"] / "two" / "trainer", dst)
    return dst


def test_truncated_shard_is_reported_torn_naming_the_file(part):
    shard = part / SHARDED_DIR / "__1_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: torn: \d+ bytes, \.metadata needs at least \d+"):
        verify_sharded(part)


def test_missing_shard_is_reported_naming_the_file(part):
    (part / SHARDED_DIR / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: missing \(named by .*\.metadata\)"):
        verify_sharded(part)


def test_torn_metadata_is_reported_naming_the_file(part):
    md = part / SHARDED_DIR / METADATA_FILE
    md.write_bytes(md.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable"):
        verify_sharded(part)


def test_corrupt_shard_bytes_fail_the_deep_check_only(part):
    shard = part / SHARDED_DIR / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    verify_sharded(part)  # sizes are intact
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: checksum mismatch"):
        verify_sharded(part, deep=True)


def test_metadata_that_would_run_code_is_refused(part, tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (part / SHARDED_DIR / METADATA_FILE).write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"not allowed in DCP metadata"):
        read_metadata(part / SHARDED_DIR / METADATA_FILE)
    assert not marker.exists()


def test_torn_part_is_refused_before_the_model_is_touched(part, runs):
    (part / SHARDED_DIR / "__1_0.distcp").unlink()
    model, opt = _new_model(runs["work"] / "init.safetensors", init_from_env(env={}))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: missing"):
        load_sharded(part, model, opt, init_from_env(env={}))
    _assert_same_state(model.state_dict(), before)


def test_failed_save_publishes_nothing_and_leaves_no_temporary(runs, tmp_path):
    model, opt = _new_model(runs["work"] / "init.safetensors", init_from_env(env={}))

    def fail(tmp: Path) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_sharded(tmp_path / "trainer", model, opt, init_from_env(env={}), step=2, attempt=0, extra=fail)
    assert list(tmp_path.iterdir()) == []


# --- (4) world size 1 without environment is the plain path -----------------------------------------


def test_no_environment_is_world_size_one_without_a_process_group(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    dp = init_from_env()
    assert (dp.rank, dp.world_size, dp.backend, dp.mesh, dp.distributed) == (0, 1, None, None, False)
    assert not dist.is_initialized()
    assert init_from_env(env={"WORLD_SIZE": "1", "RANK": "0"}).distributed is False
    teardown(dp)  # a no-op


def test_world_size_one_loss_is_the_plain_loss_and_the_model_is_not_wrapped(runs):
    dp = init_from_env(env={})
    model, _ = _new_model(runs["work"] / "init.safetensors", dp)
    assert type(model) is Qwen3ForCausalLM and not any(hasattr(p, "full_tensor") for p in model.parameters())
    b = BATCH_A()
    lp = token_logprobs(model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits, b.input_ids)
    plain, plain_stats = batch_loss(lp, b.old_logprobs, b.advantages, b.loss_mask, LOSS)
    assert runs["one"]["stats_a"]["loss"] == pytest.approx(plain.item(), rel=1e-6)
    for key in ("clip_fraction", "ratio_mean", "ratio_max", "tokens"):
        assert runs["one"]["stats_a"][key] == pytest.approx(plain_stats[key], rel=1e-6), key


def test_rendezvous_variables_are_required_beyond_one_rank():
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT not set"):
        init_from_env(env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    env = {"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(ValueError, match=r"RANK=2 is outside \[0, WORLD_SIZE=2\)"):
        init_from_env(env=env)
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        init_from_env(env={"WORLD_SIZE": "two"})


def test_backend_is_nccl_with_cuda_and_gloo_without():
    assert choose_backend(cuda_available=True) == "nccl"
    assert choose_backend(cuda_available=False) == "gloo"


def test_slices_cover_every_row_once_and_empty_ranks_train_a_weightless_placeholder():
    for rows in range(0, 9):
        for world in range(1, 5):
            bounds = [slice_bounds(rows, r, world) for r in range(world)]
            assert bounds[0][0] == 0 and bounds[-1][1] == rows
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
            sizes = [b - a for a, b in bounds]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    placeholder = rank_slice(BATCH_C(), 1, 2)
    assert placeholder.num_samples == 1 and placeholder.num_loss_tokens == 0
    assert placeholder.meta["rank_rows"] == [1, 1]


def test_tiny_model_is_sharded_per_decoder_layer():
    model = Qwen3ForCausalLM(build_config(TinyModelRecipe(), build_tokenizer()))
    assert transformer_blocks(model) == list(model.model.layers)
    assert transformer_blocks(torch.nn.Linear(2, 2)) == []
