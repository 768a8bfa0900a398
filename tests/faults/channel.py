"""The hung mount's control channel: one JSON object a line over a socket pair, both ways.

A socket pair and not a file: nothing under the mount (nor any file system) can stop the test from
telling the server to release. Every wait on it has a time limit, so a wedged server fails the
test with a message instead of hanging it.
"""
import json
import socket
import time
from typing import Optional


class ChannelClosed(ConnectionError):
    """The other side is gone (its process ended) or did not answer in time."""


class Channel:
    """One end of the socket pair: ``send`` a message, ``receive`` the next one."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._pending = b""

    def send(self, message: dict) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def receive(self, timeout: Optional[float]) -> dict:
        """The next message; raises ChannelClosed at end of stream or after ``timeout`` seconds
        (None: wait as long as it takes, for the server, whose only task is to wait for orders)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ChannelClosed(f"no answer on the control channel in {timeout} s")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                raise ChannelClosed("the control channel was closed by the other side")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        self.sock.close()
