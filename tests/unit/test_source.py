"""TrainSource: a seeded task stream resumable from its cursor; resume requests first; member numbers never reused."""

from __future__ import annotations

from collections import Counter

import pytest
from rlrun.envs import ReverseTextEnv
from rlrun.envs.base import Task
from rlrun.orchestrator.groups import GroupRequest
from rlrun.orchestrator.source import TrainSource

from tests.support.samples import task


def source(cursor: int = 0, seed: int = 3) -> TrainSource:
    return TrainSource([(ReverseTextEnv(), 1.0)], seed=seed, cursor=cursor)


def test_a_source_restored_from_its_state_draws_the_tasks_an_uninterrupted_one_would():
    uninterrupted = source()
    tasks = [uninterrupted.next_group(4).task for _ in range(10)]
    first = source()
    for _ in range(6):
        first.next_group(4)
    resumed = source()
    resumed.load_state(first.state())
    assert [resumed.next_group(4).task for _ in range(4)] == tasks[6:]
    assert source(seed=4).next_group(4).task != tasks[0]  # the seed matters


def test_new_groups_take_the_task_number_as_group_id_and_number_members_from_zero():
    s = source(cursor=40)
    assert s.next_group(8) == GroupRequest(40, s.task_at(40), members=8, first_member=0)
    assert s.next_group(8).group_id == 41 and s.cursor == 42


def test_a_task_that_admit_refuses_is_passed_over_and_one_it_raises_on_is_not():
    """``admit`` False (``overlong_prompts: filter``) passes the task over; raising (``refuse``) leaves the cursor on
    it, so a draw before the run stops asks for it again. Before, the cursor had moved: after the merge of issues 35
    and 36, a second dispatch round drew task 10 while the run stopped on task 9, which no record then accounted for."""
    s = source(cursor=8)
    s.admit = lambda t: t.index != 9
    assert s.next_group(4).group_id == 8 and s.next_group(4).group_id == 10 and s.cursor == 11

    def refuse(t: Task) -> bool:
        if t.index == 13:
            raise ValueError("task 13 does not fit")
        return True

    s.admit = refuse
    assert s.next_group(4).group_id == 11 and s.next_group(4).group_id == 12
    for _ in range(2):
        with pytest.raises(ValueError, match="task 13"):
            s.next_group(4)
        assert s.cursor == 13


def test_requests_again_come_before_new_tasks_numbered_after_every_earlier_member():
    s = source(cursor=10)
    first = s.next_group(4)  # group 10, members 0–3
    again = s.request_again(first.group_id, first.task, 2)
    assert again == GroupRequest(10, first.task, members=2, first_member=4)
    assert s.request_again(10, first.task, 1).first_member == 6  # numbering keeps going
    assert [s.next_group(4).group_id for _ in range(3)] == [10, 10, 11]
    assert s.state()["resume_requests"] == []


def test_numbers_noted_from_a_snapshot_are_not_reused():
    s = source()
    s.note_members(5, 9)  # e.g. a saved episode 5/8
    s.note_members(5, 3)  # lower evidence does not lower it
    assert s.request_again(5, task(5), 2).first_member == 9


def test_forgetting_a_group_drops_its_numbering_and_pending_requests():
    s = source(cursor=0)
    s.request_again(7, task(7), 2)
    s.request_again(8, task(8), 2)
    s.forget(7)
    assert [r.group_id for r in s.resume_requests] == [8]
    assert s.request_again(7, task(7), 1).first_member == 0


def test_pending_resume_requests_survive_a_checkpoint_with_their_numbering():
    s = source(cursor=3)
    s.request_again(1, task(1), 2)
    restored = source()
    restored.load_state(s.state())
    assert list(restored.resume_requests) == [GroupRequest(1, task(1), 2, 0)]
    assert restored.request_again(1, task(1), 1).first_member == 2


class NamedEnv:
    """An env that only says its name in its tasks."""

    def __init__(self, name: str) -> None:
        self.name = name

    def task(self, seed: int, index: int) -> Task:
        return Task(self.name, index, f"{self.name}:{seed}:{index}", "")

    def reward(self, task: Task, completion: str) -> float:
        return 0.0


def test_env_choice_is_a_pure_function_of_seed_and_index_and_follows_the_weights():
    envs = [(NamedEnv("a"), 3.0), (NamedEnv("b"), 1.0)]
    s, again = TrainSource(envs, seed=0), TrainSource(envs, seed=0)
    assert [s.task_at(i) for i in range(50)] == [again.task_at(i) for i in range(50)]
    counts = Counter(s.task_at(i).env for i in range(4000))
    assert abs(counts["a"] / 4000 - 0.75) < 0.03  # the weights 3 : 1 (seeded: the same draws every run)
