"""The one network helper every process shares: a TCP port free right now (a launcher's ports for its
children, the trainer's weight-transfer rendezvous)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (``""``: on every interface, for a listener that binds them all).
    Another process may take it before it is used: callers bind it soon after."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
