"""A refactor's before/after: the trainer's step time and peak memory, full and LoRA, and the orchestrator's capacity,
of two source trees alternated in one run (JSON on stdout), issue 49.

A redesign step moves code and must not cost time or memory. This runs, ``--repeats`` times and alternating which
tree goes first, each of:

- ``trainer_full`` / ``trainer_lora``: :mod:`trainer_memory` (this tree's script, its children on the measured tree's
  ``trainer/``: ``--source``) at ``--tokens`` tokens a step, activation checkpointing off, on its Qwen3-shaped model
  with Qwen3's vocabulary (151,936) and random weights; LoRA ``{"rank": 16}``. Kept: the measured step's
  ``step_peak_gib``, ``process_peak_gib``, ``step_s``, ``step_cpu_s``;
- ``orchestrator``: each tree's own ``benchmarks/step_time.py`` ``measure_orchestrator`` (the real orchestrator on
  the fake rollout server and the fake trainer, the default example, ``--capacity-steps`` steps): ``samples_per_s``.

Reported per measure and tree: every run's value, the median and the range; ``after_median_in_before_range`` says
whether the after-median lies inside the before range (the issue's criterion; a measure where lower is not better
is read the same way). Run it on a quiet machine: both trees share the cores with nothing else.

Usage: ``python benchmarks/before_after.py --before DIR [--after DIR] [--repeats 3] [--tokens 4096]
[--capacity-steps 150]`` where ``DIR`` is a source tree (``git archive <commit> | tar -x -C DIR``); ``--after``
defaults to this checkout. 2 cores: ≈ 1 min a trainer configuration, ≈ 20 s an orchestrator run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINER_KEYS = ("step_peak_gib", "process_peak_gib", "step_s", "step_cpu_s")
CAPACITY = """
import json, sys
sys.path.insert(0, {bench!r})
from step_time import measure_orchestrator
print(json.dumps(measure_orchestrator({steps}, None)))
"""


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "trainer"), str(tree / "operator"), env.get("PYTHONPATH", "")])
    return env


def trainer_run(tree: Path, tokens: int, lora: bool) -> dict:
    """One :mod:`trainer_memory` configuration on ``tree``'s trainer: the :data:`TRAINER_KEYS` of its measured step."""
    argv = [sys.executable, str(ROOT / "benchmarks" / "trainer_memory.py"), "--tokens", str(tokens)]
    argv += ["--checkpointing", "off", "--source", str(tree)]
    if lora:
        argv += ["--lora", '{"rank": 16}']
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=_env(tree))
    (result,) = json.loads(out.stdout)["results"]
    return {k: result[k] for k in TRAINER_KEYS}


def capacity_run(tree: Path, steps: int) -> dict:
    """The orchestrator's capacity with ``tree``'s code and its own benchmark script: samples scored per second."""
    code = CAPACITY.format(bench=str(tree / "benchmarks"), steps=steps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_env(tree))
    return {"samples_per_s": json.loads(out.stdout.strip().splitlines()[-1])["samples_per_s"]}


def summarise(runs: dict[str, list[dict]]) -> dict:
    """``{key: {before: {values, median, range}, after: {…}, after_median_in_before_range}}`` of one measure."""
    out = {}
    for key in runs["before"][0]:
        row = {}
        for side in ("before", "after"):
            values = [r[key] for r in runs[side]]
            row[side] = {"values": values, "median": statistics.median(values), "range": [min(values), max(values)]}
        lo, hi = row["before"]["range"]
        row["after_median_in_before_range"] = lo <= row["after"]["median"] <= hi
        out[key] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the source tree before the change")
    parser.add_argument("--after", type=Path, default=ROOT, help="the source tree after it (default: this checkout)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the measured trainer step")
    parser.add_argument("--capacity-steps", type=int, default=150)
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    measures = {
        "trainer_full": lambda tree: trainer_run(tree, args.tokens, lora=False),
        "trainer_lora": lambda tree: trainer_run(tree, args.tokens, lora=True),
        "orchestrator": lambda tree: capacity_run(tree, args.capacity_steps),
    }
    runs: dict[str, dict[str, list[dict]]] = {m: {"before": [], "after": []} for m in measures}
    for i in range(args.repeats):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")  # neither side always runs first
        for name, measure in measures.items():
            for side in order:
                result = measure(trees[side])
                runs[name][side].append(result)
                print(json.dumps({"repeat": i, "measure": name, "side": side, **result}), file=sys.stderr, flush=True)
    report = {
        "before": str(trees["before"]),
        "after": str(trees["after"]),
        "repeats": args.repeats,
        "tokens": args.tokens,
        "capacity_steps": args.capacity_steps,
        "measures": {name: summarise(r) for name, r in runs.items()},
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
