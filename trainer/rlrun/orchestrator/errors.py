"""The orchestrator's errors."""

from __future__ import annotations


class OrchestratorError(RuntimeError):
    """The orchestrator cannot go on (the message says why and what to do)."""
