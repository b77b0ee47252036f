"""The Dockerfiles in images/, read without building them (no Docker engine in CI).

What holds for each: the base image is pinned to a versioned tag (or a digest), the final user is
not root, the entrypoint is exec (JSON) form starting with `rlrun`, and every path it copies
exists in the repository and is not excluded from the build context by `.dockerignore`.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
IMAGES = {
    "operator": ("python:3.11", ["rlrun", "operator"]),
    "trainer": ("pytorch/pytorch:", ["rlrun"]),
    "rollout": ("vllm/vllm-openai:", ["rlrun"]),
}
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


@pytest.mark.parametrize("role", IMAGES)
def test_base_image_is_pinned_to_a_version(role):
    (base,) = [i for i in dockerfile(role) if i.keyword == "FROM"]
    words = [w for w in base.args.split() if not w.startswith("--")]
    image = words[0]
    assert "$" not in image, f"{role}: base image {image} is not literal"
    assert image.startswith(IMAGES[role][0]), f"{role}: unexpected base image {image}"
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
    assert user("trainer") == user("rollout") == RUN_AS_USER


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


def test_operator_image_installs_an_extra_that_exists():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    runs = " ".join(i.args for i in dockerfile("operator") if i.keyword == "RUN")
    for extra in re.findall(r"\.\[([\w,-]+)\]", runs):
        assert set(extra.split(",")) <= set(extras), f"operator image installs unknown extra(s) {extra}"
    assert "[operator]" in runs


def test_dockerignore_keeps_local_state_out_of_the_context():
    patterns = dockerignore_patterns()
    for path in (".venv", ".cache", "runs", ".git", "tests", "benchmarks", "docs", "rlrun.egg-info"):
        assert ignored(path, patterns), f"{path} would be sent to the Docker daemon"
    assert ignored("trainer/rlrun/__pycache__/cli.cpython-311.pyc", patterns)
    assert not ignored("trainer/rlrun/cli.py", patterns)
