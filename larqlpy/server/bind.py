"""The server's socket, bound and listening before the weights load: a busy port, an address this
machine does not have or a host that does not resolve is one refusal, not a crash after loading."""

from __future__ import annotations

import os
import socket

from larqlpy.errors import LarqlError


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (uvicorn serves on it)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise LarqlError(f"`host` {host}: cannot be resolved ({e.strerror})") from None
    try:
        return socket.create_server(address, family=family, backlog=2048)
    except OSError as e:
        raise LarqlError(f"cannot listen on {host}:{port} ({os.strerror(e.errno) if e.errno else e})") from None
