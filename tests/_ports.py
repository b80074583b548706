"""A TCP port for a test's store, free when chosen.

Chosen below Linux's ephemeral range (32768-60999), from which the kernel hands out the local ports
of every outgoing connection on the machine: a port picked there (bind to port 0) can be taken by
another process's connection between the probe and the store's own bind, a moment later.
"""

from __future__ import annotations

import random
import socket

_LOW, _HIGH = 20000, 32768


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on or holds now."""
    for _ in range(200):
        port = random.randrange(_LOW, _HIGH)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:  # a crowded range: the kernel's choice
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
