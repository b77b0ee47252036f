"""The recipes of ``examples/recipes/`` (issue 38, part 8): each loads as ``rlrun local`` would load it, holds the
published settings its header claims, and runs the default example's task and model, so that
``benchmarks/recipes.py`` compares algorithms on one task. Their runs are a benchmark, not a test: none starts here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from rlrun.api.spec import RLRunSpec
from rlrun.manifest import load_manifest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "examples" / "recipes"
DEFAULT = load_manifest(ROOT / "examples" / "reverse-text.yaml").spec


def recipe(name: str) -> RLRunSpec:
    """The recipe's spec, checked as ``rlrun local`` checks it (its env built, its model known)."""
    return load_manifest(RECIPES / f"{name}.yaml", checks="full").spec


def test_dapo_has_the_papers_settings():
    """Yu et al. 2025 (arXiv:2503.14476): clip-higher 0.2 / 0.28, token-level loss, no KL, std-normalised group
    advantage, 16 samples per prompt, 20 warm-up steps then a constant rate; weight decay 0.1 from verl's script."""
    spec = recipe("dapo")
    loss, adv, opt = spec.loss, spec.advantage, spec.optimizer
    assert (loss.objective, loss.epsilon_low, loss.epsilon_high) == ("ppo_clip", 0.2, 0.28)
    assert (loss.aggregation, loss.kl_coef, loss.dual_clip) == ("token_mean", 0.0, None)
    assert (adv.baseline, adv.std_normalize) == ("group_mean", True)
    assert spec.group_size == 16
    assert (opt.lr_schedule, opt.warmup_steps, opt.weight_decay, opt.max_grad_norm) == ("constant", 20, 0.1, 1.0)
    assert (spec.sampling.temperature, spec.sampling.top_p) == (1.0, 1.0)


def test_dr_grpo_has_the_papers_settings():
    """Liu et al. 2025 (arXiv:2503.20783): no std normalisation, the constant normaliser, PPO's clip 0.2, no KL,
    a constant rate, 8 samples per prompt."""
    spec = recipe("dr-grpo")
    loss, adv, opt = spec.loss, spec.advantage, spec.optimizer
    assert (loss.objective, loss.epsilon_low, loss.epsilon_high) == ("ppo_clip", 0.2, 0.2)
    assert (loss.aggregation, loss.kl_coef) == ("constant", 0.0)
    assert (adv.baseline, adv.std_normalize) == ("group_mean", False)
    assert (opt.lr_schedule, opt.warmup_steps) == ("constant", 0)
    assert spec.group_size == 8 and (spec.sampling.temperature, spec.sampling.top_p) == (1.0, 1.0)


def test_gspo_has_the_papers_settings():
    """Zheng et al. 2025 (arXiv:2507.18071): the sequence ratio clipped at 3e-4 / 4e-4, the mean over sequences, the
    std-normalised group advantage, no KL."""
    spec = recipe("gspo")
    loss, adv = spec.loss, spec.advantage
    assert (loss.objective, loss.epsilon_low, loss.epsilon_high) == ("gspo", 3e-4, 4e-4)
    assert (loss.aggregation, loss.kl_coef) == ("sequence_mean", 0.0)
    assert (adv.baseline, adv.std_normalize) == ("group_mean", True)


#: What a recipe may change from the default example: its algorithm (and DAPO its group size, the paper's 16).
ALGORITHM = {"optimizer", "loss", "advantage", "sampling", "group_size"}


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_a_recipe_runs_the_default_task_and_names_its_source(path):
    """The default example's model, env, batch, steps, staleness bound and evaluation (the benchmark compares them on
    one task); the header names the paper's arXiv id and what the recipe changes (the benchmark runs every file
    here)."""
    spec = load_manifest(path, checks="full").spec
    ours, default = spec.model_dump(exclude=ALGORITHM), DEFAULT.model_dump(exclude=ALGORITHM)
    assert ours == default
    assert spec.optimizer.lr == DEFAULT.optimizer.lr  # the tiny model's rate, not the papers' 1e-6 (headers say why)
    assert spec.sampling.max_tokens == DEFAULT.sampling.max_tokens
    text = path.read_text()
    header = text[: text.index("apiVersion")]
    assert "arXiv:25" in header and "Changed, and why" in header and "docs/measurements.md" in header
    assert yaml.safe_load(text)["metadata"]["name"] == path.stem
