"""The rollout client's cost on the orchestrator's event loop (JSON on stdout): aiohttp's connection pool
(the client's transport) against httpx's own (httpcore, the baseline), in the same invocation.

A fake vLLM server runs in a process of its own (``rlrun.rollout.fake.fake_vllm_process``, real HTTP on
localhost) and one :class:`~rlrun.rollout.client.RolloutClient` keeps ``--in-flight`` completion requests of
``n = 8`` (a group of the default example) open at all times, as the dispatcher does, for ``--seconds``.
For each transport and each in-flight count:

- ``requests_per_s``: completions answered per second by an instant server (the client's capacity);
- ``loop_cpu_ms_per_request``: the loop thread's CPU time (``time.thread_time``) per answered request;
- ``loop_stall_ms``: a 1 ms ticker's lateness on the loop (p50 / p99 / max) while the server answers at
  ``--samples-per-s`` (the loop has idle time: what each request's handling holds it for).

``ratio`` = aiohttp ÷ httpx for requests/s, and httpx ÷ aiohttp for CPU per request. The server's process
shares this machine's cores, which a vLLM on its own node does not.

Usage: ``python benchmarks/rollout_client.py [--seconds 5] [--in-flight 32 128]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import httpx
from journal import percentiles  # benchmarks/journal.py: the same p50 / p99 / max

N = 8
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 1]


def client(url: str, transport: str):
    from rlrun.rollout.client import RolloutClient

    if transport == "aiohttp":
        return RolloutClient(url)  # its own transport
    # httpx's pool as the client had it before: no limit on connections, many kept alive
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    return RolloutClient(url, transport=httpx.AsyncHTTPTransport(limits=limits))


async def keep_in_flight(url: str, transport: str, in_flight: int, seconds: float) -> dict:
    """``in_flight`` requests open at all times for ``seconds``; answered count, loop CPU, ticker lateness."""
    from rlrun.api.spec import SamplingSpec

    c = client(url, transport)
    loop = asyncio.get_running_loop()
    lateness: list[float] = []
    done = 0
    end = loop.time() + 1.0  # warm-up: the pool's connections open

    async def worker() -> None:
        nonlocal done
        while loop.time() < end:
            await c.complete(PROMPT, SamplingSpec(), n=N)
            done += 1

    async def tick() -> None:
        while loop.time() < end:
            t = loop.time()
            await asyncio.sleep(0.001)
            lateness.append((loop.time() - t - 0.001) * 1000)

    try:
        await asyncio.gather(*(worker() for _ in range(in_flight)))
        end = loop.time() + seconds
        done, cpu, wall = 0, time.thread_time(), time.perf_counter()
        lateness.clear()
        await asyncio.gather(tick(), *(worker() for _ in range(in_flight)))
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    finally:
        await c.aclose()
    return {"requests": done, "seconds": round(wall, 3), "cpu_s": round(cpu, 3), "lateness": lateness}


def measure(transport: str, in_flight: int, seconds: float, samples_per_s: float) -> dict:
    from rlrun.rollout.fake import fake_vllm_process

    out = {}
    for name, rate in (("capacity", None), ("paced", samples_per_s)):
        server, url = fake_vllm_process(samples_per_s=rate, error_rate=0.2)
        try:
            out[name] = asyncio.run(keep_in_flight(url, transport, in_flight, seconds))
        finally:
            server.kill()
            server.join(10)
    cap, paced = out["capacity"], out["paced"]
    return {
        "requests_per_s": round(cap["requests"] / cap["seconds"], 1),
        "loop_cpu_ms_per_request": round(1000 * cap["cpu_s"] / max(cap["requests"], 1), 3),
        "loop_stall_ms": percentiles(paced["lateness"]),
        "paced_requests_per_s": round(paced["requests"] / paced["seconds"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--samples-per-s", type=float, default=500.0, help="the paced server's rate (samples/s)")
    args = parser.parse_args()
    results = []
    for in_flight in args.in_flight:
        row = {t: measure(t, in_flight, args.seconds, args.samples_per_s) for t in ("httpx", "aiohttp")}
        row["ratio"] = {
            "requests_per_s": round(row["aiohttp"]["requests_per_s"] / row["httpx"]["requests_per_s"], 2),
            "loop_cpu_per_request": round(
                row["httpx"]["loop_cpu_ms_per_request"] / row["aiohttp"]["loop_cpu_ms_per_request"], 2
            ),
        }
        results.append({"in_flight": in_flight} | row)
    print(
        json.dumps(
            {
                "benchmark": "rollout_client",
                "cpus": os.cpu_count(),
                "n_per_request": N,
                "seconds": args.seconds,
                "samples_per_s": args.samples_per_s,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
