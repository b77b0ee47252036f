"""What losing the trainer costs (JSON on stdout): a trainer-only restart against a full restart, same seed.

Both runs are ``rlrun local MANIFEST --max-steps N --preempt-at-step K`` (real vLLM, real trainer and
orchestrator; default manifest ``examples/reverse-text.yaml``, N = 8, K = 4), in fresh run
directories, one after the other:

- ``trainer``: ``--only trainer`` — SIGTERM to the trainer (it saves the step it has), then only the
  trainer restarts with ``--resume`` and the same attempt; the orchestrator and vLLM stay up;
- ``all``: the default — pause, the trainer's notice, SIGKILL every process, restart everything.

Reported per run (from ``<run_dir>/preemptions.jsonl``, written by ``rlrun local``):
``notice_to_next_step_s`` (the notice — the SIGTERM, or the pause for ``all`` — to the end of the
next optimizer step), ``steps_recomputed`` (trainer steps trained twice, from the ledger),
``rollout_restarts``, ``trainer_exit`` (143: saved on notice), ``trainer_saved_step``, and ``wall_s``
for the whole run and ``ledger_ok`` (``rlrun local``'s exit status, which is 0 only when the ledger
check passes). ``speedup`` = ``all`` / ``trainer`` seconds to the next step.

Usage: ``python benchmarks/trainer_loss.py [--manifest examples/reverse-text.yaml] [--max-steps 8]
[--at 4] [--cache-dir DIR]`` (≈ 5 min on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(manifest: Path, run_dir: Path, max_steps: int, at: int, only: str, cache_dir: Path | None) -> dict:
    argv = [
        sys.executable,
        "-m",
        "rlrun",
        "local",
        str(manifest),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        str(max_steps),
        "--preempt-at-step",
        str(at),
        "--only",
        only,
    ]
    if cache_dir is not None:
        argv += ["--cache-dir", str(cache_dir)]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    wall = round(time.monotonic() - t0, 1)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-2000:])
        raise SystemExit(f"rlrun local --only {only} exited {proc.returncode}")
    records = [json.loads(line) for line in (run_dir / "preemptions.jsonl").read_text().splitlines()]
    if len(records) != 1:
        raise SystemExit(f"--only {only}: expected one preemption, found {len(records)} (see {run_dir})")
    keys = (
        "notice_to_next_step_s",
        "steps_recomputed",
        "rollout_restarts",
        "trainer_exit",
        "trainer_saved_step",
        "pause_step",
        "next_step",
    )
    return {**{k: records[0].get(k) for k in keys}, "wall_s": wall, "ledger_ok": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, default=ROOT / "examples" / "reverse-text.yaml")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--at", type=int, default=4, help="trainer step after which the preemption comes")
    parser.add_argument("--cache-dir", type=Path, default=None, help="model cache (default: rlrun's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-") as tmp:
        runs = {
            only: one_run(args.manifest, Path(tmp) / only, args.max_steps, args.at, only, args.cache_dir)
            for only in ("trainer", "all")
        }
    out = {
        "manifest": str(args.manifest),
        "max_steps": args.max_steps,
        "preempt_at_step": args.at,
        "trainer_only": runs["trainer"],
        "full_restart": runs["all"],
        "speedup": round(runs["all"]["notice_to_next_step_s"] / runs["trainer"]["notice_to_next_step_s"], 2),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
