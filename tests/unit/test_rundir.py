"""The run directory's rule for "this directory already holds a run" (:func:`rlrun.rundir.holds_a_run`): one
threshold, past step 0, for ``rlrun local``, the orchestrator and the trainer; a broadcast published once per
attempt (:func:`rlrun.rundir.publish_broadcast`)."""

from __future__ import annotations

from rlrun.launcher.preflight import run_dir_problem
from rlrun.rundir import RunDir, holds_a_run, publish_broadcast, publish_dir, write_file_atomic, write_meta


def test_a_run_dir_holds_a_run_once_a_checkpoint_or_batch_is_past_step_0(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    assert holds_a_run(run_dir) == []  # no directory at all
    (run_dir.checkpoints / "step_0").mkdir(parents=True)  # a fresh start's own start-up checkpoint
    assert holds_a_run(run_dir) == [] and run_dir_problem(run_dir) is None
    run_dir.rollout_batch(1).mkdir(parents=True)
    assert holds_a_run(run_dir) == [run_dir.rollouts]
    assert holds_a_run(run_dir, count_batches=False) == []  # the trainer: its own orchestrator's batch 1
    run_dir.checkpoint(2).mkdir(parents=True)
    assert holds_a_run(run_dir) == [run_dir.checkpoints, run_dir.rollouts]
    assert holds_a_run(run_dir, count_batches=False) == [run_dir.checkpoints]
    assert "already holds a run" in run_dir_problem(run_dir)


def test_a_broadcast_is_never_replaced_by_the_attempt_that_published_it(tmp_path):
    """Issue 47: a trainer retraining a step after a trainer-only loss re-published its broadcast (the old
    directory out, the new one renamed in) while a server held an adapter loaded from it. A broadcast is now
    kept by the attempt that wrote it (the version the servers hold); an earlier attempt's is replaced."""
    run_dir = RunDir(tmp_path)

    def fill(text: str, attempt: int):
        def write(tmp):
            (tmp / "weights").write_text(text)
            write_meta(tmp, 3, attempt)

        return write

    path, written = publish_broadcast(run_dir.broadcast(3), fill("first", 1), 1)
    assert written and (path / "weights").read_text() == "first"
    again = publish_broadcast(run_dir.broadcast(3), fill("retrained", 1), 1)
    assert again == (path, False) and (path / "weights").read_text() == "first"
    later = publish_broadcast(run_dir.broadcast(3), fill("next", 2), 2)
    assert later == (path, True) and (path / "weights").read_text() == "next"


def test_published_directories_and_files_are_readable_as_the_umask_says(tmp_path):
    """CI, issue 46: the builtin model was renamed into the cache as ``tempfile.mkdtemp`` made it (0700), so the
    CPU image's non-root user could not read the cache a volume mounted, and safetensors writes its files 0600
    (so did every broadcast). Published directories, the files in them and atomically written files take the modes
    ``mkdir`` and ``open`` give (0777 and 0666 less the umask)."""
    import os

    import torch
    from safetensors.torch import save_file

    def fill(directory):
        save_file({"w": torch.zeros(2)}, str(directory / "model.safetensors"))
        (directory / "model.bin").write_bytes(b"v")

    previous = os.umask(0o022)
    try:
        published = publish_dir(tmp_path / "broadcasts" / "step_1", lambda d: (d / "model.bin").write_bytes(b"w"))
        publish_dir(published, fill)  # replaces the earlier one
        write_file_atomic(tmp_path / "spec.json", b"{}")
        os.umask(0o027)
        write_file_atomic(tmp_path / "tracking.json", b"{}")
    finally:
        os.umask(previous)
    assert (published.stat().st_mode & 0o777, (published / "model.bin").read_bytes()) == (0o755, b"v")
    assert (published / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "spec.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "tracking.json").stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in published.parent.iterdir()) == ["step_1"]  # no temporary left beside it
