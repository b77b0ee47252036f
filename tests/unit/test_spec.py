from pathlib import Path

import pytest
from rlrun.manifest import ManifestError, load_manifest, parse_manifest

from tests.support.manifests import manifest

ROOT = Path(__file__).resolve().parents[2]


def errors_of(data) -> list[str]:
    with pytest.raises(ManifestError) as info:
        parse_manifest(data)
    return info.value.errors


def test_defaults_fill_a_minimal_manifest():
    run = parse_manifest(manifest())
    assert run.spec.group_size == 8 and run.spec.max_off_policy_steps == 1
    assert run.spec.checkpoint.interval == 10 and run.spec.sampling.temperature == 1.0
    assert (run.spec.trainer.nodes, run.spec.trainer.processes_per_node) == (1, 1)  # one process, as before


@pytest.mark.parametrize(
    "trainer",
    [{"gpus": 8, "processes_per_node": 8, "nodes": 4}, {"gpus": 8, "processes_per_node": 2}, {"processes_per_node": 4}],
)
def test_trainer_ranks_fit_its_gpus_or_run_on_cpu(trainer):
    """At most one rank per GPU; fewer ranks than GPUs is allowed, and CPU pods take any number of gloo ranks."""
    spec = parse_manifest(manifest(trainer=trainer)).spec.trainer
    assert (spec.nodes, spec.processes_per_node) == (trainer.get("nodes", 1), trainer["processes_per_node"])


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"group_size": 1}, "spec.group_size: must be ≥ 2"),
        ({"max_off_policy_steps": -1}, "spec.max_off_policy_steps: must be ≥ 0"),
        ({"max_steps": 0}, "spec.max_steps: must be ≥ 1"),
        ({"sampling": {"temperature": 0}}, "spec.sampling.temperature: must be > 0"),
        ({"optimizer": {"lr": -1}}, "spec.optimizer.lr: must be > 0"),
        ({"checkpoint": {"keep_last": 0}}, "spec.checkpoint.keep_last: must be ≥ 1"),
        ({"rollout": {"replicas": 0}}, "spec.rollout.replicas: must be ≥ 1"),
        ({"group_sise": 4}, "spec.group_sise: unknown field"),
        ({"envs": []}, "spec.envs: must have at least 1 item(s)"),
        ({"envs": [{"weight": 1}]}, "spec.envs[0].name: required field is missing"),
        ({"model": {}}, "spec.model: set exactly one of builtin or name"),
        ({"model": {"builtin": "huge"}}, "spec.model.builtin: must be one of 'tiny-reverse'"),
        ({"group_size": "eight"}, "spec.group_size: must be an integer"),
        ({"batch_size": 4, "group_size": 8}, "spec.batch_size: must be ≥ group_size (8)"),
        ({"rollout": {"max_inflight": 4}, "group_size": 8}, "spec.rollout: max_inflight (4) must be ≥ group_size (8)"),
        ({"trainer": {"nodes": 0}}, "spec.trainer.nodes: must be ≥ 1"),
        ({"trainer": {"nodes": 257}}, "spec.trainer.nodes: must be ≤ 256"),
        ({"trainer": {"processes_per_node": 0}}, "spec.trainer.processes_per_node: must be ≥ 1"),
        ({"trainer": {"processes_per_node": 17}}, "spec.trainer.processes_per_node: must be ≤ 16"),
        (
            {"trainer": {"gpus": 2, "processes_per_node": 4}},
            "spec.trainer.processes_per_node: must be ≤ gpus (2) when the trainer has GPUs",
        ),
    ],
)
def test_invalid_spec_names_the_field(spec, expected):
    errs = errors_of(manifest(**spec))
    assert any(e.startswith(expected) for e in errs), errs


def test_wrong_kind_and_missing_spec():
    data = manifest()
    data["kind"] = "Job"
    del data["spec"]
    errs = errors_of(data)
    assert "kind: must be one of 'RLRun'" in errs
    assert "spec: required field is missing" in errs


def test_load_manifest_reports_file_and_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed\n")
    with pytest.raises(ManifestError, match="not valid YAML"):
        load_manifest(bad)


#: Examples for Kubernetes only: their data and env package are in a volume and an image this machine lacks.
KUBERNETES_ONLY = {"dataset-on-kubernetes.yaml"}


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(path):
    """Every example passes the checks of where it runs: ``rlrun local``'s (every env built, every reward loaded),
    or the operator's (what needs no user data or code)."""
    run = load_manifest(path, checks="static" if path.name in KUBERNETES_ONLY else "full")
    assert run.kind == "RLRun"


def test_a_kubernetes_only_example_is_refused_locally_for_its_data_not_its_shape():
    with pytest.raises(ManifestError) as exc:
        load_manifest(ROOT / "examples" / "dataset-on-kubernetes.yaml")
    # its data is on a claim, its reward in its image: neither is here; every problem is named, the shape is fine
    assert [e.split(":")[0] for e in exc.value.errors] == ["spec.envs[0].args", "spec.envs[0].rewards[0].function"]
    assert "/data/arithmetic.jsonl" in exc.value.errors[0] and "my_arithmetic" in exc.value.errors[1]


def test_hf_example_names_a_hub_model():
    run = load_manifest(ROOT / "examples" / "qwen3-0.6b.yaml")
    assert run.spec.model.name == "Qwen/Qwen3-0.6B" and run.spec.model.builtin is None


def test_env_name_and_args_are_checked_by_building_the_env():
    assert errors_of(manifest(envs=[{"name": "no-such-env"}])) == [
        "spec.envs[0].name: unknown env 'no-such-env'; installed envs: ['calculator', 'dataset', 'guess-number', 'reasoning-gym', "
        "'reverse-text'] "
        "(or give an import path package.module:attr)"
    ]
    (error,) = errors_of(manifest(envs=[{"name": "reverse-text", "args": {"bogus": 1}}]))
    assert error.startswith("spec.envs[0].args: env 'reverse-text': bad args {'bogus': 1}")
    (error,) = errors_of(manifest(envs=[{"name": "reverse-text", "args": {"max_words": 0}}]))
    assert error == "spec.envs[0].args: reverse-text: max_words must be ≥ 1, got 0"


class Picky:
    name = "picky"

    def __init__(self, level: int = 1) -> None:
        raise ValueError(f"picky: unknown env level {level}")  # says "unknown env", is about args


def test_env_errors_are_placed_by_their_type_not_their_message():
    (error,) = errors_of(manifest(envs=[{"name": "tests.unit.test_spec:Picky"}]))
    assert error == "spec.envs[0].args: picky: unknown env level 1"
