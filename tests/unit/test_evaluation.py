"""Evaluation on held-out tasks (issue 27): the eval split never holds a training task, the scores are what the
completions earn, and a run evaluates at its start, every interval and its end, holding the weights it scores,
with none of it in a batch or the ledger."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from rlrun.envs.reverse_text import ReverseTextEnv, held_out
from rlrun.ledger import check_ledger, read_ledger
from rlrun.model.recipe import TinyModelRecipe
from rlrun.orchestrator.episodes import EpisodeBuilder, tokenizer_codec
from rlrun.orchestrator.evaluation import Evaluator
from rlrun.rollout.client import RolloutClient, RolloutError
from rlrun.rollout.fake import fake_vllm_transport
from rlrun.rundir import RunDir, read_jsonl
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
