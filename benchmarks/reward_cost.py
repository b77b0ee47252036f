"""What a reward costs the orchestrator's event loop (JSON on stdout): the LCS reward (reverse-text's own, the
baseline) against a reward taking 5 ms per episode — sleeping (I/O, e.g. a remote judge) or computing (pure
Python holding the GIL) — each scored the way rlrun does (worker threads, :mod:`rlrun.rewards.scoring`) and,
for contrast, inline on the loop (how rewards ran before issue 23), in the same invocation.

:class:`~rlrun.orchestrator.episodes.EpisodeBuilder` turns ``--in-flight`` groups of ``n = 8`` completions into
scored episodes at all times, for ``--seconds``, with the orchestrator's GIL switch interval (1 ms). Per variant:

- ``groups_per_s``: groups scored per second (the scoring capacity; a 5 ms reward bounds it at
  ``threads × 1000 / (5 × 8)`` groups/s when sleeping, at ``1000 / (5 × 8)`` when computing under the GIL);
- ``loop_stall_ms``: a 1 ms ticker's lateness on the loop (p50 / p99 / max), what every other request,
  weight update and control call waits.

``ratio``: each variant's p99 stall and capacity ÷ the LCS baseline's (threads).

Usage: ``python benchmarks/reward_cost.py [--seconds 3] [--in-flight 16]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from journal import percentiles  # benchmarks/journal.py: the same p50 / p99 / max

N = 8
REWARD_MS = 5.0


def sleeping(completions, **kwargs):
    """5 ms per episode, waiting (the GIL is free meanwhile)."""
    time.sleep(REWARD_MS / 1000 * len(completions))
    return [0.5] * len(completions)


def computing(completions, **kwargs):
    """5 ms of this thread's CPU per episode in pure Python (holds the GIL but for the interpreter's switches)."""
    end = time.thread_time() + REWARD_MS / 1000 * len(completions)
    x = 0
    while time.thread_time() < end:
        x += 1
    return [0.5] * len(completions)


def builder(variant: str, inline: bool):
    from rlrun.envs.reverse_text import ReverseTextEnv
    from rlrun.orchestrator.episodes import EpisodeBuilder
    from rlrun.rewards.scoring import GroupScores, RewardFunction, score_group

    env = ReverseTextEnv(reward="lcs")
    chars = {c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz= ")}
    ids = {i: c for c, i in chars.items()}
    rewards = None
    if variant != "lcs":
        rewards = {env.name: [RewardFunction(variant, 1.0, sleeping if variant == "sleep_5ms" else computing)]}
    b = EpisodeBuilder(
        encode=lambda text: [chars[c] for c in text],
        decode=lambda xs: "".join(ids.get(i, "?") for i in xs),
        eos_id=0,
        envs={env.name: env},
        rewards=rewards,
    )
    if inline:  # the reward on the loop itself, as before rewards moved to worker threads

        async def score(rewards, task, texts, completion_ids, timeout_s, context=None) -> GroupScores:
            return score_group(rewards, task, texts, completion_ids)

        b.scorer.score = score
    return b, env


async def run(variant: str, inline: bool, in_flight: int, seconds: float) -> dict:
    from rlrun.orchestrator.groups import GroupRequest
    from rlrun.rollout.client import Completion

    b, env = builder(variant, inline)
    loop = asyncio.get_running_loop()
    lateness: list[float] = []
    done = 0
    end = loop.time() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        i = w
        while loop.time() < end:
            task = env.task(0, i)
            prompt = list(b.prompt_ids(task))
            answer = [*prompt[-2::-1], 0]
            completions = [Completion(answer, [-0.1] * len(answer), "stop") for _ in range(N)]
            await b.episodes(GroupRequest(i, task, N), 0, prompt, completions)
            await asyncio.sleep(0)  # the request's own wait for its completions: other work runs meanwhile
            done += 1
            i += in_flight

    async def tick() -> None:
        while loop.time() < end:
            t = loop.time()
            await asyncio.sleep(0.001)
            lateness.append((loop.time() - t - 0.001) * 1000)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(tick(), *(worker(w) for w in range(in_flight)))
    finally:
        b.close()
    wall = time.perf_counter() - t0
    return {"groups_per_s": round(done / wall, 1), "loop_stall_ms": percentiles(lateness)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--in-flight", type=int, default=16, help="groups being scored at once")
    args = parser.parse_args()
    sys.setswitchinterval(0.001)  # the orchestrator's (rlrun.orchestrator.loop.LOOP_SWITCH_INTERVAL_S)
    results = {}
    for variant in ("lcs", "sleep_5ms", "cpu_5ms"):
        for mode in ("threads", "inline"):
            results[f"{variant}/{mode}"] = asyncio.run(run(variant, mode == "inline", args.in_flight, args.seconds))
    base = results["lcs/threads"]
    ratio = {
        name: {
            "stall_p99": round(r["loop_stall_ms"]["p99"] / max(base["loop_stall_ms"]["p99"], 1e-3), 2),
            "groups_per_s": round(r["groups_per_s"] / base["groups_per_s"], 3),
        }
        for name, r in results.items()
    }
    print(
        json.dumps(
            {
                "benchmark": "reward_cost",
                "cpus": os.cpu_count(),
                "n_per_group": N,
                "reward_ms_per_episode": REWARD_MS,
                "in_flight": args.in_flight,
                "seconds": args.seconds,
                "results": results,
                "ratio_to_lcs_threads": ratio,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
