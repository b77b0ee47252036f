import json
from pathlib import Path

import pytest
from rlrun.manifest import ManifestError, load_manifest, parse_manifest

from tests.support.manifests import manifest, rlrun_examples

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


@pytest.mark.parametrize("path", rlrun_examples(), ids=lambda p: str(p.relative_to(ROOT / "examples")))
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


def test_hf_example_names_a_hub_model_set_for_one_gpu_per_role():
    from rlrun.rollout.server import vllm_command

    run = load_manifest(ROOT / "examples" / "qwen3-0.6b.yaml")
    spec = run.spec
    assert spec.model.name == "Qwen/Qwen3-0.6B" and spec.model.builtin is None
    # issue 37 part 7: bf16, checkpointed blocks, a micro-batch that holds the longest sequence vLLM may make
    assert (spec.trainer.gpus, spec.trainer.precision, spec.trainer.activation_checkpointing) == (1, "bfloat16", True)
    assert spec.rollout.max_model_len <= spec.trainer.micro_batch_tokens
    argv = vllm_command(spec, "/models/qwen3", "0.0.0.0", 8000, gpu=True, bf16=True)
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--tensor-parallel-size") + 1] == "1"


def test_env_name_and_args_are_checked_by_building_the_env():
    assert errors_of(manifest(envs=[{"name": "no-such-env"}])) == [
        "spec.envs[0].name: unknown env 'no-such-env'; installed envs: ['calculator', 'dataset', 'guess-number', "
        "'reasoning-gym', 'reverse-text'] "
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


# A user's own task: what validate finds before anything starts (issues 35, 36)


def needs_ground_truth(completions, ground_truth, **kwargs):
    """A TRL-style reward reading a column the dataset may lack."""
    return [float(c == g) for c, g in zip(completions, ground_truth, strict=True)]


def accuracy(completions, solution, trainer_state=None, **kwargs):
    """TRL's ``accuracy_reward`` signature: the ``solution`` column."""
    return [float(c[0]["content"] == s) for c, s in zip(completions, solution, strict=True)]


def no_kwargs(completions, answer):
    """A reward without ``**kwargs``: every call passes it arguments it does not take."""
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def trl_rows(path: Path, n: int = 8) -> Path:
    """TRL's conversational format: ``prompt`` (messages) and ``solution``, no ``answer`` column."""
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "solution": str(i + 1)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dataset_env(path: Path, rewards: list[str], **args) -> dict:
    return {"name": "dataset", "args": {"path": str(path), **args}, "rewards": [{"function": r} for r in rewards]}


def test_a_reward_needing_a_column_the_dataset_lacks_is_refused_naming_the_columns(tmp_path):
    """Issue 35: the run generated, failed 64 requests in a row and stopped 20 s in; validate said nothing."""
    data = trl_rows(tmp_path / "d.jsonl")
    (error,) = errors_of(manifest(envs=[dataset_env(data, ["tests.unit.test_spec:needs_ground_truth"])]))
    assert error == (
        "spec.envs[0].rewards[0].function: reward function tests.unit.test_spec:needs_ground_truth requires argument "
        "'ground_truth', which env dataset does not pass; it passes prompts, completions, completion_ids, "
        "trainer_state, log_extra, log_metric and its task fields solution "
        f"(path '{data}' has the columns ['prompt', 'solution']: rewards get the answer column as answer and every "
        "other column (args.info_columns) by its name); or give the parameter a default"
    )
    assert parse_manifest(manifest(envs=[dataset_env(data, ["tests.unit.test_spec:accuracy"])]))  # it has solution


def needs_answer(completions, answer, **kwargs):
    """A TRL-style reward reading ``answer``, which every env passes: None where a task has none."""
    return [float(str(c).strip() == str(a)) for c, a in zip(completions, answer, strict=True)]


def tolerates_no_answer(completions, answer=None, **kwargs):
    """The same with a default: it says it handles a task without an answer."""
    return [None for _ in completions]


def needs_hint(completions, hint, **kwargs):
    return [0.0 for _ in completions]


def needs_late(completions, late, **kwargs):
    return [0.0 for _ in completions]


def test_a_reward_needing_answer_without_an_answer_column_is_refused_naming_the_columns(tmp_path):
    """Issue 47: every reward is passed ``answer``, as ``[None] * n`` without an answer column; the
    reward scored every completion 0 and the run stopped 206 groups later on NoLearningSignal."""
    data = trl_rows(tmp_path / "d.jsonl", n=20)
    (error,) = errors_of(manifest(envs=[dataset_env(data, ["tests.unit.test_spec:needs_answer"])]))
    assert error == (
        "spec.envs[0].rewards[0].function: reward function tests.unit.test_spec:needs_answer requires "
        "argument 'answer', which env dataset does not pass ('answer' only as None: none of its 20 "
        "train tasks has a value for it); it passes prompts, completions, completion_ids, "
        "trainer_state, log_extra, log_metric and its task fields solution "
        f"(path '{data}' has the columns ['prompt', 'solution']: rewards get the answer column as "
        "answer and every other column (args.info_columns) by its name); or give the parameter a default"
    )
    named = dataset_env(data, ["tests.unit.test_spec:needs_answer"], answer="solution")
    assert parse_manifest(manifest(envs=[{**named, "args": {**named["args"], "demonstration": "solution"}}]))
    assert parse_manifest(manifest(envs=[dataset_env(data, ["tests.unit.test_spec:tolerates_no_answer"])]))


def test_a_column_empty_in_every_row_is_missing_and_one_filled_after_the_first_tasks_is_not(tmp_path):
    """A field None in the first tasks read (16) is looked for in every train row before a reward
    needing it is refused: a sparse column is not an empty one."""
    rows = [{"prompt": f"{i}=", "answer": str(i), "hint": None, "late": None} for i in range(40)]
    rows[39]["late"] = "x"
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (error,) = errors_of(manifest(envs=[dataset_env(data, ["tests.unit.test_spec:needs_hint"])]))
    assert "argument 'hint', which env dataset does not pass ('hint' only as None: none of its 40 " in error
    assert error.endswith("its task fields answer, late; or give the parameter a default")
    late = dataset_env(data, ["tests.unit.test_spec:needs_late"], shuffle=False)  # its last row: task 39
    assert parse_manifest(manifest(envs=[late]))


def test_a_reward_reading_the_answer_column_by_its_own_name_is_told_it_arrives_as_answer(tmp_path):
    data = trl_rows(tmp_path / "d.jsonl")
    (error,) = errors_of(manifest(envs=[dataset_env(data, ["tests.unit.test_spec:accuracy"], answer="solution")]))
    assert "requires argument 'solution'" in error
    assert "column 'solution' is the answer column: rewards get it as answer" in error
    assert "args.demonstration: solution" in error


def test_a_reward_without_kwargs_is_refused_naming_what_every_call_passes():
    (error,) = errors_of(
        manifest(envs=[{"name": "reverse-text", "rewards": [{"function": "tests.unit.test_spec:no_kwargs"}]}])
    )
    assert error.startswith("spec.envs[0].rewards[0].function: reward function tests.unit.test_spec:no_kwargs takes no")
    assert "prompts, completion_ids, trainer_state, log_extra, log_metric" in error and "**kwargs" in error


def test_an_import_path_without_its_colon_says_the_form_it_needs():
    (error,) = errors_of(
        manifest(envs=[{"name": "reverse-text", "rewards": [{"function": "my_pkg.rewards.accuracy"}]}])
    )
    assert error == (
        "spec.envs[0].rewards[0].function: must be an import path module:attr (e.g. my_pkg.rewards:accuracy), "
        "got 'my_pkg.rewards.accuracy'"
    )
    (error,) = errors_of(manifest(envs=[{"name": "my_pkg.envs.SpellingEnv"}]))
    assert error.startswith(
        "spec.envs[0].name: unknown env 'my_pkg.envs.SpellingEnv': an import path names the module and the "
        "attribute, module:attr (e.g. my_pkg.envs:SpellingEnv)"
    )


def test_an_unknown_env_name_gets_a_did_you_mean():
    (error,) = errors_of(manifest(envs=[{"name": "reasoning_gym"}]))
    assert error.startswith("spec.envs[0].name: unknown env 'reasoning_gym'; did you mean 'reasoning-gym'? installed")


def test_the_tiny_model_on_trl_format_data_is_told_which_column_to_name_and_then_validates(tmp_path):
    """Issue 36: prompt + solution and no answer column validated, then the run died with NoDemonstrationsError in a
    79-line traceback. Now validate says what to set, and with it the manifest is valid."""
    data = trl_rows(tmp_path / "d.jsonl")
    tiny = {"model": {"builtin": "tiny"}}
    (error,) = errors_of(manifest(**tiny, envs=[dataset_env(data, ["tests.unit.test_spec:accuracy"])]))
    assert error.startswith("spec.model.builtin: the builtin model 'tiny' is warm-started on the envs' answers")
    assert "dataset: 64 of 64 tasks without an answer" in error
    assert "set args.demonstration to the column holding the completion to teach" in error
    assert "(e.g. demonstration: solution)" in error
    env = dataset_env(data, ["tests.unit.test_spec:accuracy"], demonstration="solution")
    assert parse_manifest(manifest(**tiny, envs=[env])).spec.envs[0].args["demonstration"] == "solution"
