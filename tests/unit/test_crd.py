"""The generated CRD: in sync on disk, structural, and as strict as the pydantic spec.

Every invalid manifest below is rejected twice — by the CRD (JSON Schema + CEL rules,
what the API server checks) and by ``rlrun.manifest`` (what ``rlrun local`` checks) — and
both name the same field.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from rlrun.api.crd import CHART_CRD_FILE, CRD_FILE, PRINTER_COLUMNS, build_crd, render_crd
from rlrun.manifest import ManifestError, parse_manifest

from tests.support.crd_validation import apply_defaults, cel_violations, to_json_schema
from tests.support.manifests import manifest, rlrun_examples

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]


def crd_errors(manifest: dict, old: dict | None = None) -> list[str]:
    """What the API server would reject: schema errors (with the field's path) and CEL rule failures."""
    validator = jsonschema.Draft202012Validator(to_json_schema(SCHEMA))
    errors = []
    for err in validator.iter_errors(manifest):
        path = ".".join(str(p) for p in err.absolute_path)
        if err.validator == "additionalProperties":
            unknown = sorted(set(err.instance) - set(err.schema.get("properties", {})))
            path = ".".join(filter(None, [path, *unknown]))
        elif err.validator == "required":
            path = ".".join(filter(None, [path, err.message.split("'")[1]]))
        errors.append(f"{path}: {err.message}")
    if not errors:
        old_spec = old["spec"] if old else None
        errors += [f"spec{e}" for e in cel_violations(SPEC_SCHEMA, manifest["spec"], old_spec)]
    return errors


def test_crd_files_match_the_generator():
    text = render_crd()
    for rel in (CRD_FILE, CHART_CRD_FILE):
        assert (ROOT / rel).read_text() == text, f"{rel} is stale: run `rlrun crd`"


def test_schema_is_structural():
    """Every node states its type (or preserves unknown fields); no refs or unions are left."""

    def walk(node, path):
        assert not {"$ref", "anyOf", "oneOf", "allOf", "prefixItems", "title", "const"} & set(node), path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        for name, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{name}")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}.*")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(SCHEMA, "")


def test_crd_shape_for_kubectl():
    crd = build_crd()
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["rlr"]
    assert "rlrun" in crd["spec"]["names"]["categories"]
    assert version["subresources"] == {"status": {}}
    shown = [c["name"] for c in PRINTER_COLUMNS if "priority" not in c]
    assert shown == ["Phase", "Step", "Progress", "ETA", "Resumed", "Preemptions", "Age"]
    suspend = SPEC_SCHEMA["properties"]["suspend"]  # described for kubectl explain
    assert (suspend["type"], suspend["default"]) == ("boolean", False) and "Kueue" in suspend["description"]
    envs = SPEC_SCHEMA["properties"]["envs"]  # the API server keeps env names unique
    assert envs["x-kubernetes-list-type"] == "map" and envs["x-kubernetes-list-map-keys"] == ["name"]


def test_defaults_match_the_pydantic_spec():
    """The API server's defaulting yields what pydantic fills in for the same minimal manifest."""
    defaulted = apply_defaults(SPEC_SCHEMA, manifest()["spec"])
    resolved = parse_manifest(manifest()).spec.model_dump(mode="json")
    for key in ("group_size", "batch_size", "max_off_policy_steps", "sampling", "checkpoint", "preemption"):
        assert defaulted[key] == resolved[key], key
    assert defaulted["optimizer"]["betas"] == [0.9, 0.99]
    assert defaulted["storage"]["retention_policy"] == "Retain"
    assert defaulted["storage"]["access_modes"] == ["ReadWriteMany"]
    assert defaulted["rollout"]["replicas"] == 1 and defaulted["suspend"] is False
    trainer = ("gpus", "nodes", "processes_per_node")  # one pod, one process: as before multi-node training
    assert [defaulted["trainer"][k] for k in trainer] == [resolved["trainer"][k] for k in trainer] == [0, 1, 1]


@pytest.mark.parametrize("path", rlrun_examples(), ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_examples_pass_the_crd(path):
    doc = yaml.safe_load(path.read_text())
    assert crd_errors(doc) == []


#: A valid volume (a dataset's claim at /data) and a Secret's key, for the invalid ones below to change.
CLAIM = {"name": "ds", "mount_path": "/data", "persistent_volume_claim": {"claim_name": "datasets"}}
SECRET_REF = {"secret_key_ref": {"name": "creds", "key": "token"}}

INVALID = [
    # (spec change, field the CRD names, field rlrun.manifest names)
    ({"group_size": "eight"}, "spec.group_size", "spec.group_size"),
    ({"group_size": 1}, "spec.group_size", "spec.group_size"),
    ({"batch_size": 4, "group_size": 8}, "spec.batch_size", "spec.batch_size"),
    ({"max_off_policy_steps": -1}, "spec.max_off_policy_steps", "spec.max_off_policy_steps"),
    ({"max_steps": 1.5}, "spec.max_steps", "spec.max_steps"),
    ({"envs": []}, "spec.envs", "spec.envs"),
    ({"envs": [{"weight": 1}]}, "spec.envs.0.name", "spec.envs[0].name"),
    # an env's rewards: a builtin by name or a function by import path, never both
    (
        {"envs": [{"name": "reverse-text", "rewards": [{"name": "exact", "function": "m:f"}]}]},
        "spec.envs[0].rewards[0]",
        "spec.envs[0].rewards[0]",
    ),
    (
        {"envs": [{"name": "reverse-text", "rewards": [{"weight": 2}]}]},
        "spec.envs[0].rewards[0]",
        "spec.envs[0].rewards[0]",
    ),
    (
        {"envs": [{"name": "reverse-text", "rewards": [{"function": "m:f", "args": {"k": 1}}]}]},
        "spec.envs[0].rewards[0].args",
        "spec.envs[0].rewards[0]",
    ),
    (
        {"envs": [{"name": "reverse-text", "rewards": [{"function": "not a path"}]}]},
        "spec.envs.0.rewards.0.function",
        "spec.envs[0].rewards[0].function",
    ),
    (
        {"envs": [{"name": "reverse-text", "reward_timeout_seconds": 0}]},
        "spec.envs.0.reward_timeout_seconds",
        "spec.envs[0].reward_timeout_seconds",
    ),
    ({"model": {"builtin": "gpt-9"}}, "spec.model.builtin", "spec.model.builtin"),
    ({"model": {"builtin": "tiny-reverse", "name": "Qwen/Qwen3-0.6B"}}, "spec.model", "spec.model"),
    ({"model": {}}, "spec.model", "spec.model"),
    (
        {"model": {"builtin": "tiny-reverse", "lora": {"dropout": 0.1}}},
        "spec.model.lora.dropout",
        "spec.model.lora.dropout",
    ),
    ({"group_sise": 4}, "spec.group_sise", "spec.group_sise"),
    ({"weights": {"transport": "nccl"}}, "spec.weights.transport", "spec.weights.transport"),
    ({"weights": {"timeout_seconds": 0}}, "spec.weights.timeout_seconds", "spec.weights.timeout_seconds"),
    ({"weights": {"timeout_seconds": 7200}}, "spec.weights.timeout_seconds", "spec.weights.timeout_seconds"),
    ({"sampling": {"temperature": 0}}, "spec.sampling.temperature", "spec.sampling.temperature"),
    ({"sampling": {"top_p": 1.5}}, "spec.sampling.top_p", "spec.sampling.top_p"),
    ({"optimizer": {"betas": [0.9]}}, "spec.optimizer.betas", "spec.optimizer.betas[1]"),
    ({"checkpoint": {"keep_last": 0}}, "spec.checkpoint.keep_last", "spec.checkpoint.keep_last"),
    ({"rollout": {"replicas": 0}}, "spec.rollout.replicas", "spec.rollout.replicas"),
    ({"rollout": {"max_inflight": 4}}, "spec.rollout.max_inflight", "spec.rollout"),
    (
        {"rollout": {"resources": {"requests": {"memory": "lots"}}}},
        "spec.rollout.resources.requests.memory",
        "spec.rollout.resources.requests.memory",
    ),
    (
        {"rollout": {"gpu_memory_utilization": 1.2}},
        "spec.rollout.gpu_memory_utilization",
        "spec.rollout.gpu_memory_utilization",
    ),
    (
        {"rollout": {"gpu_memory_utilization": 0}},
        "spec.rollout.gpu_memory_utilization",
        "spec.rollout.gpu_memory_utilization",
    ),
    # vLLM arguments rlrun sets itself (the CRD: as written in full; rlrun.manifest: every spelling)
    (
        {"rollout": {"vllm_args": ["--enable-prefix-caching", "--tensor-parallel-size", "2"]}},
        "spec.rollout.vllm_args[1]",
        "spec.rollout.vllm_args",
    ),
    ({"rollout": {"vllm_args": ["--dtype=float16"]}}, "spec.rollout.vllm_args[0]", "spec.rollout.vllm_args"),
    ({"rollout": {"vllm_args": ["-tp", "2"]}}, "spec.rollout.vllm_args[0]", "spec.rollout.vllm_args"),
    ({"rollout": {"vllm_args": ["--served_model_name", "x"]}}, "spec.rollout.vllm_args[0]", "spec.rollout.vllm_args"),
    ({"rollout": {"vllm_args": ["--max-num-seqs 64"]}}, "spec.rollout.vllm_args[0]", "spec.rollout.vllm_args"),
    ({"rollout": {"vllm_args": [""]}}, "spec.rollout.vllm_args.0", "spec.rollout.vllm_args[0]"),
    ({"trainer": {"gpus": -1}}, "spec.trainer.gpus", "spec.trainer.gpus"),
    ({"orchestrator": {"gpus": 1}}, "spec.orchestrator.gpus", "spec.orchestrator.gpus"),
    ({"trainer": {"nodes": 0}}, "spec.trainer.nodes", "spec.trainer.nodes"),
    ({"trainer": {"nodes": "2"}}, "spec.trainer.nodes", "spec.trainer.nodes"),
    ({"trainer": {"processes_per_node": 17}}, "spec.trainer.processes_per_node", "spec.trainer.processes_per_node"),
    (
        {"trainer": {"gpus": 2, "processes_per_node": 4}},
        "spec.trainer.processes_per_node",
        "spec.trainer.processes_per_node",
    ),
    (
        {"preemption": {"snapshot_timeout_seconds": 120, "termination_grace_period_seconds": 60}},
        "spec.preemption.termination_grace_period_seconds",
        "spec.preemption.termination_grace_period_seconds",
    ),
    ({"storage": {"retention_policy": "Keep"}}, "spec.storage.retention_policy", "spec.storage.retention_policy"),
    ({"storage": {"existing_claim": "Bad_Name"}}, "spec.storage.existing_claim", "spec.storage.existing_claim"),
    ({"storage": {"access_modes": ["ReadMostly"]}}, "spec.storage.access_modes.0", "spec.storage.access_modes[0]"),
    ({"suspend": "yes"}, "spec.suspend", "spec.suspend"),
    # the loss: contradictory clips, unknown names, bounds, the mask's window (docs/algorithms.md)
    ({"loss": {"ratio_clip": 0.2, "clip_low": 0.2}}, "spec.loss.clip_low", "spec.loss.clip_low"),
    ({"loss": {"ratio_clip": 0.2, "clip_high": 0.28}}, "spec.loss.clip_high", "spec.loss.clip_high"),
    ({"loss": {"clip_low": 1.5}}, "spec.loss.clip_low", "spec.loss.clip_low"),
    ({"loss": {"objective": "grpo"}}, "spec.loss.objective", "spec.loss.objective"),
    ({"loss": {"objective": "cispo", "dual_clip": 3}}, "spec.loss.dual_clip", "spec.loss.dual_clip"),
    ({"loss": {"dual_clip": 1.0}}, "spec.loss.dual_clip", "spec.loss.dual_clip"),
    ({"loss": {"aggregation": "seq_mean"}}, "spec.loss.aggregation", "spec.loss.aggregation"),
    ({"loss": {"kl_coef": -0.1}}, "spec.loss.kl_coef", "spec.loss.kl_coef"),
    ({"loss": {"kl_estimator": "k4"}}, "spec.loss.kl_estimator", "spec.loss.kl_estimator"),
    (
        {"loss": {"importance_correction": {"mode": "clip"}}},
        "spec.loss.importance_correction.mode",
        "spec.loss.importance_correction.mode",
    ),
    (
        {"loss": {"importance_correction": {"mode": "truncate", "cap": 0.5}}},
        "spec.loss.importance_correction.cap",
        "spec.loss.importance_correction.cap",
    ),
    (
        {"loss": {"importance_correction": {"mode": "mask", "low": 1.0, "high": 1.0}}},
        "spec.loss.importance_correction.high",
        "spec.loss.importance_correction.high",
    ),
    (
        {"loss": {"importance_correction": {"mode": "mask", "low": 2.0, "high": 1.5}}},
        "spec.loss.importance_correction.low",
        "spec.loss.importance_correction.low",
    ),
    # the curriculum (issue 48): a known policy, pools by increasing pass rate up to 1, weights above 0
    ({"curriculum": {"policy": "greso"}}, "spec.curriculum.policy", "spec.curriculum.policy"),
    (
        {
            "curriculum": {
                "pools": [
                    {"max_pass_rate": 0.5, "weight": 1},
                    {"max_pass_rate": 0.25, "weight": 1},
                    {"max_pass_rate": 1, "weight": 1},
                ]
            }
        },
        "spec.curriculum.pools",
        "spec.curriculum.pools",
    ),
    (
        {"curriculum": {"pools": [{"max_pass_rate": 0.5, "weight": 1}]}},
        "spec.curriculum.pools",
        "spec.curriculum.pools",
    ),
    (
        {"curriculum": {"pools": [{"max_pass_rate": 1, "weight": 0}]}},
        "spec.curriculum.pools.0.weight",
        "spec.curriculum.pools[0].weight",
    ),
    (
        {"curriculum": {"pools": [{"max_pass_rate": 1.5, "weight": 1}]}},
        "spec.curriculum.pools.0.max_pass_rate",
        "spec.curriculum.pools[0].max_pass_rate",
    ),
    ({"curriculum": {"max_skip": 1}}, "spec.curriculum.max_skip", "spec.curriculum.max_skip"),
    (
        {"scheduling": {"node_selector": {"pool": 3}}},
        "spec.scheduling.node_selector.pool",
        "spec.scheduling.node_selector.pool",
    ),
    # a role's volumes and env: a restricted Kubernetes Volume / EnvVar, kept apart from rlrun's own
    (
        {"orchestrator": {"volumes": [{**CLAIM, "config_map": {"name": "cfg"}}]}},
        "spec.orchestrator.volumes[0]",
        "spec.orchestrator.volumes[0]",
    ),
    (
        {"orchestrator": {"volumes": [{"name": "ds", "mount_path": "/data"}]}},
        "spec.orchestrator.volumes[0]",
        "spec.orchestrator.volumes[0]",
    ),
    (
        {"orchestrator": {"volumes": [{**CLAIM, "mount_path": "data"}]}},
        "spec.orchestrator.volumes.0.mount_path",
        "spec.orchestrator.volumes[0].mount_path",
    ),
    (
        {"orchestrator": {"volumes": [{**CLAIM, "mount_path": "/data/../etc"}]}},
        "spec.orchestrator.volumes.0.mount_path",
        "spec.orchestrator.volumes[0].mount_path",
    ),
    (
        {"trainer": {"volumes": [{**CLAIM, "mount_path": "/var/lib/rlrun/run/data"}]}},
        "spec.trainer.volumes[0].mount_path",
        "spec.trainer.volumes[0].mount_path",
    ),
    (
        {"trainer": {"volumes": [{**CLAIM, "mount_path": "/var"}]}},
        "spec.trainer.volumes[0].mount_path",
        "spec.trainer.volumes[0].mount_path",
    ),
    (
        {"trainer": {"volumes": [{**CLAIM, "name": "data"}]}},
        "spec.trainer.volumes[0].name",
        "spec.trainer.volumes[0].name",
    ),
    ({"rollout": {"volumes": [CLAIM, {**CLAIM, "name": "ds2"}]}}, "spec.rollout.volumes", "spec.rollout.volumes"),
    (
        {"orchestrator": {"volumes": [{**CLAIM, "mountPath": "/data"}]}},
        "spec.orchestrator.volumes.0.mountPath",
        "spec.orchestrator.volumes[0].mountPath",
    ),
    (
        {"orchestrator": {"volumes": [{**CLAIM, "read_only": "true"}]}},
        "spec.orchestrator.volumes.0.read_only",
        "spec.orchestrator.volumes[0].read_only",
    ),
    (
        {
            "orchestrator": {
                "volumes": [
                    {
                        "name": "cfg",
                        "mount_path": "/cfg",
                        "config_map": {"name": "cfg", "items": [{"key": "a", "path": "../a"}]},
                    }
                ]
            }
        },
        "spec.orchestrator.volumes.0.config_map.items.0.path",
        "spec.orchestrator.volumes[0].config_map.items[0].path",
    ),
    (
        {"orchestrator": {"env": [{"name": "HOME", "value": "/root"}]}},
        "spec.orchestrator.env[0].name",
        "spec.orchestrator.env[0].name",
    ),
    (
        {"trainer": {"env": [{"name": "RLRUN_CACHE_DIR", "value": "/x"}]}},
        "spec.trainer.env[0].name",
        "spec.trainer.env[0].name",
    ),
    ({"trainer": {"env": [{"name": "1ST", "value": "x"}]}}, "spec.trainer.env.0.name", "spec.trainer.env[0].name"),
    ({"rollout": {"env": [{"name": "TOKEN"}]}}, "spec.rollout.env[0]", "spec.rollout.env[0]"),
    (
        {"rollout": {"env": [{"name": "TOKEN", "value": "x", "value_from": SECRET_REF}]}},
        "spec.rollout.env[0]",
        "spec.rollout.env[0]",
    ),
    (
        {
            "rollout": {
                "env": [
                    {"name": "TOKEN", "value_from": {**SECRET_REF, "config_map_key_ref": {"name": "c", "key": "k"}}}
                ]
            }
        },
        "spec.rollout.env[0].value_from",
        "spec.rollout.env[0].value_from",
    ),
    (
        {"rollout": {"env": [{"name": "TOKEN", "value_from": {"secret_key_ref": {"name": "Creds", "key": "k"}}}]}},
        "spec.rollout.env.0.value_from.secret_key_ref.name",
        "spec.rollout.env[0].value_from.secret_key_ref.name",
    ),
]


@pytest.mark.parametrize(("change", "crd_field", "spec_field"), INVALID, ids=[str(c[0]) for c in INVALID])
def test_invalid_manifest_is_rejected_naming_the_field(change, crd_field, spec_field):
    doc = manifest(**change)
    errors = crd_errors(doc)
    assert errors, "the CRD accepted it"
    assert any(e.startswith(f"{crd_field}:") for e in errors), errors
    with pytest.raises(ManifestError) as info:
        parse_manifest(doc)
    assert any(e.startswith(f"{spec_field}:") for e in info.value.errors), info.value.errors


def test_lora_dropout_is_refused_by_the_crd_and_the_manifest_saying_why():
    """Issue 47: dropout made the trainer's log π a random draw the sampler never drew from (mean |Δ logp|
    0.013 → 0.51 against a perfect sampler with 0.1, 38 % of tokens clipped); 0 is what both accept."""
    why = (
        "must be 0: dropout makes the trainer's log π a random draw while the rollout servers sample "
        "without it, so the importance ratio against the sampler and its clipping would be biased"
    )
    doc = manifest(model={"builtin": "tiny-reverse", "lora": {"rank": 8, "dropout": 0.1}})
    assert crd_errors(doc) == [f"spec.model.lora.dropout: model.lora.dropout {why}"]
    with pytest.raises(ManifestError) as info:
        parse_manifest(doc)
    assert info.value.errors == [f"spec.model.lora.dropout: {why}"]
    for zero in (0, 0.0):
        doc = manifest(model={"builtin": "tiny-reverse", "lora": {"rank": 8, "dropout": zero}})
        assert crd_errors(doc) == [] and parse_manifest(doc).spec.model.lora.dropout == 0


def test_weights_in_memory_with_lora_is_refused_by_the_crd_and_the_manifest_naming_both_fields():
    """Issue 50: a LoRA run's adapters reach the servers through the file system (vLLM loads adapters by path)."""
    lora = {"builtin": "tiny-reverse", "lora": {"rank": 8}}
    doc = manifest(model=lora, weights={"transport": "collective"})
    [error] = crd_errors(doc)
    assert error.startswith("spec.weights.transport: weights.transport collective cannot be used with model.lora")
    with pytest.raises(ManifestError) as info:
        parse_manifest(doc)
    assert info.value.errors == [
        "spec.weights: transport collective cannot be used with model.lora: a LoRA run's adapters reach the rollout "
        "servers through the file system (set weights.transport: filesystem, or drop model.lora)"
    ]
    for ok in (manifest(model=lora), manifest(weights={"transport": "collective", "timeout_seconds": 30})):
        assert crd_errors(ok) == [] and parse_manifest(ok)
    spec = parse_manifest(manifest()).spec
    assert (spec.weights.transport, spec.weights.timeout_seconds) == ("filesystem", 120.0)
    defaulted = apply_defaults(SPEC_SCHEMA, manifest()["spec"])
    assert defaulted["weights"] == spec.weights.model_dump(mode="json")


def test_missing_spec_and_wrong_kind_types():
    doc = manifest()
    del doc["spec"]
    assert any(e.startswith("spec:") for e in crd_errors(doc))
    doc = manifest()
    doc["spec"]["envs"] = {"name": "reverse-text"}
    assert any(e.startswith("spec.envs:") for e in crd_errors(doc))


def test_model_and_storage_are_immutable():
    old = manifest(storage={"size": "20Gi"})
    assert crd_errors(copy.deepcopy(old), old) == []  # an unchanged update is fine
    new = copy.deepcopy(old)
    new["spec"]["model"] = {"name": "Qwen/Qwen3-0.6B"}
    assert any(e.startswith("spec.model:") and "immutable" in e for e in crd_errors(new, old))
    new = copy.deepcopy(old)
    new["spec"]["storage"]["size"] = "40Gi"
    assert any(e.startswith("spec.storage:") and "immutable" in e for e in crd_errors(new, old))
    new = copy.deepcopy(old)
    new["spec"]["max_steps"] = 500  # other fields may change
    new["spec"]["suspend"] = True
    assert crd_errors(new, old) == []


@pytest.mark.parametrize("name", ["x" * 51, "9lives", "dotted.run", "trailing-"])
def test_run_names_leave_room_for_the_service_name(name):
    doc = manifest()
    doc["metadata"]["name"] = name
    assert any(e.startswith(".metadata.name:") for e in cel_violations(SCHEMA, doc))
    with pytest.raises(ManifestError) as info:
        parse_manifest(doc)
    assert any(e.startswith("metadata.name:") for e in info.value.errors)
    doc["metadata"]["name"] = "x" * 50
    assert cel_violations(SCHEMA, doc) == [] and parse_manifest(doc)


def test_a_roles_volumes_and_env_pass_the_crd_read_only_unless_said_otherwise():
    """Every source of a volume and of a variable passes both checks; a volume is read-only by default on both."""
    volumes = [
        CLAIM,
        {
            "name": "rewards-conf",
            "mount_path": "/etc/my-env",
            "config_map": {"name": "my-env.conf", "items": [{"key": "a.yaml", "path": "conf/a.yaml"}]},
        },
        {
            "name": "creds",
            "mount_path": "/home/user/.cache/creds",
            "read_only": False,
            "secret": {"secret_name": "creds"},
        },
    ]
    env = [
        {"name": "HF_TOKEN", "value_from": SECRET_REF},
        {"name": "MY_ENV_MODE", "value_from": {"config_map_key_ref": {"name": "my-env.conf", "key": "mode"}}},
        {"name": "OMP_NUM_THREADS", "value": "4"},
    ]
    doc = manifest(orchestrator={"volumes": volumes, "env": env}, trainer={"volumes": [CLAIM]})
    assert crd_errors(doc) == []
    spec = parse_manifest(doc).spec
    defaulted = apply_defaults(SPEC_SCHEMA, doc["spec"])
    assert [v["read_only"] for v in defaulted["orchestrator"]["volumes"]] == [True, True, False]
    assert [v.read_only for v in spec.orchestrator.volumes] == [True, True, False]
    assert spec.orchestrator.env[0].value_from.secret_key_ref.key == "token" and spec.rollout.volumes == []
    for role in ("orchestrator", "trainer", "rollout"):  # the API server keeps names unique
        for key in ("volumes", "env"):
            node = SPEC_SCHEMA["properties"][role]["properties"][key]
            assert node["x-kubernetes-list-type"] == "map" and node["x-kubernetes-list-map-keys"] == ["name"]
