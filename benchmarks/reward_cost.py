"""What a reward costs the orchestrator's event loop (JSON on stdout), every number against a baseline of
the same invocation.

1. ``results``: ``--in-flight`` groups of ``n = 8`` completions turned into scored episodes at all times
   (:class:`~rlrun.orchestrator.episodes.EpisodeBuilder`) for ``--seconds``, with the orchestrator's GIL
   switch interval (1 ms), by the LCS reward (reverse-text's own, in threads: the baseline) and by a reward
   taking 5 ms per episode — sleeping (I/O, e.g. a remote judge) or computing (pure Python holding the GIL) —
   each scored in worker threads, in worker processes (``isolation: process``, :mod:`rlrun.rewards.workers`)
   and, for contrast, inline on the loop (how rewards ran before issue 23); ``idle``: nothing scored (the
   machine's own noise). Per variant ``groups_per_s`` (the scoring capacity) and ``loop_stall_ms``: a 1 ms
   ticker's lateness on the loop (p50 / p99 / max), what every other request, weight update and control call
   waits; ``ratio_to_lcs_threads``: p99 stall and capacity ÷ the baseline's.
2. ``pathological_math``: the builtin ``math`` reward (math-verify) on ``$10^{10^{7}}$``, whose parse
   computes a 10-million-digit integer in C with the GIL held: how long it takes in a thread, and the answer
   time of a ``POST /pause`` to the real control server (:class:`~rlrun.orchestrator.control.ControlServer`
   over an orchestrator stand-in that answers at once) sent ``--pause-after`` seconds into the scoring from
   another process, the reward in a thread (``isolation: thread``) and in a process (the default), both with
   ``--timeout`` as ``reward_timeout_seconds``; the loop's longest stall meanwhile.
3. ``workers``: a worker process's cost — its start (to its first answer: the interpreter, math-verify; a
   user function's worker also imports ``transformers`` for TRL's ``trainer_state``), its memory (psutil:
   RSS, and USS, the memory only it holds), a call's round trip per group against a thread's (the ``exact``
   reward on 8 completions, one call at a time: the overhead alone), and the replacement of a worker killed
   at its timeout.

Usage: ``python benchmarks/reward_cost.py [--seconds 3] [--in-flight 16] [--timeout 3] [--pause-after 1]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

from journal import percentiles  # benchmarks/journal.py: the same p50 / p99 / max

N = 8
REWARD_MS = 5.0
PATHOLOGICAL = "$10^{10^{7}}$"
#: Each reward and where it is scored (``processes``: not the sleeping one, which waits and holds no GIL).
VARIANTS = (
    ("lcs", ("threads", "processes", "inline")),
    ("sleep_5ms", ("threads", "inline")),
    ("cpu_5ms", ("threads", "processes", "inline")),
)
TOKEN = "benchmark"
#: The pause's client, in its own process (the benchmark's process may be the one whose GIL is held).
CLIENT = """
import json, sys, time, urllib.request
port, delay, token = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
time.sleep(delay)
url, headers = f"http://127.0.0.1:{port}/pause", {"Authorization": f"Bearer {token}"}
t0 = time.perf_counter()
with urllib.request.urlopen(urllib.request.Request(url, method="POST", headers=headers)) as answer:
    status = answer.status
print(json.dumps({"answer_ms": round((time.perf_counter() - t0) * 1000, 1), "status": status}))
"""


def sleeping(completions, **kwargs):
    """5 ms per episode, waiting (the GIL is free meanwhile)."""
    time.sleep(REWARD_MS / 1000 * len(completions))
    return [0.5] * len(completions)


def computing(completions, **kwargs):
    """5 ms of this thread's CPU per episode in pure Python (holds the GIL but for the switches)."""
    end = time.thread_time() + REWARD_MS / 1000 * len(completions)
    x = 0
    while time.thread_time() < end:
        x += 1
    return [0.5] * len(completions)


def reward(variant: str, mode: str):
    """The ``RewardFunction`` of ``variant`` scored in ``mode`` (None: reverse-text's own LCS, in threads)."""
    from rlrun.api.spec import RewardSpec
    from rlrun.rewards.builtin import lcs
    from rlrun.rewards.scoring import RewardFunction

    isolation = "process" if mode == "processes" else "thread"
    if variant == "lcs" and mode != "processes":
        return None  # reverse-text's own
    if variant == "lcs":  # the builtin lcs: the same function as reverse-text's own
        return RewardFunction("lcs", 1.0, lcs, spec=RewardSpec(name="lcs", isolation=isolation))
    func = sleeping if variant == "sleep_5ms" else computing
    spec = RewardSpec(function=f"reward_cost:{func.__name__}", isolation=isolation)
    return RewardFunction(variant, 1.0, func, spec=spec)


def builder(variant: str, mode: str):
    from rlrun.envs.reverse_text import ReverseTextEnv
    from rlrun.orchestrator.episodes import EpisodeBuilder
    from rlrun.rewards.scoring import GroupScores, score_group

    env = ReverseTextEnv(reward="lcs")
    chars = {c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz= ")}
    ids = {i: c for c, i in chars.items()}
    func = reward(variant, mode)
    b = EpisodeBuilder(
        encode=lambda text: [chars[c] for c in text],
        decode=lambda xs: "".join(ids.get(i, "?") for i in xs),
        eos_id=0,
        envs={env.name: env},
        rewards=None if func is None else {env.name: [func]},
    )
    if mode == "inline":  # the reward on the loop itself, as before rewards moved to worker threads

        async def score(rewards, task, texts, completion_ids, timeout_s, context=None) -> GroupScores:
            return score_group(rewards, task, texts, completion_ids)

        b.scorer.score = score
    return b, env


async def run(variant: str, mode: str, in_flight: int, seconds: float) -> dict:
    from rlrun.orchestrator.groups import GroupRequest
    from rlrun.rollout.client import Completion

    b, env = builder(variant, mode)
    loop = asyncio.get_running_loop()
    lateness: list[float] = []
    done = 0

    def group(i: int):
        task = env.task(0, i)
        prompt = list(b.prompt_ids(task))
        answer = [*prompt[-2::-1], 0]
        completions = [Completion(answer, [-0.1] * len(answer), "stop") for _ in range(N)]
        return GroupRequest(i, task, N), prompt, completions

    async def one(i: int) -> None:
        request, prompt, completions = group(i)
        await b.episodes(request, 0, prompt, completions)

    # before the clock runs: imports done (TRL's trainer_state: transformers), every worker started and loaded
    warm = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(b.scorer.workers.size)))
    warm = time.perf_counter() - warm
    end = loop.time() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        i = w
        while loop.time() < end:
            await one(i)
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
    out = {"groups_per_s": round(done / wall, 1), "loop_stall_ms": percentiles(lateness)}
    return out | ({"workers_warm_s": round(warm, 2)} if mode == "processes" else {})


async def idle(seconds: float) -> dict:
    """The ticker alone: the loop's lateness with nothing scored (the machine's own noise floor)."""
    loop = asyncio.get_running_loop()
    lateness: list[float] = []
    end = loop.time() + seconds
    while loop.time() < end:
        t = loop.time()
        await asyncio.sleep(0.001)
        lateness.append((loop.time() - t - 0.001) * 1000)
    return {"loop_stall_ms": percentiles(lateness)}


class Stand_in:
    """What the control server serves: an orchestrator whose pause answers at once (the loop is tested)."""

    def status(self):
        raise NotImplementedError

    async def pause(self):
        from rlrun.api.control import PauseResult

        counts = {"queued_traces": 0, "open_groups": 0, "requested_groups": 0, "finished_episodes_kept": 0}
        return PauseResult(step=None, path=None, time=time.time(), note="benchmark", **counts)

    async def set_endpoints(self, endpoints):
        return None


async def pause_during_pathological(isolation: str, timeout_s: float, pause_after_s: float) -> dict:
    """A ``POST /pause`` answered while ``math`` scores :data:`PATHOLOGICAL` in a thread or a process."""
    from rlrun.api.spec import RewardSpec
    from rlrun.envs.base import Task
    from rlrun.orchestrator.control import ControlServer
    from rlrun.rewards.builtin import math
    from rlrun.rewards.scoring import RewardFunction, RewardScorer

    rewards = [RewardFunction("math", 1.0, math, spec=RewardSpec(name="math", isolation=isolation))]
    task = Task("bench", 0, "What is 1?", "1")
    scorer = RewardScorer()
    server = ControlServer(Stand_in(), "127.0.0.1", 0, TOKEN)
    port = await server.start()
    lateness: list[float] = []
    loop = asyncio.get_running_loop()

    async def tick() -> None:
        while True:
            t = loop.time()
            await asyncio.sleep(0.001)
            lateness.append((loop.time() - t - 0.001) * 1000)

    try:
        await scorer.score(rewards, task, ["$1$"], [[1]], 60.0)  # math-verify imported, its worker started
        argv = [sys.executable, "-I", "-c", CLIENT, str(port), str(pause_after_s), TOKEN]
        client = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        ticker = asyncio.create_task(tick())
        t0 = time.perf_counter()
        scores = await scorer.score(rewards, task, [PATHOLOGICAL], [[1]], timeout_s)
        scoring_s = time.perf_counter() - t0
        answer = json.loads((await asyncio.to_thread(client.communicate, timeout=600))[0])
        ticker.cancel()
    finally:
        await server.stop()
        scorer.close()
    return {
        "scoring_s": round(scoring_s, 2),
        "error": scores.errors[0],
        "pause_answer_ms": answer["answer_ms"],
        "pause_status": answer["status"],
        "loop_stall_max_ms": round(max(lateness), 1),
    }


def memory(pids: list[int]) -> list[dict]:
    import psutil

    out = []
    for pid in pids:
        info = psutil.Process(pid).memory_full_info()
        out.append({"rss_mib": round(info.rss / 2**20, 1), "uss_mib": round(info.uss / 2**20, 1)})
    return out


async def worker_costs(calls: int) -> dict:
    """A worker's start, memory, a call's overhead against a thread's, and the replacement after a kill."""
    from rlrun.api.spec import RewardSpec
    from rlrun.envs.base import Task
    from rlrun.rewards.builtin import exact
    from rlrun.rewards.scoring import RewardContext, RewardFunction, RewardScorer

    task = Task("bench", 0, "p", "ba")
    texts, ids = ["ba", "ab"] * (N // 2), [[1, 2]] * N
    out: dict = {}
    by_mode = {}
    for isolation in ("thread", "process"):
        rewards = [RewardFunction("exact", 1.0, exact, spec=RewardSpec(name="exact", isolation=isolation))]
        scorer = RewardScorer(processes=1)
        try:
            t0 = time.perf_counter()
            await scorer.score(rewards, task, texts, ids, 60.0)
            first = time.perf_counter() - t0
            took = []
            for _ in range(calls):
                t0 = time.perf_counter()
                await scorer.score(rewards, task, texts, ids, 60.0)
                took.append((time.perf_counter() - t0) * 1000)
            by_mode[isolation] = {"first_call_s": round(first, 3), "call_ms": percentiles(took)}
            if isolation == "process":
                by_mode[isolation]["memory"] = memory(scorer.workers.pids())
        finally:
            scorer.close()
    out["exact_8_completions"] = by_mode
    overhead = by_mode["process"]["call_ms"]["p50"] - by_mode["thread"]["call_ms"]["p50"]
    out["process_overhead_ms_per_group_p50"] = round(overhead, 3)

    # math's worker: its start (math-verify), its memory, and its replacement after a kill at the timeout
    rewards = [RewardFunction("math", 1.0, None, spec=RewardSpec(name="math"))]
    scorer = RewardScorer(processes=1)
    try:
        t0 = time.perf_counter()
        await scorer.score(rewards, task, ["$1$"], [[1]], 60.0)
        start = time.perf_counter() - t0
        mem = memory(scorer.workers.pids())
        await scorer.score(rewards, task, [PATHOLOGICAL], [[1]], 0.5)  # killed at 0.5 s
        t0 = time.perf_counter()
        await scorer.score(rewards, task, ["$1$"], [[1]], 60.0)
        replaced = time.perf_counter() - t0
        out["math_worker"] = {
            "start_s": round(start, 3),
            "memory": mem,
            "replaced_after_kill_s": round(replaced, 3),
            "killed": scorer.workers.killed,
            "started": scorer.workers.started,
        }
    finally:
        scorer.close()

    # a user function's worker, called as the orchestrator calls it: TRL's trainer_state needs transformers (and
    # torch) imported in the worker
    spec = RewardSpec(function="reward_cost:sleeping", isolation="process")
    scorer = RewardScorer(processes=1)
    try:
        t0 = time.perf_counter()
        user = [RewardFunction("sleep", 1.0, sleeping, spec=spec)]
        await scorer.score(user, task, ["x"], [[1]], 600.0, RewardContext(step=0, max_steps=1))
        took = round(time.perf_counter() - t0, 2)
        out["user_function_worker"] = {"start_s": took, "memory": memory(scorer.workers.pids())}
    finally:
        scorer.close()
    return out


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--in-flight", type=int, default=16, help="groups being scored at once")
    parser.add_argument("--timeout", type=float, default=3.0, help="the pathological call's timeout (s)")
    parser.add_argument("--pause-after", type=float, default=1.0, help="seconds into it the pause is sent")
    parser.add_argument("--calls", type=int, default=200, help="calls timed one at a time for the overhead")
    args = parser.parse_args()
    sys.setswitchinterval(0.001)  # the orchestrator's (rlrun.orchestrator.loop.LOOP_SWITCH_INTERVAL_S)
    results = {"idle": asyncio.run(idle(args.seconds))}
    for variant, modes in VARIANTS:
        for mode in modes:
            results[f"{variant}/{mode}"] = asyncio.run(run(variant, mode, args.in_flight, args.seconds))
    base = results["lcs/threads"]
    ratio = {
        name: {
            "stall_p99": round(r["loop_stall_ms"]["p99"] / max(base["loop_stall_ms"]["p99"], 1e-3), 2),
            "groups_per_s": round(r["groups_per_s"] / base["groups_per_s"], 3),
        }
        for name, r in results.items()
        if name != "idle"
    }
    pathological = {
        isolation: asyncio.run(pause_during_pathological(isolation, args.timeout, args.pause_after))
        for isolation in ("thread", "process")
    }
    workers = asyncio.run(worker_costs(args.calls))
    print(
        json.dumps(
            {
                "benchmark": "reward_cost",
                "cpus": os.cpu_count(),
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "reward_processes": _processes(),
                "n_per_group": N,
                "reward_ms_per_episode": REWARD_MS,
                "in_flight": args.in_flight,
                "seconds": args.seconds,
                "results": results,
                "ratio_to_lcs_threads": ratio,
                "pathological_math": {
                    "answer": PATHOLOGICAL,
                    "timeout_s": args.timeout,
                    "pause_after_s": args.pause_after,
                    **pathological,
                },
                "workers": workers,
            },
            indent=2,
        )
    )


def _processes() -> int:
    from rlrun.rewards.workers import REWARD_PROCESSES

    return REWARD_PROCESSES


if __name__ == "__main__":
    main()
