"""What a node loss costs a real run (JSON on stdout): the same seed with and without a preemption.

Both runs are end-to-end tests' scenario 1 on a ``LocalCluster`` (``tests/support/kubelet``:
the API emulator, three fake nodes whose pods are real ``rlrun`` processes with real vLLM, the
real ``rlrun operator`` process), the manifest of ``tests/support/scenarios.py`` (``--max-steps``,
default 20). ``preempted`` loses the node of ``--role`` (``trainer``, default: the operator
replaces only the trainer; ``orchestrator``: the whole attempt restarts) with a spot notice
(``--notice`` s, default 10) once the trainer has published ``--at`` policy versions (default 5)
and the orchestrator is mid-batch; ``baseline`` is not touched. Reported per run:

- ``reward_last10``: mean reward of the last 10 steps (``metrics.jsonl``; RL on 2 busy cores is
  noisy, so compare it with ``reward_last10`` of the baseline, measured in the same invocation);
- ``wall_s``: ``kubectl apply`` → ``Succeeded``; ``wall_ratio``: preempted / baseline;
- for the preempted run, ``cost_s``: for a trainer loss, notice → old trainer signalled → gone →
  replacement started → next optimizer step (``tests/support/scenarios.trainer_loss_cost``); for an
  orchestrator loss, notice → pause answered → old pods gone → new pods ready → first batch of
  the new attempt (``tests/support/scenarios.preemption_cost``); ``steps_recomputed`` (trainer steps
  trained twice), ``vllm_starts`` (rollout server processes started), ``resumed`` (the status's
  ``lastResume``: what a new attempt kept) and ``preempted_at`` (the orchestrator's step, policy
  version, queue, open groups and samples in flight at the notice).

Usage: ``python benchmarks/preemption.py [--role trainer] [--max-steps 20] [--at 5] [--notice 10]``
(≈ 5 min).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlrun.launcher.preemption import steps_recomputed

from tests.support.kubelet import LocalCluster
from tests.support.scenarios import (
    NAME,
    OPERATOR_ENV,
    apply,
    ledger_check,
    manifest,
    preemption_cost,
    reward_tail,
    run_dir,
    seed_model,
    trainer_loss_cost,
    wait_for_end,
    wait_for_generation,
    wait_for_training,
)


def one_run(root: Path, cache: Path, max_steps: int, preempt_at: int | None, notice_s: float, role: str) -> dict:
    with LocalCluster(root, operator_env=OPERATOR_ENV) as cluster:
        seed_model(cluster, cache)
        start = time.time()
        apply(cluster, manifest(max_steps=max_steps))
        out: dict = {}
        if preempt_at is not None:
            wait_for_training(cluster, preempt_at)
            node = cluster.pod(NAME, role)["spec"]["nodeName"]
            at = wait_for_generation(cluster)
            keys = ("step", "policy_version", "queued_traces", "open_groups", "inflight_samples")
            out["preempted_at"] = {k: at[k] for k in keys}
            cluster.nodes.preempt_node(node, notice_seconds=notice_s)
            notice = cluster.first(f"notice node {node}")
        status = wait_for_end(cluster, timeout=600)
        out["wall_s"] = round(time.time() - start, 1)
        out["reward_last10"] = round(reward_tail(cluster), 4)
        if preempt_at is not None:
            trainer_only = status["attempt"] == 0
            out["cost_s"] = trainer_loss_cost(cluster, notice) if trainer_only else preemption_cost(cluster, notice, 1)
            out["resumed"] = status.get("lastResume")
        out["preemptions"] = status["preemptions"]
        out["steps_recomputed"] = steps_recomputed(run_dir(cluster) / "ledger")
        out["vllm_starts"] = sum(" started on " in w and "-rollout-" in w for _, w in cluster.timeline)
        ledger_check(cluster)
        out["ledger_check"] = "passed"
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--at", type=int, default=5, help="policy versions published before the notice")
    parser.add_argument("--notice", type=float, default=10.0, help="spot notice window, seconds")
    parser.add_argument("--role", choices=("trainer", "orchestrator"), default="trainer", help="whose node is lost")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-") as tmp:
        cache = Path(tmp) / "cache"
        baseline = one_run(Path(tmp) / "baseline", cache, args.max_steps, None, args.notice, args.role)
        preempted = one_run(Path(tmp) / "preempted", cache, args.max_steps, args.at, args.notice, args.role)
    out = {
        "max_steps": args.max_steps,
        "lost": args.role,
        "seed": manifest()["spec"]["seed"],
        "baseline": baseline,
        "preempted": preempted,
        "wall_ratio": round(preempted["wall_s"] / baseline["wall_s"], 2),
        "reward_last10_delta": round(preempted["reward_last10"] - baseline["reward_last10"], 4),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
