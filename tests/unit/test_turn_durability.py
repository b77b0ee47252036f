"""Turn-level durability: a multi-turn episode's finished turns are journaled, kept once durable, saved by a pause's
snapshot, and continued by the next attempt at the last durable turn — the same episode, its stream extended, not
sampled again — unless too stale, surplus or of a scored group; and ``rlrun ledger check`` proves no kept turn was
lost (the real Orchestrator against a scripted fake server, the fake trainer)."""

from __future__ import annotations

import asyncio
import json
import math
import random

import httpx
import pytest
from rlrun.checkpoint import latest_complete_checkpoint, load_orchestrator_progress
from rlrun.envs.base import EnvStateError, Reply, Task
from rlrun.errors import classify_error
from rlrun.ledger import Ledger, LedgerEvent, check_ledger
from rlrun.orchestrator.groups import KeptConversation
from rlrun.orchestrator.journal import Journal
from rlrun.orchestrator.journal_files import journal_root, read_records
from rlrun.orchestrator.resume import with_journal
from rlrun.orchestrator.snapshot import SinkSnapshot, pack, restore_plan, unpack
from rlrun.orchestrator.turns import Conversation
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir
from rlrun.samples import Episode, QueuedTrace, TrainingSample
from rlrun.training.fake import start_fake_trainer
from transformers import AutoTokenizer

from tests.support.envs import InPlace
from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator, run_to_the_end
from tests.support.polling import wait_for_async
from tests.unit.test_rollout_faults import events

NAN = math.nan


class Chatter:
    """A resumable multi-turn env: the episode ends when the model says ``1`` (reward 1), else the env answers
    ``no``."""

    name = "chatter"
    max_turns = 4
    resumable = True

    def task(self, seed, index, split="train"):
        return Task(self.name, index, [{"role": "user", "content": "go"}], "1")

    def start(self, task):
        return {"said": []}

    def respond(self, task, state, completion):
        said = [*state["said"], completion]
        return Reply(None if completion == "1" else "no", completion == "1", {"said": said})

    def reward(self, task, completion):
        return 1.0 if completion == "1" else 0.0


def kept(group=3, member=1, turns=2, version=4, state=None) -> KeptConversation:
    task = Chatter().task(0, group)
    return KeptConversation(
        group,
        member,
        task,
        version,
        [5, 6],
        [7, 8, 9, 10],
        [-0.5, NAN, NAN, -0.25],
        state or {"said": ["2"]},
        turns,
        0.5,
        1,
        0,
    )


def test_a_turn_record_round_trips_through_the_journal_with_its_env_tokens(tmp_path):
    journal = Journal(tmp_path, attempt=1)
    journal.append_turn(kept())
    journal.close()
    [record] = list(read_records(tmp_path / "attempt-1", 1))
    c = record.conversation
    assert record.episodes == [] and c is not None and c.episode_id == "3/1" and c.state == {"said": ["2"]}
    assert list(c.completion_ids) == [7, 8, 9, 10] and [math.isnan(x) for x in c.logprobs] == [False, True, True, False]
    assert (c.turns, c.policy_version, c.reward, c.tool_calls, c.sampled_tokens) == (2, 4, 0.5, 1, 2)
    assert KeptConversation.from_dict(json.loads(json.dumps(c.to_dict()))).state == c.state


def test_a_snapshot_keeps_its_conversations():
    snap = SinkSnapshot([], [], [], {}, [kept(), kept(member=2, turns=3)])
    back = unpack(*pack(snap))
    assert [(c.episode_id, c.turns, list(c.prompt_ids)) for c in back.conversations] == [
        ("3/1", 2, [5, 6]),
        ("3/2", 3, [5, 6]),
    ]
    assert math.isnan(back.conversations[0].logprobs[1]) and back.counts([]).turns_kept == 5
    assert dict(back.taken_members()) == {3: 3}  # a continued member keeps its number; new ones come after


def test_the_journal_brings_a_conversation_forward_and_a_finished_episode_ends_it(tmp_path):
    journal = Journal(tmp_path, attempt=1)
    journal.append_turn(kept(member=1, turns=3))  # after the snapshot: one more turn kept
    journal.append_turn(kept(member=2, turns=2))
    task = Chatter().task(0, 3)
    journal.append(3, task, [Episode(3, 2, task, [5], [1, 0], [-0.1, -0.1], 4, 1.0, "stop")])  # member 2 finished
    journal.close()
    records = list(read_records(tmp_path / "attempt-1", 1))
    merged, added = with_journal(SinkSnapshot([], [], [], {}, [kept(member=1, turns=2)]), records)
    assert [(c.member, c.turns) for c in merged.conversations] == [(1, 3)]
    assert [e.episode_id for e in added] == ["3/2"]


def sample(group: int, version: int) -> TrainingSample:
    return TrainingSample([1], [2], [-0.1], 0.0, 0.0, QueuedTrace("chatter", version, group, 0))


def test_a_resume_continues_fresh_conversations_and_drops_the_rest_with_why():
    snap = SinkSnapshot(
        [sample(group=5, version=9)],
        [],
        [],
        {},
        [
            kept(group=3, member=1, turns=3, version=9),
            kept(group=3, member=2, turns=2, version=9),
            kept(group=4, member=0, turns=3, version=1),  # too old for the resumed step
            kept(group=5, member=3, turns=2, version=9),  # its group is scored and queued already
        ],
    )
    plan = restore_plan(snap, [], next_step=11, max_off_policy_steps=1, group_size=2)
    assert plan.floor == 9
    assert [(c.episode_id, c.turns) for c in plan.continued] == [("3/1", 3), ("3/2", 2)]
    assert sorted((c.episode_id, why) for c, why in plan.dropped_conversations) == [
        ("4/0", "stale"),
        ("5/3", "group_scored"),
    ]
    assert plan.to_complete == []  # group 3 is whole with its two conversations; group 4 was never emitted
    surplus = restore_plan(snap, [], next_step=11, max_off_policy_steps=1, group_size=1)
    assert ("3/2", "surplus") in [(c.episode_id, why) for c, why in surplus.dropped_conversations]


def test_the_ledger_check_finds_lost_and_unended_turns(tmp_path):
    root = tmp_path / "ledger"
    one = Ledger(root, 1, "orchestrator")
    one.write_each(LedgerEvent.TURN, [{"id": "3/1", "k": 3, "j": 0, "v": 4}])
    one.write_each(LedgerEvent.TURN, [{"id": "3/2", "k": 1, "j": 1, "v": 4}])
    one.close()
    two = Ledger(root, 2, "orchestrator")
    two.write(LedgerEvent.CONTINUED, ids=["3/1"], turns=[2], v=[4], floor=5)
    two.close()
    report = check_ledger(root)
    assert report.turns_kept == 2 and report.conversations_continued == 1 and report.turns_lost == 1
    assert "episode 3/1 was continued at turn 2 (attempt 2) although turn 3 was kept" in report.problems
    assert "episode 3/1 was continued with policy version 4, below the staleness floor 5 of its step (attempt 2)" in (
        report.problems
    )
    assert "episode 3/2 kept 1 turns but neither finished nor was dropped" in report.problems


class Scripted(httpx.AsyncBaseTransport):
    """Answers each turn with ``1`` (the env's done) or ``2`` and EOS; once ``hang`` is set, most later turns never
    return (a preemption will find them mid-conversation). Records every completion prompt."""

    def __init__(self, tokenizer, seed: int = 0) -> None:
        self.inner = fake_vllm_transport()
        self.ids = {d: tokenizer.convert_tokens_to_ids(d) for d in "12"}
        self.eos = tokenizer.eos_token_id
        self.turn1 = len(
            tokenizer.apply_chat_template(Chatter().task(0, 0).prompt, add_generation_prompt=True, tokenize=True)
        )
        self.hang = False
        self.rng = random.Random(seed)
        self.prompts: list[list[int]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":
            return await self.inner.handle_async_request(request)
        body = json.loads(request.content)
        self.prompts.append(body["prompt"])
        if self.hang and len(body["prompt"]) > self.turn1 and self.rng.random() < 0.7:
            await asyncio.sleep(3600)  # a later turn, still being sampled when the pause comes
        choices = []
        for i in range(body["n"]):
            said = "1" if self.rng.random() < 0.3 else "2"
            choices.append(
                {
                    "index": i,
                    "token_ids": [self.ids[said], self.eos],
                    "logprobs": {"token_logprobs": [-1.0, -0.1]},
                    "finish_reason": "stop",
                }
            )
        return httpx.Response(200, json={"choices": choices})


def run_spec(max_steps: int = 3):
    envs = [{"name": "tests.unit.test_turn_durability:Chatter"}]
    return parse(
        "turns",
        envs=envs,
        group_size=4,
        batch_size=8,
        max_off_policy_steps=2,
        max_steps=max_steps,
        sampling={"max_tokens": 4},
        checkpoint={"interval": 1, "keep_last": 3},
        rollout={"members_per_request": 2},
    ).spec


async def test_a_paused_conversation_is_continued_at_its_last_durable_turn(tmp_path, thinking_model):
    run_dir = RunDir(tmp_path / "run")
    tokenizer = AutoTokenizer.from_pretrained(thinking_model)
    server = Scripted(tokenizer)
    first = make_orchestrator(run_spec(8), run_dir, thinking_model, server)
    stop = start_fake_trainer(run_dir, thinking_model, 8, 1, attempt=1)
    run = asyncio.create_task(first.run())
    try:
        while first.checkpoints.last_step < 1:
            assert not run.done(), run.exception() if run.done() else None
            await asyncio.sleep(0.01)
        server.hang = True
        while len(first.kept) < 2 or not any(c.turns >= 2 for c in first.kept.current()):
            assert not run.done(), run.exception() if run.done() else None
            await asyncio.sleep(0.01)
        paused = await first.pause()
        kept_then = {c.episode_id: c for c in first.kept.current()}
        assert paused.conversations_kept == len(kept_then) >= 2 and paused.turns_kept >= 3
        first.request_stop()
        await asyncio.wait_for(run, 10)
    finally:
        stop.set()

    server = Scripted(tokenizer)
    second = make_orchestrator(run_spec(8), run_dir, thinking_model, server, attempt=2, resume=True)
    resumed = latest_complete_checkpoint(run_dir).step  # parts saved after the pause are completed with its snapshot
    assert await run_to_the_end(second, first_step=resumed) == 8
    report = second.resume_report
    continued = events(run_dir, "continued")
    turns = dict(zip(continued[0]["ids"], continued[0]["turns"], strict=True)) if continued else {}
    replayed = {i for e in events(run_dir, "replayed") for i in e["ids"]}
    # every conversation the pause kept is continued, at its turn then or later (turns durable in the journal but
    # not yet admitted when the pause came are kept too: they are after the snapshot's cut and replayed), or it had
    # finished just before the pause (its episode not yet admitted, so the snapshot kept the conversation) and is
    # replayed finished: seen in about 1 run in 8
    assert all(turns[i] >= c.turns if i in turns else i in replayed for i, c in kept_then.items())
    kept_turns = sum(c.turns for i, c in kept_then.items() if i in turns)
    assert report.conversations_continued == len(turns) and report.turns_kept == sum(turns.values()) >= kept_turns
    # a continued episode's next turn is prompted with its kept stream, not sampled again from its prompt
    streams = {tuple([*c.prompt_ids, *c.completion_ids]) for i, c in kept_then.items() if turns.get(i) == c.turns}
    assert (streams or not turns) and streams <= {tuple(p) for p in server.prompts}
    finished = {e["id"]: e for e in events(run_dir, "finished")}
    # the same episodes finished, with their ids, or were still running their turns when the run reached its last
    # step (a busy machine: their group left over, which the ledger check accounts for)
    left_over = {g for e in events(run_dir, "leftover") for g in e.get("groups", [])}
    unfinished = set(kept_then) - set(finished) - replayed
    assert {int(i.split("/")[0]) for i in unfinished} <= left_over, unfinished
    ledger = check_ledger(run_dir.root / "ledger")
    assert ledger.ok and ledger.steps == 8 and ledger.turns_lost == 0, ledger.problems
    assert ledger.conversations_continued == len(turns) and ledger.turns_kept >= paused.turns_kept


async def test_a_run_ends_every_kept_conversation(tmp_path, thinking_model):
    run_dir = RunDir(tmp_path / "run")
    orch = make_orchestrator(
        run_spec(), run_dir, thinking_model, Scripted(AutoTokenizer.from_pretrained(thinking_model))
    )
    assert await run_to_the_end(orch) == 3
    ledger = check_ledger(run_dir.root / "ledger")
    assert ledger.ok and ledger.turns_kept > 0, ledger.problems
    assert len(orch.kept) == 0 and journal_root(run_dir).is_dir()


def test_the_resume_messages_say_how_many_episodes_resumed_at_a_later_turn():
    from rlrun.api.control import ResumeReport
    from rlrun.launcher.preemption import resume_line
    from rlrun_operator.recovery import resume_message

    counts = {
        "from_step": 4,
        "shipped": 4,
        "queued_traces": 3,
        "open_groups": 1,
        "requested_groups": 2,
        "finished_episodes_kept": 2,
        "dropped_stale": 0,
        "members_requested": 5,
        "progress_only_would_lose": 5,
        "time": 0.0,
    }
    report = ResumeReport(**counts, conversations_continued=7, turns_kept=12)
    assert resume_line(report).endswith("; 7 multi-turn episodes resumed at turn > 1 (12 turns kept)")
    assert resume_message(report).endswith("; 7 multi-turn episodes resumed at turn > 1 (12 turns kept)")
    assert "multi-turn" not in resume_line(ResumeReport(**counts))  # said only when there were some


class OneOrTwo(httpx.AsyncBaseTransport):
    """Answers each turn of a plain-text prompt ``1`` (a third of the time) or ``2``, then EOS."""

    def __init__(self, tokenizer, seed: int = 0) -> None:
        self.inner = fake_vllm_transport()
        self.ids = {d: tokenizer.convert_tokens_to_ids(d) for d in "12"}
        self.eos = tokenizer.eos_token_id
        self.rng = random.Random(seed)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":
            return await self.inner.handle_async_request(request)
        choices = [
            {
                "index": i,
                "token_ids": [self.ids["1" if self.rng.random() < 0.3 else "2"], self.eos],
                "logprobs": {"token_logprobs": [-1.0, -0.1]},
                "finish_reason": "stop",
            }
            for i in range(json.loads(request.content)["n"])
        ]
        return httpx.Response(200, json={"choices": choices})


async def test_a_pause_during_a_respond_that_changes_the_state_in_place_keeps_the_state_of_the_kept_turn(
    tmp_path, tiny_model
):
    # issue 35.5: the kept state was the env's own object, which its next respond changed while the pause saved it.
    # max_off_policy_steps 8: the held conversations' requests stay fresh (none cancelled stale) until the pause
    run_dir = RunDir(tmp_path / "run")
    envs = [{"name": "tests.support.envs:InPlace", "args": {"prompts": 5}}]
    spec = parse(
        "in-place",
        envs=envs,
        group_size=4,
        batch_size=8,
        max_off_policy_steps=8,
        max_steps=50,
        sampling={"max_tokens": 4},
        checkpoint={"interval": 1, "keep_last": 3},
        rollout={"members_per_request": 2},
    ).spec
    orch = make_orchestrator(spec, run_dir, tiny_model, OneOrTwo(AutoTokenizer.from_pretrained(tiny_model)))
    stop = start_fake_trainer(run_dir, tiny_model, 50, 1, attempt=1)
    run = asyncio.create_task(orch.run())
    try:
        await wait_for_async(lambda: orch.checkpoints.last_step >= 1 or run.done(), 30, "checkpoint 1")
        assert not run.done(), run.exception()
        InPlace.gate.clear()  # from now on a respond after a conversation's first waits, its move recorded
        held = lambda: InPlace.held == InPlace.most_held and len(orch.kept) >= InPlace.most_held  # noqa: E731
        await wait_for_async(lambda: held() or run.done(), 30, "responds in progress")
        assert not run.done(), run.exception()
        paused = await orch.pause()
        orch.request_stop()
    finally:
        InPlace.gate.set()
        stop.set()
    await asyncio.wait_for(run, 30)
    # what a resume reads: the newest complete checkpoint, the pause's step or a newer trainer part that the paused
    # orchestrator completed with the same snapshot (the trainer trains the batches shipped before the pause while
    # the pause closes the trackers; with 3 such parts keep_last prunes the pause's own step)
    step = latest_complete_checkpoint(run_dir).step
    assert (
        step >= paused.step and [e["reason"] for e in events(run_dir, "checkpoint") if e["step"] == step][-1] == "pause"
    )
    state = load_orchestrator_progress(run_dir, step)
    kept = unpack(state["sink"], state.get("tensors", {})).conversations
    assert paused.conversations_kept == len(kept) >= InPlace.most_held
    # one move per turn played: the state as of the kept turn, not the one its respond was changing at the pause
    assert [len(c.state["moves"]) for c in kept] == [c.turns for c in kept]
    # the copy reads as a resume reads it, and a continued conversation plays on a copy of its own
    resumed = Conversation.from_kept(kept[0])
    resumed.state["moves"].append("2")
    assert len(kept[0].state["moves"]) == kept[0].turns


def test_a_resumable_env_whose_state_is_not_json_is_refused_naming_it():
    conv = Conversation(2, [5, 6, 7], [-0.5], state={"seen": {1, 2}}, turns=1)  # a set: no JSON
    with pytest.raises(EnvStateError, match=r"env chatter: resumable = True, but its state is not plain JSON"):
        conv.kept(3, 1, Chatter().task(0, 3), 0)
    assert classify_error(EnvStateError("x")) == (True, "EnvStateNotJSON")  # the orchestrator exits 78
