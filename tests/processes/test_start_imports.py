"""What a role loads before it does anything: every attempt after a preemption pays it again, and so does every
test that starts a role. ``rlrun local`` reads the manifest and the run directory's checkpoints without torch
(≈ 5 s of its start on 2 cores before); the orchestrator loads its tokenizer without transformers' auto-model
machinery, which brings torch's compiler (≈ 2.5 s of every orchestrator start; ``docs/measurements.md``)."""

from __future__ import annotations

import subprocess
import sys


def loaded_after(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after ``statement``."""
    script = f"{statement}\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return set(done.stdout.split())


def test_the_local_launcher_and_the_checkpoint_rules_load_no_torch():
    loaded = loaded_after("import rlrun.launcher.local, rlrun.checkpoint, rlrun.dcp_format, rlrun.cli")
    assert "torch" not in loaded and "transformers" not in loaded


def test_the_orchestrator_loads_neither_transformers_auto_models_nor_torch_s_compiler():
    loaded = loaded_after("import rlrun.orchestrator.main")
    assert "torch" in loaded  # it writes progress.pt and batches with torch: that much it needs
    assert "transformers.models.auto.auto_factory" not in loaded and "torch._dynamo" not in loaded
    assert "torch.distributed.checkpoint" not in loaded
