"""The KL term's reference policy (``rlrun.training.reference``): the starting weights on every start, a resume
included; ``kl_ref`` in the step's metrics; a reference that cannot fit beside the policy refused by its field."""

from __future__ import annotations

from array import array

import pytest
import torch
from rlrun.batch import write_batch
from rlrun.checkpoint import save_orchestrator_progress
from rlrun.errors import classify_error
from rlrun.identity import run_identity
from rlrun.manifest import ManifestError
from rlrun.rundir import RunDir
from rlrun.samples import QueuedTrace, TrainingSample
from rlrun.training import reference as reference_module
from rlrun.training.reference import GIB, room_problem
from rlrun.training.trainer import Trainer
from safetensors.torch import load_file

from tests.support.manifests import parse

KL = {"kl_coef": 0.1, "kl_estimator": "k3"}


def _batch(run_dir: RunDir, step: int) -> None:
    samples = [
        TrainingSample(
            array("q", [3, 4, 9]),
            array("q", c),
            array("d", [-2.0] * len(c)),
            adv,
            0.5,
            QueuedTrace("reverse-text", step - 1, step, m),
        )
        for m, (c, adv) in enumerate([([5, 6, 7, 0], 1.0), ([5, 9, 0], -1.0), ([12, 0], 0.5)])
    ]
    write_batch(run_dir.rollout_batch(step), step, samples, pad_id=0)


def test_kl_ref_is_zero_while_the_policy_is_the_reference_and_grows_as_it_moves(tmp_path, tiny_model):
    """Step 1 trains the starting weights, which the reference holds: KL 0 (k3 of δ = 0). Step 2's policy has
    moved: KL > 0, and the loss is the policy loss plus β · kl_ref (token mean: both are means over the same tokens)."""
    spec = parse(max_steps=2, loss=KL).spec
    run_dir = RunDir(tmp_path)
    trainer = Trainer(spec, run_dir, str(tiny_model))
    assert trainer.policy.reference is not None and not trainer.policy.reference.training
    assert not any(p.requires_grad for p in trainer.policy.reference.parameters())
    _batch(run_dir, 1)
    _batch(run_dir, 2)
    first, second = trainer.train_step(1), trainer.train_step(2)
    trainer.ledger.close()
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-9)
    assert second["kl_ref"] > 1e-6
    assert second["loss"] == pytest.approx(second["policy_loss"] + 0.1 * second["kl_ref"], rel=1e-5)
    assert all(p.grad is None for p in trainer.policy.reference.parameters())  # frozen: no gradient ever reaches it


def test_no_reference_is_held_or_logged_when_kl_coef_is_0(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path)
    trainer = Trainer(parse(max_steps=1).spec, run_dir, str(tiny_model))
    _batch(run_dir, 1)
    metrics = trainer.train_step(1)
    trainer.ledger.close()
    assert trainer.policy.reference is None and "kl_ref" not in metrics and "policy_loss" not in metrics


def test_a_resumed_trainer_holds_the_starting_weights_as_its_reference_not_the_checkpoints(tmp_path, tiny_model):
    spec = parse(max_steps=3, loss=KL).spec
    run_dir = RunDir(tmp_path)
    first = Trainer(spec, run_dir, str(tiny_model))
    _batch(run_dir, 1)
    first.train_step(1)
    first.step = 1
    first.checkpoint(1)
    first.ledger.close()
    save_orchestrator_progress(run_dir, 1, {"step": 1, "shipped": 1, "identity": run_identity(spec)})
    resumed = Trainer(spec, run_dir, str(tiny_model), resume=True)
    resumed.ledger.close()
    assert resumed.step == 1
    start = load_file(str(tiny_model / "model.safetensors"))
    ref, policy = resumed.policy.reference.state_dict(), resumed.policy.model.state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(ref[name], start[name].float())
    assert not torch.equal(policy[name], start[name].float())  # the policy resumed the trained weights


@pytest.mark.parametrize(
    ("parameters", "world", "dtype_bytes", "free_gib", "sharing", "fits"),
    [
        # a 0.6B model in one process: bf16 reference 1.12 GiB + 12 bytes/parameter of state to come 6.71 GiB
        (600_000_000, 1, 2, 8.0, 1, True),
        (600_000_000, 1, 2, 7.5, 1, False),
        (600_000_000, 1, 4, 8.0, 1, False),  # a float32 reference: 2.24 + 6.71 > 8
        (600_000_000, 4, 2, 2.0, 1, True),  # 4 ranks each hold a quarter: 0.28 + 1.68 GiB
        (600_000_000, 4, 2, 2.0, 4, False),  # … unless the 4 share one machine's memory (CPU ranks)
    ],
)
def test_the_reference_fits_when_its_shard_and_the_state_to_come_fit_in_the_free_memory(
    parameters, world, dtype_bytes, free_gib, sharing, fits
):
    problem = room_problem(parameters, world, dtype_bytes, int(free_gib * GIB), "GPU cuda:0", sharing)
    assert (problem is None) == fits
    if problem:
        assert problem.startswith("spec.loss.kl_coef: ") and f"{free_gib:.2f} GiB free" in problem


def test_a_trainer_without_room_for_the_reference_refuses_kl_coef_permanently(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setattr(reference_module, "free_bytes", lambda device: (1 << 20, "CPU memory"))  # 1 MiB free
    with pytest.raises(ManifestError) as info:
        Trainer(parse(max_steps=1, loss=KL).spec, RunDir(tmp_path), str(tiny_model))
    assert info.value.errors[0].startswith("spec.loss.kl_coef: the reference policy")
    assert classify_error(info.value) == (True, "InvalidManifest")  # exit 78: retrying cannot heal it
    Trainer(parse(max_steps=1).spec, RunDir(tmp_path / "off"), str(tiny_model)).ledger.close()  # no KL: no check
