"""The checkpoint error type, on its own so that both :mod:`rlrun.checkpoint` (which re-exports it)
and :mod:`rlrun.training.sharded_checkpoint` (whose ``verify_sharded`` the completeness rule calls
for a sharded trainer part) can raise it without importing each other."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CheckpointError(RuntimeError):
    """A checkpoint part that is missing, torn, corrupt or from another run (message names the file)."""


def read_json_part(path: Path) -> Any:
    """The parsed JSON file ``path`` of a checkpoint part (``progress.json``, ``meta.json``).

    Raises:
        CheckpointError: the file is missing, unreadable or not JSON (message names it).
    """
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
