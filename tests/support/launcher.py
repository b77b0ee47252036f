"""A ``rlrun local`` launcher on a small manifest, and the run-directory records its decisions read.

The launcher is built as the CLI builds it, with its console captured; nothing is started until a
test calls into it, and its control URL points at a free port where nothing listens (an
orchestrator that has exited).
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch
from rich.console import Console
from rlrun.checkpoint import save_orchestrator_progress
from rlrun.launcher.local import LocalLauncher
from rlrun.net import free_port
from rlrun.rundir import RunDir
from safetensors.torch import save_file

from tests.support.manifests import parse


def make_launcher(
    tmp_path, max_steps: int | None = None, resume: bool = False, preempt_at_step: int | None = None, **spec: Any
) -> tuple[LocalLauncher, io.StringIO]:
    """A launcher of a 6-step run (``spec`` overrides its fields) with run directory ``tmp_path/run``, and
    what it prints."""
    out = io.StringIO()
    launcher = LocalLauncher(
        tmp_path / "m.yaml",
        parse("t", **{"max_steps": 6, **spec}),
        tmp_path / "run",
        max_steps=max_steps,
        resume=resume,
        console=Console(file=out, width=400),
        preempt_at_step=preempt_at_step,
    )
    launcher.control_url = f"http://127.0.0.1:{free_port()}"  # nothing listens: an orchestrator that has exited
    return launcher, out


def complete_checkpoint(rd: RunDir, step: int) -> None:
    """Both parts of checkpoint ``step``, written with the real writers (so they verify)."""
    root = rd.trainer_checkpoint(step)
    root.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(root / "model.safetensors"))
    (root / "progress.json").write_text(json.dumps({"step": step}))
    save_orchestrator_progress(rd, step, {"step": step, "shipped": step, "source": {"cursor": step * 10}})


#: what a resume from step 4 put back in the launcher's tests (a
#: :func:`~tests.support.fake_orchestrator.resume_report`'s fields): 7 queued traces, 2 open and 1 requested group,
#: every count other than 0 so that none is lost unseen
RESUMED = dict(
    from_attempt=1,
    shipped=5,
    queued_traces=7,
    open_groups=2,
    requested_groups=1,
    finished_episodes_kept=3,
    dropped_stale=1,
    members_requested=5,
    progress_only_would_lose=10,
    time=1.0,
)


def write_ledger(rd: RunDir, attempt: int, events: list[dict], torn_tail: bool = False) -> None:
    """Attempt ``attempt``'s orchestrator ledger: ``events``, one JSON line each (then a torn line)."""
    (rd.root / "ledger").mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(ev) + "\n" for ev in events) + ('{"e": "disp' if torn_tail else "")
    (rd.root / "ledger" / f"attempt-{attempt}.orchestrator.jsonl").write_text(text)


def metrics_row(step: int, attempt: int, reward: float | None, tokens_per_s: float, step_time_s: float = 1.0) -> dict:
    """A ``metrics.jsonl`` line of step ``step``."""
    return {
        "step": step,
        "attempt": attempt,
        "reward_mean": reward,
        "rollout_tokens_per_s": tokens_per_s,
        "step_time_s": step_time_s,
        "completion_len_mean": 6.0,
        "staleness_mean": 0.5,
        "staleness_max": 1,
        "queue": 3,
        "policy_version": step - 1,
    }
