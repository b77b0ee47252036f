"""Evaluation on held-out tasks (issue 27): the eval split never holds a training task, the scores are what the
completions earn, and a run evaluates at its start, every interval and its end, holding the weights it scores,
with none of it in a batch or the ledger."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
from rlrun.checkpoint import WEIGHTS_FILE
from rlrun.envs.reverse_text import ReverseTextEnv, held_out
from rlrun.ledger import check_ledger, read_ledger
from rlrun.model.recipe import TinyModelRecipe
from rlrun.orchestrator import evaluation
from rlrun.orchestrator.episodes import EpisodeBuilder, tokenizer_codec
from rlrun.orchestrator.evaluation import EvalRounds, Evaluator
from rlrun.orchestrator.follower import WeightFollower
from rlrun.orchestrator.metrics import StepMetrics
from rlrun.rollout.client import RolloutClient, RolloutError
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir, publish_dir, read_jsonl, write_meta
from transformers import AutoTokenizer

from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator, run_to_the_end


@pytest.mark.parametrize("seeds", [(0, 0), (0, 1), (1, 0), (3, 7)])
def test_no_eval_task_is_a_training_task_whatever_the_seeds(seeds):
    train_seed, eval_seed = seeds
    env = ReverseTextEnv()
    train = {env.task(train_seed, i).prompt for i in range(20_000)}
    evals = [env.task(eval_seed, i, "eval") for i in range(500)]
    assert train.isdisjoint(t.prompt for t in evals)
    assert all(held_out(t.prompt[:-1]) for t in evals) and not any(held_out(p[:-1]) for p in train)
    assert len({t.prompt for t in evals}) > 150  # a real held-out set (drawn as training draws: short texts repeat)


def test_the_builtin_model_is_warm_started_on_no_held_out_text():
    recipe = TinyModelRecipe()  # its warm-start stream: seed + 1_000_003, the train split (rlrun.model.tiny)
    env = ReverseTextEnv()
    texts = [env.text(recipe.seed + 1_000_003, i) for i in range(recipe.sft_steps * recipe.sft_batch_size)]
    assert not any(held_out(t) for t in texts)


def test_an_unknown_split_is_refused():
    with pytest.raises(ValueError, match="split must be one of"):
        ReverseTextEnv().task(0, 0, "test")


class Recording(httpx.AsyncBaseTransport):
    """The fake server, noting each completion request's temperature and ``n``."""

    def __init__(self, error_rate: float) -> None:
        self.inner = fake_vllm_transport(error_rate=error_rate)
        self.asked: list[tuple[float, int]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            body = json.loads(request.content)
            self.asked.append((body["temperature"], body["n"]))
        return await self.inner.handle_async_request(request)


def evaluator(tmp_path, tiny_model, **evaluation) -> Evaluator:
    spec = parse("eval", evaluation={"enabled": True, "tasks": 6, "samples_per_task": 3, **evaluation}).spec
    env = ReverseTextEnv(reward="exact")
    episodes = EpisodeBuilder(*tokenizer_codec(AutoTokenizer.from_pretrained(str(tiny_model))), {env.name: env})
    return Evaluator(spec.evaluation, spec.sampling, episodes, spec.seed, RunDir(tmp_path).evaluations)


@pytest.mark.parametrize(("error_rate", "solved"), [(0.0, 1.0), (1.0, 0.0)])
async def test_scores_are_what_the_completions_earn(tmp_path, tiny_model, error_rate, solved):
    ev = evaluator(tmp_path, tiny_model, interval=2)
    server = Recording(error_rate)  # 0: every completion is the exact reversal; 1: every token is replaced
    client = RolloutClient("http://fake:1", transport=server)
    client.loaded_version = 4
    line = await ev.evaluate([client], version=4)
    assert sorted(server.asked) == [(0.0, 1)] * 6 + [(1.0, 3)] * 6  # greedy once, sampled k = 3 times, per task
    assert line["policy_version"] == 4 and line["tasks"] == 6 and line["samples_per_task"] == 3
    for key in ("greedy_solved", "pass_at_k", "greedy_reward", "sampled_reward"):
        assert line[key] == pytest.approx(solved), key
    assert line["per_env"]["reverse-text"]["greedy_solved"] == solved
    assert read_jsonl(RunDir(tmp_path).evaluations) == [line]
    assert not ev.due(4, max_steps=10) and ev.due(6, max_steps=10) and not ev.due(5, max_steps=10)
    assert ev.crossed(5, 7, max_steps=10) and not ev.crossed(6, 7, max_steps=10) and ev.crossed(8, 10, max_steps=10)
    # a resumed attempt: policy 5 stands in for 4 only if 4 went unevaluated (a round cut short by a preemption)
    assert not ev.due_at_start(5, max_steps=10) and ev.due_at_start(7, max_steps=10) and ev.due_at_start(0, 10)
    await client.aclose()


def test_a_resume_evaluates_again_the_versions_past_its_checkpoint_and_ends_a_torn_line(tmp_path, tiny_model):
    path = RunDir(tmp_path).evaluations
    rows = [{"policy_version": v, "greedy_solved": 0.5} for v in (0, 2, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"policy_version": 6, "gre')  # killed mid-line
    ev = evaluator(tmp_path, tiny_model, interval=2)
    assert path.read_text().endswith('"gre\n') and ev.evaluated == {0, 2, 4}
    ev.resumed_at(2)  # the weights of 4 are trained again from the checkpoint of step 2
    assert ev.evaluated == {0, 2} and ev.due(4, max_steps=10) and not ev.due(2, max_steps=10)


async def test_a_run_evaluates_at_its_start_every_interval_and_its_end_and_trains_none_of_it(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path)
    spec = parse(
        "eval",
        group_size=4,
        batch_size=8,
        max_off_policy_steps=1,
        max_steps=5,
        checkpoint={"interval": 1, "keep_last": 1},
        evaluation={"enabled": True, "interval": 2, "tasks": 5, "samples_per_task": 2},
    ).spec
    server = Recording(error_rate=0.3)
    assert await run_to_the_end(make_orchestrator(spec, run_dir, tiny_model, server)) == 5
    lines = read_jsonl(run_dir.evaluations)
    versions = [line["policy_version"] for line in lines]
    assert versions[0] == 0 and versions[-1] == 5 and versions == sorted(set(versions))
    assert any(2 <= v < 5 for v in versions)  # the interval crossed mid-run (a push may skip a version: 3 for 2)
    # eval work: greedy requests (temperature 0), never dispatched, never in a batch or the ledger's fates
    assert sum(1 for t, _ in server.asked if t == 0.0) == 5 * len(lines)
    ledger = [e for evs in read_ledger(run_dir.root / "ledger").values() for e in evs]
    dispatched = [e for e in ledger if e["e"] == "dispatched"]
    assert dispatched and all(e.get("task") is not None for e in dispatched)
    report = check_ledger(run_dir.root / "ledger")
    assert report.ok and report.steps == 5 and report.trained == 40, report.problems
    env = ReverseTextEnv()
    trained_prompts = {env.task(spec.seed, e["task"]).prompt for e in dispatched}
    assert trained_prompts.isdisjoint(env.task(spec.seed, i, "eval").prompt for i in range(5))


async def test_a_round_whose_weights_moved_before_it_was_answered_is_discarded(tmp_path, tiny_model):
    ev = evaluator(tmp_path, tiny_model)
    server = Recording(error_rate=0.0)
    client = RolloutClient("http://fake:1", transport=server)
    client.loaded_version = 4
    round_ = asyncio.ensure_future(ev.evaluate([client], version=4))
    await asyncio.sleep(0)
    client.loaded_version = 5  # the hold ran out (MAX_HOLD_S) and a push went ahead mid-round
    with pytest.raises(RolloutError, match="moved past policy 4"):
        await round_
    assert read_jsonl(RunDir(tmp_path).evaluations) == [] and 4 not in ev.evaluated
    await client.aclose()


def rounds_over(ev: Evaluator, client: RolloutClient, tmp_path, max_steps: int = 4):
    """A run of ``max_steps``'s rounds on ``client``, and the metrics counting what they drop and hold."""
    rounds, metrics = EvalRounds(), StepMetrics(tmp_path / "metrics.jsonl", attempt=1)
    rounds.bind(ev, lambda: [client], max_steps, metrics)
    return rounds, metrics


def broadcast(run_dir: RunDir, model, step: int) -> None:
    """What the trainer publishes after ``step``: its weights in ``broadcasts/step_N/``."""
    run_dir.broadcast(step).parent.mkdir(parents=True, exist_ok=True)

    def fill(tmp):
        shutil.copy(model / WEIGHTS_FILE, tmp / WEIGHTS_FILE)
        write_meta(tmp, step, 0)

    publish_dir(run_dir.broadcast(step), fill)


async def test_the_final_evaluation_holds_the_pushes_and_runs_beside_the_follower(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path)
    ev = evaluator(tmp_path, tiny_model)
    client = RolloutClient("http://fake:1", transport=fake_vllm_transport(error_rate=0.0, reload_s=0.2))
    follower = WeightFollower(run_dir, 0, None)
    await follower.load([client], tiny_model, 3)  # the servers hold policy 3; the trainer publishes step 4
    broadcast(run_dir, tiny_model, 4)
    rounds, metrics = rounds_over(ev, client, tmp_path)

    async def following():  # the orchestrator's follower loop: the newest broadcast unless a round holds
        while True:
            if not rounds.holding:
                await follower.follow([client])
            await asyncio.sleep(0.01)

    final = asyncio.ensure_future(rounds.finish(lambda: follower.load([client], follower.weights_dir(4), 4)))
    await asyncio.sleep(0.05)  # the final round is loading step 4's weights when the follower looks
    loop = asyncio.ensure_future(following())
    await final
    loop.cancel()
    # before: the follower's push of the same weights reloaded the server as the round began ("no server")
    assert [line["policy_version"] for line in read_jsonl(run_dir.evaluations)] == [4]
    assert metrics.eval_rounds_dropped == 0 and 0 < metrics.eval_hold_seconds < 5
    await client.aclose()


async def test_the_final_evaluation_waits_for_a_reload_under_way(tmp_path, tiny_model):
    run_dir = RunDir(tmp_path)
    ev = evaluator(tmp_path, tiny_model)
    client = RolloutClient("http://fake:1", transport=fake_vllm_transport(error_rate=0.0, reload_s=0.2))
    follower = WeightFollower(run_dir, 0, None)
    loads = []

    async def load_last():
        loads.append(4)
        await follower.load([client], tiny_model, 4)

    push = asyncio.ensure_future(follower.load([client], tiny_model, 4))  # the follower's push, under way
    await asyncio.sleep(0.05)
    rounds, _ = rounds_over(ev, client, tmp_path)
    await rounds.finish(load_last)
    await push
    assert [line["policy_version"] for line in read_jsonl(run_dir.evaluations)] == [4] and loads == []
    await client.aclose()


class Hanging(httpx.AsyncBaseTransport):
    """A server that never answers a completion."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await asyncio.Event().wait()
        raise AssertionError("never answered")


async def test_a_hung_round_is_said_when_its_hold_runs_out_and_counted_when_dropped(
    tmp_path, tiny_model, monkeypatch, caplog
):
    monkeypatch.setattr(evaluation, "MAX_HOLD_S", 0.2)
    ev = evaluator(tmp_path, tiny_model, interval=2, timeout_seconds=0.6)
    client = RolloutClient("http://fake:1", transport=Hanging())
    client.loaded_version = 4
    rounds, metrics = rounds_over(ev, client, tmp_path, max_steps=10)
    rounds.updated(3, 4)  # the servers reached policy 4: an evaluation point (interval 2)
    assert rounds.holding
    await asyncio.sleep(0.3)
    assert rounds.running and not rounds.holding  # the pushes go on
    assert "evaluation of policy 4 unanswered after 0 s: the weight pushes it held go on" in caplog.text
    await rounds.finish(lambda: asyncio.sleep(0))  # the round under way ends (dropped); then the final one
    dropped = "evaluation of policy 4 dropped (1 this attempt): TimeoutError: no answer within 1 s"
    assert dropped in caplog.text
    assert metrics.eval_rounds_dropped >= 1 and metrics.eval_hold_seconds >= 0.2
    assert read_jsonl(RunDir(tmp_path).evaluations) == []
    await client.aclose()


async def test_a_mixtures_held_out_scores_are_reported_per_task_family(tmp_path, tiny_model):
    from rlrun.envs.reasoning_gym import ReasoningGymEnv

    spec = parse("eval", evaluation={"enabled": True, "tasks": 8, "samples_per_task": 1}).spec
    small = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    members = [
        {"name": "basic_arithmetic", "config": {**small, "operators": ["+"]}},
        {"name": "chain_sum", "config": small},
    ]
    env = ReasoningGymEnv(tasks=members, chat=False, system_prompt="", answer_format="raw")
    codec = tokenizer_codec(AutoTokenizer.from_pretrained(str(tiny_model)))
    episodes = EpisodeBuilder(*codec, {env.name: env})
    ev = Evaluator(spec.evaluation, spec.sampling, episodes, spec.seed, RunDir(tmp_path).evaluations)
    client = RolloutClient("http://fake:1", transport=fake_vllm_transport(error_rate=0.0))
    line = await ev.evaluate([client], version=0)
    families = line["per_env"]["reasoning-gym"]["per_family"]
    assert sorted(families) == sorted({t.info["family"] for t in ev.tasks})
    assert sorted(families) == ["basic_arithmetic", "chain_sum"]
    keys = {"greedy_reward", "greedy_solved", "sampled_reward", "pass_at_k", "completion_len_mean"}
    assert set(families["chain_sum"]) == set(families["basic_arithmetic"]) == keys
    await client.aclose()
