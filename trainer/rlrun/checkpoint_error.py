"""The checkpoint error type, on its own so that both :mod:`rlrun.checkpoint` (which re-exports it)
and :mod:`rlrun.training.sharded_checkpoint` (whose ``verify_sharded`` the completeness rule calls
for a sharded trainer part) can raise it without importing each other."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint part that is missing, torn, corrupt or from another run (message names the file)."""
