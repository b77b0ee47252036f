"""``spec.trainer.precision`` (``rlrun.training.precision``): the compute dtype per device, the one warning when bf16
is missing, and weights published in the dtype the rollout servers serve (the trainer's compute dtype)."""

from __future__ import annotations

import logging

import pytest
import torch
from rlrun.orchestrator.weights import validate_weights_dir, weights_signature
from rlrun.rundir import RunDir
from rlrun.training import precision
from rlrun.training.precision import resolve_precision
from rlrun.training.trainer import Trainer
from safetensors import safe_open

from tests.support.manifests import parse

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("requested", "device", "has_bf16", "expected"),
    [
        ("auto", CPU, True, torch.float32),  # a CPU trains in float32 unless asked
        ("auto", GPU, True, torch.bfloat16),
        ("auto", GPU, False, torch.float32),  # a GPU older than Ampere
        ("bfloat16", CPU, True, torch.bfloat16),
        ("float32", GPU, True, torch.float32),
    ],
)
def test_the_compute_dtype_follows_the_setting_and_the_hardware(monkeypatch, requested, device, has_bf16, expected):
    monkeypatch.setattr(precision, "bf16_supported", lambda d: has_bf16)
    assert resolve_precision(requested, device) == expected


def test_bfloat16_without_the_hardware_falls_back_to_float32_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(precision, "bf16_supported", lambda d: False)
    with caplog.at_level(logging.WARNING, logger="rlrun.training.precision"):
        assert resolve_precision("bfloat16", CPU) == torch.float32
        assert resolve_precision("bfloat16", CPU, warn=False) == torch.float32  # another rank: no second line
    [record] = caplog.records
    assert "spec.trainer.precision: bfloat16 requested" in record.message and "float32" in record.message


def _dtypes(path) -> set[str]:
    with safe_open(str(path), framework="pt") as fh:
        return {str(fh.get_slice(k).get_dtype()) for k in fh.keys()}  # noqa: SIM118


@pytest.mark.parametrize(("has_bf16", "published"), [(True, {"BF16"}), (False, {"F32"})])
def test_weights_are_published_in_the_compute_dtype_and_checkpointed_in_float32(
    monkeypatch, tmp_path, tiny_model, has_bf16, published
):
    monkeypatch.setattr(precision, "bf16_supported", lambda d: has_bf16)
    spec = parse("bf16", max_steps=1, trainer={"precision": "bfloat16"}).spec
    run_dir = RunDir(tmp_path)
    trainer = Trainer(spec, run_dir, str(tiny_model))
    trainer.publish(1)
    trainer.ledger.close()
    assert trainer.policy.compute_dtype == (torch.bfloat16 if has_bf16 else torch.float32)
    assert _dtypes(run_dir.broadcast(1) / "model.safetensors") == published  # what vLLM serves
    assert _dtypes(run_dir.trainer_checkpoint(0) / "model.safetensors") == {"F32"}  # master weights
    assert all(p.dtype == torch.float32 for p in trainer.policy.model.parameters())
    # the orchestrator accepts it against the float32 initial model (names and shapes match)
    validate_weights_dir(run_dir.broadcast(1), weights_signature(tiny_model))
