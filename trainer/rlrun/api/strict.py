"""The base of every model of the ``RLRun`` spec (:mod:`rlrun.api.spec` and the modules it composes)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A spec model: strict types ("yes" is not a bool nor "8" an int, as for the API server's schema validation), no
    unknown field, frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
