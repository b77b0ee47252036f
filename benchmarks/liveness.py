"""The rollout liveness guard (JSON on stdout): how soon lost requests are asked again, and false alarms.

The real :class:`~rlrun.orchestrator.loop.Orchestrator` (default guard settings: look every 2 s, a request
counts after 2 s out, two looks 3 s apart) with a fake trainer in a thread of this process:

- ``lost``: two rollout servers, one of which takes completion requests and never answers while its
  ``/metrics`` reports 0 running and 0 waiting (the server of issue 26). For every request the guard
  declared lost: ``re_request_s``, seconds from the request being sent to the mute server to the healthy
  server receiving its prompt again after the declaration (p50 / max over ``--trials`` runs of ``--steps``
  steps; goal ≤ 10 s; the request timeout is 300 s).
- ``healthy``: one fake server generating at ``--rollout-samples-per-s`` (its ``/metrics`` counts what it is
  generating, as vLLM's does) with ``max_inflight`` well above what it serves at once, so requests wait
  seconds in it: ``false_alarms``, requests the guard asked again (goal 0), over ``--healthy-steps`` steps.

Usage: ``python benchmarks/liveness.py [--trials 3] [--steps 4] [--healthy-steps 30]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from example import example_spec  # benchmarks/example.py (scripts run with benchmarks/ on sys.path)

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "examples" / "reverse-text.yaml"


class Recording(httpx.AsyncBaseTransport):
    """A fake vLLM server that notes when it receives each prompt; ``mute``: it never answers completions
    and reports 0 requests running."""

    def __init__(self, mute: bool, **fake) -> None:
        from rlrun.rollout.fake import fake_vllm_transport

        self.inner = fake_vllm_transport(**fake)
        self.mute = mute
        self.received: list[tuple[float, tuple[int, ...]]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            self.received.append((time.monotonic(), tuple(json.loads(request.content)["prompt"])))
            if self.mute:
                await asyncio.sleep(3600)
        if self.mute and request.url.path == "/metrics":
            return httpx.Response(200, text='vllm:num_requests_running{model_name="policy"} 0\n')
        return await self.inner.handle_async_request(request)


async def run(spec, model_dir: Path, transports: dict[str, Recording], steps: int):
    from rlrun.orchestrator.loop import Orchestrator
    from rlrun.rollout.client import RolloutClient
    from rlrun.rundir import RunDir
    from rlrun.training.fake import start_fake_trainer

    with tempfile.TemporaryDirectory(prefix="rlrun-bench-liveness-") as tmp:
        run_dir = RunDir(tmp)
        orch = Orchestrator(
            spec,
            run_dir,
            list(transports),
            str(model_dir),
            max_steps=steps,
            attempt=1,
            client_factory=lambda url: RolloutClient(url, transport=transports[url]),
        )
        stop = start_fake_trainer(run_dir, model_dir, steps, spec.checkpoint.interval, attempt=1)
        try:
            await asyncio.wait_for(orch.run(), 600)
        finally:
            stop.set()
        return orch


def measure_lost(spec, model_dir: Path, trials: int, steps: int) -> dict:
    from rlrun.orchestrator.dispatcher import Dispatcher

    declared: list[tuple[float, float, tuple[int, ...]]] = []  # (sent at, declared lost at, prompt)
    lose = Dispatcher.lose

    def noting(self, keys, why):
        now = time.monotonic()
        for k in keys:
            if k in self.inflight:
                e = self.inflight[k]
                declared.append((e.sent_at, now, tuple(self.episodes.prompt_ids(e.request.task))))
        return lose(self, keys, why)

    delays = []
    Dispatcher.lose = noting
    try:
        for _ in range(trials):
            declared.clear()
            up = Recording(mute=False)
            asyncio.run(run(spec, model_dir, {"http://mute:1": Recording(mute=True), "http://up:1": up}, steps))
            for sent, lost_at, prompt in declared:  # sent to the mute server → the same prompt asked again
                again = [t for t, p in up.received if p == prompt and t >= lost_at]
                if again:
                    delays.append(again[0] - sent)
    finally:
        Dispatcher.lose = lose
    return {
        "trials": trials,
        "steps": steps,
        "requests_lost": len(delays),
        "re_request_s": {"p50": round(statistics.median(delays), 2), "max": round(max(delays), 2)} if delays else None,
        "goal_s": 10,
    }


def measure_healthy(spec, model_dir: Path, steps: int, rate: float) -> dict:
    served = Recording(mute=False, samples_per_s=rate)
    t0 = time.monotonic()
    orch = asyncio.run(run(spec, model_dir, {"http://busy:1": served}, steps))
    return {
        "steps": steps,
        "rollout_samples_per_s": rate,
        "max_inflight": spec.rollout.max_inflight,
        "seconds": round(time.monotonic() - t0, 1),
        "false_alarms": orch.liveness.lost_requests,
        "goal_false_alarms": 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--healthy-steps", type=int, default=30, help="0: skip the false-alarm run")
    parser.add_argument("--rollout-samples-per-s", type=float, default=50.0)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from rlrun.model.resolve import resolve_model

    spec = example_spec()
    model_dir = Path(resolve_model(spec.model, envs=spec.envs))
    out = {"benchmark": "liveness", "lost": measure_lost(spec, model_dir, args.trials, args.steps)}
    if args.healthy_steps > 0:
        out["healthy"] = measure_healthy(spec, model_dir, args.healthy_steps, args.rollout_samples_per_s)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
