"""A LoRA run on the real trainer (one process, the builtin tiny-reverse model): it publishes and checkpoints the
adapter alone, never writes the base weights, reports what each publish wrote, resumes from its part with the
weights and optimizer of the uninterrupted run, refuses a resume without LoRA, and takes the KL term's reference
from the adapter disabled (no second model)."""

from __future__ import annotations

import json

import pytest
import torch
from rlrun.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, is_b
from rlrun.batch import write_batch
from rlrun.checkpoint import WEIGHTS_FILE, save_orchestrator_progress
from rlrun.errors import CheckpointMismatch
from rlrun.manifest import ManifestError
from rlrun.probes import PROBE_FILE
from rlrun.rundir import RunDir
from rlrun.training.distributed import single_process
from rlrun.training.lora import AdapterOff, adapter_state
from rlrun.training.trainer import Trainer
from safetensors.torch import load_file

from tests.support.manifests import parse
from tests.support.samples import sample

LORA = {"builtin": "tiny-reverse", "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}}


def _batches(run_dir: RunDir, steps: range) -> None:
    for step in steps:
        batch = [sample(step, m, step - 1, a) for m, a in enumerate((0.5, -0.5, 1.0))]
        write_batch(run_dir.rollout_batch(step), step, batch, pad_id=0)


def _run(spec, run_dir: RunDir, model, **kwargs) -> Trainer:
    trainer = Trainer(spec, run_dir, str(model), **kwargs)
    trainer.run()
    trainer.ledger.close()
    return trainer


def test_a_lora_run_writes_the_adapter_alone_and_resumes_with_the_uninterrupted_runs_weights(tmp_path, tiny_model):
    spec = parse("lora", model=LORA, max_steps=3, checkpoint={"interval": 2}, optimizer={"lr": 0.01}).spec
    whole_dir = RunDir(tmp_path / "whole")
    _batches(whole_dir, range(1, 4))
    whole = _run(spec, whole_dir, tiny_model)
    assert whole.step == 3

    # the base weights are never written and never change
    base = load_file(str(tiny_model / WEIGHTS_FILE))
    now = {k.replace(".base_layer", ""): v for k, v in whole.policy.model.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(now[k], v) for k, v in base.items())
    # broadcasts and parts: the adapter alone (tiny-reverse: 2.5 MB of weights; this adapter: 56 kB in float32)
    part = whole_dir.trainer_checkpoint(2)
    assert {p.name for p in part.iterdir()} == {
        ADAPTER_CONFIG_FILE,
        ADAPTER_WEIGHTS_FILE,
        "optimizer.pt",
        "progress.json",
        "meta.json",
    }
    adapter_bytes = (part / ADAPTER_WEIGHTS_FILE).stat().st_size
    params = sum(p.numel() for p in whole.policy.model.parameters() if p.requires_grad)
    assert params == 4 * (4 * 128 + 128 * 4 + 4 * 128 + 64 * 4 + 4 * 256 + 128 * 4)  # 4 layers: q, v, down
    assert 4 * params < adapter_bytes < 4 * params + 8192  # float32 tensors and the header
    assert adapter_bytes < (tiny_model / WEIGHTS_FILE).stat().st_size / 10
    broadcast = whole_dir.broadcast(3)
    published = {p.name for p in broadcast.iterdir()}  # the adapter, and its version's mismatch probe
    assert published == {ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, "meta.json", PROBE_FILE}
    # each step reports what its publish wrote: bytes and seconds
    lines = [json.loads(line) for line in whole_dir.trainer_metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3] and all(m["broadcast_s"] > 0 for m in lines)
    for m in lines:
        assert m["broadcast_bytes"] == sum(f.stat().st_size for f in whole_dir.broadcast(m["step"]).iterdir())

    # interrupted after step 2, resumed from its part: step 3 gives the uninterrupted run's adapter and optimizer
    run_dir = RunDir(tmp_path / "run")
    _batches(run_dir, range(1, 4))
    _run(spec, run_dir, tiny_model, max_steps=2)
    save_orchestrator_progress(run_dir, 2, {"step": 2, "shipped": 2})
    resumed = Trainer(spec, run_dir, str(tiny_model), resume=True)
    assert resumed.step == 2
    resumed.run()
    resumed.ledger.close()
    want = adapter_state(whole.policy.adapter, single_process())
    got = adapter_state(resumed.policy.adapter, single_process())
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-7, msg=name)
    assert any(float(v.abs().max()) > 1e-3 for k, v in want.items() if is_b(k))  # the adapter moved
    for p, q in zip(
        whole.optimizer.param_groups[0]["params"], resumed.optimizer.param_groups[0]["params"], strict=True
    ):
        assert whole.optimizer.state[p]["step"] == resumed.optimizer.state[q]["step"] == 3
        torch.testing.assert_close(resumed.optimizer.state[q]["exp_avg_sq"], whole.optimizer.state[p]["exp_avg_sq"])

    # the same part resumed by a run without LoRA is refused, saying why (exit 78)
    with pytest.raises(CheckpointMismatch, match=r"the checkpoint trained a LoRA adapter .* hold the adapter alone"):
        Trainer(
            parse("lora", max_steps=3, checkpoint={"interval": 2}, optimizer={"lr": 0.01}).spec,
            run_dir,
            str(tiny_model),
            resume=True,
        )


def test_the_kl_reference_of_a_lora_run_is_its_base_model_with_no_second_copy(tmp_path, tiny_model):
    spec = parse("lora-kl", model=LORA, max_steps=2, loss={"kl_coef": 0.1}, optimizer={"lr": 0.01}).spec
    run_dir = RunDir(tmp_path)
    _batches(run_dir, range(1, 3))
    trainer = Trainer(spec, run_dir, str(tiny_model))
    assert isinstance(trainer.policy.reference, AdapterOff)
    first, second = trainer.train_step(1), trainer.train_step(2)
    trainer.ledger.close()
    assert first["kl_ref"] == pytest.approx(0, abs=1e-9)  # B starts at zero: the policy is the base model
    assert second["kl_ref"] > 1e-6  # the adapter moved; the reference did not


def test_a_target_module_the_model_lacks_stops_the_trainer_at_start(tmp_path, tiny_model):
    spec = parse("lora-bad", model={**LORA, "lora": {"target_modules": ["q_proj", "qkv_proj"]}}).spec
    with pytest.raises(ManifestError, match=r"target_modules\[1\]: 'qkv_proj' names no module .* did you mean"):
        Trainer(spec, RunDir(tmp_path), str(tiny_model))
    assert not RunDir(tmp_path).checkpoints.exists() or not any(RunDir(tmp_path).checkpoints.iterdir())
