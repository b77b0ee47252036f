"""A LoRA run end to end (issue 40): ``rlrun local --preempt-at-step`` on a manifest with ``spec.model.lora``, the
real trainer and orchestrator as processes and the fake rollout server (which answers vLLM's adapter routes and
refuses a completion naming an adapter it does not hold, as vLLM does). Real vLLM serving the adapters is
``test_rollout_server.py``'s LoRA test."""

from __future__ import annotations

import json
import re
import subprocess

import torch
from peft import PeftModel
from rlrun.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, is_b
from rlrun.checkpoint import latest_complete_checkpoint
from rlrun.ledger import check_ledger
from rlrun.probes import PROBE_FILE
from rlrun.rundir import META_FILE, RunDir, step_dirs
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.support.manifests import PREEMPTION_RUN, write_manifest
from tests.support.runs import local_argv, metrics

MAX_STEPS = 10
LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def test_a_preempted_lora_run_resumes_its_adapter_and_loses_no_episode(tmp_path, cache_dir, tiny_model):
    model = {"builtin": "tiny-reverse", "lora": LORA}
    manifest = write_manifest(tmp_path / "m.yaml", base=PREEMPTION_RUN, max_steps=MAX_STEPS, model=model)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        local_argv(manifest, run_dir, cache_dir, "--preempt-at-step", "4"), capture_output=True, text=True, timeout=600
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    assert "Resuming with" in out and "1 preemption(s)" in out and "ledger: ok" in out, out[-3000:]
    [record] = [json.loads(line) for line in (run_dir / "preemptions.jsonl").read_text().splitlines()]
    saved = record["trainer_saved_step"]
    assert record["steps_recomputed"] == 0 and saved >= 4 and record["next_step"] == saved + 1
    # the resumed trainer loaded the adapter it saved on notice (its log names the part), and trained every step once
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert f"restored trainer checkpoint step {saved} " in trainer_log, trainer_log[-3000:]
    assert "trains a LoRA adapter of rank 8 on q_proj, v_proj, down_proj" in trainer_log
    rows = metrics(run_dir / "trainer_metrics.jsonl")
    assert sorted(r["step"] for r in rows) == list(range(1, MAX_STEPS + 1))
    report = check_ledger(run_dir / "ledger")
    assert report.ok and report.rolled_back == 0 and report.steps == MAX_STEPS, report.problems
    # every policy version reached the rollout server: the orchestrator's follower loaded each newest broadcast
    versions = [
        int(v) for v in re.findall(r"policy version \d+ -> (\d+)", (run_dir / "logs" / "orchestrator.log").read_text())
    ]
    assert versions and max(versions) == MAX_STEPS
    # what a LoRA run writes is the adapter alone: broadcasts and trainer parts, no full weights anywhere
    rd = RunDir(run_dir)
    broadcasts = step_dirs(rd.broadcasts)
    adapter = {ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, META_FILE}  # and a trained step's probe
    assert broadcasts and all(
        adapter <= {f.name for f in p.iterdir()} <= adapter | {PROBE_FILE} for p in broadcasts.values()
    )
    ckpt = latest_complete_checkpoint(rd)
    assert ckpt is not None and ckpt.step == MAX_STEPS
    part = rd.trainer_checkpoint(MAX_STEPS)
    assert {f.name for f in part.iterdir()} == {
        ADAPTER_CONFIG_FILE,
        ADAPTER_WEIGHTS_FILE,
        "optimizer.pt",
        "progress.json",
        META_FILE,
    }
    # the last adapter is trained (B moved off zero), loads with peft onto the base, and changes the base's logits
    adapter = load_file(str(part / ADAPTER_WEIGHTS_FILE))
    assert len(adapter) == 2 * 3 * 4  # A and B of 3 targets in each of the tiny model's 4 blocks
    assert all(t.abs().max() > 0 for k, t in adapter.items() if is_b(k))
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
        after = PeftModel.from_pretrained(base, str(part)).eval()(input_ids=ids).logits
    assert not torch.allclose(before, after, atol=1e-6)
