"""The real operator (kopf + rlrun_operator.handlers) against the API emulator and fake orchestrators."""

from __future__ import annotations

import asyncio
import base64
import copy
import time

import jsonschema
import pytest
import yaml
from prometheus_client import REGISTRY
from rlrun.api.crd import build_crd
from rlrun_operator import handlers

from tests.kube.conftest import NAMESPACE, validate_object
from tests.support.crd_validation import to_json_schema
from tests.support.fake_orchestrator import resume_report
from tests.support.kube.errors import ApiError
from tests.support.manifests import manifest
from tests.support.polling import wait_for

RLRUN_SCHEMA = to_json_schema(build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def validate_rlrun(obj: dict) -> None:
    doc = copy.deepcopy(obj)
    doc["metadata"] = {"name": doc["metadata"]["name"]}
    jsonschema.validate(doc, RLRUN_SCHEMA)


def objects_of(cluster, name="demo"):
    sel = f"app.kubernetes.io/instance={name}"
    out = {}
    for resource in ("persistentvolumeclaims", "secrets", "configmaps", "services", "pods"):
        out[resource] = cluster.kube.list(resource, NAMESPACE, label_selector=sel)
    return out


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_create_makes_every_object_owned_labelled_and_schema_valid(cluster):
    created_before = metric("rlrun_operator_reconciles_total", handler="create")
    run = cluster.kube.create("rlruns", manifest(rollout={"replicas": 2}), NAMESPACE)
    objects = wait_for(lambda: (o := objects_of(cluster)) and len(o["pods"]) == 4 and o, what="4 pods")
    assert [len(objects[r]) for r in ("persistentvolumeclaims", "secrets", "configmaps", "services")] == [1, 1, 1, 1]
    uid = run["metadata"]["uid"]
    for resource, items in objects.items():
        for obj in items:
            validate_object(obj)
            labels = obj["metadata"]["labels"]
            assert labels["app.kubernetes.io/managed-by"] == "rlrun-operator"
            assert labels["app.kubernetes.io/name"] == "rlrun"
            owners = obj["metadata"].get("ownerReferences", [])
            if resource == "persistentvolumeclaims":
                assert owners == []  # retention policy Retain: the run directory outlives the RLRun
            else:
                assert [(o["kind"], o["uid"], o["controller"]) for o in owners] == [("RLRun", uid, True)]
    names = sorted(p["metadata"]["name"] for p in objects["pods"])
    assert names == ["demo-orchestrator-a0", "demo-rollout-0-a0", "demo-rollout-1-a0", "demo-trainer-a0"]
    assert {p["metadata"]["labels"]["rlrun.dev/attempt"] for p in objects["pods"]} == {"0"}
    token = base64.b64decode(objects["secrets"][0]["data"]["token"]).decode()
    assert len(token) >= 32
    resolved = yaml.safe_load(objects["configmaps"][0]["data"]["rlrun.yaml"])
    assert resolved["spec"]["rollout"]["replicas"] == 2 and resolved["metadata"]["namespace"] == NAMESPACE
    status = wait_for(lambda: cluster.status().get("phase") and cluster.status(), what="a status")
    assert status["phase"] in ("Pending", "Running") and status["attempt"] == 0  # Running once the fake answers
    validate_rlrun(cluster.rlrun())
    assert metric("rlrun_operator_reconciles_total", handler="create") == created_before + 1


def test_a_lora_run_s_rollout_pods_serve_its_adapters_and_a_rank_no_server_takes_is_refused_by_the_api(cluster):
    """Issue 40: nothing new in the CRD but ``spec.model.lora``; a rollout pod runs ``rlrun rollout`` on the run's
    manifest, whose vLLM argv and environment carry the LoRA settings (``rlrun.rollout.server``)."""
    from rlrun.manifest import parse_manifest
    from rlrun.rollout.server import vllm_command, vllm_env
    from rlrun_operator import naming, pods

    with pytest.raises(ApiError) as refused:  # above vLLM's largest --max-lora-rank: the CRD's own schema says no
        cluster.kube.create("rlruns", manifest(model={"builtin": "tiny-reverse", "lora": {"rank": 600}}), NAMESPACE)
    assert refused.value.code == 422 and "spec.model.lora.rank" in str(refused.value)
    lora = {"builtin": "tiny-reverse", "lora": {"rank": 24, "target_modules": ["q_proj", "v_proj"]}}
    cluster.kube.create("rlruns", manifest(model=lora, max_off_policy_steps=2), NAMESPACE)
    rollout = wait_for(lambda: [p for p in cluster.pods() if "rollout" in p["metadata"]["name"]], what="a rollout pod")
    assert rollout[0]["spec"]["containers"][0]["command"] == pods.command(naming.ROLLOUT, 0)
    served = parse_manifest(
        yaml.safe_load(cluster.kube.get("configmaps", "demo-config", NAMESPACE)["data"]["rlrun.yaml"])
    )
    argv = vllm_command(served.spec, "/cache/tiny", "0.0.0.0", naming.ROLLOUT_PORT, gpu=False, bf16=False)
    assert argv[argv.index("--max-lora-rank") + 1] == "32" and argv[argv.index("--max-loras") + 1] == "4"
    assert "--enable-lora" in argv and vllm_env(served.spec, "/cache/tiny", {})["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]


def test_status_follows_the_orchestrator_and_ready_rollouts_get_pushed(cluster):
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    fake = cluster.orchestrators.run(NAMESPACE, "demo")
    fake.status.update(step=12, policy_version=11, last_checkpoint_step=10)
    cluster.run_orchestrator()
    # no rollout server ready: running but not Ready
    wait_for(lambda: cluster.status().get("step") == 12, what="step 12")
    assert cluster.condition("Ready")["status"] == "False"
    rollout = cluster.pod("rollout")
    cluster.set_pod_status(rollout, ip="10.0.0.7")
    wait_for(lambda: fake.endpoint_puts and fake.endpoint_puts[-1] == ["http://10.0.0.7:8000"], what="endpoints PUT")
    secret = cluster.kube.get("secrets", "demo-control", NAMESPACE)
    assert fake.token == base64.b64decode(secret["data"]["token"]).decode()  # the run's own token
    ready = wait_for(lambda: (c := cluster.condition("Ready")) and c["status"] == "True" and c, what="Ready")
    status = cluster.status()
    assert status["phase"] == "Running" and status["lastCheckpointStep"] == 10 and status["policyVersion"] == 11
    assert status["rolloutEndpoints"] == 1 and ready["reason"] == "Running"
    assert ready["observedGeneration"] == cluster.rlrun()["metadata"]["generation"]
    validate_rlrun(cluster.rlrun())
    # a resume report becomes the printer columns' totals: resumed groups are open + requested ones
    report = resume_report(open_groups=2, requested_groups=1, queued_traces=104, finished_episodes_kept=8)
    fake.status["resume"] = report.model_dump(mode="json")
    wait_for(lambda: cluster.status().get("resumedGroups") == 3, what="resumedGroups")
    assert cluster.status()["resumedTraces"] == 104 and cluster.status()["lastResume"]["groups"] == 3
    # the rollout pod goes unready: the orchestrator is told at once, and the run is Degraded
    cluster.set_pod_status(rollout, ready=False, ip="10.0.0.7")
    wait_for(lambda: fake.endpoint_puts[-1] == [], what="empty endpoints PUT")
    wait_for(lambda: (c := cluster.condition("Degraded")) and c["status"] == "True", what="Degraded")
    cluster.wait_for_events("Created", "Running")


def test_suspend_pauses_then_removes_pods_and_unsuspend_resumes_as_next_attempt(cluster):
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    fake = cluster.orchestrators.run(NAMESPACE, "demo")
    cluster.run_orchestrator()
    wait_for(lambda: cluster.status().get("phase") == "Running", what="Running")
    cluster.kube.patch("rlruns", "demo", {"spec": {"suspend": True}}, NAMESPACE)
    wait_for(lambda: cluster.status().get("phase") == "Suspended", what="Suspended")
    assert fake.pauses == 1
    assert cluster.pods() == []
    message = "snapshot at step 10: 104 queued traces, 3 open groups, 1 requested groups, 8 finished episodes kept"
    assert message in cluster.condition("Ready")["message"]
    status = cluster.status()
    assert (status["suspensions"], status["preemptions"], status.get("failures", 0)) == (1, 0, 0)
    cluster.kube.patch("rlruns", "demo", {"spec": {"suspend": False}}, NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="attempt 1 pods")
    assert {p["metadata"]["labels"]["rlrun.dev/attempt"] for p in cluster.pods()} == {"1"}
    orch = cluster.pod("orchestrator")
    command = orch["spec"]["containers"][0]["command"]
    assert command[command.index("--attempt") + 1] == "1" and "--resume" in command
    wait_for(lambda: cluster.status().get("attempt") == 1, what="attempt 1")
    time.sleep(0.3)  # pods created is not resumed: the Resumed condition waits for the orchestrator's report
    assert cluster.condition("Resumed") is None and cluster.status()["recovery"]["stage"] == "Resuming"
    fake.status.update(
        phase="running",
        attempt=1,
        resume=resume_report(open_groups=3, requested_groups=1, queued_traces=104, finished_episodes_kept=8).model_dump(
            mode="json"
        ),
    )
    resumed = wait_for(lambda: (c := cluster.condition("Resumed")) and c["status"] == "True" and c, what="Resumed")
    assert (
        resumed["message"]
        == "attempt 1 resumed at step 10 with 104 queued traces and 4 open groups (8 finished episodes kept)"
    )
    assert "recovery" not in cluster.status() and cluster.status()["resumedGroups"] == 4
    cluster.wait_for_events("Paused", "Suspended", "Recreated", "Resumed")


def test_created_suspended_starts_no_pods_until_unsuspended(cluster):
    cluster.kube.create("rlruns", manifest(suspend=True), NAMESPACE)
    wait_for(lambda: cluster.status().get("phase") == "Suspended", what="Suspended")
    assert cluster.pods() == [] and len(cluster.kube.list("configmaps", NAMESPACE)) == 1
    cluster.kube.patch("rlruns", "demo", {"spec": {"suspend": False}}, NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="attempt 0 pods")
    assert {p["metadata"]["labels"]["rlrun.dev/attempt"] for p in cluster.pods()} == {"0"}


def test_a_run_whose_create_handler_has_not_finished_is_left_alone_by_the_reconciler(cluster):
    """The status timer can reach a run before its create handler has written the first status. The reconciler
    once started a suspension of a run created suspended then (counted as one, Suspended before its ConfigMap
    existed); it leaves such a run to the create handler."""
    cluster.operator.stop()
    cluster.kube.create("rlruns", manifest(suspend=True), NAMESPACE)
    asyncio.run(handlers.STATE.reconciler.reconcile(NAMESPACE, "demo", list, dict))  # what a timer tick does
    assert cluster.status() == {}
    cluster.restart_operator()
    wait_for(lambda: cluster.status().get("phase") == "Suspended", what="Suspended")
    assert "suspensions" not in cluster.status() and len(cluster.kube.list("configmaps", NAMESPACE)) == 1


def test_success_frees_the_rollout_pods(cluster):
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    cluster.orchestrators.run(NAMESPACE, "demo").status.update(phase="done", step=100)
    cluster.exit_pod(cluster.pod("orchestrator"))
    wait_for(lambda: cluster.status().get("phase") == "Succeeded", what="Succeeded")
    assert cluster.condition("Succeeded")["status"] == "True"
    wait_for(lambda: not any(p["metadata"]["name"].startswith("demo-rollout") for p in cluster.pods()), what="freed")
    assert {p["metadata"]["name"] for p in cluster.pods()} == {"demo-orchestrator-a0", "demo-trainer-a0"}


def test_a_failed_orchestrator_is_restarted_until_the_failure_budget_is_spent(cluster):
    cluster.kube.create("rlruns", manifest(failure_policy={"backoff_limit": 1}), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    terminated = {"state": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}, "name": "orchestrator"}
    cluster.set_pod_status(cluster.pod("orchestrator"), phase="Failed", ready=False, containerStatuses=[terminated])
    wait_for(lambda: cluster.status().get("attempt") == 1 and len(cluster.pods()) == 3, what="attempt 1")
    status = cluster.status()
    assert (status["failures"], status.get("preemptions", 0)) == (1, 0)
    assert cluster.orchestrators.run(NAMESPACE, "demo").pauses == 0  # never a pause to a Failed orchestrator
    cluster.set_pod_status(cluster.pod("orchestrator"), phase="Failed", ready=False, containerStatuses=[terminated])
    failed = wait_for(lambda: (c := cluster.condition("Failed")) and c["status"] == "True" and c, what="Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and "OOMKilled" in failed["message"]
    assert cluster.status()["phase"] == "Failed" and cluster.status()["failures"] == 2
    cluster.wait_for_events("PodFailed", "Recreated", "Failed")


def test_invalid_spec_gets_a_failed_condition_naming_the_field(cluster):
    # passes the CRD's OpenAPI schema (CEL rules are not run by the emulator), fails rlrun.manifest
    cluster.kube.create("rlruns", manifest(group_size=16, batch_size=8), NAMESPACE)
    failed = wait_for(lambda: (c := cluster.condition("Failed")) and c, what="Failed condition")
    assert failed["status"] == "True" and failed["reason"] == "InvalidSpec"
    assert "spec.batch_size: must be ≥ group_size (16)" in failed["message"]
    assert cluster.status()["phase"] == "Failed" and cluster.pods() == []
    events = cluster.wait_for_events("InvalidSpec")
    assert next(e for e in events if e.get("reason") == "InvalidSpec")["type"] == "Warning"
    # fixing the manifest (kubectl apply again) creates the run after all
    cluster.kube.patch("rlruns", "demo", {"spec": {"batch_size": 32}}, NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods once the spec is fixed")
    wait_for(lambda: cluster.condition("Failed")["status"] == "False", what="Failed cleared")
    assert cluster.status()["attempt"] == 0 and cluster.status()["phase"] in ("Pending", "Running")
    cluster.wait_for_events("SpecFixed", "Created")


def test_a_run_that_existed_before_a_restart_is_handled_once(cluster):
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3 and cluster.status().get("phase"), what="pods and status")
    # kopf posts Events from a queue after the handler returns: an operator stopped before it posted this one
    # loses it (its queue goes with the process), which is not what this test is about
    cluster.wait_for_events("Created")
    cluster.restart_operator()
    cluster.kube.create("rlruns", manifest("second"), NAMESPACE)  # the restarted operator is live
    wait_for(lambda: len(cluster.pods("second")) == 3, what="second run's pods")
    creates = [r for r in cluster.kube.requests if r.rbac == ("", "pods", "create")]
    assert len(creates) == 6  # 3 per run: the first run's were not created again

    def created_events():
        return [e for e in cluster.kube.list("events", NAMESPACE) if e.get("reason") == "Created"]

    wait_for(lambda: len(created_events()) == 2, 30, "two Created events")  # posted asynchronously by kopf
    time.sleep(0.5)  # a few timer ticks later: still handled once
    assert len(created_events()) == 2
    assert len([r for r in cluster.kube.requests if r.rbac == ("", "pods", "create")]) == 6


def test_spec_change_updates_the_configmap_for_the_next_attempt(cluster):
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    cluster.kube.patch("rlruns", "demo", {"spec": {"max_steps": 300, "rollout": {"replicas": 2}}}, NAMESPACE)

    def max_steps():
        cm = cluster.kube.get("configmaps", "demo-config", NAMESPACE)
        return yaml.safe_load(cm["data"]["rlrun.yaml"])["spec"]["max_steps"] == 300

    wait_for(max_steps, what="ConfigMap update")
    time.sleep(0.5)  # a few reconciles: the second rollout server is the next attempt's, not a missing pod
    assert len(cluster.pods()) == 3  # running pods are left alone
    status = cluster.status()
    assert status.get("preemptions") == 0 and "recovery" not in status and status["rolloutReplicas"] == 1


def test_deleting_the_run_removes_its_finalizer_and_owned_objects(cluster):
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    wait_for(lambda: cluster.rlrun()["metadata"].get("finalizers"), what="kopf's finalizer")
    cluster.kube.delete("rlruns", "demo", NAMESPACE)
    wait_for(lambda: cluster.rlrun() is None, what="the RLRun gone")
    wait_for(lambda: cluster.pods() == [], what="pods garbage-collected")
    # the claim is retained (no owner reference) so the run directory survives
    assert [c["metadata"]["name"] for c in cluster.kube.list("persistentvolumeclaims", NAMESPACE)] == ["demo-run"]


def test_an_invalid_change_to_a_running_run_is_ignored_with_a_warning(cluster):
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    cluster.run_orchestrator()
    wait_for(lambda: cluster.status().get("phase") == "Running", what="Running")
    cluster.kube.patch("rlruns", "demo", {"spec": {"batch_size": 4}}, NAMESPACE)  # < group_size 8
    events = cluster.wait_for_events("InvalidSpec")
    warning = next(e for e in events if e.get("reason") == "InvalidSpec")
    assert warning["type"] == "Warning" and warning["message"].startswith("change ignored")
    time.sleep(0.5)
    assert cluster.status()["phase"] == "Running" and len(cluster.pods()) == 3
    assert cluster.condition("Failed")["status"] == "False"
    cm = cluster.kube.get("configmaps", "demo-config", NAMESPACE)
    assert yaml.safe_load(cm["data"]["rlrun.yaml"])["spec"]["batch_size"] == 64  # the previous spec stands


def test_a_failed_orchestrator_frees_the_other_pods_and_suspend_resume_retries(cluster):
    cluster.kube.create("rlruns", manifest(failure_policy={"backoff_limit": 0}), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    cluster.set_pod_status(cluster.pod("orchestrator"), phase="Failed", ready=False)
    wait_for(lambda: cluster.status().get("phase") == "Failed", what="Failed")
    wait_for(lambda: [p["metadata"]["name"] for p in cluster.pods()] == ["demo-orchestrator-a0"], what="freed")
    cluster.kube.patch("rlruns", "demo", {"spec": {"suspend": True}}, NAMESPACE)
    wait_for(lambda: cluster.status().get("phase") == "Suspended", what="Suspended")
    cluster.kube.patch("rlruns", "demo", {"spec": {"suspend": False}}, NAMESPACE)
    wait_for(lambda: cluster.status().get("attempt") == 1 and len(cluster.pods()) == 3, what="attempt 1")
    assert cluster.condition("Failed")["status"] == "False"


def test_an_answer_from_another_attempts_orchestrator_is_not_taken(cluster):
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    fake = cluster.orchestrators.run(NAMESPACE, "demo")
    fake.status.update(attempt=5, step=99, resume=resume_report(open_groups=7, queued_traces=1).model_dump(mode="json"))
    ready = wait_for(lambda: (c := cluster.condition("Ready")) and "attempt 5" in c["message"] and c, what="refused")
    assert ready["status"] == "False" and cluster.status().get("step") == 0 and cluster.status()["resumedGroups"] == 0


def test_recreating_a_run_over_its_retained_claim_says_so(cluster):
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    cluster.kube.delete("rlruns", "demo", NAMESPACE)
    wait_for(lambda: cluster.rlrun() is None and cluster.pods() == [], what="deleted")
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    events = cluster.wait_for_events("ExistingClaim")
    claim = next(e for e in events if e.get("reason") == "ExistingClaim")
    assert claim["type"] == "Warning" and "demo-run already existed" in claim["message"]


def test_a_run_created_while_the_operator_was_down_is_handled_once(cluster):
    cluster.operator.stop()
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    cluster.restart_operator()
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    cluster.wait_for_events("Created")
    time.sleep(0.5)
    assert len([r for r in cluster.kube.requests if r.rbac == ("", "pods", "create")]) == 3
    assert len([e for e in cluster.kube.list("events", NAMESPACE) if e.get("reason") == "Created"]) == 1


def pod_deletions(cluster) -> dict[str, str | None]:
    """``{pod: gracePeriodSeconds}`` of the pod deletions the operator sent (the emulator removes pods at once)."""
    return {r.name: r.param("gracePeriodSeconds") for r in cluster.kube.requests if r.rbac == ("", "pods", "delete")}


@pytest.mark.parametrize(
    ("orchestrator_phase", "deleted"),
    [("Succeeded", {"demo-rollout-0-a0"}), ("Failed", {"demo-trainer-a0", "demo-rollout-0-a0"})],
)
def test_pods_are_deleted_with_the_spec_models_default_grace_period(cluster, orchestrator_phase, deleted):
    # no spec.preemption: the model's default grace, 120 s; no failure budget: a failure ends the run
    cluster.kube.create("rlruns", manifest(failure_policy={"backoff_limit": 0}), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    cluster.orchestrators.run(NAMESPACE, "demo").status.update(phase="done", step=100)
    cluster.exit_pod(cluster.pod("orchestrator"), code=0 if orchestrator_phase == "Succeeded" else 1)
    wait_for(lambda: set(pod_deletions(cluster)) == deleted, what=f"pods deleted: {deleted}")
    assert pod_deletions(cluster) == dict.fromkeys(deleted, "120")


def test_after_an_ignored_invalid_change_the_previous_spec_stands_for_the_operator_too(cluster):
    grace = {"snapshot_timeout_seconds": 30, "termination_grace_period_seconds": 90}
    cluster.kube.create("rlruns", manifest(preemption=grace), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    cluster.set_pod_status(cluster.pod("rollout"), ip="10.0.0.7")
    cluster.run_orchestrator()
    wait_for(lambda: (c := cluster.condition("Ready")) and c["status"] == "True", what="Ready")
    # invalid (batch_size < group_size), with a new grace period and more rollout servers in the same change
    change = {"batch_size": 4, "rollout": {"replicas": 3}, "preemption": {"termination_grace_period_seconds": 200}}
    cluster.kube.patch("rlruns", "demo", {"spec": change}, NAMESPACE)
    cluster.wait_for_events("InvalidSpec")
    time.sleep(0.5)  # a few status ticks: one rollout server is still all the run needs
    assert cluster.condition("Degraded")["status"] == "False" and cluster.condition("Ready")["status"] == "True"
    cluster.exit_pod(cluster.pod("orchestrator"))
    wait_for(lambda: pod_deletions(cluster), what="the rollout pod deleted")
    assert pod_deletions(cluster) == {"demo-rollout-0-a0": "90"}


def test_a_pod_is_deleted_with_the_grace_period_it_was_created_with_not_the_spec_in_force(cluster):
    grace = {"snapshot_timeout_seconds": 30, "termination_grace_period_seconds": 90}
    cluster.kube.create("rlruns", manifest(preemption=grace), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    cluster.run_orchestrator()
    wait_for(lambda: cluster.status().get("phase") == "Running", what="Running")
    # a valid change: the next attempt's pods get 200 s; the running ones were created with 90
    cluster.kube.patch("rlruns", "demo", {"spec": {"preemption": {"termination_grace_period_seconds": 200}}}, NAMESPACE)
    cluster.wait_for_events("SpecUpdated")
    cluster.orchestrators.run(NAMESPACE, "demo").status.update(phase="done", step=100)
    cluster.exit_pod(cluster.pod("orchestrator"))
    wait_for(lambda: pod_deletions(cluster), what="the rollout pod deleted")
    assert pod_deletions(cluster) == {"demo-rollout-0-a0": "90"}


def test_an_invalid_spec_a_restarted_operator_never_saw_valid_waits_for_a_fix(cluster):
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    cluster.run_orchestrator()
    wait_for(lambda: cluster.status().get("phase") == "Running", what="Running")
    cluster.kube.patch("rlruns", "demo", {"spec": {"batch_size": 4}}, NAMESPACE)
    cluster.wait_for_events("InvalidSpec")
    cluster.restart_operator()  # forgets the run's last valid spec
    cluster.exit_pod(cluster.pod("orchestrator"))

    def asks_for_a_fix():
        return [e for e in cluster.kube.list("events", NAMESPACE) if "fix the spec" in e.get("message", "")]

    (event,) = wait_for(asks_for_a_fix, what="an Event asking to fix the spec")  # once: retried after 60 s
    assert event["type"] == "Warning" and event["reason"] == "InvalidSpec"
    assert "spec.batch_size: must be ≥ group_size (8)" in event["message"]
    assert cluster.status()["phase"] == "Running" and pod_deletions(cluster) == {}  # left as it was


def test_an_answer_outside_the_contract_counts_as_no_answer(cluster):
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    cluster.run_orchestrator()
    wait_for(lambda: cluster.status().get("phase") == "Running", what="Running")
    fake = cluster.orchestrators.run(NAMESPACE, "demo")
    fake.status.update(step=7, policy_version="seven")

    def refused():
        ready = cluster.condition("Ready")
        return ready if ready["reason"] == "OrchestratorUnreachable" else None

    ready = wait_for(refused, what="the answer refused")
    assert "/status: the answer is not a StatusReport: policy_version:" in ready["message"]
    assert cluster.status()["phase"] == "Running" and cluster.status()["step"] == 0  # nothing taken from it


def test_an_outdated_crd_is_reported_on_each_run_once(cluster):
    from rlrun_operator import crd_drift

    crd = cluster.kube.get("customresourcedefinitions", "rlruns.rlrun.dev")
    assert crd["metadata"]["annotations"]["rlrun.dev/schema-hash"] == crd_drift.expected_hash()  # crds/ is current
    # what `helm upgrade` leaves: the previous chart's CRD (another schema, another hash)
    patch = {"metadata": {"annotations": {"rlrun.dev/schema-hash": "0123456789abcdef"}}}
    cluster.kube.patch("customresourcedefinitions", "rlruns.rlrun.dev", patch)
    cluster.restart_operator()
    cluster.kube.create("rlruns", manifest(), NAMESPACE)
    [event] = [e for e in cluster.wait_for_events("CRDOutdated") if e["reason"] == "CRDOutdated"]
    assert event["type"] == "Warning" and "schema hash 0123456789abcdef, expected" in event["message"]
    assert "kubectl apply --server-side -f crds/" in event["message"]
    wait_for(lambda: len(cluster.pods()) == 3, what="pods")
    cluster.set_pod_status(cluster.pod("rollout"), ip="10.0.0.9")
    cluster.run_orchestrator()
    wait_for(lambda: cluster.status().get("phase") == "Running", what="Running")  # reported, not refused
    assert [e["reason"] for e in cluster.kube.list("events", NAMESPACE)].count("CRDOutdated") == 1
