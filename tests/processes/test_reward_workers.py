"""Rewards in worker processes (``rlrun.rewards.workers``): a reward that computes holds none of the
orchestrator's GIL — a pause is answered while math-verify chews on a giant exponent — its call is killed at
its timeout and its worker replaced; a reward that raises or whose worker dies fails its members, never scores
them 0; and no worker outlives the scorer, nor the process that owns it, even mid-call. Worker processes are
child processes: this tier.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

from rlrun.api.control import PauseResult
from rlrun.api.spec import EnvSpec, RewardSpec
from rlrun.envs.base import Task
from rlrun.envs.reverse_text import ReverseTextEnv
from rlrun.orchestrator.control import ControlServer
from rlrun.rewards.builtin import exact
from rlrun.rewards.scoring import RewardFunction, RewardScorer, env_rewards

from tests.support.polling import wait_for, wait_for_async
from tests.support.processes import alive
from tests.support.rewards import boom, dies, pid

#: math-verify parses it into a 10-million-digit integer, computed in C with the GIL held: seconds (7.5 s on
#: the 2-core machine; ``benchmarks/reward_cost.py`` measures it).
PATHOLOGICAL = "$10^{10^{7}}$"
TASK = Task("e", 0, "What is 1?", "1")
TOKEN = "t"
#: ``POST /pause`` from another process (this one's GIL is what a reward in a thread would hold): after
#: ``argv[2]`` seconds; prints the answer's status and how long it took.
PAUSE = """
import json, sys, time, urllib.request
time.sleep(float(sys.argv[2]))
request = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/pause", method="POST",
                                 headers={"Authorization": "Bearer " + sys.argv[3]})
t0 = time.monotonic()
with urllib.request.urlopen(request, timeout=120) as answer:
    print(json.dumps({"status": answer.status, "seconds": time.monotonic() - t0}))
"""


def in_process(func) -> RewardFunction:
    """``func`` of :mod:`tests.support.rewards` as a user reward in a worker process (by its import path)."""
    spec = RewardSpec(function=f"{func.__module__}:{func.__name__}", isolation="process")
    return RewardFunction(spec.series, spec.weight, func, spec=spec)


def math_reward() -> RewardFunction:
    [reward] = env_rewards(EnvSpec(name="reverse-text", rewards=[RewardSpec(name="math")]), ReverseTextEnv())
    return reward


class PausesAtOnce:
    """An orchestrator whose pause answers at once: the control server's loop is what is tested."""

    def status(self):
        raise NotImplementedError

    async def pause(self) -> PauseResult:
        counts = {"queued_traces": 0, "open_groups": 0, "requested_groups": 0, "finished_episodes_kept": 0}
        return PauseResult(step=None, path=None, time=time.time(), note="nothing to save", **counts)

    async def set_endpoints(self, endpoints: list[str]) -> None:
        return None


def test_a_pause_is_answered_while_math_chews_on_a_giant_exponent_and_the_call_is_killed_at_its_timeout():
    """Issue 47: math-verify on an answer it takes long to parse froze the event loop 126 s (pause, /metrics
    and rollouts with it). The builtin ``math`` runs in a worker process by default: the pause, sent 0.3 s
    into the scoring, is answered at once; the call is killed at its 1.5 s timeout, failing its member; the
    next group gets a new worker."""
    reward = math_reward()

    async def main():
        scorer = RewardScorer(processes=1)
        server = ControlServer(PausesAtOnce(), "127.0.0.1", 0, TOKEN)
        port = await server.start()
        try:
            warm = await scorer.score([reward], TASK, ["$1$"], [[1]], 60.0)  # its worker started, math loaded
            argv = [sys.executable, "-I", "-c", PAUSE, str(port), "0.3", TOKEN]
            client = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
            t0 = time.monotonic()
            hung = await scorer.score([reward], TASK, [PATHOLOGICAL], [[1]], 1.5)
            took = time.monotonic() - t0
            pause = json.loads((await asyncio.to_thread(client.communicate, timeout=120))[0])
            after = await scorer.score([reward], TASK, ["$1$", "$0.5$"], [[1], [2]], 60.0)
            return warm, hung, took, pause, after, scorer.workers.killed, scorer.workers.started
        finally:
            await server.stop()
            scorer.close()

    assert reward.process  # the builtin math's default: spec.envs[].rewards[].isolation unset
    warm, hung, took, pause, after, killed, started = asyncio.run(main())
    assert warm.rewards == [1.0]
    assert pause["status"] == 200 and pause["seconds"] < 1.0, pause  # in a thread: once the integer is done
    assert hung.rewards == [None] and hung.parts == {"math": [None]}
    assert hung.errors == [
        "rewards ran longer than 1.5 s (spec.envs[].reward_timeout_seconds); its worker process was killed"
    ]
    assert took < 4.0  # killed at its timeout, not when math-verify is done
    assert after.rewards == [1.0, 0.0] and (killed, started) == (1, 2)


def test_a_user_reward_runs_in_a_worker_when_isolation_says_process_and_its_failures_fail_its_members():
    """A TRL-style function by import path, ``isolation: process``: scored in a worker beside a reward in a
    thread (the weighted sum of both); one that raises fails every member with its error, as in a thread; one
    whose worker dies fails them saying so, and the next call gets a new worker."""
    in_thread = RewardFunction("exact", 2.0, exact, spec=RewardSpec(name="exact", weight=2.0))
    where = in_process(pid)

    async def main():
        scorer = RewardScorer(processes=1)
        try:
            mixed = await scorer.score([in_thread, where], TASK, ["1", "2"], [[1], [2]], 30.0)
            workers = scorer.workers.pids()
            raised = await scorer.score([in_thread, in_process(boom)], TASK, ["1", "2"], [[1], [2]], 30.0)
            died = await scorer.score([in_process(dies)], TASK, ["1"], [[1]], 30.0)
            again = await scorer.score([where], TASK, ["1"], [[1]], 30.0)
            return mixed, workers, raised, died, again, scorer.workers.pids()
        finally:
            scorer.close()

    assert where.process and not in_thread.process
    mixed, workers, raised, died, again, later = asyncio.run(main())
    assert mixed.parts["exact"] == [1.0, 0.0] and mixed.parts["pid"] == [float(workers[0])] * 2
    assert workers[0] != os.getpid() and mixed.rewards == [2.0 + workers[0], workers[0]]
    assert raised.rewards == [None, None] and raised.parts["exact"] == [1.0, 0.0]
    assert raised.errors == ["reward boom: ValueError: no judge today"] * 2  # as in a thread: never scored 0
    assert died.rewards == [None]
    assert died.errors[0].startswith("its reward worker process died (exit code 3)"), died.errors
    assert again.parts["pid"] == [float(later[0])] and later != workers


def test_closing_the_scorer_kills_its_workers_idle_or_busy():
    async def main():
        scorer = RewardScorer(processes=2)
        busy = asyncio.create_task(scorer.score([math_reward()], TASK, [PATHOLOGICAL], [[1]], 60.0))
        await wait_for_async(lambda: scorer.workers.pids(), what="a worker for the giant exponent")
        await scorer.score([in_process(pid)], TASK, ["1"], [[1]], 30.0)  # a second worker, idle after it
        pids = scorer.workers.pids()
        assert len(pids) == 2
        scorer.close()
        return pids, await busy

    pids, busy = asyncio.run(main())
    assert busy.rewards == [None] and busy.errors == ["the reward workers were closed during the call"]
    assert alive(pids) == []


#: A process that owns a scorer: prints its worker's pid once math-verify is loaded there, then scores the
#: giant exponent (its timeout far away) until it is killed.
OWNER = """
import asyncio, sys
from rlrun.api.spec import RewardSpec
from rlrun.envs.base import Task
from rlrun.rewards.scoring import RewardFunction, RewardScorer

async def main():
    scorer = RewardScorer(processes=1)
    math = RewardFunction("math", 1.0, None, spec=RewardSpec(name="math"))
    await scorer.score([math], Task("e", 0, "p", "1"), ["$1$"], [[1]], 600.0)
    print(scorer.workers.pids()[0], flush=True)
    await scorer.score([math], Task("e", 0, "p", "1"), [sys.argv[1]], [[1]], 600.0)

asyncio.run(main())
"""


def test_a_worker_mid_call_dies_with_the_process_that_owns_it():
    """An orchestrator killed with SIGKILL runs no teardown: its workers go with it (``PR_SET_PDEATHSIG``),
    even one computing for minutes, so no orphan keeps a core busy."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, PATHOLOGICAL], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(owner.stdout.readline())
        time.sleep(0.5)  # mid-call: computing the integer
        assert alive(worker)
        owner.kill()
        owner.wait(timeout=10)
        wait_for(lambda: not alive(worker), timeout=5, what="the worker to die with its owner")
    finally:
        owner.kill()
        owner.wait(timeout=10)
