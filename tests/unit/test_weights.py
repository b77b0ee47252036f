"""Weights checked before they reach vLLM (``rlrun.orchestrator.weights.validate_weights_dir``): names and shapes
must be the model's; a floating-point tensor may come in another floating-point dtype (the trainer publishes bf16 when
it computes in bf16), nothing else may."""

from __future__ import annotations

import pytest
import torch
from rlrun.errors import WeightsMismatch
from rlrun.orchestrator.weights import validate_weights_dir, weights_signature
from safetensors.torch import save_file


def _dir(path, **tensors):
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture
def reference(tmp_path):
    return weights_signature(_dir(tmp_path / "ref", w=torch.zeros(4, 3), ids=torch.zeros(2, dtype=torch.int64)))


def test_a_floating_tensor_may_come_in_another_floating_dtype(tmp_path, reference):
    bf16 = _dir(tmp_path / "bf16", w=torch.zeros(4, 3, dtype=torch.bfloat16), ids=torch.zeros(2, dtype=torch.int64))
    assert validate_weights_dir(bf16, reference)["w"] == ("BF16", (4, 3))


@pytest.mark.parametrize(
    ("tensors", "problem"),
    [
        ({"w": torch.zeros(4, 2), "ids": torch.zeros(2, dtype=torch.int64)}, r"w: \('F32', \(4, 2\)\)"),
        ({"w": torch.zeros(4, 3, dtype=torch.int32), "ids": torch.zeros(2, dtype=torch.int64)}, r"w: \('I32'"),
        ({"w": torch.zeros(4, 3), "ids": torch.zeros(2)}, r"ids: \('F32'"),
        ({"w": torch.zeros(4, 3)}, "missing ids"),
        ({"w": torch.zeros(4, 3), "ids": torch.zeros(2, dtype=torch.int64), "x": torch.zeros(1)}, "unexpected x"),
    ],
)
def test_names_shapes_and_the_kind_of_dtype_must_match(tmp_path, reference, tensors, problem):
    with pytest.raises(WeightsMismatch, match=problem):
        validate_weights_dir(_dir(tmp_path / "bad", **tensors), reference)
