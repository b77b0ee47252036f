"""What a user hands a role's pods: volumes (a dataset's claim, a ConfigMap, a Secret), environment variables, and
resources (:class:`ResourcesSpec`).

Restricted, snake_case subsets of Kubernetes' ``Volume`` + ``VolumeMount`` and ``EnvVar`` (``spec.<role>.volumes``,
``spec.<role>.env`` of :class:`rlrun.api.spec.RoleSpec`), which ``rlrun_operator.pods`` turns into the pods' own
shapes. What holds: a user's volume or variable never replaces one of rlrun's: its mount path is outside
:data:`RESERVED_MOUNT_PATHS`, its name not in :data:`RESERVED_VOLUME_NAMES` / :data:`RESERVED_ENV_NAMES` (nor
``RLRUN_*``), and names and mount paths are unique in a role. The CRD repeats these rules as CEL
(:data:`ROLE_CEL_RULES`), so ``kubectl apply`` refuses what ``rlrun.manifest`` refuses, naming the same field.
``rlrun local`` ignores both fields.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, field_validator, model_validator

from rlrun.api.strict import Strict

#: A Kubernetes resource quantity ("500m", "16Gi", "1"); the pattern is Kubernetes' own.
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN)]
#: Kubernetes' label-value / DNS-1123 label pattern (names of claims and priority classes).
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class ResourcesSpec(Strict):
    """Container resources of one role's pods, as in a Kubernetes container (quantities as strings).

    GPUs are asked for with the role's ``gpus`` instead of an ``nvidia.com/gpu`` key here.
    """

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


#: A volume's name in the pod: a DNS-1123 label.
VOLUME_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: Kubernetes' DNS-1123 subdomain pattern (names of claims, ConfigMaps and Secrets, which may hold dots).
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
#: A key of a ConfigMap's or Secret's data (Kubernetes' own pattern).
DATA_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
#: An environment variable's name (Kubernetes' C-identifier-like rule, which every Kubernetes version takes).
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# One part of a path: letters, digits, '-', '_', '.', but never '.' or '..' (RE2 has no lookahead).
_PATH_PART = r"(\.?[-_a-zA-Z0-9][-._a-zA-Z0-9]*|\.\.[-._a-zA-Z0-9]+)"
#: An absolute, normalized path (``/data``, ``/opt/my-env``): no trailing ``/``, no ``.`` or ``..`` parts.
MOUNT_PATH_PATTERN = rf"^(/{_PATH_PART})+$"
#: A normalized relative path (``train.jsonl``, ``conf/reward.yaml``): no ``.`` or ``..`` parts.
RELATIVE_PATH_PATTERN = rf"^{_PATH_PART}(/{_PATH_PART})*$"

#: Where the operator mounts its own volumes in every pod (the run's claim, the manifest's ConfigMap, scratch
#: space, shared memory, the termination log): a role's ``volumes`` may not be mounted at, inside or above them.
RESERVED_MOUNT_PATHS = ("/var/lib/rlrun", "/etc/rlrun", "/tmp", "/dev/shm", "/dev/termination-log")
#: The pod volume names the operator uses itself.
RESERVED_VOLUME_NAMES = ("data", "config", "tmp", "dshm")
#: Environment variables the operator sets (and rlrun reads) that a role's ``env`` may not override; nor may it
#: set any name starting with :data:`RESERVED_ENV_PREFIX`.
RESERVED_ENV_NAMES = ("HF_HOME", "HOME", "PYTHONUNBUFFERED", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
RESERVED_ENV_PREFIX = "RLRUN_"


def _check_pattern(value: str, pattern: str, what: str) -> str:
    # a pattern whose pydantic message ("must match ^(/(…") would say nothing to the user; the CRD keeps the pattern
    if not re.fullmatch(pattern, value):
        raise ValueError(f"must be {what}, got {value!r}")
    return value


class KeyToPathSpec(Strict):
    """One key of a ConfigMap or Secret shown as a file (Kubernetes' ``KeyToPath``).

    Attributes:
        key: the key in the ConfigMap's or Secret's data.
        path: the file's path relative to the volume's ``mount_path`` (no ``..`` parts).
    """

    key: str = Field(max_length=253, pattern=DATA_KEY_PATTERN)
    path: str = Field(max_length=253, json_schema_extra={"pattern": RELATIVE_PATH_PATTERN})

    @field_validator("path")
    @classmethod
    def _relative(cls, path: str) -> str:
        return _check_pattern(path, RELATIVE_PATH_PATTERN, "a relative path such as conf/reward.yaml (no '..')")


class ClaimSourceSpec(Strict):
    """A PersistentVolumeClaim of the run's namespace (a dataset's claim).

    Attributes:
        claim_name: the claim's name.
    """

    claim_name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)


class ConfigMapSourceSpec(Strict):
    """A ConfigMap of the run's namespace, one file per key.

    Attributes:
        name: the ConfigMap's name.
        items: only these keys, at these paths (empty: every key, as a file named after it).
    """

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    items: list[KeyToPathSpec] = Field(default_factory=list, max_length=64)


class SecretSourceSpec(Strict):
    """A Secret of the run's namespace, one file per key.

    Attributes:
        secret_name: the Secret's name.
        items: only these keys, at these paths (empty: every key, as a file named after it).
    """

    secret_name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    items: list[KeyToPathSpec] = Field(default_factory=list, max_length=64)


class VolumeSpec(Strict):
    """A volume of the user's mounted into a role's pods: a dataset's claim, a ConfigMap, a Secret.

    A subset of Kubernetes' ``Volume`` and ``VolumeMount`` in one: exactly one source.

    Attributes:
        name: the volume's name in the pod (a DNS-1123 label; not one of rlrun's own: ``data``,
            ``config``, ``tmp``, ``dshm``).
        mount_path: where the pod sees it: an absolute path outside rlrun's own mounts
            (``/var/lib/rlrun``, ``/etc/rlrun``, ``/tmp``, ``/dev/shm``).
        read_only: mount it read-only (a claim too: the kubelet then leaves its files' ownership alone).
        persistent_volume_claim: a PersistentVolumeClaim (pods on several nodes need ``ReadOnlyMany``
            or ``ReadWriteMany``).
        config_map: a ConfigMap's keys as files.
        secret: a Secret's keys as files.
    """

    name: str = Field(max_length=63, pattern=VOLUME_NAME_PATTERN)
    mount_path: str = Field(max_length=256, json_schema_extra={"pattern": MOUNT_PATH_PATTERN})
    read_only: bool = True
    persistent_volume_claim: ClaimSourceSpec | None = None
    config_map: ConfigMapSourceSpec | None = None
    secret: SecretSourceSpec | None = None

    @field_validator("name")
    @classmethod
    def _not_rlruns_volume(cls, name: str) -> str:
        if name in RESERVED_VOLUME_NAMES:
            raise ValueError(
                f"{name!r} is a volume of rlrun's own ({', '.join(RESERVED_VOLUME_NAMES)}): choose another"
            )
        return name

    @field_validator("mount_path")
    @classmethod
    def _outside_rlruns_mounts(cls, path: str) -> str:
        _check_pattern(path, MOUNT_PATH_PATTERN, "an absolute path such as /data (no trailing '/', no '..')")
        for own in RESERVED_MOUNT_PATHS:
            if path == own or path.startswith(own + "/") or own.startswith(path + "/"):
                clash = "would hide" if own.startswith(path + "/") else "is" if path == own else "is inside"
                raise ValueError(
                    f"{path} {clash} {own}, where rlrun mounts its own volume: "
                    f"choose a path outside {', '.join(RESERVED_MOUNT_PATHS)}"
                )
        return path

    @model_validator(mode="after")
    def _one_source(self) -> VolumeSpec:
        sources = [s for s in ("persistent_volume_claim", "config_map", "secret") if getattr(self, s) is not None]
        if len(sources) != 1:
            raise ValueError(
                f"set exactly one of persistent_volume_claim, config_map or secret, got {len(sources)}"
                + (f" ({', '.join(sources)})" if sources else "")
            )
        return self


class KeyRefSpec(Strict):
    """One key of a Secret or ConfigMap of the run's namespace.

    Attributes:
        name: the Secret's or ConfigMap's name.
        key: the key in its data.
    """

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    key: str = Field(max_length=253, pattern=DATA_KEY_PATTERN)


class EnvVarSourceSpec(Strict):
    """Where an environment variable's value comes from: exactly one of a Secret's key or a ConfigMap's key.

    Attributes:
        secret_key_ref: a key of a Secret (an API key, a tracker's token).
        config_map_key_ref: a key of a ConfigMap.
    """

    secret_key_ref: KeyRefSpec | None = None
    config_map_key_ref: KeyRefSpec | None = None

    @model_validator(mode="after")
    def _one_source(self) -> EnvVarSourceSpec:
        if (self.secret_key_ref is None) == (self.config_map_key_ref is None):
            raise ValueError("set exactly one of secret_key_ref or config_map_key_ref")
        return self


class EnvVarSpec(Strict):
    """An environment variable of a role's container: a value, or a key of a Secret or ConfigMap.

    A subset of Kubernetes' ``EnvVar``: exactly one of ``value`` or ``value_from``.

    Attributes:
        name: the variable's name; not one rlrun sets itself (``HOME``, ``HF_HOME``, ``PYTHONUNBUFFERED``,
            ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, ``RLRUN_*``).
        value: its value.
        value_from: where its value comes from.
    """

    name: str = Field(max_length=253, pattern=ENV_NAME_PATTERN)
    value: str | None = None
    value_from: EnvVarSourceSpec | None = None

    @field_validator("name")
    @classmethod
    def _not_rlruns_variable(cls, name: str) -> str:
        if name in RESERVED_ENV_NAMES or name.startswith(RESERVED_ENV_PREFIX):
            raise ValueError(
                f"{name} is set by rlrun itself ({', '.join(RESERVED_ENV_NAMES)}, {RESERVED_ENV_PREFIX}*): "
                "choose another name"
            )
        return name

    @model_validator(mode="after")
    def _one_value(self) -> EnvVarSpec:
        if (self.value is None) == (self.value_from is None):
            raise ValueError(f"set exactly one of value or value_from for {self.name}")
        return self


def _unique_volumes(volumes: list[VolumeSpec]) -> list[VolumeSpec]:
    for what in ("name", "mount_path"):
        values = [getattr(v, what) for v in volumes]
        dups = sorted({v for v in values if values.count(v) > 1})
        if dups:
            raise ValueError(f"two volumes have the {what.replace('_', ' ')} {dups[0]}: each must be unique")
    return volumes


def _unique_env(env: list[EnvVarSpec]) -> list[EnvVarSpec]:
    names = [e.name for e in env]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"{dups[0]} is set twice: each name must be unique")
    return env


#: A role's ``volumes``: names and mount paths unique.
Volumes = Annotated[list[VolumeSpec], Field(max_length=32), AfterValidator(_unique_volumes)]
#: A role's ``env``: names unique.
EnvVars = Annotated[list[EnvVarSpec], Field(max_length=64), AfterValidator(_unique_env)]


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


#: The CEL rules of every role's schema (``rlrun.api.crd``), by path below the role (``"[]"``: each item of a
#: list): the validators above, for the API server.
ROLE_CEL_RULES: dict[tuple[str, ...], list[dict[str, str]]] = {
    (): [
        {
            "rule": (
                "!has(self.volumes) || self.volumes.all(v, self.volumes.exists_one(w, w.mount_path == v.mount_path))"
            ),
            "message": "two volumes have the same mount_path: each must be unique",
            "fieldPath": ".volumes",
        },
    ],
    ("volumes", "[]"): [
        {
            "rule": "(has(self.persistent_volume_claim) ? 1 : 0) + (has(self.config_map) ? 1 : 0) "
            "+ (has(self.secret) ? 1 : 0) == 1",
            "message": "set exactly one of persistent_volume_claim, config_map or secret",
        },
        {
            "rule": f"!({_cel_list(RESERVED_VOLUME_NAMES)}.exists(n, self.name == n))",
            "message": f"name must not be one of rlrun's own volumes ({', '.join(RESERVED_VOLUME_NAMES)})",
            "fieldPath": ".name",
        },
        {
            "rule": f"!({_cel_list(RESERVED_MOUNT_PATHS)}.exists(p, self.mount_path == p || "
            "self.mount_path.startsWith(p + '/') || p.startsWith(self.mount_path + '/')))",
            "message": "mount_path must be outside rlrun's own mounts (" + ", ".join(RESERVED_MOUNT_PATHS) + ")",
            "fieldPath": ".mount_path",
        },
    ],
    ("env", "[]"): [
        {
            "rule": "has(self.value) != has(self.value_from)",
            "message": "set exactly one of value or value_from",
        },
        {
            "rule": f"!({_cel_list(RESERVED_ENV_NAMES)}.exists(n, self.name == n)) "
            f"&& !self.name.startsWith('{RESERVED_ENV_PREFIX}')",
            "message": f"name must not be a variable rlrun sets itself ({', '.join(RESERVED_ENV_NAMES)}, "
            f"{RESERVED_ENV_PREFIX}*)",
            "fieldPath": ".name",
        },
    ],
    ("env", "[]", "value_from"): [
        {
            "rule": "has(self.secret_key_ref) != has(self.config_map_key_ref)",
            "message": "set exactly one of secret_key_ref or config_map_key_ref",
        },
    ],
}
