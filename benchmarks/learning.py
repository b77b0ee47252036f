"""Does the default example learn, and does a preemption change what it learns? JSON on stdout.

For each ``--seeds`` seed, the default example (``examples/reverse-text.yaml``, its ``seed`` replaced) runs with
``rlrun local`` twice: uninterrupted, and with ``--preempt-at-step`` (every process killed and resumed there).
Each run's held-out evaluation (``eval.jsonl``: greedy solved and sampled reward by policy version, at the
start, every ``evaluation.interval`` steps and at the end) is its curve. Reported:

- ``curves``: per seed and run, ``[[policy_version, greedy_solved, sampled_reward], …]``;
- ``final``: the last evaluation of each run, and ``gain`` (greedy solved, last − first) of the uninterrupted;
- ``seed_spread``: max − min over the seeds of the uninterrupted runs' final greedy solved, and
  ``resumed_minus_uninterrupted`` per seed: a preemption costs nothing when these stay within the spread;
  ``late`` is the same on the mean of the evaluations in the last fifth of the run (less noisy than one
  round of 100 tasks: a binomial standard error of ≈ 0.05 at 0.35);
- ``step_time_s``: the mean ``step_time_s`` of metrics.jsonl (steps after the first 5) of the first seed's
  uninterrupted run (evaluation on) and of a run of the same seed with evaluation off, and their ratio
  (issue 27's bar: within 10 %).

Usage: ``python benchmarks/learning.py [--seeds 0 1 2] [--preempt-at-step 60] [--cache-dir DIR]``
(≈ 3 min a run on 2 cores; 7 runs with the defaults).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "examples" / "reverse-text.yaml"


def run(work: Path, name: str, seed: int, cache: Path, preempt: int | None = None, evaluation: bool = True) -> dict:
    """One ``rlrun local`` run of the default example; its evaluations and step times."""
    from rlrun.rundir import read_jsonl

    doc = yaml.safe_load(MANIFEST.read_text())
    doc["spec"]["seed"] = seed
    doc["spec"].setdefault("evaluation", {})["enabled"] = evaluation
    manifest = work / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    run_dir = work / name
    argv = [sys.executable, "-m", "rlrun", "local", str(manifest), "--run-dir", str(run_dir), "--cache-dir", str(cache)]
    argv += ["--preempt-at-step", str(preempt)] if preempt else []
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"{name}: rlrun local exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    evals = read_jsonl(run_dir / "eval.jsonl")
    steps = [r["step_time_s"] for r in read_jsonl(run_dir / "metrics.jsonl")[5:] if not r.get("restored")]
    return {
        "curve": [[e["policy_version"], round(e["greedy_solved"], 4), round(e["sampled_reward"], 4)] for e in evals],
        "step_time_s": statistics.mean(steps) if steps else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--preempt-at-step", type=int, default=None, help="default: half the example's max_steps")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "rlrun-bench-cache")
    args = p.parse_args()
    max_steps = yaml.safe_load(MANIFEST.read_text())["spec"]["max_steps"]
    preempt = args.preempt_at_step or max_steps // 2
    out: dict = {"manifest": str(MANIFEST.relative_to(ROOT)), "max_steps": max_steps, "preempt_at_step": preempt}
    with tempfile.TemporaryDirectory(prefix="rlrun-learning-") as tmp:
        work = Path(tmp)
        runs = {
            seed: {
                "uninterrupted": run(work, f"s{seed}", seed, args.cache_dir),
                "preempted": run(work, f"s{seed}-preempted", seed, args.cache_dir, preempt=preempt),
            }
            for seed in args.seeds
        }
        off = run(work, f"s{args.seeds[0]}-eval-off", args.seeds[0], args.cache_dir, evaluation=False)
    out["curves"] = {seed: {k: r["curve"] for k, r in rs.items()} for seed, rs in runs.items()}
    final = {seed: {k: r["curve"][-1][1] for k, r in rs.items()} for seed, rs in runs.items()}
    gains = {
        seed: rs["uninterrupted"]["curve"][-1][1] - rs["uninterrupted"]["curve"][0][1] for seed, rs in runs.items()
    }
    spread = max(f["uninterrupted"] for f in final.values()) - min(f["uninterrupted"] for f in final.values())
    diffs = {seed: round(f["preempted"] - f["uninterrupted"], 4) for seed, f in final.items()}
    out["final"] = {"greedy_solved": final, "gain": {s: round(g, 4) for s, g in gains.items()}}
    out["seed_spread"] = round(spread, 4)
    out["resumed_minus_uninterrupted"] = diffs
    out["resumed_within_spread"] = all(abs(d) <= spread for d in diffs.values())
    late = {
        seed: {k: statistics.mean(p[1] for p in r["curve"] if p[0] >= 0.8 * max_steps) for k, r in rs.items()}
        for seed, rs in runs.items()
    }
    late_spread = max(v["uninterrupted"] for v in late.values()) - min(v["uninterrupted"] for v in late.values())
    out["late"] = {
        "greedy_solved": {s: {k: round(v, 4) for k, v in d.items()} for s, d in late.items()},
        "seed_spread": round(late_spread, 4),
        "resumed_minus_uninterrupted": {s: round(d["preempted"] - d["uninterrupted"], 4) for s, d in late.items()},
    }
    on = runs[args.seeds[0]]["uninterrupted"]["step_time_s"]
    out["step_time_s"] = {"eval_on": on, "eval_off": off["step_time_s"], "ratio": on / off["step_time_s"]}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
