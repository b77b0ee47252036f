"""Reward functions named by import path (``tests.support.rewards:pid``), for rewards run in worker processes
(``isolation: process``): a worker imports this module, so it imports nothing but the standard library."""

from __future__ import annotations

import os


def pid(completions, **kwargs):
    """The pid of the process it runs in, as every completion's score."""
    return [float(os.getpid())] * len(completions)


def boom(completions, **kwargs):
    """Raises ``ValueError("no judge today")``."""
    raise ValueError("no judge today")


def dies(completions, **kwargs):
    """Ends its process at once with exit code 3 (a crash no ``except`` sees)."""
    os._exit(3)
