"""CRD drift: the operator tells an installed CRD that is not its own from one that is."""

from __future__ import annotations

from rlrun.api.crd import SCHEMA_HASH_ANNOTATION, build_crd, schema_hash
from rlrun_operator.crd_drift import drift, expected_hash


def test_the_generated_crd_carries_the_hash_of_its_own_spec():
    crd = build_crd()
    assert crd["metadata"]["annotations"][SCHEMA_HASH_ANNOTATION] == schema_hash(crd["spec"]) == expected_hash()
    assert len(expected_hash()) == 16


def test_any_schema_change_changes_the_hash():
    crd = build_crd()
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    schema["rollout"]["properties"]["max_group_retries"]["default"] = 7
    assert schema_hash(crd["spec"]) != expected_hash()


def test_drift_is_none_for_this_operators_crd_and_a_sentence_with_the_fix_otherwise():
    assert drift(expected_hash()) is None
    other = drift("0123456789abcdef")
    assert f"schema hash 0123456789abcdef, expected {expected_hash()}" in other
    assert "kubectl apply --server-side -f crds/" in other
    assert "no schema hash (an older chart's)" in drift(None)
    assert drift(None, readable=False).startswith("could not read CustomResourceDefinition rlruns.rlrun.dev")
