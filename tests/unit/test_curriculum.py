"""Issue 48: what zero-spread groups cost, per-task difficulty state that survives preemption, and the curriculum
policies that read it (:mod:`rlrun.orchestrator.difficulty`, :mod:`rlrun.orchestrator.curriculum`)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import time

import numpy as np
import pytest
from pydantic import ValidationError
from rlrun.api.curriculum import CurriculumSpec
from rlrun.api.spec import EnvSpec, RLRunSpec
from rlrun.checkpoint import decode_progress, latest_complete_checkpoint, write_progress
from rlrun.envs import make_env
from rlrun.envs.base import Task
from rlrun.ledger import Ledger, check_ledger
from rlrun.orchestrator.curriculum import Curriculum
from rlrun.orchestrator.difficulty import FIELDS, TaskDifficulty
from rlrun.orchestrator.journal_files import JournalRecord
from rlrun.orchestrator.metrics import token_cost
from rlrun.orchestrator.resume import Stages, plan_resume, put_back, restore
from rlrun.orchestrator.sink import TrainSink
from rlrun.orchestrator.snapshot import SinkSnapshot
from rlrun.orchestrator.source import TrainSource
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir
from rlrun.training.fake import start_fake_trainer

from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator
from tests.support.samples import episode

ROWS = 60


def dataset(tmp_path, rows: int = ROWS, offset: int = 0):
    path = tmp_path / "data.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{i + offset}+1=", "answer": str(i + offset + 1)}) + "\n" for i in range(rows))
    )
    return make_env(EnvSpec(name="dataset", args={"path": str(path), "prompt": "prompt", "answer": "answer"}))


def rewards_of(row: int, group: int) -> list[float]:
    """A fixed world: a third of the rows solved by every member, a third by none, the rest half of the time."""
    if row % 3 == 0:
        return [1.0] * 4
    if row % 3 == 1:
        return [0.0] * 4
    return [1.0, 0.0, 1.0, 0.0] if group % 2 else [1.0, 1.0, 0.0, 0.0]


def pipeline(env, spec: CurriculumSpec, seed: int = 7):
    difficulty = TaskDifficulty({env.name: env}, seed)
    curriculum = Curriculum(spec, difficulty, seed)
    return TrainSource([(env, 1.0)], seed, 0, curriculum), curriculum


def draw(source: TrainSource, curriculum: Curriculum, env, groups: int) -> list[tuple[int, int]]:
    """Draw ``groups`` groups, each scored at once; returns ``(task index, row)`` of each."""
    out = []
    for _ in range(groups):
        request = source.next_group(4)
        row = env.task_key(source.seed, request.task.index)
        curriculum.difficulty.record(request.task, rewards_of(row, request.group_id))
        out.append((request.task.index, row))
    return out


def round_trip(source: TrainSource) -> tuple[dict, dict]:
    """The source's state through a real ``progress.pt`` (as the checkpoint writes and a resume reads it)."""
    buffer = io.BytesIO()
    write_progress(buffer, {"source": source.state()}, source.tensors())
    state = decode_progress(buffer.getvalue(), "progress.pt")
    return state["source"], state["tensors"]


@pytest.mark.parametrize("policy", ["uniform", "pools", "skip"])
def test_a_preempted_run_draws_exactly_the_tasks_an_uninterrupted_one_draws(tmp_path, policy):
    spec = CurriculumSpec(policy=policy)
    env = dataset(tmp_path)
    source, curriculum = pipeline(env, spec)
    straight = draw(source, curriculum, env, 200)
    first, curriculum_a = pipeline(dataset(tmp_path), spec)
    before = draw(first, curriculum_a, env, 90)
    state, tensors = round_trip(first)
    resumed, curriculum_b = pipeline(dataset(tmp_path), spec)  # a new process: env, state and policy built anew
    resumed.load_state(state, tensors)
    after = draw(resumed, curriculum_b, env, 110)
    assert before + after == straight
    assert curriculum_b.skipped == curriculum.skipped
    if policy != "uniform":
        assert curriculum.skipped > 0  # the policy did pass tasks over


@pytest.mark.parametrize("policy", ["pools", "skip"])
def test_a_policy_draws_fewer_zero_spread_groups_than_uniform(tmp_path, policy):
    """Over 5 epochs of the fixed world, a policy draws the rows whose groups have zero spread far less often."""
    env = dataset(tmp_path)
    shares = {}
    for name in ("uniform", policy):
        drawn = draw(*pipeline(env, CurriculumSpec(policy=name)), env, 5 * ROWS)
        shares[name] = sum(row % 3 != 2 for _, row in drawn) / len(drawn)  # rows whose groups have zero spread
    assert shares["uniform"] == pytest.approx(2 / 3, abs=0.05)
    assert shares[policy] < shares["uniform"] - 0.15


def test_the_skip_probability_follows_greso_with_its_floor(tmp_path):
    env = dataset(tmp_path)
    spec = CurriculumSpec(policy="skip", exploration=0.5, max_skip=0.8)
    source, curriculum = pipeline(env, spec)
    task = env.task(source.seed, 0)
    assert curriculum.draw_probability(task) == 1.0  # never scored
    for p in (0.5, 0.25, 0.2, 0.2):  # k = 1, 2, 3, 4 zero-spread groups in a row: 1 − min(0.8, 1 − 0.5^k)
        curriculum.difficulty.record(task, [0.0] * 4)
        assert curriculum.draw_probability(task) == pytest.approx(p)
    curriculum.difficulty.record(task, [0.0, 1.0, 0.0, 0.0])  # spread again: the streak ends
    assert curriculum.draw_probability(task) == 1.0


def test_pools_weigh_a_task_by_its_last_pass_rate(tmp_path):
    env = dataset(tmp_path)
    source, curriculum = pipeline(env, CurriculumSpec(policy="pools"))  # ≤0.25: 0.2, ≤0.75: 1, ≤1: 0.2; unseen 1
    task = env.task(source.seed, 3)
    assert curriculum.draw_probability(task) == 1.0
    for rewards, p in [([0.0] * 4, 0.2), ([1.0, 0.0, 0.0, 0.0], 0.2), ([1.0, 1.0, 0.0, 0.0], 1.0), ([1.0] * 4, 0.2)]:
        curriculum.difficulty.record(task, rewards)
        assert curriculum.draw_probability(task) == pytest.approx(p)
    assert curriculum.difficulty.stats(task) == (4, 1.0, 1)


def test_a_procedural_env_keeps_no_state_and_is_drawn_uniformly():
    env = make_env(EnvSpec(name="reverse-text"))
    difficulty = TaskDifficulty({env.name: env}, 0)
    curriculum = Curriculum(CurriculumSpec(policy="skip"), difficulty, 0)
    task = env.task(0, 5)
    difficulty.record(task, [0.0] * 4)
    assert difficulty.tables == {} and difficulty.stats(task) is None and curriculum.draw_probability(task) == 1.0


def test_changed_data_drops_the_state_with_one_warning_naming_the_env(tmp_path, caplog):
    env = dataset(tmp_path)
    source, curriculum = pipeline(env, CurriculumSpec(policy="skip"))
    draw(source, curriculum, env, 50)
    state, tensors = round_trip(source)
    changed = dataset(tmp_path, offset=100)  # the same row count, other rows
    resumed, curriculum_b = pipeline(changed, CurriculumSpec(policy="skip"))
    with caplog.at_level(logging.WARNING):
        resumed.load_state(state, tensors)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "env dataset" in warnings[0] and "dropped" in warnings[0]
    assert int(curriculum_b.difficulty.tables["dataset"].arrays["scored"].sum()) == 0
    assert resumed.cursor == source.cursor  # the rest of the source's state is restored


def test_a_million_task_dataset_state_fits_in_tens_of_megabytes():
    class Rows:
        name = "rows"

        def num_task_keys(self) -> int:
            return 1_000_000

        def task_key(self, seed: int, index: int) -> int:
            return index % 1_000_000

    t0 = time.perf_counter()
    difficulty = TaskDifficulty({"rows": Rows()}, 0)  # type: ignore[dict-item]
    assert difficulty.nbytes == 18_000_000  # 18 bytes a task
    tensors = difficulty.tensors()
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == 18_000_000
    assert time.perf_counter() - t0 < 5  # built and copied in well under the checkpoint interval (not a benchmark)


def test_the_sink_counts_what_zero_spread_groups_cost_in_tokens():
    sink = TrainSink(group_size=2, batch_size=2, max_off_policy_steps=1)
    sink.add_episodes(0, episode(0, 0, 1.0, 0).task, [episode(0, m, 1.0, 0, (1, 2, 3)) for m in (0, 1)], 1)
    sink.add_episodes(1, episode(1, 0, 0.0, 0).task, [episode(1, m, 0.0, 0, (1, 2)) for m in (0, 1)], 1)
    sink.add_episodes(
        2, episode(2, 0, 0.0, 0).task, [episode(2, 0, 0.0, 0, (1,)), episode(2, 1, 1.0, 0, (1, 2, 3, 4, 5))], 1
    )
    batch = sink.take_batch(1)
    assert batch is not None and len(batch) == 2
    cost = token_cost(sink.drain_recent_tokens(), sink.counters)
    assert cost == {
        "tokens_generated": 16,  # 6 + 4 + 6
        "zero_spread_token_fraction": 10 / 16,
        "zero_spread_solved_token_fraction": 6 / 16,
        "zero_spread_unsolved_token_fraction": 4 / 16,
        "trained_token_fraction": 6 / 16,
        "generated_tokens_per_trained_token": 16 / 6,
    }
    assert token_cost(sink.drain_recent_tokens(), sink.counters)["zero_spread_token_fraction"] is None  # drained


def test_the_sink_tells_the_difficulty_state_every_group_it_scores(tmp_path):
    env = dataset(tmp_path)
    difficulty = TaskDifficulty({env.name: env}, 0)
    sink = TrainSink(group_size=2, batch_size=4, max_off_policy_steps=1)
    sink.difficulty = difficulty
    task = env.task(0, 4)
    sink.add_episodes(4, task, [episode(4, 0, 1.0, 0), episode(4, 1, 1.0, 0)], 1)
    assert difficulty.stats(task) == (1, 1.0, 1)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"policy": "greso"}, "policy"),
        ({"pools": [{"max_pass_rate": 0.5, "weight": 1}, {"max_pass_rate": 0.5, "weight": 1}]}, "pools"),
        ({"pools": [{"max_pass_rate": 0.5, "weight": 1}]}, "pools"),
        ({"pools": [{"max_pass_rate": 1.5, "weight": 1}]}, "pools.0.max_pass_rate"),
        ({"pools": [{"max_pass_rate": 1, "weight": 0}]}, "pools.0.weight"),
        ({"exploration": 1.0}, "exploration"),
        ({"max_skip": 1.0}, "max_skip"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(settings, field):
    with pytest.raises(ValidationError) as err:
        CurriculumSpec(**settings)
    assert [".".join(map(str, e["loc"])) for e in err.value.errors()] == [field]


def test_a_task_passed_over_is_recorded_before_the_cursor_moves_past_it(tmp_path):
    written = []

    class Ledger:
        def write(self, event, **fields):
            written.append((str(event), fields))

    env = dataset(tmp_path)
    difficulty = TaskDifficulty({env.name: env}, 0)
    curriculum = Curriculum(CurriculumSpec(policy="pools", unseen_weight=1e-6), difficulty, 0, Ledger())  # type: ignore[arg-type]
    source = TrainSource([(env, 1.0)], 0, 0, curriculum)
    for i in range(ROWS):
        difficulty.record(env.task(0, i), [0.0] * 4)  # every task seen and failed: drawn at p = 0.2 each
    request = source.next_group(4)
    assert [f["index"] for _, f in written] == list(range(request.group_id))
    assert {f["reason"] for _, f in written} == {"curriculum"} and curriculum.skipped == request.group_id > 0
    table, row = difficulty.key(request.task)
    assert isinstance(request.task, Task) and int(table.arrays["drawn"].sum()) == int(table.arrays["drawn"][row]) == 1


def test_a_group_rejected_for_zero_spread_after_the_snapshot_is_not_generated_again(tmp_path):
    """Part 4 (SkyRL's rule): the journal replays a group that finished, and was rejected for zero spread, after the
    snapshot: the resumed attempt rejects it once more from the replay (one ``rejected`` line in its ledger, and its
    task's state updated as before the crash) and requests only the unfinished group again."""
    env = dataset(tmp_path)
    spec = RLRunSpec.model_validate(
        {"model": {"builtin": "tiny"}, "envs": [{"name": "dataset"}], "group_size": 4, "batch_size": 8}
    )
    source, curriculum = pipeline(env, CurriculumSpec(policy="skip"), seed=0)
    source.cursor = 3  # the snapshot's cut: tasks 0–2 drawn and done

    def members(group: int, first: int, n: int, reward: float):
        task = env.task(0, group)
        return [dataclasses.replace(episode(group, m, reward, 0), task=task) for m in range(first, first + n)]

    records = [
        JournalRecord(1, 0, 3, env.task(0, 3), members(3, 0, 4, 0.0)),  # the whole group, every member failed
        JournalRecord(1, 1, 4, env.task(0, 4), members(4, 0, 2, 1.0)),  # half of the next one
    ]
    recorded = []
    sink = TrainSink(4, 8, 1, record=lambda event, ids, **f: recorded.append((event.value, f.get("group"))))
    sink.difficulty = curriculum.difficulty
    ledger = Ledger(tmp_path / "ledger", 2, "orchestrator")
    resume = plan_resume(SinkSnapshot([], [], []), records, spec, source, 0)
    put_back(resume, Stages(source, sink, ledger), 0)
    ledger.close()
    assert [(r.group_id, r.members) for r in source.resume_requests] == [(4, 2)]  # group 3 is not asked again
    assert recorded == [("rejected", 3)] and sink.counters.groups_rejected_zero_spread == 1
    assert curriculum.difficulty.stats(env.task(0, 3)) == (1, 0.0, 1) and source.cursor == 5


async def test_the_state_a_real_checkpoint_holds_is_what_a_resumed_attempt_restores(tmp_path, tiny_model):
    """The real orchestrator (fake rollouts and trainer) with ``skip`` on a small dataset: its checkpoint holds the
    per-task arrays and the skip count as they were at the cut, a new attempt's resume restores exactly those, and
    every task passed over is in the ledger (the check counts none skipped unrecorded)."""
    words = [*"abcdefghij", "flatters", "question", "darkness", "sandwich", "triangle", "overland", "birthday"]
    data = tmp_path / "words.jsonl"  # the fake server reverses a prompt: short words are solved by every member
    data.write_text("".join(json.dumps({"prompt": f"{w}=", "answer": w[::-1]}) + "\n" for w in words))
    run_spec = parse(
        "curriculum",
        group_size=4,
        batch_size=8,
        max_steps=8,
        seed=1,
        curriculum={"policy": "skip"},
        envs=[{"name": "dataset", "args": {"path": str(data), "prompt": "prompt", "answer": "answer"}}],
        checkpoint={"interval": 4, "keep_last": 2},
        rollout={"max_inflight": 32},
    ).spec
    run_dir = RunDir(tmp_path / "run")
    first = make_orchestrator(run_spec, run_dir, tiny_model, fake_vllm_transport(error_rate=0.05, seed=1))
    stop = start_fake_trainer(run_dir, tiny_model, first.max_steps, 4, attempt=1)
    try:
        assert await asyncio.wait_for(first.run(), 60) == 8
    finally:
        stop.set()
    ckpt = latest_complete_checkpoint(run_dir)
    saved, tensors = ckpt.orchestrator["source"]["curriculum"], ckpt.orchestrator["tensors"]
    assert saved["skipped"] > 0 and int(tensors["curriculum.dataset.scored"].sum()) > 0
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.tasks_checked and report.tasks_dropped >= saved["skipped"], report.problems
    second = make_orchestrator(run_spec, run_dir, tiny_model, fake_vllm_transport(seed=2), attempt=2, resume=True)
    await restore(run_dir, run_spec, Stages(second.source, second.sink, second.ledger, second.kept))
    arrays = second.curriculum.difficulty.tables["dataset"].arrays
    for field in FIELDS:
        assert np.array_equal(arrays[field], tensors[f"curriculum.dataset.{field}"].numpy(), equal_nan=True), field
    assert second.curriculum.skipped == saved["skipped"]
    second.ledger.close()


def test_a_policy_on_an_env_it_cannot_act_on_is_said_at_validation(tmp_path):
    """A procedural env keeps no per-task state: ``skip`` or ``pools`` on it draws uniformly, and ``rlrun validate``,
    ``rlrun local`` and the orchestrator say so, naming the env (a dataset env gets no warning)."""
    from rlrun.manifest import curriculum_warnings

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "ab=", "answer": "ba"}\n' * 3)
    envs = [{"name": "reverse-text"}, {"name": "dataset", "args": {"path": str(data)}}]
    assert curriculum_warnings(parse(envs=envs).spec) == []  # uniform
    [warning] = curriculum_warnings(parse(envs=envs, curriculum={"policy": "skip"}).spec)
    assert "env reverse-text" in warning and "drawn uniformly" in warning and "dataset" not in warning
