"""A role's volumes and env (``rlrun.api.pod_inputs``): a user's volume or variable never replaces one of rlrun's.

The table of invalid manifests in ``test_crd.py`` checks that the CRD refuses the same ones naming the same field;
``test_builders.py`` that the reserved names and paths cover everything the builders give a pod.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from rlrun.api.pod_inputs import EnvVarSpec, VolumeSpec
from rlrun.api.role_specs import RoleSpec

CLAIM = {"persistent_volume_claim": {"claim_name": "datasets"}}


@pytest.mark.parametrize(
    ("path", "clash"),
    [
        ("/tmp", "/tmp is /tmp"),
        ("/var/lib/rlrun/run/data", "is inside /var/lib/rlrun"),
        ("/var", "/var would hide /var/lib/rlrun"),
        ("/dev", "/dev would hide /dev/shm"),
        ("/etc/rlrun/extra", "is inside /etc/rlrun"),
    ],
)
def test_a_mount_path_at_inside_or_above_rlruns_own_mounts_is_refused_saying_which(path, clash):
    with pytest.raises(ValidationError, match=clash):
        VolumeSpec(name="ds", mount_path=path, **CLAIM)


@pytest.mark.parametrize("path", ["/data", "/var/lib/datasets", "/etc/my-env", "/devices", "/tmpdata", "/a/.cache"])
def test_a_mount_path_beside_rlruns_own_mounts_is_taken(path):
    volume = VolumeSpec(name="ds", mount_path=path, **CLAIM)
    assert volume.mount_path == path and volume.read_only


@pytest.mark.parametrize("path", ["data", "/data/", "/data/../var/lib/rlrun", "/./data", "//data", "/"])
def test_a_mount_path_must_be_absolute_and_normalized(path):
    with pytest.raises(ValidationError, match="must be an absolute path such as /data"):
        VolumeSpec(name="ds", mount_path=path, **CLAIM)


@pytest.mark.parametrize(
    "name",
    ["HOME", "HF_HOME", "PYTHONUNBUFFERED", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "RLRUN_CONTROL_TOKEN", "RLRUN_ANYTHING"],
)
def test_rlruns_own_variables_cannot_be_overridden(name):
    with pytest.raises(ValidationError, match=f"{name} is set by rlrun itself"):
        EnvVarSpec(name=name, value="x")
    assert EnvVarSpec(name=f"MY_{name}", value="x").value == "x"


def test_names_and_mount_paths_are_unique_in_a_role_but_not_across_roles():
    with pytest.raises(ValidationError, match="two volumes have the name ds"):
        RoleSpec(volumes=[{"name": "ds", "mount_path": "/a", **CLAIM}, {"name": "ds", "mount_path": "/b", **CLAIM}])
    with pytest.raises(ValidationError, match="two volumes have the mount path /a"):
        RoleSpec(volumes=[{"name": "a", "mount_path": "/a", **CLAIM}, {"name": "b", "mount_path": "/a", **CLAIM}])
    with pytest.raises(ValidationError, match="TOKEN is set twice"):
        RoleSpec(env=[{"name": "TOKEN", "value": "1"}, {"name": "TOKEN", "value": "2"}])
    one = {"volumes": [{"name": "ds", "mount_path": "/a", **CLAIM}], "env": [{"name": "TOKEN", "value": "1"}]}
    assert RoleSpec(**one) == RoleSpec(**one)  # the same in two roles is fine
