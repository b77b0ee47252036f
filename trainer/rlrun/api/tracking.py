"""``spec.logging``: the experiment trackers a run logs its steps to (:mod:`rlrun.tracking`).

Both are optional and off unless given; each imports its package only when configured (``pip install
'rlrun[tracking]'`` installs both). What is logged, and when: a step once its checkpoint is complete, with the
values of the attempt whose checkpoint holds it, so a run is **one** tracker run across every attempt whose
steps never go backwards (``docs/observability.md``, "Experiment trackers").
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlrun.api.pod_inputs import KeyRefSpec
from rlrun.api.strict import Strict

#: A W&B project or entity name (W&B's limits: at most 128 characters, no ``/ \\ # ? % :``).
NAME_PATTERN = r"^[-_.a-zA-Z0-9]+$"


class WandbSpec(Strict):
    """Weights & Biases.

    The W&B run's id derives from the run's identity (the RLRun's uid; under ``rlrun local``, an id kept in
    the run directory), and every attempt resumes it (``resume="allow"``), as verl does.

    Attributes:
        project: the W&B project.
        entity: the team or user (None: the API key's default entity).
        mode: ``online`` (sync as it logs), ``offline`` (files under ``<run_dir>/wandb/``, uploaded later with
            ``wandb sync``), ``disabled`` (nothing; the configuration stays in the manifest).
        name: the run's display name (None: the RLRun's ``metadata.name``).
        tags: W&B tags.
        api_key_secret: on Kubernetes, the Secret key holding the API key: the operator gives it to the
            orchestrator, the one process that logs, as ``WANDB_API_KEY``. ``rlrun local`` reads the variable
            (or ``wandb login``'s netrc) from this machine.
    """

    project: str = Field(min_length=1, max_length=128, pattern=NAME_PATTERN)
    entity: str | None = Field(default=None, min_length=1, max_length=128, pattern=NAME_PATTERN)
    mode: Literal["online", "offline", "disabled"] = "online"
    name: str | None = Field(default=None, min_length=1, max_length=128)
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(default_factory=list, max_length=20)
    api_key_secret: KeyRefSpec | None = None


class TensorBoardSpec(Strict):
    """TensorBoard: event files under ``<run_dir>/tensorboard/<tracker run id>/`` (``tensorboard --logdir
    <run_dir>/tensorboard``).

    Attributes:
        enabled: write them (``tensorboard: {}`` turns it on; a key with no value is absent, as Kubernetes prunes
            a null).
    """

    enabled: bool = True


class LoggingSpec(Strict):
    """Experiment trackers (none by default): ``wandb``, ``tensorboard``, or both."""

    wandb: WandbSpec | None = None
    tensorboard: TensorBoardSpec | None = None

    @property
    def trackers(self) -> list[str]:
        """The names of the trackers turned on (``["wandb", "tensorboard"]``, ``[]``: none; a disabled W&B is
        none): each one's field here, its key in ``tracking.json`` and its package's name."""
        names = ["wandb"] if self.wandb is not None and self.wandb.mode != "disabled" else []
        return names + (["tensorboard"] if self.tensorboard is not None and self.tensorboard.enabled else [])
