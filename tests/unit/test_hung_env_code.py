"""Hung env code costs only its own episode (issue 47, item 5): a multi-turn env's ``start`` and ``respond``
run in threads of the env's own, each timed by its own run time, so an env that hangs on every 5th task fails
those tasks' episodes and no other — nor another env's, nor the event loop's default executor (the
checkpoint's and the journal's file writes). Before, they shared that executor (6 threads on 2 cores) and
their timeout counted the wait for one: innocent starts failed ``took longer than 5 s``. Episodes are played
as the dispatcher plays a run's requests in flight (:func:`rlrun.orchestrator.turns.play`, with the
:class:`EpisodeBuilder`'s ``turn_io``)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from rlrun.orchestrator.episodes import EpisodeBuilder
from rlrun.orchestrator.turns import Conversation, play
from rlrun.rollout.client import Completion

from tests.support.envs import Hangs

EOS = 0


@pytest.fixture(autouse=True)
def hung_calls_end():
    """Every call a test leaves hung returns when it ends."""
    Hangs.release.clear()
    yield
    Hangs.release.set()


def builder(envs: list[Hangs], timeout_s: float) -> EpisodeBuilder:
    """Episodes of ``envs`` with a one-character-per-token tokenizer, each env call timed out at
    ``timeout_s``."""
    return EpisodeBuilder(
        encode=lambda text: [ord(c) for c in text],
        decode=lambda ids: "".join(map(chr, ids)),
        eos_id=EOS,
        envs={env.name: env for env in envs},
        reward_timeout_s={env.name: timeout_s for env in envs},
    )


async def play_tasks(episodes: EpisodeBuilder, env: Hangs, tasks: range) -> list[Conversation]:
    """Each task's episode, all at once; every model turn answers ``x``."""

    async def complete(ids: list[int]) -> Completion:
        return Completion([ord("x"), EOS], [-0.1, -0.1], "stop")

    async def one(i: int) -> Conversation:
        task = env.task(0, i)
        first = await complete([])
        return await play(env, task, episodes.prompt_ids(task), first, episodes.turn_io(task, complete))

    return await asyncio.gather(*(one(i) for i in tasks))


@pytest.mark.parametrize("hang_in", ["start", "respond"])
async def test_an_env_that_hangs_on_every_fifth_task_fails_only_those_episodes(hang_in):
    env = Hangs(every=5, hang_in=hang_in)
    episodes = builder([env], timeout_s=0.5)
    started = time.monotonic()
    # 40 of them hang: more than any default executor has threads
    played = await play_tasks(episodes, env, range(200))
    took = time.monotonic() - started
    failed = {i: c.error for i, c in enumerate(played) if c.error is not None}
    where = "start failed" if hang_in == "start" else "respond failed at turn 1"
    assert failed == {i: f"env hangs: {where}: took longer than 0.5 s" for i in range(0, 200, 5)}
    innocent = [c for i, c in enumerate(played) if i % 5]
    assert len(innocent) == 160 and all(c.turns == 1 and c.error is None for c in innocent)
    # 32 calls of the env at once: the hung ones held their turns 0.5 s each (two rounds), then only spare
    # threads
    assert took < 4.0, took
    # the loop's default executor (the checkpoint's and the journal's writes) was never the env's
    assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 1.0) == "free"
    assert episodes.env_calls["hangs"].abandoned == 40


async def test_an_env_whose_calls_all_hang_takes_no_slot_of_another_env():
    """Env ``stuck`` hangs on every start, more calls than its threads and spares: those past them fail at
    once saying so (they never ran); env ``hangs`` (none of its tasks hangs) runs every episode to its end
    meanwhile."""
    stuck, innocent = Hangs(every=1), Hangs(every=0)
    stuck.name = "stuck"
    episodes = builder([stuck, innocent], timeout_s=0.3)
    calls = episodes.env_calls["stuck"]
    capacity = calls.threads + calls.spare
    hung, played = await asyncio.gather(
        play_tasks(episodes, stuck, range(capacity + 4)), play_tasks(episodes, innocent, range(100))
    )
    assert [c.error for c in played] == [None] * 100 and {c.turns for c in played} == {1}
    timed_out = [c.error for c in hung if c.error.endswith("took longer than 0.3 s")]
    never_ran = [c.error for c in hung if "no env stuck thread was free within 0.3 s" in c.error]
    assert len(timed_out) == capacity and len(never_ran) == 4, [c.error for c in hung]
    assert set(timed_out) == {"env stuck: start failed: took longer than 0.3 s"}
    assert calls.abandoned == capacity
    # the threads are daemon threads: a hung call never holds the process's exit
    # (tests/processes/test_hung_env_exit.py)
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("env stuck"))


async def test_an_env_call_that_raises_without_a_message_is_named_by_its_type_alone():
    """An env's ``start`` raising a bare ``ConnectionResetError()`` fails its episode with the type, no dangling
    ``": "`` (as the dispatcher describes a request's failure)."""

    class Bare(Hangs):
        def start(self, task):
            raise ConnectionResetError()

    env = Bare(every=0)
    played = await play_tasks(builder([env], timeout_s=1.0), env, range(1))
    assert [c.error for c in played] == ["env hangs: start failed: ConnectionResetError"]
