"""The protocol's errors: every way a frame or a connection can fail, all `ProtocolError`s, so a
reader drops the connection on any of them (and `DigestMismatch`, which leaves the stream in
step, is told apart where that matters)."""
from __future__ import annotations

from typing import Any

from ..errors import HpctError


class ProtocolError(HpctError):
    """A frame that cannot be trusted or understood; the connection should be dropped."""


class ConnectionClosed(ProtocolError):
    """The peer closed the connection cleanly between two frames."""


class ConnectionCut(ProtocolError):
    """The connection broke under a frame: reset by the peer, timed out by the kernel, or
    closed half-way through a frame. Its process or host died; nothing malformed arrived."""


class ProtocolTimeout(ProtocolError):
    """No complete frame arrived within the timeout."""


class DigestMismatch(ProtocolError):
    """An authentic header whose body does not match its digests (corrupted at the sender or on
    the way). The whole frame has been read, so the connection is still in step and usable."""

    def __init__(self, message: str, msg: Any):
        super().__init__(message)
        self.msg = msg


class HeaderTooLarge(ProtocolError):
    """A frame to be sent whose header is over HEADER_MAX: a sender that can split its message
    (a relay's Batch) tells this apart from a malformed one."""
