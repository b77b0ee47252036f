"""Cost of the experiment trackers on the orchestrator (JSON on stdout): capacity and event-loop stall, with and
without trackers, in one invocation.

The runs are ``benchmarks/journal.py``'s (the real :class:`~rlrun.orchestrator.loop.Orchestrator`, journal on,
instant fake rollouts, the fake trainer in a process of its own), on the default example's spec with
``logging`` either empty (the baseline) or both trackers: TensorBoard and W&B in ``offline`` mode (what a run
without network writes; ``online`` hands the same rows to the same local W&B process, which uploads them).

- ``capacity``: ``--repeats`` runs each, interleaved, to ``--steps`` steps; episodes/s as ``journal.py`` counts
  them. ``capacity_ratio`` = median with trackers ÷ median without; goal ≥ 0.95 (the run-to-run spread on 2 busy
  cores is larger: compare ``best_ratio`` too).
- ``loop_stall_ms``: lateness of a 1 ms ticker on the orchestrator's event loop (p50 / p99 / max, pooled over
  ``--stall-repeats`` interleaved runs) in runs whose fake rollouts arrive at ``--rollout-samples-per-s``, with
  and without trackers; goal: p99 ≤ 3 ms (journal.py's goal). Each run with trackers includes their start
  (``wandb.init`` spawns W&B's process while the run goes on; the packages are imported before it starts).
- ``publisher_cpu_ms_per_step``: CPU time the publisher's thread spent per step logged (reading the metrics
  files, logging to both trackers) in the capacity runs: what it takes from the orchestrator's process, beside
  its loop. W&B's own process (``wandb-core``) is not counted in it; it is in the capacity.
- ``logged``: the last step the trackers logged in each run with them, so a run that logged nothing cannot pass
  as free.

Usage: ``python benchmarks/tracking.py [--steps 200] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import tempfile
from pathlib import Path

from example import example_spec  # benchmarks/example.py (scripts run with benchmarks/ on sys.path)
from journal import one_run, percentiles

TRACKERS = {"tensorboard": {}, "wandb": {"project": "rlrun-benchmark", "mode": "offline"}}


def run(spec, model_dir: Path, steps: int, parent: Path, **kwargs) -> dict:
    """``journal.one_run`` with the journal on."""
    return one_run(spec, model_dir, steps, True, parent, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stall-steps", type=int, default=24)
    parser.add_argument("--stall-repeats", type=int, default=3)
    parser.add_argument("--rollout-samples-per-s", type=float, default=500.0)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where run dirs go")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()

    from rlrun.model.resolve import resolve_model
    from rlrun.orchestrator.loop import Orchestrator

    specs = {"trackers": example_spec(logging=TRACKERS), "baseline": example_spec()}
    model_dir = Path(resolve_model(specs["baseline"].model, args.cache_dir, envs=specs["baseline"].envs))
    run(specs["trackers"], model_dir, 4, args.dir)  # warm-up: imports (wandb, tensorboard), caches
    capacity: dict[str, list[dict]] = {"trackers": [], "baseline": []}
    for _ in range(args.repeats):
        for mode in ("baseline", "trackers"):  # interleaved: drift in the machine's load hits both alike
            capacity[mode].append(run(specs[mode], model_dir, args.steps, args.dir))
    poll_s = inspect.signature(Orchestrator).parameters["poll_s"].default  # as it runs: its default polling
    stall: dict[str, list[dict]] = {"trackers": [], "baseline": []}
    for _ in range(args.stall_repeats):
        for mode in ("baseline", "trackers"):
            stall[mode].append(
                run(
                    specs[mode],
                    model_dir,
                    args.stall_steps,
                    args.dir,
                    samples_per_s=args.rollout_samples_per_s,
                    poll_s=poll_s,
                )
            )
    median = {m: statistics.median(r["episodes_per_s"] for r in runs) for m, runs in capacity.items()}
    best = {m: max(r["episodes_per_s"] for r in runs) for m, runs in capacity.items()}
    print(
        json.dumps(
            {
                "benchmark": "tracking",
                "cpus": os.cpu_count(),
                "trackers": TRACKERS,
                "capacity": {
                    "steps": args.steps,
                    "repeats": args.repeats,
                    "episodes_per_s": median,
                    "runs_episodes_per_s": {m: [r["episodes_per_s"] for r in runs] for m, runs in capacity.items()},
                    "capacity_ratio": round(median["trackers"] / median["baseline"], 3),
                    "best_ratio": round(best["trackers"] / best["baseline"], 3),
                },
                "loop_stall_ms": {
                    "rollout_samples_per_s": args.rollout_samples_per_s,
                    "steps": args.stall_steps,
                    "repeats": args.stall_repeats,
                    **{m: percentiles([x for r in runs for x in r["lateness"]]) for m, runs in stall.items()},
                },
                "publisher_cpu_ms_per_step": round(
                    1000
                    * sum(r["publisher_cpu_s"] for r in capacity["trackers"])
                    / sum(r["logged_step"] for r in capacity["trackers"]),
                    3,
                ),
                "logged": {
                    "capacity_runs": [r.get("logged_step") for r in capacity["trackers"]],
                    "stall_runs": [r.get("logged_step") for r in stall["trackers"]],
                },
                "goals": {"capacity_ratio": 0.95, "loop_stall_p99_ms": 3},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
