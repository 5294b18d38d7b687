"""A free TCP port on 127.0.0.1."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the kernel has just handed out and released (port 0), for a server to bind.

    Another process could take it before the server binds it; on a test machine that window
    is harmless.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
