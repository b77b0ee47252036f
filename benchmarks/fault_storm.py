"""Fault storm (issue 26): the real Orchestrator against a fake vLLM that fails in every way at random moments,
many short runs; every run must end, its ledger check passing (JSON on stdout).

Each run (seed ``s``): 8 steps of groups of 4 (batch 8), ``max_off_policy_steps`` ∈ {0, 1, 2},
``members_per_request`` ∈ {1, 2, 4}, a checkpoint every 1–3 steps, a 1 s request timeout and a 2 s retry window,
the fake trainer. The server (the fake's answers, :mod:`rlrun.rollout.fake`) waits 0–30 ms before and after each
completion and 0–50 ms on each admin call of a weight update (so results land at every moment of an update), and
fails completions at random: 8 % answer 500, 4 % hang (counted as running in ``/metrics``, so only the timeout
ends them), 4 % reset the connection, 3 % answer ``abort``. A run that has not ended after ``--run-timeout``
seconds is a **stall**: the stall accounting (where every sample the next batch needs is,
:func:`rlrun.orchestrator.liveness.stall_accounting`) is printed to stderr.

Output: ``runs``, ``stalls``, ``ledger_failures``, run seconds p50 / max.

Usage: ``python benchmarks/fault_storm.py [--runs 100] [--first-seed 0] [--run-timeout 45] [--cache-dir DIR]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

STEPS = 8


class Storm(httpx.AsyncBaseTransport):
    """The fake vLLM transport with random faults and delays (module docstring)."""

    def __init__(self, seed: int) -> None:
        from rlrun.rollout.fake import fake_vllm_transport

        self.rng = random.Random(seed)
        self.inner = fake_vllm_transport(error_rate=0.3, seed=seed)
        self.hanging = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path, r = request.url.path, self.rng.random()
        if path == "/metrics":  # the hanging requests count as running, as a slow vLLM reports them
            text = (await self.inner.handle_async_request(request)).text
            running = int(text.split("vllm:num_requests_running", 1)[1].split()[1]) + self.hanging
            return httpx.Response(200, text=f'vllm:num_requests_running{{model_name="policy"}} {running}\n')
        if path == "/v1/completions":
            await asyncio.sleep(self.rng.random() * 0.03)
            if r < 0.08:
                return httpx.Response(500, text="injected failure")
            if r < 0.12:
                self.hanging += 1
                try:
                    await asyncio.sleep(3600)
                finally:
                    self.hanging -= 1
            if r < 0.16:
                raise httpx.ReadError("injected connection reset")
            answer = await self.inner.handle_async_request(request)
            if r < 0.19:
                body = json.loads(answer.content)
                body["choices"][-1]["finish_reason"] = "abort"
                return httpx.Response(200, json=body)
            await asyncio.sleep(self.rng.random() * 0.03)
            return answer
        if path in ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache"):
            await asyncio.sleep(self.rng.random() * 0.05)
        return await self.inner.handle_async_request(request)


async def one(seed: int, model: Path, root: Path, run_timeout: float) -> dict:
    from rlrun.ledger import check_ledger
    from rlrun.manifest import parse_manifest
    from rlrun.orchestrator.liveness import stall_accounting
    from rlrun.orchestrator.loop import Orchestrator
    from rlrun.rollout.client import RolloutClient
    from rlrun.rundir import RunDir
    from rlrun.training.fake import start_fake_trainer

    rng = random.Random(seed)
    body = {
        "model": {"builtin": "tiny-reverse"},
        "envs": [{"name": "reverse-text"}],
        "group_size": 4,
        "batch_size": 8,
        "max_off_policy_steps": rng.choice([0, 1, 2]),
        "max_steps": STEPS,
        "seed": seed,
        "checkpoint": {"interval": rng.choice([1, 2, 3]), "keep_last": 2},
        "rollout": {
            "request_timeout_seconds": 1,
            "retry_window_seconds": 2,
            "max_group_retries": 3,
            "members_per_request": rng.choice([1, 2, 4]),
        },
    }
    doc = {"apiVersion": "rlrun.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": "storm"}, "spec": body}
    spec = parse_manifest(doc).spec
    run_dir = RunDir(root / f"run-{seed}")
    transport = Storm(seed)
    orch = Orchestrator(
        spec,
        run_dir,
        ["http://fake-rollout:1"],
        str(model),
        attempt=1,
        poll_s=0.01,
        client_factory=lambda url: RolloutClient(url, transport=transport),
    )
    stop = start_fake_trainer(run_dir, model, STEPS, spec.checkpoint.interval, attempt=1)
    t0 = time.monotonic()
    task = asyncio.ensure_future(orch.run())
    try:
        done, _ = await asyncio.wait({task}, timeout=run_timeout)
        if not done:
            print(
                f"stall: seed {seed}: {json.dumps(stall_accounting(orch.view(detail=True)), default=str)}",
                file=sys.stderr,
            )
            task.cancel()
            return {"seed": seed, "stalled": True}
        report = check_ledger(run_dir.root / "ledger")
        return {
            "seed": seed,
            "stalled": False,
            "steps": task.result(),
            "ledger_ok": report.ok,
            "seconds": time.monotonic() - t0,
        }
    finally:
        stop.set()


async def storm(args) -> list[dict]:
    from rlrun.model.resolve import ensure_builtin_model

    model = ensure_builtin_model("tiny-reverse", args.cache_dir)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.first_seed, args.first_seed + args.runs):
            out.append(await one(seed, model, Path(tmp), args.run_timeout))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--run-timeout", type=float, default=45.0, help="seconds after which a run is a stall")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "rlrun-bench-cache")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    runs = asyncio.run(storm(args))
    seconds = sorted(r["seconds"] for r in runs if not r["stalled"])
    print(
        json.dumps(
            {
                "runs": len(runs),
                "stalls": [r["seed"] for r in runs if r["stalled"]],
                "ledger_failures": [r["seed"] for r in runs if not r["stalled"] and not r["ledger_ok"]],
                "short_runs": [r["seed"] for r in runs if not r["stalled"] and r["steps"] != STEPS],
                "seconds": {
                    "p50": seconds[len(seconds) // 2] if seconds else None,
                    "max": seconds[-1] if seconds else None,
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
