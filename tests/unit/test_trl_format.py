"""A dataset in TRL's format — ``prompt`` (conversational) and ``solution``, no ``answer`` column — trains with the
builtin ``tiny`` model (issue 36): ``demonstration: solution`` names the column the warm start teaches, and TRL-style
rewards keep receiving ``solution`` by its name. Without it, ``rlrun validate`` says what to set."""

from __future__ import annotations

import difflib
import json

import pytest
from rlrun.ledger import check_ledger
from rlrun.manifest import ManifestError
from rlrun.model.recipe import TinyEnvsRecipe
from rlrun.model.tiny_envs import init_tiny_envs_model
from rlrun.rundir import RunDir

from tests.support.manifests import parse
from tests.support.orchestrators import make_orchestrator, run_to_the_end
from tests.unit.test_rollout_faults import Faults, events

#: A warm start of a second: 3 steps, no progress checks.
BRIEF = TinyEnvsRecipe(sft_steps=3, sft_batch_size=16, sft_check_every=1000, sft_check_tasks=4, vocab_rows=64)


def similarity(completions, solution, trainer_state, **kwargs):
    """A TRL reward over the ``solution`` column (conversational completions)."""
    return [
        difflib.SequenceMatcher(None, c[0]["content"], s).ratio() for c, s in zip(completions, solution, strict=True)
    ]


def trl_spec(tmp_path, **args):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}="}], "solution": str(2 * i)} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {"name": "dataset", "args": {"path": str(data), **args}, "rewards": [{"function": f"{__name__}:similarity"}]}
    return parse(
        "trl",
        model={"builtin": "tiny"},
        envs=[env],
        group_size=4,
        batch_size=8,
        max_steps=2,
        checkpoint={"interval": 1, "keep_last": 2},
    ).spec


def test_without_naming_the_demonstration_column_validate_says_what_to_set(tmp_path):
    with pytest.raises(
        ManifestError, match=r"spec\.model\.builtin: .*set args\.demonstration .*demonstration: solution"
    ):
        trl_spec(tmp_path)


async def test_trl_format_data_trains_with_the_builtin_tiny_model(tmp_path):
    spec = trl_spec(tmp_path, demonstration="solution")
    model = tmp_path / "tiny"
    report = init_tiny_envs_model(model, spec.envs, BRIEF, evaluate=False)
    assert report["sft_steps"] == 3 and report["drawn"][0]["used"] > 0 and report["drawn"][0]["no_answer"] == 0
    run_dir = RunDir(tmp_path / "run")
    assert await run_to_the_end(make_orchestrator(spec, run_dir, model, Faults())) == 2
    assert events(run_dir, "reward_failed") == []  # the reward got solution, every time
    rows = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["reward/similarity"] is not None for r in rows)
    assert check_ledger(run_dir.root / "ledger").ok
