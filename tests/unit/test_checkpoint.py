import json
import logging

import pytest
import torch
from rlrun.checkpoint import (
    CheckpointError,
    decode_progress,
    encode_progress,
    latest_complete_checkpoint,
    prune_checkpoints,
    save_orchestrator_progress,
)
from rlrun.errors import CheckpointMismatch
from rlrun.identity import check_compatible, run_identity
from rlrun.rundir import RunDir
from safetensors.torch import save_file

from tests.support.manifests import parse


def spec(**kw):
    return parse("t", **kw).spec


def write_trainer_part(rd: RunDir, step: int) -> None:
    root = rd.trainer_checkpoint(step)
    root.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(root / "model.safetensors"))
    (root / "progress.json").write_text(json.dumps({"step": step}))


def complete_step(rd: RunDir, step: int) -> None:
    write_trainer_part(rd, step)
    save_orchestrator_progress(rd, step, {"step": step, "shipped": step, "source": {"cursor": step * 10}})


def test_progress_round_trip_is_plain_data():
    state = {"step": 3, "source": {"cursor": 12}, "queue": [1.5, "x", None]}
    data = encode_progress(state, {"ids": torch.arange(5)})
    decoded = decode_progress(data, "p")
    assert decoded.pop("tensors")["ids"].tolist() == [0, 1, 2, 3, 4]
    assert decoded == state
    # loadable with weights_only=True: no code from the file runs
    import io

    obj = torch.load(io.BytesIO(data), weights_only=True)
    assert obj["schema_version"] == 1


def test_checksum_mismatch_is_detected():
    import io

    obj = torch.load(io.BytesIO(encode_progress({"step": 1})), weights_only=True)
    obj["payload"] = obj["payload"].replace("1", "2")
    buf = io.BytesIO()
    torch.save(obj, buf)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        decode_progress(buf.getvalue(), "p")


def test_truncated_progress_is_detected():
    with pytest.raises(CheckpointError, match="unreadable"):
        decode_progress(encode_progress({"step": 1})[:50], "p")


def test_latest_complete_skips_incomplete_and_corrupt_steps(tmp_path, caplog):
    rd = RunDir(tmp_path)
    complete_step(rd, 10)
    complete_step(rd, 20)
    write_trainer_part(rd, 30)  # trainer part only: not complete
    (rd.orchestrator_checkpoint(20) / "progress.pt").write_bytes(b"garbage")  # corrupt
    with caplog.at_level(logging.WARNING):
        ckpt = latest_complete_checkpoint(rd)
    assert ckpt.step == 10 and ckpt.orchestrator["source"] == {"cursor": 100}
    assert ckpt.orchestrator["tensors"] == {}
    assert "step 30 is not usable" in caplog.text and "missing" in caplog.text
    assert "step 20 is not usable" in caplog.text and "unreadable" in caplog.text


def test_no_checkpoint_returns_none(tmp_path):
    assert latest_complete_checkpoint(RunDir(tmp_path)) is None


def test_prune_keeps_last_complete_and_newer_incomplete(tmp_path):
    rd = RunDir(tmp_path)
    for s in (10, 20, 30):
        complete_step(rd, s)
    write_trainer_part(rd, 25)  # incomplete and older than the newest complete: can never complete
    write_trainer_part(rd, 40)  # incomplete but newest: the orchestrator may still complete it
    assert prune_checkpoints(rd, keep_last=2) == [10, 25]
    assert sorted(p.name for p in rd.checkpoints.iterdir()) == ["step_20", "step_30", "step_40"]


def test_prune_keeps_the_newest_checkpoint_that_verifies_not_a_torn_newer_one(tmp_path, caplog):
    # keep_last 1, a complete step 4, and a step 6 whose progress.pt is torn (a pause before the trainer started
    # used to prune step 4 away, and the next resume started over from step 0)
    rd = RunDir(tmp_path)
    complete_step(rd, 2)
    complete_step(rd, 4)
    complete_step(rd, 6)
    path = rd.orchestrator_checkpoint(6) / "progress.pt"
    path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert prune_checkpoints(rd, keep_last=1) == [2]
    assert sorted(p.name for p in rd.checkpoints.iterdir()) == ["step_4", "step_6"]
    assert "checkpoint step 6 is not usable" in caplog.text
    assert latest_complete_checkpoint(rd).step == 4  # what the next resume starts from


def test_each_orchestrator_part_is_verified_once(tmp_path, monkeypatch):
    import rlrun.checkpoint as checkpoint

    rd = RunDir(tmp_path)
    complete_step(rd, 1)
    complete_step(rd, 2)
    reads = []
    monkeypatch.setattr(checkpoint, "_verifies", lambda run_dir, step: reads.append(step) or True)
    assert checkpoint.usable_steps(rd) == [1, 2] and checkpoint.usable_steps(rd) == [1, 2]
    assert reads == [1, 2]
    save_orchestrator_progress(rd, 2, {"step": 2, "shipped": 3, "source": {"cursor": 7}})  # a pause rewrites it
    checkpoint.mark_verified(rd.orchestrator_checkpoint(2) / "progress.pt")
    assert checkpoint.usable_steps(rd) == [1, 2] and reads == [1, 2]


def test_config_mismatch_refuses_and_names_the_field():
    saved = run_identity(spec(group_size=8))
    check_compatible(saved, spec(group_size=8, max_steps=5), "ckpt")  # other fields may change
    with pytest.raises(CheckpointMismatch, match=r"spec.group_size: checkpoint has 8, manifest has 4"):
        check_compatible(saved, spec(group_size=4), "ckpt")
    with pytest.raises(CheckpointMismatch, match=r"spec.model: checkpoint has 'builtin:tiny-reverse'"):
        check_compatible(saved, spec(model={"name": "Qwen/Qwen3-0.6B"}), "ckpt")
    check_compatible(None, spec(group_size=4), "old checkpoint without identity")


async def test_a_paused_manager_pairs_its_pause_snapshot_with_each_newer_trainer_part_up_to_shipped(tmp_path):
    # The trainer's save on notice comes after the pause: the paused orchestrator completes it with the
    # pause snapshot itself (not a new capture), and only a part the snapshot's `shipped` covers.
    from rlrun.checkpoint import load_orchestrator_progress
    from rlrun.ledger import Ledger
    from rlrun.orchestrator.checkpointing import CheckpointManager
    from rlrun.orchestrator.snapshot import SinkSnapshot
    from rlrun.rundir import write_meta

    rd = RunDir(tmp_path).ensure()
    shipped = {"now": 5}
    captured: list[int] = []

    def capture(step):
        captured.append(step)
        snap = SinkSnapshot([], [], [])
        return {"step": step, "shipped": shipped["now"], "source": {"cursor": 7}}, snap, snap.counts([])

    def part(step):
        write_trainer_part(rd, step)
        write_meta(rd.trainer_checkpoint(step), step, 1)

    ledger = Ledger(rd.root / "ledger", 1, "orchestrator")
    manager = CheckpointManager(rd, 1, keep_last=5, ledger=ledger, capture=capture)
    part(0)
    assert (await manager.save_pause()).step == 0
    shipped["now"] = 99  # what a capture after the pause would say
    part(4)
    part(6)  # past the snapshot's shipped (5): batch 6 is not in the cut, cannot be paired
    await manager.complete_new_trainer_parts()
    await manager.complete_new_trainer_parts()  # again: nothing new to write
    assert captured == [0]
    at_pause, paired = load_orchestrator_progress(rd, 0), load_orchestrator_progress(rd, 4)
    assert (paired["step"], paired["shipped"], paired["source"]) == (4, 5, {"cursor": 7})
    assert paired["ledger_line"] == at_pause["ledger_line"]
    assert not (rd.orchestrator_checkpoint(6) / "progress.pt").exists()
    assert latest_complete_checkpoint(rd).step == 4
    ledger.close()
    events = [
        json.loads(line) for line in (rd.root / "ledger" / "attempt-1.orchestrator.jsonl").read_text().splitlines()
    ]
    assert [(e["step"], e["reason"]) for e in events if e["e"] == "checkpoint"] == [(0, "pause"), (4, "pause")]


def _directory_for_progress(root):
    (root / "progress.json").unlink()
    (root / "progress.json").mkdir()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda root: (root / "model.safetensors").unlink(), "missing"),
        (_directory_for_progress, "unreadable (Is a directory)"),
    ],
)
def test_a_damaged_trainer_part_is_named_once_with_its_reason(tmp_path, damage, reason, caplog):
    """Issue 36: "…/model.safetensors: unreadable (No such file or directory: …/model.safetensors)" said the path
    twice."""
    rd = RunDir(tmp_path)
    complete_step(rd, 10)
    damage(rd.trainer_checkpoint(10))
    with caplog.at_level(logging.WARNING):
        assert latest_complete_checkpoint(rd) is None
    (record,) = caplog.records
    assert record.getMessage().endswith(f": {reason}") and record.getMessage().count(str(tmp_path)) == 1


def test_a_lora_part_verifies_by_its_adapter_files(tmp_path, caplog):
    """A LoRA run's trainer part holds the adapter alone (no ``model.safetensors``): complete with its weights and
    config, skipped with the file named when its config is missing."""
    rd = RunDir(tmp_path)
    complete_step(rd, 4)
    root = rd.trainer_checkpoint(4)
    (root / "model.safetensors").rename(root / "adapter_model.safetensors")
    (root / "adapter_config.json").write_text(json.dumps({"r": 4, "peft_type": "LORA"}))
    assert latest_complete_checkpoint(rd).step == 4
    (root / "adapter_config.json").unlink()
    with caplog.at_level(logging.WARNING):
        assert latest_complete_checkpoint(rd) is None
    assert caplog.records[0].getMessage().endswith("adapter_config.json: missing")
