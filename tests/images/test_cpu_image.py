"""The CPU image of every role trains the default example inside itself: ``rlrun local`` starts the trainer, the
orchestrator and vLLM-CPU (the image's own vLLM, not the test runner's) in one container, on the run directory a
volume mounts, and the ledger of that directory holds (nothing finished lost or trained twice)."""

from __future__ import annotations

import json
import os

from rlrun.versions import imitated_vllm, report

from tests.support.images import CPU_IMAGE, CPU_ROLLOUT_IMAGE, ROOT, Container, image_config

STEPS = 5


def test_cpu_image_trains_the_default_example_on_its_own_vllm_and_the_ledger_holds(images, tmp_path, tiny_model):
    assert image_config(CPU_IMAGE) == image_config(CPU_ROLLOUT_IMAGE)  # one image, both roles' names
    volume = tmp_path / "volume"
    volume.mkdir()
    uid, gid = (int(part) for part in image_config(CPU_IMAGE)["User"].split(":"))
    os.chown(volume, uid, gid)  # the pod's fsGroup makes the run's volume its user's
    run_dir = "/var/lib/rlrun/volume/run"
    mounts = [(ROOT / "examples", "/var/lib/rlrun/examples", "ro"), (volume, "/var/lib/rlrun/volume")]
    # the session's model cache, read-only: the builtin model the other tiers built (a build in the image costs
    # ≈ 30 s and proves nothing the training does not: torch and transformers run in the trainer)
    cache = tiny_model.parent.parent
    cache.chmod(0o755)  # pytest makes its temporary directories 0700: the image's user must be let in
    mounts.append((cache, "/var/lib/rlrun/model-cache", "ro"))
    with Container(CPU_IMAGE) as container:
        argv = ["rlrun", "local", "examples/reverse-text.yaml", "--max-steps", str(STEPS), "--run-dir", run_dir]
        argv += ["--cache-dir", "/var/lib/rlrun/model-cache"]
        done = container.run(argv, volumes=mounts, timeout=900)
        assert done.returncode == 0, done.stdout[-4000:]
        checked = container.run(["rlrun", "ledger", "check", run_dir], volumes=mounts)
        assert checked.returncode == 0, checked.stdout[-2000:]

    run = volume / "run"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    assert (run / "checkpoints" / f"step_{STEPS}" / "orchestrator" / "progress.pt").is_file()
    evaluated = [json.loads(line)["policy_version"] for line in (run / "eval.jsonl").read_text().splitlines()]
    assert evaluated == [0, STEPS]  # the example's held-out evaluation, at the start and the end
    assert "ledger: ok" in done.stdout and json.loads(checked.stdout)["ok"] is True
    # the vLLM that served is the image's: the pinned release (the test runner's is not in the container)
    assert f"version {imitated_vllm()}" in (run / "logs" / "rollout-0.log").read_text()


def test_cpu_image_holds_the_torch_and_vllm_the_tests_run(images):
    with Container(CPU_IMAGE) as container:
        done = container.run(["rlrun", "versions", "--json"])
    assert done.returncode == 0, done.stdout
    inside = json.loads(done.stdout)
    here = report().to_dict()
    assert inside["ok"] is True and inside["rlrun"] == here["rlrun"]
    assert inside["packages"] == here["packages"]  # same distributions, versions and pins as this test runner's
